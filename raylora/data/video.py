"""Video rows: frames decoded and sampled here, then handed to the processor with their `VideoMetadata`.

Why raylora decodes, and with PyAV: transformers 5.23's video processors decode a path themselves
(`fetch_videos`) with torchcodec only (their fallback, torchvision's decoder, is gone from torchvision
0.29), and torchcodec needs FFmpeg's shared libraries on the node and a build that matches torch. PyAV's
wheels bundle FFmpeg, so `pip install av` is all a node needs. The frames then reach the processor already
sampled (`do_sample_frames=False`) with the metadata of the sampling (the source's fps, the indices of the
frames taken, its frame count), which is what Qwen3-VL's timestamps and Qwen2.5-VL's `second_per_grid_ts`
are computed from.

Sampling follows the peers: `data.video_fps` frames per second of video (LLaMA-Factory's video_fps, 2.0
unless data.video_num_frames is set), or `data.video_num_frames` evenly spaced, at most
`data.video_max_frames`; the count is rounded to an even number (Qwen's temporal patch takes frames in pairs,
as qwen-vl-utils rounds to its FRAME_FACTOR of 2), so a one-frame video gives its frame twice. A video entry
may also be a list of frames (images, as ms-swift and LLaMA-Factory accept), taken as frames at
data.video_fps (2.0 unset).

Imports: config-free; `raylora.data.labels` and `raylora.data.batches` use it.
"""

from __future__ import annotations

import importlib.util
import io
from dataclasses import dataclass

import numpy as np
from PIL import Image

DEFAULT_FPS = 2.0  # LLaMA-Factory's video_fps and qwen-vl-utils' FPS
FRAME_FACTOR = 2  # Qwen's temporal_patch_size: frames go to the vision tower in pairs
DECODER = "av"
# What the driver says when a source has video rows and no decoder is installed.
NO_DECODER = (
    "video rows need PyAV to decode their frames, and it is not installed: pip install 'av>=18,<20' "
    "(its wheels bundle FFmpeg)"
)


class Unusable(ValueError):
    """A video that cannot be trained on; the message says why."""


