"""Generated test media: images in several modes and formats, short videos, broken files."""

from __future__ import annotations

import io
import struct
import zlib

import av
import numpy as np
from PIL import Image


def random_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    rgb = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    if mode == "P":
        return rgb.quantize(colors=37)
    if mode == "RGBA":
        alpha = Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8))
        rgba = rgb.convert("RGBA")
        rgba.putalpha(alpha)
        return rgba
    return rgb.convert(mode)


def encode_image(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


def encode_video(
    frames: list[np.ndarray], fps: float, codec: str = "mpeg4", fmt: str = "mp4", pix_fmt: str = "yuv420p"
) -> bytes:
    height, width = frames[0].shape[:2]
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        for array in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def random_frames(count: int, width: int, height: int, seed: int = 0) -> list[np.ndarray]:
    """Smooth moving gradients (codecs keep them close) plus a little noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    frames = []
    for i in range(count):
        base = np.stack([(x * 3 + i * 7) % 256, (y * 5 + i * 11) % 256, ((x + y) * 2 + i * 13) % 256], axis=-1)
        frames.append((base + rng.integers(0, 8, base.shape)).clip(0, 255).astype(np.uint8))
    return frames


def decode_all_frames(data: bytes) -> tuple[np.ndarray, float]:
    """Every frame (rgb24) and the native fps, read with a plain PyAV loop."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        return np.stack(frames), float(stream.average_rate)


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def png_declaring(width: int, height: int) -> bytes:
    """A valid-looking PNG whose header declares width x height but carries almost no data."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    data = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", data) + _png_chunk(b"IEND", b"")


def jpeg_declaring(width: int, height: int) -> bytes:
    """A small real JPEG with its SOF0 frame header patched to declare width x height."""
    data = bytearray(encode_image(random_image(16, 16), "JPEG"))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)
