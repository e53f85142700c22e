"""One request's media end to end: limits, parallel decoding in the pool, prompt pieces."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import Any

from sglang_m3.multimodal.errors import MediaError
from sglang_m3.multimodal.image import ImageFeatures, image_features
from sglang_m3.multimodal.limits import MediaLimits
from sglang_m3.multimodal.options import ItemOptions, check_request_options, item_options, request_options
from sglang_m3.multimodal.patches import PatchGeometry
from sglang_m3.multimodal.pool import MediaWorkerPool
from sglang_m3.multimodal.prompt import MediaTokens
from sglang_m3.multimodal.sources import read_media
from sglang_m3.multimodal.video import VideoFeatures, video_features

# M3's video processor: same patching as images, up to 768 * 28 * 28 pixels per frame.
VIDEO_GEOMETRY = PatchGeometry(min_pixels=4 * 28 * 28, max_pixels=768 * 28 * 28)


@dataclass(frozen=True)
class PreprocessConfig:
    image: PatchGeometry = field(default_factory=PatchGeometry)
    video: PatchGeometry = VIDEO_GEOMETRY
    limits: MediaLimits = field(default_factory=MediaLimits)
    tokens: MediaTokens = field(default_factory=MediaTokens)

    @classmethod
    def from_settings(
        cls, hf_processor: Any = None, mm_process_config: dict[str, Any] | None = None
    ) -> "PreprocessConfig":
        """Geometry from the checkpoint's processor (if any), then server overrides.

        ``mm_process_config`` is SGLang's ``--mm-process-config``: ``{"image": {"min_pixels",
        "max_pixels"}, "video": {"min_pixels", "max_pixels", "fps"}, "limits": {...MediaLimits}}``.
        """
        image, video = PatchGeometry(), VIDEO_GEOMETRY
        image_processor = getattr(hf_processor, "image_processor", None)
        video_processor = getattr(hf_processor, "video_processor", None)
        if image_processor is not None:
            _check_supported_switches(image_processor, "image")
            size = image_processor.size
            image = _geometry_from(image_processor, image, size["shortest_edge"], size["longest_edge"])
        if video_processor is not None:
            _check_supported_switches(video_processor, "video")
            video = _geometry_from(video_processor, video, video_processor.min_pixels, video_processor.max_pixels)
        settings = dict(mm_process_config or {})
        unknown = sorted(set(settings) - {"image", "video", "audio", "limits"})
        if unknown:
            raise ValueError(f"unknown mm_process_config section(s) {unknown}")
        limits = dict(settings.get("limits") or {})
        video_settings = dict(settings.get("video") or {})
        if "fps" in video_settings:
            limits.setdefault("video_fps", video_settings.pop("fps"))
        checkpoint_fps = _checkpoint_fps(video_processor) if "video_fps" not in limits else None
        if checkpoint_fps is not None:
            limits["video_fps"] = checkpoint_fps
        return cls(
            image=_with_pixels(image, settings.get("image") or {}, "image"),
            video=_with_pixels(video, video_settings, "video"),
            limits=_limits_from(limits, checkpoint_fps),
        )


def check_against_vision_config(config: PreprocessConfig, vision: dict) -> None:
    """The processor's patching must be the one the vision tower was built for.

    The processor files and ``config.json`` are separate files of a checkpoint; a patch or
    merge size that differs between them gives every image the wrong number of placeholder
    tokens or rows the tower cannot embed, so the server refuses to start instead.
    """
    pairs = (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"), ("merge_size", "spatial_merge_size"))
    for kind, geometry in (("image", config.image), ("video", config.video)):
        for ours, theirs in pairs:
            expected = vision.get(theirs)
            if expected is not None and getattr(geometry, ours) != expected:
                raise ValueError(
                    f"the {kind} processor's {ours} ({getattr(geometry, ours)}) differs from the "
                    f"checkpoint's vision_config.{theirs} ({expected})"
                )


# The steps this preprocessing always runs; a processor may not switch them off.
ALWAYS_ON = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")
# PIL's code and torchvision's name of bicubic, the one resampler implemented (M3's processors ship with it).
BICUBIC = (3, "bicubic")


def _check_supported_switches(processor: Any, kind: str) -> None:
    """A checkpoint's processor saved with another resampler or with a step switched off is
    refused at start-up, naming the setting: such settings were ignored, so every image differed
    from what transformers' processor makes of the same files."""
    for name in ALWAYS_ON:
        value = getattr(processor, name, None)
        if value is not None and value is not True:
            raise ValueError(
                f"the checkpoint's {kind} processor sets {name}={value!r}; sglang-m3 supports only {name}=True"
            )
    resample = getattr(processor, "resample", None)
    if resample is not None and getattr(resample, "value", resample) not in BICUBIC:
        raise ValueError(
            f"the checkpoint's {kind} processor sets resample={resample!r}; sglang-m3 supports only bicubic (3)"
        )


def _checkpoint_fps(video_processor: Any) -> float | None:
    """The rate the checkpoint's video processor samples at when a caller gives none.

    transformers' processor samples at its saved ``fps``; it was ignored here (1 fps always), so a
    checkpoint saved with another rate got other frames, grids and timestamps than transformers'.
    The server's own ``video.fps`` / ``limits.video_fps`` still win.
    """
    fps = getattr(video_processor, "fps", None)
    if fps is None:
        return None
    if isinstance(fps, bool) or not isinstance(fps, (int, float)):
        raise ValueError(f"the checkpoint's video processor fps must be a number, got {fps!r}")
    return float(fps)


