"""Reading media from URLs (a real local HTTP server), local paths, data URLs and bare base64."""

import base64
import http.server
import re
import socket
import threading

import pytest

from sglang_m3.multimodal.errors import MediaError
from sglang_m3.multimodal.limits import MediaLimits
from sglang_m3.multimodal.sources import read_media, sniff_image_format
from tests.multimodal.media_factory import encode_image, random_image

PNG = encode_image(random_image(30, 20), "PNG")


class MediaHandler(http.server.BaseHTTPRequestHandler):
    """Routes: /ok.png, /missing, /huge-declared, /endless, /page.html."""

    def do_GET(self):  # noqa: N802 (http.server's naming)
        if self.path == "/ok.png":
            self._reply(200, "image/png", PNG)
        elif self.path == "/page.html":
            self._reply(200, "text/html", b"<html></html>")
        elif self.path == "/huge-declared":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(10**12))
            self.end_headers()
        elif self.path == "/endless":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            try:
                for _ in range(64):
                    self.wfile.write(b"\x89PNG" + b"x" * 65536)
            except (BrokenPipeError, ConnectionResetError):
                pass
        else:
            self._reply(404, "text/plain", b"no")

    def _reply(self, status, mime, body):
        self.send_response(status)
        self.send_header("Content-Type", mime)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), MediaHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def read_image(item, limits=MediaLimits()):
    return read_media(item, kind="image", part="image 3", limits=limits)


def test_url_is_fetched(server):
    assert read_image(f"{server}/ok.png").data == PNG


@pytest.mark.parametrize(
    "path,limits,reason",
    [
        ("/missing", MediaLimits(), r"fetching .*/missing failed: HTTP 404"),
        ("/page.html", MediaLimits(), r"declared MIME type 'text/html' is not an image type"),
        ("/huge-declared", MediaLimits(), r"declares 1000000000000 bytes, over the limit of 33554432"),
        ("/endless", MediaLimits(max_image_bytes=200_000), r"sent more than the limit of 200000 bytes"),
    ],
)
def test_url_failures_name_the_part(server, path, limits, reason):
    with pytest.raises(MediaError, match=r"^image 3: ") as caught:
        read_image(f"{server}{path}", limits)
    assert re.search(reason, caught.value.reason), caught.value.reason


def test_unreachable_url():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(MediaError, match=r"image 3: fetching .* failed: ConnectionError"):
        read_image(f"http://127.0.0.1:{port}/x.png")


def test_local_paths_only_inside_the_configured_root(tmp_path):
    inside = tmp_path / "media" / "a.png"
    inside.parent.mkdir()
    inside.write_bytes(PNG)
    outside = tmp_path / "b.png"
    outside.write_bytes(PNG)
    limits = MediaLimits(local_media_root=str(inside.parent))
    source = read_image(str(inside), limits)
    assert source.path == inside and source.data is None  # handed to the decoder as a path
    assert read_image(f"file://{inside}", limits).path == inside
    with pytest.raises(MediaError, match=r"is outside"):
        read_image(str(outside), limits)
    with pytest.raises(MediaError, match=r"is outside"):
        read_image(str(inside.parent / ".." / "b.png"), limits)
    with pytest.raises(MediaError, match=r"does not exist"):
        read_image(str(inside.parent / "c.png"), limits)


def test_bare_base64_and_data_urls_and_objects():
    encoded = base64.b64encode(PNG).decode()
    assert read_image(encoded).data == PNG
    assert read_image(f"data:image/png;base64,{encoded}").data == PNG
    assert read_image({"url": f"data:image/png;base64,{encoded}"}).data == PNG
    # Without ";base64" base64 data are still read, as transformers reads them (RFC 2397's
    # percent-encoded form: test_media_inputs_audit); a data URL needs its comma.
    assert read_image(f"data:image/png,{encoded}").data == PNG
    with pytest.raises(MediaError, match=r"must be 'data:\[<mime>\]\[;base64\],<data>'"):
        read_image(f"data:image/png;base64{encoded}")
    with pytest.raises(MediaError, match=r"unsupported image input of type int"):
        read_image(5)


def test_base64_over_the_cap_is_refused_before_decoding():
    with pytest.raises(MediaError, match=r"media is about 3000 bytes, over the limit of 100"):
        read_image("A" * 4000, MediaLimits(max_image_bytes=100))


@pytest.mark.parametrize("fmt,name", [("PNG", "PNG"), ("JPEG", "JPEG"), ("GIF", "GIF"), ("WEBP", "WEBP"), ("BMP", "BMP"), ("TIFF", "TIFF")])
def test_sniffing_knows_the_formats_we_accept(fmt, name):
    assert sniff_image_format(encode_image(random_image(8, 8), fmt)[:16]) == name
