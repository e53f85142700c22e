"""Per-item media options of a request: read where SGLang hands them on, checked before any media
is read, and either honoured or refused naming the option.

SGLang passes an item's options as a dict item's own keys (``/generate`` with ``{"url": ..., "fps":
2}``), in its ``preprocess_kwargs`` (where the chat layer puts a ``video_url``'s ``fps`` /
``max_frames``), or as ``ImageData`` / ``VideoData`` attributes (``max_long_side_pixel``). Options
transformers' M3 processors take per call are honoured: ``min_pixels`` / ``max_pixels`` (images and
videos) and ``fps`` (videos); ``max_frames`` caps a video's sampled frames as the server's
``max_video_frames`` does. Every other option is refused: all of them were accepted and silently
ignored, so a caller believed they had taken effect.

A request's ``mm_processor_kwargs`` (chat, completions and ``/generate`` carry it) are read as
transformers' processor reads its call's kwargs: a flat option reaches every kind that takes it,
``images_kwargs`` / ``videos_kwargs`` one kind, flat ones first (transformers' priority). They are
the defaults of every item of the request; an item's own option wins.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from sglang_m3.multimodal.errors import MediaError
from sglang_m3.multimodal.patches import PatchGeometry

HONOURED = {"image": ("min_pixels", "max_pixels"), "video": ("min_pixels", "max_pixels", "fps", "max_frames")}
# Options other SGLang processors take; M3's processors have no such setting.
UNSUPPORTED = ("max_long_side_pixel", "max_dynamic_patch", "min_dynamic_patch", "max_tokens_per_frame", "max_image_tokens")
KNOWN = HONOURED["video"] + UNSUPPORTED


@dataclass(frozen=True)
class ItemOptions:
    """How one item is processed: the server's geometry with the item's pixel bounds, its video
    rate (None: the server's) and its frame cap (None: the server's)."""

    geometry: PatchGeometry
    fps: float | None = None
    max_frames: int | None = None


REQUEST_PART = "mm_processor_kwargs"
PER_KIND_KWARGS = {"images_kwargs": "image", "videos_kwargs": "video"}


def request_options(kwargs: Any) -> dict[str, dict[str, Any]]:
    """A request's ``mm_processor_kwargs``, split per kind (``{"image": {...}, "video": {...}}``)
    as transformers' processor routes its call's kwargs. Options no kind takes are refused naming
    them; the values are checked where they apply (:func:`check_request_options`)."""
    split: dict[str, dict[str, Any]] = {"image": {}, "video": {}}
    if kwargs is None:
        return split
    if not isinstance(kwargs, dict):
        raise MediaError(REQUEST_PART, f"must be an object, got {type(kwargs).__name__}")
    flat = {key: value for key, value in kwargs.items() if key not in PER_KIND_KWARGS and value is not None}
    for section, kind in PER_KIND_KWARGS.items():
        options = kwargs.get(section)
        if options is None:
            continue
        if not isinstance(options, dict):
            raise MediaError(REQUEST_PART, f"{section} must be an object, got {type(options).__name__}")
        for name, value in options.items():
            if value is not None:
                _check_applies(name, kind, REQUEST_PART, f"{section}.{name}")
                split[kind][name] = value
    for name, value in flat.items():
        kinds = [kind for kind in split if name in HONOURED[kind]]
        if not kinds:
            _check_applies(name, "image", REQUEST_PART, any_kind=True)
        for kind in kinds:
            split[kind][name] = value  # flat kwargs win, as in transformers
    return split


def check_request_options(options: dict[str, Any], *, kind: str, geometry: PatchGeometry) -> None:
    """Refuses (naming ``mm_processor_kwargs``) request options of one kind that no item could honour."""
    item_options({}, kind=kind, part=REQUEST_PART, geometry=geometry, request=options)


def item_options(
    item: Any, *, kind: str, part: str, geometry: PatchGeometry, request: dict[str, Any] | None = None
) -> ItemOptions:
    """The options ``item`` (an image or video part named ``part``) carries, on top of the
    request's options of its kind (``request``, from :func:`request_options`) and the server's
    ``geometry``; a :class:`MediaError` naming ``part`` and the option for any it cannot honour."""
    given = _given_options(item, kind, part)
    for name in given:
        _check_applies(name, kind, part)
    given = {**(request or {}), **given}
    return ItemOptions(
        geometry=_bounded_geometry(geometry, given, part),
        fps=_rate(given["fps"], part) if "fps" in given else None,
        max_frames=_positive_int(given["max_frames"], "max_frames", part) if "max_frames" in given else None,
    )


def _given_options(item: Any, kind: str, part: str) -> dict[str, Any]:
    """Every known option ``item`` sets (``None`` counts as unset), from its own fields and its
    ``preprocess_kwargs``; an unknown ``preprocess_kwargs`` key or one option given twice with
    different values is refused (either value would be silently dropped)."""
    fields = _own_options(item)
    extra = _preprocess_kwargs(item, part)
    for key in extra:
        if key not in KNOWN:
            raise MediaError(part, f"preprocess_kwargs.{key} is not a media option; {_takes(kind)}")
    for key in fields.keys() & extra.keys():
        if fields[key] != extra[key]:
            raise MediaError(part, f"{key} is given twice with different values ({fields[key]!r} and {extra[key]!r})")
    return {**extra, **fields}


def _own_options(item: Any) -> dict[str, Any]:
    """The known options set as a dict item's keys or an ``ImageData`` / ``VideoData``'s fields
    (items SGLang passes on with a ``url``); strings, bytes and PIL images carry none."""
    if isinstance(item, dict):
        return {key: item[key] for key in KNOWN if item.get(key) is not None}
    if hasattr(item, "url"):
        return {key: getattr(item, key) for key in KNOWN if getattr(item, key, None) is not None}
    return {}


def _preprocess_kwargs(item: Any, part: str) -> dict[str, Any]:
    options = item.get("preprocess_kwargs") if isinstance(item, dict) else getattr(item, "preprocess_kwargs", None)
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise MediaError(part, f"preprocess_kwargs must be an object, got {type(options).__name__}")
    return {key: value for key, value in options.items() if value is not None}


def _check_applies(name: str, kind: str, part: str, label: str | None = None, any_kind: bool = False) -> None:
    """Refuses an option M3 has no setting for, a video option on an image, or (``any_kind``: a
    request-wide option) one that no kind takes. ``label`` is how the message names the option."""
    label = label or name
    if name in UNSUPPORTED:
        raise MediaError(part, f"{label} is not supported for MiniMax M3 media; use min_pixels / max_pixels")
    if any_kind:
        raise MediaError(part, f"{label} is not a media option; {_takes('image')}; {_takes('video')}")
    if name in HONOURED["video"] and name not in HONOURED[kind]:
        raise MediaError(part, f"{label} is a video option; {_takes(kind)}")
    if name not in HONOURED[kind]:
        raise MediaError(part, f"{label} is not a media option; {_takes(kind)}")


def _takes(kind: str) -> str:
    return f"{kind}s take {', '.join(HONOURED[kind])}"


def _bounded_geometry(server: PatchGeometry, given: dict[str, Any], part: str) -> PatchGeometry:
    """The server's geometry with the item's pixel bounds, as transformers' processor takes them per
    call. The server's ``max_pixels`` stays the ceiling: it bounds the rows and tokens one item
    costs (an 8192x8192 image unbounded is ~85,000 tokens), and operators raise it in
    ``--mm-process-config``."""
    low = _positive_int(given["min_pixels"], "min_pixels", part) if "min_pixels" in given else server.min_pixels
    high = _positive_int(given["max_pixels"], "max_pixels", part) if "max_pixels" in given else server.max_pixels
    if high > server.max_pixels:
        raise MediaError(part, f"max_pixels {high} is over the server's max_pixels {server.max_pixels}")
    if low > high:
        _refuse_crossed_bounds(low, high, given, part)
    return replace(server, min_pixels=low, max_pixels=high)


def _refuse_crossed_bounds(low: int, high: int, given: dict[str, Any], part: str) -> None:
    """Names the bound the caller sent. With a minimum over the maximum, transformers' resize grows
    small media past the maximum; a bound crossed with the server's own default is refused too."""
    if "max_pixels" not in given:
        raise MediaError(part, f"min_pixels {low} is over the server's max_pixels {high}")
    if "min_pixels" not in given:
        raise MediaError(part, f"max_pixels {high} is under the server's min_pixels {low}; send min_pixels as well")
    raise MediaError(part, f"min_pixels {low} is over max_pixels {high}")


def _positive_int(value: Any, name: str, part: str) -> int:
    """Integers and integral floats (JSON writers that emit ``3136.0``) above zero; the rest,
    booleans and strings included, are refused naming ``name``."""
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not integral or value <= 0:
        raise MediaError(part, f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _rate(value: Any, part: str) -> float:
    """``fps`` as a float: numbers and numeric strings, as upstream SGLang reads it. Over HTTP
    SGLang's schema gate admits only numbers, but the Engine API passes any object: others escaped
    as a TypeError naming no video, and ``True`` was taken as 1 fps. The range is checked against
    the limits when the video is decoded."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise MediaError(part, f"fps must be a number, got {value!r}")
    try:
        return float(value)
    except ValueError:
        raise MediaError(part, f"fps must be a number, got {value!r}") from None
