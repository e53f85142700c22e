"""Configurable caps on what one request may send, checked before anything large is decoded."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

MIB = 1024 * 1024


@dataclass(frozen=True)
class MediaLimits:
    """Per-request media limits. Defaults fit M3's processors (768 frames at 1 fps, a budget of
    ``64000 * 28 * 28 * 0.9`` resized pixels summed over a video's sampled frames).

    Pixel caps apply to the *declared* size read from the file header, so a 50k x 50k PNG is
    refused before a byte of it is decompressed.
    """

    max_images: int = 16
    max_videos: int = 2
    max_image_bytes: int = 32 * MIB
    max_video_bytes: int = 512 * MIB
    max_image_pixels: int = 8192 * 8192
    max_frame_pixels: int = 4096 * 4096
    max_video_seconds: float = 1200.0
    max_video_frames: int = 768
    max_video_total_pixels: int = int(64000 * 28 * 28 * 0.9)
    video_fps: float = 1.0
    min_video_fps: float = 0.1
    max_video_fps: float = 10.0
    url_timeout_s: float = 20.0
    local_media_root: str | None = None

    def __post_init__(self) -> None:
        for spec in fields(self):
            value = getattr(self, spec.name)
            if spec.name == "local_media_root":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"media limit {spec.name} must be a positive number, got {value!r}")
        if not self.min_video_fps <= self.video_fps <= self.max_video_fps:
            raise ValueError(
                f"media limit video_fps {self.video_fps} is outside "
                f"[min_video_fps {self.min_video_fps}, max_video_fps {self.max_video_fps}]"
            )

    @classmethod
    def from_mapping(cls, values: dict[str, Any] | None) -> "MediaLimits":
        """Builds limits from e.g. ``--mm-process-config '{"limits": {...}}'``; unknown keys fail."""
        values = dict(values or {})
        known = {spec.name for spec in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown media limit(s) {unknown}; known: {sorted(known)}")
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