def _limits_from(values: dict[str, Any], checkpoint_fps: float | None) -> MediaLimits:
    """MediaLimits, with an out-of-range rate traced to the checkpoint when it came from there."""
    try:
        return MediaLimits.from_mapping(values)
    except ValueError as exc:
        if checkpoint_fps is None or not str(exc).startswith("media limit video_fps "):
            raise
        raise ValueError(
            f"{exc}: video_fps {checkpoint_fps} is the checkpoint's video processor fps "
            f"(set mm_process_config video.fps, or limits min_video_fps / max_video_fps)"
        ) from None


def _geometry_from(processor: Any, base: PatchGeometry, min_pixels: int, max_pixels: int) -> PatchGeometry:
    return replace(
        base,
        patch_size=processor.patch_size,
        temporal_patch_size=processor.temporal_patch_size,
        merge_size=processor.merge_size,
        min_pixels=int(min_pixels),
        max_pixels=int(max_pixels),
        rescale_factor=float(processor.rescale_factor),
        image_mean=tuple(processor.image_mean),
        image_std=tuple(processor.image_std),
    )


def _with_pixels(geometry: PatchGeometry, overrides: dict[str, Any], section: str) -> PatchGeometry:
    unknown = sorted(set(overrides) - {"min_pixels", "max_pixels"})
    if unknown:
        raise ValueError(f"unknown mm_process_config.{section} key(s) {unknown}")
    updated = replace(geometry, **{key: int(value) for key, value in overrides.items()})
    if not 0 < updated.min_pixels <= updated.max_pixels:
        raise ValueError(f"mm_process_config.{section}: need 0 < min_pixels <= max_pixels")
    return updated


@dataclass
class ProcessedMedia:
    images: list[ImageFeatures]
    videos: list[VideoFeatures]
    image_texts: list[str]
    video_texts: list[str]


class MediaPreprocessor:
    """Turns a request's image and video parts into patch rows and placeholder texts."""

    def __init__(self, config: PreprocessConfig, pool: MediaWorkerPool):
        self.config = config
        self.pool = pool

    def check_counts(self, num_images: int, num_videos: int) -> None:
        limits = self.config.limits
        if num_images > limits.max_images:
            raise MediaError("request", f"{num_images} images, over the limit of {limits.max_images}")
        if num_videos > limits.max_videos:
            raise MediaError("request", f"{num_videos} videos, over the limit of {limits.max_videos}")

    def image(self, item: Any, part: str, options: ItemOptions) -> ImageFeatures:
        source = read_media(item, kind="image", part=part, limits=self.config.limits)
        return image_features(source, options.geometry, self.config.limits)

    def video(self, item: Any, part: str, options: ItemOptions) -> VideoFeatures:
        source = read_media(item, kind="video", part=part, limits=self.config.limits)
        return video_features(source, options.geometry, self.config.limits, options.fps, options.max_frames)

    def parts(
        self, images: list[Any], videos: list[Any], request_kwargs: Any = None
    ) -> list[tuple[Any, str, ItemOptions]]:
        """Each part with its name and options, read before any media is: a refused option fails
        the request at once, naming the request's ``mm_processor_kwargs`` (``request_kwargs``) or
        the first part at fault in request order. Request options are checked for the kinds the
        request carries, as transformers' processor uses only those."""
        shared = request_options(request_kwargs)
        for kind, items, geometry in (("image", images, self.config.image), ("video", videos, self.config.video)):
            if items and shared[kind]:
                check_request_options(shared[kind], kind=kind, geometry=geometry)
        parts = [(item, "image", f"image {i + 1}", self.config.image) for i, item in enumerate(images)]
        parts += [(item, "video", f"video {i + 1}", self.config.video) for i, item in enumerate(videos)]
        return [
            (item, part, item_options(item, kind=kind, part=part, geometry=geometry, request=shared[kind]))
            for item, kind, part, geometry in parts
        ]

    async def process(self, images: list[Any], videos: list[Any], request_kwargs: Any = None) -> ProcessedMedia:
        """Decodes every part in parallel; the first failing part (in request order) is raised.
        ``request_kwargs``: the request's ``mm_processor_kwargs`` (see :mod:`.options`)."""
        self.check_counts(len(images), len(videos))
        parts = self.parts(images, videos, request_kwargs)
        jobs = [self.pool.run(self.image, *part) for part in parts[: len(images)]]
        jobs += [self.pool.run(self.video, *part) for part in parts[len(images) :]]
        results = await asyncio.gather(*jobs, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        image_results, video_results = results[: len(images)], results[len(images) :]
        tokens = self.config.tokens
        return ProcessedMedia(
            images=image_results,
            videos=video_results,
            image_texts=[tokens.image_text(f.grid_thw, self.config.image.merge_size) for f in image_results],
            video_texts=[
                tokens.video_text(
                    f.grid_thw, self.config.video.merge_size, f.timestamps(self.config.video.temporal_patch_size)
                )
                for f in video_results
            ],
        )
