"""The model's batches: rows decoded when a batch uses them (`read`), each sample encoded with its labels
(`raylora.data.labels`), padded and stacked; the label-less stand-in that keeps every ZeRO-3 rank in step.
Which rows a step uses is `raylora.data.sampler`'s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from PIL import Image

from raylora.config import ConfigError
from raylora.data import packing, video
from raylora.data.formats import BadRow, Rows, load_image, load_video
from raylora.data.labels import IGNORE_INDEX, Decoded, Row, encode

# Why a video row is skipped in a run whose passes carry no video stand-in (data.video_stand_in).
NO_VIDEO_STAND_IN = (
    "a video row in a run whose passes carry no video stand-in (the driver's preflight found no video rows "
    "in data.train): under ZeRO-3 a rank with a video would run a vision pass the others do not; set "
    "data.video_stand_in=true"
)


def read(rows: Rows, i: int, sampling: video.Sampling | None = None) -> Decoded:
    """Row `i` of `rows`, its images and videos decoded (videos' frames sampled by `sampling`: data.video_fps,
    data.video_num_frames, data.video_max_frames); `BadRow` when the row or one of its media is unusable.
    A row without videos is (messages, images), one with videos (messages, images, videos)."""
    sample = rows.sample(i)
    images = [load_image(entry) for entry in sample.images]
    if not sample.videos:
        return sample.messages, images
    return (
        sample.messages,
        images,
        [load_video(entry, sampling or video.Sampling()) for entry in sample.videos],
    )


def _cat(values: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along the first dimension, zero-padding the others where they differ: Idefics3's
    images per sample, Pixtral's image height and width (the zeros are what their processors pad with)."""
    shape = [max(v.shape[d] for v in values) for d in range(1, values[0].dim())]
    padded = []
    for v in values:
        pad = [p for d in reversed(range(1, v.dim())) for p in (0, shape[d - 1] - v.shape[d])]
        padded.append(F.pad(v, pad) if any(pad) else v)
    return torch.cat(padded, dim=0)


def _collate(processor, rows: list[Row], with_answers: bool) -> dict:
    """Right-padded training rows, or left-padded generation prompts (no labels)."""
    pad_id = processor.tokenizer.pad_token_id
    width = max(len(r.labels) for r in rows)
    keys = list(dict.fromkeys(k for r in rows for k in r.tokens))
    if with_answers:
        keys.append("labels")
    batch = {}
    for key in keys:
        fill = {"input_ids": pad_id, "labels": IGNORE_INDEX}.get(key, 0)
        padded = []
        for r in rows:
            values = r.labels if key == "labels" else r.tokens.get(key, [0] * len(r.labels))
            pad = [fill] * (width - len(values))
            padded.append(values + pad if with_answers else pad + values)
        batch[key] = torch.tensor(padded, dtype=torch.long)
    for key in dict.fromkeys(k for r in rows for k in r.vision):
        batch[key] = _cat([v for r in rows for v in r.vision.get(key, [])])
    return batch


def make_batch(processor, samples: list[Decoded], with_answers: bool = True) -> dict:
    """Tensors for the model from decoded samples, rendered with the model's own chat template: labels
    on every assistant turn and its end-of-turn token, IGNORE_INDEX elsewhere (`encode`).

    With `with_answers=False` (generation) each sample's last assistant turn is left out, the generation
    prompt ends it, and padding goes on the left. Token-aligned tensors (input_ids, attention_mask,
    mm_token_type_ids, ...) are padded together; vision tensors are concatenated along their first
    dimension, which stacks Llava's images and joins Qwen2-VL's patch rows alike; samples without images
    add none, so text-only and image samples share a batch.
    """
    return _collate(processor, [encode(processor, s, with_answers) for s in samples], with_answers)


STAND_IN_EDGE = 56  # pixels a side: Qwen2-VL's smallest image (min_pixels 56 * 56); resized elsewhere
# The processor's attribute that turns the video stand-in on (`use_video_stand_in`).
VIDEO_STAND_IN = "video_stand_in"


def stand_in() -> Decoded:
    """The sample that takes a slot's place without training on it (its labels are cleared): a blank
    image, an empty question and answer. Under ZeRO-3 every rank must run the same forward and backward
    passes, so a slot is never dropped: a too-long or bad sample, or an empty slot of the global batch,
    becomes this row, vision tower and all."""
    image = Image.new("RGB", (STAND_IN_EDGE, STAND_IN_EDGE), (127, 127, 127))
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": ""}]},
        {"role": "assistant", "content": [{"type": "text", "text": ""}]},
    ]
    return messages, [image]


def _stand_in_row(processor, sample: Decoded | None = None) -> Row:
    row = encode(processor, sample or stand_in())
    row.labels = [IGNORE_INDEX] * len(row.labels)
    return row