@dataclass(frozen=True)
class Sampling:
    """How frames are taken from a video (data.video_fps, data.video_num_frames, data.video_max_frames)."""

    fps: float | None = None
    num_frames: int | None = None
    max_frames: int = 128

    @classmethod
    def of(cls, data) -> Sampling:
        """The sampling of a `DataConfig` (the defaults for what it leaves out)."""
        return cls(
            getattr(data, "video_fps", None),
            getattr(data, "video_num_frames", None),
            getattr(data, "video_max_frames", cls.max_frames),
        )

    def count(self, total: int, source_fps: float) -> int:
        """Frames to take from a video of `total` frames at `source_fps`: even, at least 2, and at most
        max_frames and the frames the video has (rounded down to even; LLaMA-Factory caps alike)."""
        if self.num_frames is not None:
            n = self.num_frames
        else:
            n = int(total / source_fps * (self.fps or DEFAULT_FPS))
        n = min(n, total, self.max_frames)
        return max(FRAME_FACTOR, n // FRAME_FACTOR * FRAME_FACTOR)


@dataclass(frozen=True)
class PixelCaps:
    """The video processor's pixel caps (data.video_min_pixels and data.video_max_pixels for each frame,
    data.video_total_pixels for a whole video); None: the model folder's own. `raylora.data.processor`
    hands them to the processor (`cap_video_size`)."""

    min_pixels: int | None = None
    max_pixels: int | None = None
    total_pixels: int | None = None

    @classmethod
    def of(cls, data) -> PixelCaps:
        """The caps of a `DataConfig`, or of its dict (the config a checkpoint keeps)."""
        get = data.get if isinstance(data, dict) else lambda key: getattr(data, key, None)
        return cls(get("video_min_pixels"), get("video_max_pixels"), get("video_total_pixels"))

    def __bool__(self) -> bool:
        return any(v is not None for v in (self.min_pixels, self.max_pixels, self.total_pixels))


@dataclass
class Video:
    """A decoded video: its sampled frames (frames, height, width, 3; uint8) and `VideoMetadata`."""

    frames: np.ndarray
    metadata: object  # transformers.video_utils.VideoMetadata


def decoder_installed() -> bool:
    return importlib.util.find_spec(DECODER) is not None


def indices(total: int, count: int) -> list[int]:
    """`count` frame indices spread evenly over `total` frames, first and last included (as transformers'
    Qwen video processors sample)."""
    return np.linspace(0, total - 1, count).round().astype(int).tolist()


def _metadata(total: int, fps: float, taken: list[int], frames: np.ndarray):
    from transformers.video_utils import VideoMetadata

    return VideoMetadata(
        total_num_frames=total,
        fps=fps,
        width=int(frames.shape[2]),
        height=int(frames.shape[1]),
        duration=total / fps,
        video_backend="pyav",
        frames_indices=taken,
    )


def decode(data: bytes, sampling: Sampling) -> Video:
    """The sampled frames of an encoded video (any container and codec FFmpeg reads); `ValueError` naming
    why when it has no video stream, no frame or does not decode.

    Only the sampled frames are kept: the indices come from the container's frame count, and where that
    count is missing or wrong (AVI and variable-rate files can say so) a second pass takes them from the
    count the first pass decoded."""
    if not decoder_installed():
        raise Unusable(NO_DECODER)
    try:
        stated, fps, _ = _frames(data, None)
        total, kept, taken = 0, {}, []
        if stated:
            taken = indices(stated, sampling.count(stated, fps))
            total, _, kept = _frames(data, set(taken))
        if not stated:
            total = _frames(data, set(), count_only=True)[0]
        if total and total != stated:  # the container's count was missing or wrong: sample what decoded
            taken = indices(total, sampling.count(total, fps))
            kept = _frames(data, set(taken))[2]
    except Unusable:
        raise
    except Exception as err:  # FFmpeg's errors come as many types (InvalidDataError, a ValueError too, ...)
        raise Unusable(f"the video does not decode ({type(err).__name__}: {err})") from err
    if not total:
        raise Unusable("the video has no frames")
    frames = np.stack([kept[i] for i in taken])  # a one-frame video: its frame twice
    return Video(frames, _metadata(total, fps, taken, frames))


def _frames(data: bytes, wanted: set[int] | None, count_only: bool = False):
    """(frames, fps, {index: RGB array} of the `wanted` frames) of one pass over the video; with
    `wanted` None, the container's stated frame count (0: none stated) instead of a decode."""
    import av

    with av.open(io.BytesIO(data)) as container:
        if not container.streams.video:
            raise Unusable("the file has no video stream")
        stream = container.streams.video[0]
        # FFmpeg starts no threads of its own, to decode or to convert. Decoding runs in the input
        # pipeline's processes (their number is the parallelism), forked from the training process, and a
        # process forked from one that had run FFmpeg's thread pools was seen to hang inside FFmpeg
        # (dev/LOG.md); a thread per core in each process would also oversubscribe the node.
        threads = 1
        stream.thread_count = threads
        rate = stream.average_rate or stream.guessed_rate
        fps = float(rate) if rate else DEFAULT_FPS
        if wanted is None:
            return int(stream.frames or 0), fps, {}
        kept, n = {}, 0
        for n, picture in enumerate(container.decode(stream), start=1):
            if not count_only and n - 1 in wanted:
                kept[n - 1] = picture.to_ndarray(format="rgb24", threads=threads)
        return n, fps, kept


def from_frames(images: list[Image.Image], sampling: Sampling) -> Video:
    """A video given as its frames (a list of images): taken as frames at data.video_fps, sampled down to
    data.video_num_frames / data.video_max_frames."""
    if not images:
        raise Unusable("the video has no frames")
    fps = sampling.fps or DEFAULT_FPS
    total = len(images)
    count = sampling.count(total, fps) if sampling.num_frames is not None else total
    taken = indices(total, max(FRAME_FACTOR, min(count, sampling.max_frames) // FRAME_FACTOR * FRAME_FACTOR))
    size = images[0].size
    frames = np.stack([np.asarray(images[i].convert("RGB").resize(size)) for i in taken])
    return Video(frames, _metadata(total, fps, taken, frames))


def blank(edge: int, frames: int = FRAME_FACTOR) -> Video:
    """A grey video of `frames` frames `edge` pixels a side at 2 fps: the stand-in's."""
    pixels = np.full((frames, edge, edge, 3), 127, dtype=np.uint8)
    return Video(pixels, _metadata(frames, DEFAULT_FPS, list(range(frames)), pixels))


def processor_inputs(videos: list[Video]) -> dict:
    """The processor's keyword arguments for `videos` (none without videos): the frames as sampled here,
    with their metadata, and `do_sample_frames=False` so that the processor keeps them as they are."""
    if not videos:
        return {}
    return {
        "videos": [v.frames for v in videos],
        "video_metadata": [v.metadata for v in videos],
        "do_sample_frames": False,
    }


# Processor outputs that come with videos only, although their names do not say so (Qwen2.5-VL's).
VIDEO_KEYS = ("second_per_grid_ts",)


def has_video(vision: dict) -> bool:
    """Whether a row's (or batch's) vision tensors hold a video (Qwen's pixel_values_videos, ...)."""
    return any("video" in key or key in VIDEO_KEYS for key in vision)


def has_image(vision: dict) -> bool:
    """Whether a row's (or batch's) vision tensors hold an image (pixel_values, image_grid_thw, ...)."""
    return any("video" not in key and key not in VIDEO_KEYS for key in vision)


def takes_videos(processor) -> bool:
    """Whether `processor` has a video part (the model has a video path of its own)."""
    return getattr(processor, "video_processor", None) is not None
