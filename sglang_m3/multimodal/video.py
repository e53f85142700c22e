"""Video decoding with PyAV: declared length and size checked first, only sampled frames kept.

Frames are sampled at the requested rate as transformers' default sampler does
(``n = int(total / native_fps * fps)`` frames at indices ``i * total // n``), with ``n`` kept in
``[1, min(total, max_video_frames)]`` (or the request's lower ``max_frames``). Each kept frame is
resized as soon as it is decoded, so memory holds only the resized frames, never the whole
decoded video.
"""

from __future__ import annotations

from dataclasses import dataclass

import av
import torch

from sglang_m3.multimodal.errors import MediaError
from sglang_m3.multimodal.limits import MediaLimits
from sglang_m3.multimodal.patches import PatchGeometry, fit_size, resize_frames, to_patch_rows
from sglang_m3.multimodal.sources import MediaSource


@dataclass(frozen=True)
class VideoHeader:
    """What the container declares, read without decoding a frame."""

    fps: float
    total_frames: int
    seconds: float
    width: int
    height: int


@dataclass
class VideoFeatures:
    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    frame_indices: list[int]
    fps: float

    def timestamps(self, temporal_patch_size: int) -> list[float]:
        """Seconds of the first frame of each temporal patch (the M3 prompt shows these)."""
        last = len(self.frame_indices) - 1
        return [
            self.frame_indices[min(chunk * temporal_patch_size, last)] / self.fps for chunk in range(self.grid_thw[0])
        ]


def sample_indices(total_frames: int, native_fps: float, fps: float, max_frames: int) -> list[int]:
    count = int(total_frames / native_fps * fps)
    count = max(1, min(count, total_frames, max_frames))
    return [i * total_frames // count for i in range(count)]


def read_header(source: MediaSource, limits: MediaLimits) -> VideoHeader:
    part = source.part
    with source.open() as handle, _open_container(handle, part) as container:
        if not container.streams.video:
            raise MediaError(part, "container has no video stream")
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate
        if not rate or rate <= 0:
            raise MediaError(part, "video declares no frame rate")
        fps = float(rate)
        if stream.duration is not None and stream.time_base is not None:
            seconds = float(stream.duration * stream.time_base)
        elif container.duration is not None:
            seconds = container.duration / av.time_base
        else:
            seconds = 0.0
        codec = stream.codec_context
        if codec is None:
            raise MediaError(part, "the video stream has no decodable codec (corrupt or truncated file)")
        width, height = codec.width, codec.height
        if width * height == 0:
            raise MediaError(part, f"video declares an empty frame size {width}x{height}")
        if width * height > limits.max_frame_pixels:
            raise MediaError(
                part, f"frame size {width}x{height} is over the limit of {limits.max_frame_pixels} pixels"
            )
        if seconds > limits.max_video_seconds:
            raise MediaError(
                part, f"video declares {seconds:.0f} s, over the limit of {limits.max_video_seconds:.0f} s"
            )
        total = stream.frames or _count_packets(container, stream, part)
        if seconds == 0.0:
            seconds = total / fps
            if seconds > limits.max_video_seconds:
                raise MediaError(
                    part, f"video holds {seconds:.0f} s, over the limit of {limits.max_video_seconds:.0f} s"
                )
        if total <= 0:
            raise MediaError(part, "video holds no frames")
    return VideoHeader(fps=fps, total_frames=total, seconds=seconds, width=width, height=height)


def _count_packets(container, stream, part: str) -> int:
    """Frame count of a container that does not declare one (WebM, Matroska): demux, no decoding."""
    try:
        return sum(1 for packet in container.demux(stream) if packet.size)
    except av.FFmpegError as exc:
        raise MediaError(part, f"video is corrupt or truncated ({exc})") from None


def _open_container(handle, part: str):
    try:
        return av.open(handle, mode="r", metadata_errors="ignore")
    except av.FFmpegError as exc:
        raise MediaError(part, f"content is not a decodable video ({exc})") from None


def decode_frames(source: MediaSource, header: VideoHeader, indices: list[int], size: tuple[int, int]) -> torch.Tensor:
    """uint8 ``[len(indices), 3, *size]``: the frames at ``indices`` (presentation order), resized."""
    part = source.part
    wanted = set(indices)
    kept: list[torch.Tensor] = []
    position = -1
    try:
        with source.open() as handle, _open_container(handle, part) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            for position, frame in enumerate(container.decode(stream)):
                _check_frame_size(frame, header, position, part)
                if position in wanted:
                    rgb = torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1)
                    kept.append(resize_frames(rgb.unsqueeze(0), size)[0])
                if position >= indices[-1]:
                    break
    except av.FFmpegError as exc:
        raise MediaError(part, f"video is corrupt or truncated at frame {position + 1} ({exc})") from None
    if len(kept) != len(indices):
        raise MediaError(part, f"video ended after {position + 1} frames, before frame {indices[-1]} it declares")
    return torch.stack(kept)


def _check_frame_size(frame: av.VideoFrame, header: VideoHeader, position: int, part: str) -> None:
    """Every frame must have the size the stream declares.

    The resize target and the frame-size cap come from the declared size. A stream whose frames
    change size (concatenated segments, VP9 resolution switches) was squashed into the first
    size, aspect ratio lost, and its larger frames escaped ``max_frame_pixels``; transformers'
    video processor refuses frames of differing sizes too (it cannot stack them).
    """
    if (frame.width, frame.height) != (header.width, header.height):
        raise MediaError(
            part,
            f"frame {position} is {frame.width}x{frame.height} but the video declares "
            f"{header.width}x{header.height} frames (frames of differing sizes are not supported)",
        )


def video_features(
    source: MediaSource,
    geometry: PatchGeometry,
    limits: MediaLimits,
    fps: float | None = None,
    max_frames: int | None = None,
) -> VideoFeatures:
    """One video part -> patch rows, (t, h, w) grid and the sampled frame indices.

    ``fps`` and ``max_frames`` are the request's own (None: the server's); a request's frame cap
    asks for at most that many frames, so the server's ``max_video_frames`` still bounds it.
    """
    part = source.part
    fps = limits.video_fps if fps is None else fps
    if not limits.min_video_fps <= fps <= limits.max_video_fps:
        raise MediaError(part, f"fps {fps} is outside [{limits.min_video_fps}, {limits.max_video_fps}]")
    frame_cap = limits.max_video_frames if max_frames is None else min(max_frames, limits.max_video_frames)
    header = read_header(source, limits)
    indices = sample_indices(header.total_frames, header.fps, fps, frame_cap)
    try:
        size = fit_size(header.height, header.width, geometry)
    except ValueError as exc:
        raise MediaError(part, str(exc)) from None
    total_pixels = len(indices) * size[0] * size[1]
    if total_pixels > limits.max_video_total_pixels:
        raise MediaError(
            part,
            f"{len(indices)} sampled frames of {size[1]}x{size[0]} are {total_pixels} pixels, over the "
            f"limit of {limits.max_video_total_pixels} (lower fps or resolution)",
        )
    frames = decode_frames(source, header, indices, size)
    rows, grid = to_patch_rows(frames, geometry)
    return VideoFeatures(pixel_values=rows, grid_thw=grid, frame_indices=indices, fps=header.fps)