def stand_in_video() -> Decoded:
    """The video counterpart of `stand_in()`: a blank two-frame video, an empty question and answer."""
    messages = [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": ""}]},
        {"role": "assistant", "content": [{"type": "text", "text": ""}]},
    ]
    return messages, [], [video.blank(STAND_IN_EDGE)]


def use_video_stand_in(processor, on: bool | None, sampling: video.Sampling | None = None) -> None:
    """Turn the video stand-in on for batches built with `processor` (data.video_stand_in, resolved by the
    driver's preflight), where the model has a video path of its own (`_with_vision`); and keep the run's
    frame sampling beside it, for the readers that have the processor only (`video_sampling`)."""
    setattr(processor, VIDEO_STAND_IN, bool(on) and video.takes_videos(processor))
    processor.video_sampling = sampling or video.Sampling()


def video_sampling(processor) -> video.Sampling:
    """The run's frame sampling kept with `processor` (`use_video_stand_in`), or the defaults."""
    return getattr(processor, "video_sampling", None) or video.Sampling()


def check_max_length(processor, max_length: int, key: str = "data.max_length") -> None:
    """`ConfigError` when even the stand-in sample is longer than `max_length` (the setting `key`)."""
    batch = make_batch(processor, [stand_in()])
    length = int(batch["attention_mask"].sum())
    if length > max_length:
        image_id = getattr(processor, "image_token_id", None)
        images = f", {int((batch['input_ids'] == image_id).sum())} of them image tokens" if image_id else ""
        raise ConfigError(
            f"{key} ({max_length}) is shorter than the shortest possible sample: a blank "
            f"{STAND_IN_EDGE}x{STAND_IN_EDGE} image with an empty prompt and answer takes {length} tokens"
            f"{images}"
        )


def _encode_slots(
    processor, samples: list[Decoded | None], max_length: int | None, rejected: dict[int, str] | None
) -> tuple[list[Row | None], list[int]]:
    """Each sample encoded, None where there is no sample or it is rejected (into `rejected`) or longer
    than `max_length`; and the positions of the too-long ones (`limit_length`)."""
    from jinja2 import TemplateError  # what a chat template's raise_exception raises

    rows: list[Row | None] = []
    for i, sample in enumerate(samples):
        try:
            if sample is not None and len(sample) > 2 and not getattr(processor, VIDEO_STAND_IN, False):
                raise BadRow(NO_VIDEO_STAND_IN)
            rows.append(None if sample is None else encode(processor, sample))
        except BadRow as err:
            if rejected is None:
                raise
            rejected[i] = err.reason
            rows.append(None)
        except (ValueError, TemplateError) as err:
            if rejected is None:
                raise
            rejected[i] = (
                f"the processor rejects it ({type(err).__name__}: {' '.join(str(err).split())[:300]})"
            )
            rows.append(None)
    too_long = [i for i, r in enumerate(rows) if r and max_length is not None and len(r.labels) > max_length]
    for i in too_long:
        rows[i] = None
    return rows, too_long


def limit_length(
    processor,
    samples: list[Decoded | None],
    max_length: int | None,
    *,
    rejected: dict[int, str] | None = None,
) -> tuple[dict, list[int]]:
    """A training micro batch: `make_batch`, with each `None` slot (no sample) and each sample longer than
    `max_length` tokens (all its turns, image tokens and end-of-turn tokens) replaced by the label-less
    `stand_in()`. Returns the batch and the positions of the too-long samples.

    With `rejected` given, a sample that the processor or the chat template rejects (a `ValueError` such
    as "Found 1 <image> tokens in the text but no images", or the template's own `raise_exception`) is a
    bad row: it is replaced by the stand-in too, and its position and why go into `rejected`. The same
    row fails at every attempt, so it must not fail the step. Without `rejected` the error propagates.

    Too-long samples are skipped, not truncated: cutting image tokens breaks the model's image-token
    count, and cutting an answer would train on part of it.

    A batch without any image gets one stand-in row more. Under ZeRO-3 the vision tower's forward gathers
    its parameters and, when it is trained, its backward reduce-scatters their gradients: a rank that
    skipped the tower would leave the other ranks waiting in those collectives forever. A real image row
    through the model's own forward works for every architecture, where calling the tower on the side
    (and adding 0 times its output to the loss) would need each architecture's vision call; its labels are
    all IGNORE_INDEX, so it changes neither the loss nor the gradient. A model with a video path of its
    own (Qwen-VL: `pixel_values_videos` through the tower in a call of their own) runs one more tower pass
    for a batch with videos, so in a run with video rows (data.video_stand_in) a batch without a video gets
    the stand-in video row (`stand_in_video`) as well.
    """
    encoded, too_long = _encode_slots(processor, samples, max_length, rejected)
    return _with_vision(processor, [_stand_in_row(processor) if r is None else r for r in encoded]), too_long


