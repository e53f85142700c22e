"""Resize geometry, normalisation and patch layout shared by images and videos.

An image is a one-frame video: frames are padded to a multiple of the temporal patch by
repeating the last one, then cut into ``patch x patch`` cells ordered block-major over
``merge x merge`` blocks, each row holding ``channels x temporal_patch x patch x patch`` values.
This is the layout transformers' M3 processors produce and the vision tower expects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torchvision.transforms.v2 import functional as tvF

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class PatchGeometry:
    """How media become patch rows (defaults: M3's image processor)."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 576
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def tokens(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // self.merge_size**2


def fit_size(height: int, width: int, geometry: PatchGeometry) -> tuple[int, int]:
    """Target (height, width): multiples of patch x merge, pixel count within the bounds, aspect kept.

    Rounds each side to the nearest multiple first; if that leaves the pixel bounds, scales
    both sides by the same factor and rounds down (too big) or up (too small).
    """
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(f"aspect ratio {ratio:.1f} is over the limit of {MAX_ASPECT_RATIO}")
    f = geometry.factor
    h_out, w_out = round(height / f) * f, round(width / f) * f
    if h_out * w_out > geometry.max_pixels:
        shrink = math.sqrt(height * width / geometry.max_pixels)
        h_out = max(f, math.floor(height / shrink / f) * f)
        w_out = max(f, math.floor(width / shrink / f) * f)
    elif h_out * w_out < geometry.min_pixels:
        grow = math.sqrt(geometry.min_pixels / (height * width))
        h_out = math.ceil(height * grow / f) * f
        w_out = math.ceil(width * grow / f) * f
    return h_out, w_out


def resize_frames(frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Bicubic, antialiased resize of uint8 ``[frames, C, H, W]`` (the resampler M3's processors use)."""
    if tuple(frames.shape[-2:]) == size:
        return frames
    return tvF.resize(frames, list(size), interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)


def to_patch_rows(frames: torch.Tensor, geometry: PatchGeometry) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """uint8 ``[frames, C, H, W]`` (sides multiples of patch x merge) -> float32 rows and (t, h, w) grid.

    The cells are reordered while still uint8 (a quarter of the bytes of float32) and normalised
    in place afterwards; per element this is the same ``(x - mean) / std`` as transformers'.
    """
    num_frames, channels, height, width = frames.shape
    p, m, tp = geometry.patch_size, geometry.merge_size, geometry.temporal_patch_size
    if height % (p * m) or width % (p * m):
        raise ValueError(f"frame size {height}x{width} is not a multiple of {p * m}")
    if pad := -num_frames % tp:
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
    grid = (frames.shape[0] // tp, height // p, width // p)
    gt, gh, gw = grid
    cells = frames.reshape(gt, tp, channels, gh // m, m, p, gw // m, m, p)
    # -> [t, h-block, w-block, h-in-block, w-in-block, channel, temporal, patch row, patch col]
    cells = cells.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(gt * gh * gw, channels, tp * p * p)
    mean = torch.tensor(geometry.image_mean) * (1.0 / geometry.rescale_factor)
    std = torch.tensor(geometry.image_std) * (1.0 / geometry.rescale_factor)
    rows = cells.to(torch.float32).sub_(mean.view(1, -1, 1)).div_(std.view(1, -1, 1))
    return rows.view(gt * gh * gw, channels * tp * p * p), grid
