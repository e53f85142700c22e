"""A local HTTP host of one PNG, for tests of how media URLs are fetched: under generic content
types, gzip-encoded, chunked, trickled a byte at a time (a body that never ends in time), or 404."""

from __future__ import annotations

import gzip
import http.server
import threading
import time

import pytest

from tests.multimodal.media_factory import encode_image, random_image

PNG = encode_image(random_image(45, 31, seed=21), "PNG")
DRIP_SECONDS = 0.05


class Handler(http.server.BaseHTTPRequestHandler):
    """/octet and /binary-octet: the PNG under the generic types S3 and other stores send;
    /gzip and /chunked: the PNG gzip-encoded, or in chunks; /drip: the PNG one byte at a time,
    forever (a body that never ends in time)."""

    def do_GET(self):  # noqa: N802 (http.server's naming)
        if self.path in ("/octet", "/binary-octet"):
            mime = "application/octet-stream" if self.path == "/octet" else "binary/octet-stream"
            self.send_response(200)
            self.send_header("Content-Type", mime)
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            self.wfile.write(PNG)
        elif self.path in ("/gzip", "/chunked"):
            body = gzip.compress(PNG) if self.path == "/gzip" else PNG
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            if self.path == "/gzip":
                self.send_header("Content-Encoding", "gzip")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for start in range(0, len(body), 100):
                    piece = body[start : start + 100]
                    self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                self.wfile.write(b"0\r\n\r\n")
        elif self.path == "/drip":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            try:
                for _ in range(100_000):
                    for byte in PNG:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(DRIP_SECONDS)
            except (BrokenPipeError, ConnectionResetError):
                pass
        else:
            self.send_error(404)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def media_host():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
