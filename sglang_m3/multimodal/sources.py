"""Reading one content part's media: data URL / base64, http(s) URL, allowed local path, bytes,
or an in-memory PIL image (SGLang's Engine API passes those through unchanged).

Each source is read at most once and never past its byte cap: base64 is sized before decoding,
HTTP bodies are streamed and cut off at the cap (and at ``url_timeout_s`` for the whole fetch),
local files are checked with ``stat`` and handed to the decoder as a path (decoders stream from
disk). Declared MIME types (data URL, HTTP ``Content-Type``) must belong to the part's kind or be
the generic ``application/octet-stream``; images must also *look* like an image of a format in
:data:`IMAGE_SIGNATURES` (the formats the decoder opens).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
import urllib3
from PIL import Image

from sglang_m3.multimodal.errors import MediaError
from sglang_m3.multimodal.limits import MediaLimits

IMAGE_SIGNATURES = {
    b"\x89PNG\r\n\x1a\n": "PNG",
    b"\xff\xd8\xff": "JPEG",
    b"GIF87a": "GIF",
    b"GIF89a": "GIF",
    b"BM": "BMP",
    b"II*\x00": "TIFF",
    b"MM\x00*": "TIFF",
    # PIL opens these too, and so transformers' processor takes them: they were refused here.
    b"\xff\x4f\xff\x51": "JPEG2000",  # codestream
    b"\x00\x00\x00\x0cjP  \r\n\x87\n": "JPEG2000",  # JP2 container
    b"\x00\x00\x01\x00": "ICO",
    b"qoif": "QOI",
    **{b"P" + kind: "PPM" for kind in (b"1", b"2", b"3", b"4", b"5", b"6")},  # PBM / PGM / PPM
}
# ISO-BMFF images, named by the brand of their ``ftyp`` box (bytes 4-12; MP4 videos carry others).
FTYP_IMAGE_BRANDS = {b"avif": "AVIF", b"avis": "AVIF"}
# The PIL plugins image decoding may use: the formats above, and no other (EPS, for one, runs
# Ghostscript).
PIL_FORMATS = ("PNG", "JPEG", "GIF", "BMP", "TIFF", "WEBP", "JPEG2000", "ICO", "QOI", "PPM", "AVIF")
URL_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]{0,31}):")  # bounded: never scans a base64 body
# Declared types that say nothing about the content (object stores send them for files uploaded
# without a type); the content decides.
GENERIC_MIME = {"application/octet-stream", "binary/octet-stream"}
# Image formats that are also videos: transformers' PyAV reader decodes an animated GIF as one.
VIDEO_IMAGE_FORMATS = {"GIF": "image/gif"}
INVALID_PERCENT_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")
HTTP_CHUNK = 1 << 16


@dataclass(frozen=True)
class MediaSource:
    """The bytes (or a local path, or an already opened PIL image) of one content part, ready for a decoder."""

    part: str
    data: bytes | None = None
    path: Path | None = None
    image: Image.Image | None = None

    def open(self):
        """A binary file object over the media (the caller closes it)."""
        if self.path is not None:
            return open(self.path, "rb")
        return io.BytesIO(self.data)

    def head(self, size: int = 16) -> bytes:
        if self.data is not None:
            return self.data[:size]
        with open(self.path, "rb") as handle:
            return handle.read(size)


def sniff_image_format(head: bytes) -> str | None:
    """The image format the leading bytes announce, or None."""
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    if head[4:8] == b"ftyp" and head[8:12] in FTYP_IMAGE_BRANDS:
        return FTYP_IMAGE_BRANDS[head[8:12]]
    for signature, name in IMAGE_SIGNATURES.items():
        if head.startswith(signature):
            return name
    return None


def source_url(item: Any) -> Any:
    """The URL-or-bytes payload of an SGLang media item (str, bytes, ImageData/VideoData, dict)."""
    if isinstance(item, (str, bytes, bytearray)):
        return item
    if isinstance(item, dict):
        return item.get("url")
    return getattr(item, "url", item)


def read_media(item: Any, *, kind: str, part: str, limits: MediaLimits) -> MediaSource:
    """Resolves one content part into a MediaSource, refusing anything outside ``limits``."""
    cap = limits.max_image_bytes if kind == "image" else limits.max_video_bytes
    payload = source_url(item)
    if isinstance(payload, Image.Image):
        return _pil_image(payload, kind, part)
    if isinstance(payload, (bytes, bytearray)):
        source = _checked_bytes(bytes(payload), part, cap)
    elif not isinstance(payload, str):
        raise MediaError(part, f"unsupported {kind} input of type {type(payload).__name__}")
    else:
        source = _read_text_source(payload.strip(), kind=kind, part=part, cap=cap, limits=limits)
    image_format = sniff_image_format(source.head())
    if kind == "image" and image_format is None:
        raise MediaError(part, f"content is not a supported image ({', '.join(PIL_FORMATS)})")
    if kind == "video" and image_format is not None and image_format not in VIDEO_IMAGE_FORMATS:
        raise MediaError(part, f"content is a {image_format} image, not a video")
    return source


def _read_text_source(payload: str, *, kind: str, part: str, cap: int, limits: MediaLimits) -> MediaSource:
    """A string payload: a URL by its scheme (case-insensitive, as RFC 3986 has it), a local path,
    or bare base64 (SGLang passes those without a ``data:`` prefix).

    Base64 has no ``:``, so a string with a scheme is a URL: one of another scheme (ftp, s3, ...)
    is refused for its scheme; it was decoded as base64 and refused as "invalid base64 data",
    and ``DATA:`` / ``HTTPS://`` URLs were refused the same way.
    """
    scheme = _scheme(payload)
    if scheme == "data":
        mime, is_base64, encoded = _split_data_url(payload, part)
        _check_declared_mime(mime, kind, part)
        if is_base64 and "%" in encoded:  # a data URL is a URL: its base64 may be percent-encoded too
            encoded = urllib.parse.unquote(encoded)
        data = _decode_base64(encoded, part, cap) if is_base64 else _decode_plain_data(encoded, part, cap)
        return _checked_bytes(data, part, cap)
    if scheme in ("http", "https"):
        return _fetch_url(payload, kind=kind, part=part, cap=cap, timeout=limits.url_timeout_s)
    if scheme == "file" or os.path.isabs(payload) or payload.startswith("./"):
        path = payload[len("file://") :] if scheme == "file" else payload
        return _local_file(path, part, cap, limits.local_media_root)
    if scheme is not None:
        raise MediaError(part, f"unsupported URL scheme '{scheme}' (send an http(s) URL, a data URL or base64)")
    return _checked_bytes(_decode_base64(payload, part, cap), part, cap)


def _scheme(payload: str) -> str | None:
    """The lower-cased URL scheme ``payload`` starts with, or None."""
    match = URL_SCHEME.match(payload)
    return match.group(1).lower() if match else None


def _pil_image(image: Image.Image, kind: str, part: str) -> MediaSource:
    """An in-memory image: SGLang types ``image_data`` items as ``str | bytes | dict | ImageData |
    PIL.Image``, and its Engine API hands PIL images to the processor as they are; they were
    refused as an "unsupported image input". Its size is checked by the decoder like a file's."""
    if kind != "image":
        raise MediaError(part, f"content is a PIL image, not a {kind}")
    return MediaSource(part=part, image=image)


