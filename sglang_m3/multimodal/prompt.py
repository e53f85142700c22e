"""Prompt expansion: each media placeholder becomes one token per merged patch block.

An image becomes ``start + image * n + end``; a video becomes, per temporal patch, the
timestamp text ``]<]{seconds:.1f} seconds[>[`` then ``start + video * n_frame + end``. The i-th
placeholder of a kind takes the i-th media item of that kind, as in transformers' processor.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sglang_m3.multimodal.errors import MediaError


@dataclass(frozen=True)
class MediaTokens:
    image: str = "]<]image[>["
    video: str = "]<]video[>["
    start: str = "]<]start of image[>["
    end: str = "]<]end of image[>["

    def image_text(self, grid: Sequence[int], merge_size: int) -> str:
        t, h, w = grid
        return self.start + self.image * (t * h * w // merge_size**2) + self.end

    def video_text(self, grid: Sequence[int], merge_size: int, timestamps: Sequence[float]) -> str:
        _, h, w = grid
        frame = self.start + self.video * (h * w // merge_size**2) + self.end
        return "".join(f"]<]{seconds:.1f} seconds[>[" + frame for seconds in timestamps)


def _check_counts(found: dict[str, int], given: dict[str, int]) -> None:
    for kind in ("image", "video"):
        if found[kind] != given[kind]:
            raise MediaError(
                "request",
                f"the prompt has {found[kind]} {kind} placeholder(s) but the request carries "
                f"{given[kind]} {kind}(s)",
            )


def expand_text(text: str, tokens: MediaTokens, image_texts: Sequence[str], video_texts: Sequence[str]) -> str:
    """Replaces the placeholders of ``text`` in order; counts must match the media."""
    pattern = re.compile(f"(?P<image>{re.escape(tokens.image)})|(?P<video>{re.escape(tokens.video)})")
    matches = list(pattern.finditer(text))
    found = {kind: sum(1 for m in matches if m.lastgroup == kind) for kind in ("image", "video")}
    _check_counts(found, {"image": len(image_texts), "video": len(video_texts)})
    pieces, last = [], 0
    queues = {"image": iter(image_texts), "video": iter(video_texts)}
    for match in matches:
        pieces.append(text[last : match.start()])
        pieces.append(next(queues[match.lastgroup]))
        last = match.end()
    pieces.append(text[last:])
    return "".join(pieces)


def expand_ids(
    ids: Sequence[int],
    token_ids: dict[str, int],
    image_texts: Sequence[str],
    video_texts: Sequence[str],
    encode: Callable[[str], list[int]],
) -> list[int]:
    """The token-id form of :func:`expand_text`, for requests that arrive already tokenized."""
    image_id, video_id = token_ids["image"], token_ids["video"]
    found = {"image": sum(1 for i in ids if i == image_id), "video": sum(1 for i in ids if i == video_id)}
    _check_counts(found, {"image": len(image_texts), "video": len(video_texts)})
    queues = {image_id: iter(image_texts), video_id: iter(video_texts)}
    out: list[int] = []
    for token in ids:
        if token in queues:
            out.extend(encode(next(queues[token])))
        else:
            out.append(token)
    return out


def placeholder_runs(ids: Sequence[int], token_id: int) -> list[tuple[int, int]]:
    """Inclusive ``(start, end)`` spans of consecutive ``token_id`` in ``ids``."""
    runs, start = [], None
    for position, token in enumerate(ids):
        if token == token_id and start is None:
            start = position
        elif token != token_id and start is not None:
            runs.append((start, position - 1))
            start = None
    if start is not None:
        runs.append((start, len(ids) - 1))
    return runs
