"""Reading one content part's media: data URL / base64, http(s) URL, allowed local path, bytes,
or an in-memory PIL image (SGLang's Engine API passes those through unchanged).

Each source is read at most once and never past its byte cap: base64 is sized before decoding,
HTTP bodies are streamed and cut off at the cap, local files are checked with ``stat`` and handed
to the decoder as a path (decoders stream from disk). Declared MIME types (data URL, HTTP
``Content-Type``) must belong to the part's kind; images must also *look* like an image.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
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
}
URL_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]{0,31}):")  # bounded: never scans a base64 body
VIDEO_MIME_PASS = {"application/octet-stream", "binary/octet-stream"}
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
        raise MediaError(part, "content is not a supported image (PNG, JPEG, WebP, GIF, BMP, TIFF)")
    if kind == "video" and image_format is not None:
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
        mime, encoded = _split_data_url(payload, part)
        _check_declared_mime(mime, kind, part)
        return _checked_bytes(_decode_base64(encoded, part, cap), part, cap)
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


def _split_data_url(url: str, part: str) -> tuple[str, str]:
    header, comma, encoded = url[5:].partition(",")
    if not comma or not header.endswith(";base64"):
        raise MediaError(part, "data URL must be 'data:<mime>;base64,<data>'")
    mime = header[: -len(";base64")].split(";")[0].strip().lower()
    return mime, encoded


def _check_declared_mime(mime: str | None, kind: str, part: str) -> None:
    if not mime:
        return
    if mime.startswith(f"{kind}/") or (kind == "video" and mime in VIDEO_MIME_PASS):
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
            for chunk in response.iter_content(HTTP_CHUNK):
                body += chunk
                if len(body) > cap:
                    raise MediaError(part, f"{url} sent more than the limit of {cap} bytes")
    except requests.RequestException as exc:
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