def _with_vision(processor, rows: list[Row]) -> dict:
    """A training batch of `rows`, with the stand-in image row added when none of them has an image, and the
    stand-in video row when none has a video in a run with video rows (every rank's pass must run the same
    vision tower passes under ZeRO-3: `limit_length`)."""
    if not any(video.has_image(r.vision) for r in rows):
        rows = [*rows, _stand_in_row(processor)]
    if getattr(processor, VIDEO_STAND_IN, False) and not any(video.has_video(r.vision) for r in rows):
        rows = [*rows, _stand_in_row(processor, stand_in_video())]
    return _collate(processor, rows, with_answers=True)


def packed_passes(
    processor,
    samples: list[Decoded | None],
    budget: int,
    max_length: int | None,
    rope_index=None,
    *,
    rejected: dict[int, str] | None = None,
) -> tuple[list[dict], list[int]]:
    """A rank's share of a step as packed passes (train.packing, `raylora.data.packing`): the usable samples
    in rows of at most `budget` tokens; a sample longer than `budget` or `max_length` is skipped as too
    long, and a bad one (with `rejected`) as `limit_length` skips it. Unlike a padded micro batch, a
    skipped sample takes no stand-in's place: a packed pass has no fixed number of slots. A pass without an
    image gets the stand-in row (its labels cleared), for the vision tower's collectives under ZeRO-3,
    which may take it past `budget` by the stand-in's tokens. Returns the passes (with labels) and the
    positions of the too-long samples."""
    limit = budget if max_length is None else min(max_length, budget)
    encoded, too_long = _encode_slots(processor, samples, limit, rejected)
    rows = [r for r in encoded if r is not None]
    passes = []
    for group in packing.pack([packing.length(r) for r in rows], budget):
        passes.append(packing.packed(_with_vision(processor, [rows[i] for i in group]), rope_index))
    return passes, too_long


def stand_in_micro_batch(processor) -> dict:
    """The pass a rank with fewer passes than another runs to stay in step with it (packed, or padded under
    a token budget): the stand-in row alone, with labels that train on nothing. Packed:
    `packing.packed(stand_in_micro_batch(processor), rope_index)`."""
    return _with_vision(processor, [_stand_in_row(processor)])


def budgeted_micro_batches(
    processor,
    samples: list[Decoded | None],
    budget: int,
    max_length: int | None,
    *,
    rejected: dict[int, str] | None = None,
) -> tuple[list[dict], list[int]]:
    """A rank's share of a step as padded micro batches of at most `budget` positions each, rows times
    their longest row (train.max_tokens_per_micro_batch without packing): the usable samples ordered by
    length, longest first, each micro batch taking rows while they fit, so that short samples share a
    pass and long ones do not. Taking as many as fit, longest first, gives the fewest micro batches for
    that order. A sample longer than `budget` or `max_length` is skipped as too long, and, as in a packed
    step, a skipped slot takes no stand-in's place: the pass count is the samples', and the caller evens
    it out over the ranks. A micro batch without an image gets the stand-in image row (`limit_length`),
    which may take it past `budget`. Returns the micro batches and the positions of the too-long samples."""
    limit = budget if max_length is None else min(max_length, budget)
    encoded, too_long = _encode_slots(processor, samples, limit, rejected)
    rows = sorted((r for r in encoded if r is not None), key=lambda r: len(r.labels), reverse=True)
    groups: list[list[Row]] = []
    for row in rows:  # a group's first row is its longest: its width
        if groups and (len(groups[-1]) + 1) * len(groups[-1][0].labels) <= budget:
            groups[-1].append(row)
        else:
            groups.append([row])
    return [_with_vision(processor, group) for group in groups], too_long


def sorted_micro_batches(
    processor,
    samples: list[Decoded | None],
    micro_batch_size: int,
    count: int,
    max_length: int | None,
    *,
    rejected: dict[int, str] | None = None,
) -> tuple[list[dict], list[int]]:
    """A rank's share of a step as `count` padded micro batches of similar lengths (train.sort_by_length):
    the usable samples ordered by length, then cut, so that each micro batch pads to a length near its
    own samples'. A skipped slot (no sample, too long, bad) becomes a stand-in at the end, as a padded
    step keeps it, so every rank still runs `count` passes of at most `micro_batch_size` rows."""
    encoded, too_long = _encode_slots(processor, samples, max_length, rejected)
    rows = sorted((r for r in encoded if r is not None), key=lambda r: len(r.labels))
    rows += [_stand_in_row(processor) for r in encoded if r is None]
    groups = [rows[k : k + micro_batch_size] for k in range(0, len(rows), micro_batch_size)]
    groups += [[_stand_in_row(processor)] for _ in range(count - len(groups))]
    return [_with_vision(processor, group) for group in groups], too_long