def _checked_bytes(data: bytes, part: str, cap: int) -> MediaSource:
    if not data:
        raise MediaError(part, "media is empty (0 bytes)")
    if len(data) > cap:
        raise MediaError(part, f"media is {len(data)} bytes, over the limit of {cap}")
    return MediaSource(part=part, data=data)


def _split_data_url(url: str, part: str) -> tuple[str, bool, str]:
    """``data:[<mime>][;param=value]*[;base64],<data>`` -> (mime, base64?, data) (RFC 2397)."""
    header, comma, encoded = url[5:].partition(",")
    if not comma:
        raise MediaError(part, "data URL must be 'data:[<mime>][;base64],<data>'")
    mime, *parameters = (piece.strip() for piece in header.split(";"))
    is_base64 = bool(parameters) and parameters[-1].lower() == "base64"
    return mime.lower(), is_base64, encoded


def _decode_plain_data(encoded: str, part: str, cap: int) -> bytes:
    """The data of a data URL without ``;base64``. RFC 2397 makes them percent-encoded octets;
    data with no ``%`` escape that are valid base64 are read as base64, as transformers reads any
    data URL (binary media always need escapes, so the two never meet)."""
    if len(encoded) // 3 > cap:  # the fewest bytes either reading gives
        raise MediaError(part, f"media is at least {len(encoded) // 3} bytes, over the limit of {cap}")
    if "%" not in encoded:
        try:
            return base64.b64decode("".join(encoded.split()), validate=True)
        except (binascii.Error, ValueError):
            pass
    if INVALID_PERCENT_ESCAPE.search(encoded):
        raise MediaError(part, "invalid percent-encoding in the data URL")
    return urllib.parse.unquote_to_bytes(encoded)


