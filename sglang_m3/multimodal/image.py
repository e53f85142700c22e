"""Image decoding: declared size checked from the header before any pixel is decompressed."""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass

import torch
from PIL import Image, UnidentifiedImageError

from sglang_m3.multimodal.errors import MediaError
from sglang_m3.multimodal.limits import MediaLimits
from sglang_m3.multimodal.patches import PatchGeometry, fit_size, resize_frames, to_patch_rows
from sglang_m3.multimodal.sources import PIL_FORMATS, MediaSource

warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning, module=__name__)

_IN_MEMORY_IMAGES = threading.Lock()


@dataclass
class ImageFeatures:
    pixel_values: torch.Tensor  # [rows, C * temporal_patch * patch * patch], float32
    grid_thw: tuple[int, int, int]


def decode_image(source: MediaSource, limits: MediaLimits) -> torch.Tensor:
    """uint8 ``[3, H, W]`` RGB (first frame of animated formats; alpha dropped as transformers does)."""
    part = source.part
    with warnings.catch_warnings():
        # PIL warns (and past 2x its own cap raises) on big images; our own cap decides.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            if source.image is not None:
                # One PIL object may be several parts of a request, decoded on several workers;
                # PIL's lazy load() is not thread-safe.
                with _IN_MEMORY_IMAGES:
                    return _rgb_pixels(source.image, part, limits)
            with source.open() as handle, Image.open(handle, formats=PIL_FORMATS) as image:
                return _rgb_pixels(image, part, limits)
        except Image.DecompressionBombError as exc:
            raise MediaError(part, f"declared size is over PIL's decompression-bomb cap ({exc})") from None
        except UnidentifiedImageError:
            raise MediaError(part, "content is not a decodable image") from None
        except (OSError, SyntaxError, ValueError) as exc:
            if isinstance(exc, MediaError):
                raise
            raise MediaError(part, f"image is corrupt or truncated ({exc})") from None


def _rgb_pixels(image: Image.Image, part: str, limits: MediaLimits) -> torch.Tensor:
    """The declared size is checked before ``load()`` decompresses anything."""
    width, height = image.size
    if width * height > limits.max_image_pixels:
        raise MediaError(
            part,
            f"declared size {width}x{height} ({width * height} pixels) is over the "
            f"limit of {limits.max_image_pixels} pixels",
        )
    if width == 0 or height == 0:
        raise MediaError(part, f"declared size {width}x{height} is empty")
    image.load()
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    # One copy out of PIL (pil_to_tensor makes two); a [3, H, W] view of HWC bytes.
    # The buffer is read-only; nothing writes to it (resize and patching copy).
    pixels = torch.frombuffer(rgb.tobytes(), dtype=torch.uint8)
    return pixels.view(height, width, 3).permute(2, 0, 1)


def image_features(source: MediaSource, geometry: PatchGeometry, limits: MediaLimits) -> ImageFeatures:
    """One image part -> patch rows and its (1, h, w) grid."""
    pixels = decode_image(source, limits)
    try:
        size = fit_size(pixels.shape[1], pixels.shape[2], geometry)
    except ValueError as exc:
        raise MediaError(source.part, str(exc)) from None
    rows, grid = to_patch_rows(resize_frames(pixels.unsqueeze(0), size), geometry)
    return ImageFeatures(pixel_values=rows, grid_thw=grid)