def _check_declared_mime(mime: str | None, kind: str, part: str) -> None:
    if not mime or mime in GENERIC_MIME:
        return
    if mime.startswith(f"{kind}/") or (kind == "video" and mime in VIDEO_IMAGE_FORMATS.values()):
        return
    article = "an" if kind == "image" else "a"
    raise MediaError(part, f"declared MIME type {mime!r} is not {article} {kind} type")


def _decode_base64(encoded: str, part: str, cap: int) -> bytes:
    encoded = "".join(encoded.split())
    if len(encoded) // 4 * 3 > cap + 2:
        raise MediaError(part, f"media is about {len(encoded) // 4 * 3} bytes, over the limit of {cap}")
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaError(part, f"invalid base64 data ({exc})") from None


def _fetch_url(url: str, *, kind: str, part: str, cap: int, timeout: float) -> MediaSource:
    """The body of ``url``, within ``cap`` bytes and ``timeout`` seconds in all.

    requests' timeout bounds each wait for the server, not the fetch: a body sent a byte at a
    time never timed out and held the request and a media worker for hours. The body is read a
    socket read at a time (``read1``), so the deadline is checked at least once per ``timeout``.
    """
    deadline = time.monotonic() + timeout
    try:
        with requests.get(url, stream=True, timeout=timeout) as response:
            if response.status_code != 200:
                raise MediaError(part, f"fetching {url} failed: HTTP {response.status_code}")
            mime = (response.headers.get("Content-Type") or "").split(";")[0].strip().lower()
            _check_declared_mime(mime, kind, part)
            declared = response.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > cap:
                raise MediaError(part, f"{url} declares {declared} bytes, over the limit of {cap}")
            body = bytearray()
            while chunk := response.raw.read1(HTTP_CHUNK, decode_content=True):
                body += chunk
                if len(body) > cap:
                    raise MediaError(part, f"{url} sent more than the limit of {cap} bytes")
                if time.monotonic() > deadline:
                    raise MediaError(part, f"fetching {url} took longer than {timeout:g} s (url_timeout_s)")
    except (requests.RequestException, urllib3.exceptions.HTTPError) as exc:
        raise MediaError(part, f"fetching {url} failed: {type(exc).__name__}") from None
    return _checked_bytes(bytes(body), part, cap)


def _local_file(path_text: str, part: str, cap: int, root: str | None) -> MediaSource:
    if root is None:
        raise MediaError(part, "local file paths are disabled (set the media limit local_media_root)")
    path = Path(path_text).resolve()
    allowed = Path(root).resolve()
    if not path.is_relative_to(allowed):
        raise MediaError(part, f"local path {path_text} is outside {allowed}")
    if not path.is_file():
        raise MediaError(part, f"local file {path_text} does not exist")
    size = path.stat().st_size
    if size == 0:
        raise MediaError(part, "media is empty (0 bytes)")
    if size > cap:
        raise MediaError(part, f"media is {size} bytes, over the limit of {cap}")
    return MediaSource(part=part, path=path)
