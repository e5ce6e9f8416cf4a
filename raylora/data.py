"""Image-text data: Parquet rows (image bytes, prompt, answer), a global sampler, and batches.

The sampler is global: which samples form step `s`'s batch depends only on (seed, epoch) and the
global batch size, never on the number of workers. Ray Data's iterators have no state to save, so an
exact mid-epoch resume needs this sampler of our own; its position is just the step.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.fs
import pyarrow.parquet as pq
import torch
from PIL import Image

from raylora.config import ConfigError
from raylora.storage import filesystem

REQUIRED_COLUMNS = ("image", "prompt", "answer")
IGNORE_INDEX = -100  # labels PyTorch's cross-entropy skips: prompt, image and padding tokens


def check_parquet(uri: str, key: str) -> int:
    """Fail early, naming `key` and the file, if the Parquet file is missing or lacks a needed column."""
    fs, path = filesystem(uri)
    try:
        info = fs.get_file_info(path)
    except (OSError, pa.ArrowException) as err:
        raise ConfigError(f"{key}: cannot reach {uri}: {err}") from err
    if info.type != pyarrow.fs.FileType.File:
        raise ConfigError(f"{key}: Parquet file not found: {uri}")
    try:
        meta = pq.read_metadata(path, filesystem=fs)
    except (OSError, pa.ArrowException) as err:
        raise ConfigError(f"{key}: {uri} is not a readable Parquet file: {err}") from err
    names = meta.schema.to_arrow_schema().names
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise ConfigError(
            f"{key}: {uri} lacks column(s) {', '.join(missing)} (has: {', '.join(names)}; "
            f"needs image (PNG/JPEG bytes), prompt, answer)"
        )
    if meta.num_rows == 0:
        raise ConfigError(f"{key}: {uri} has no rows")
    return meta.num_rows


class BadRowError(ConfigError):
    """A data row that cannot be trained on, with `data.on_bad_row: error`."""


def bad_row_reason(image: bytes | None, prompt: str | None, answer: str | None) -> str | None:
    """Why a row cannot be trained on, or None. Checked once, up front, so that no worker dies on a
    cryptic trace from inside a collate function halfway through a run."""
    if not answer or not answer.strip():
        return "empty answer"
    if prompt is None:
        return "missing prompt"
    if not image:
        return "missing image"
    try:
        with Image.open(io.BytesIO(image)) as img:
            img.verify()  # header and structure, without decoding every pixel
    except Exception as err:  # PIL raises many types for a broken file
        return f"image does not decode ({type(err).__name__}: {err})"
    return None


class ImageTextData:
    """The usable rows of one Parquet file, decoded lazily (each worker decodes only what it uses).

    Rows whose image does not decode or whose answer is empty are skipped and counted
    (`on_bad_row="skip"`), or stop everything with the row number (`on_bad_row="error"`).
    """

    def __init__(self, uri: str, on_bad_row: str = "skip"):
        fs, path = filesystem(uri)
        table = pq.read_table(path, filesystem=fs, columns=list(REQUIRED_COLUMNS))
        self.uri = uri
        images = table.column("image").to_pylist()
        prompts = table.column("prompt").to_pylist()
        answers = table.column("answer").to_pylist()
        self.bad_rows: list[tuple[int, str]] = []
        keep = []
        for row, (image, prompt, answer) in enumerate(zip(images, prompts, answers, strict=True)):
            reason = bad_row_reason(image, prompt, answer)
            if reason is None:
                keep.append(row)
            elif on_bad_row == "error":
                raise BadRowError(f"{uri}: row {row}: {reason} (data.on_bad_row: error)")
            else:
                self.bad_rows.append((row, reason))
        self.images = [images[i] for i in keep]
        self.prompts = [prompts[i] for i in keep]
        self.answers = [answers[i] for i in keep]

    def __len__(self) -> int:
        return len(self.answers)

    def example(self, i: int) -> tuple[Image.Image, str, str]:
        image = Image.open(io.BytesIO(self.images[i])).convert("RGB")
        return image, self.prompts[i], self.answers[i]


@dataclass(frozen=True)
class GlobalSampler:
    """Sample order from (seed, epoch) only; one global batch per step, drop-last within an epoch."""

    num_samples: int
    global_batch_size: int
    seed: int

    def __post_init__(self):
        if self.num_samples < self.global_batch_size:
            raise ConfigError(
                f"train.global_batch_size ({self.global_batch_size}) exceeds the {self.num_samples} "
                f"training samples"
            )

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size

    def epoch(self, step: int) -> int:
        return step // self.steps_per_epoch

    def global_batch(self, step: int) -> list[int]:
        """Sample indices of the global batch that optimizer step `step` (0-based) trains on."""
        epoch, pos = divmod(step, self.steps_per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        start = pos * self.global_batch_size
        return order[start : start + self.global_batch_size].tolist()

    def micro_batches(self, step: int, rank: int, world_size: int, micro_batch_size: int) -> list[list[int]]:
        """This rank's contiguous share of the global batch, cut into micro batches."""
        batch = self.global_batch(step)
        per_rank = len(batch) // world_size
        mine = batch[rank * per_rank : (rank + 1) * per_rank]
        return [mine[i : i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]


def prompt_text(processor, prompt: str) -> str:
    """The model's own chat template around one image and the prompt, up to the assistant's turn."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def answer_ids(processor, answer: str) -> list[int]:
    tokenizer = processor.tokenizer
    return tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def make_batch(processor, examples: list[tuple[Image.Image, str, str]], with_answers: bool = True) -> dict:
    """Tensors for the model: prompt (with image) then answer + EOS, labels only on the answer.

    With `with_answers=False` (generation) the answer is left out and padding goes on the left.
    Token-aligned tensors from the processor (input_ids, attention_mask, mm_token_type_ids, ...)
    are extended and padded together; vision tensors are concatenated along their first dimension,
    which stacks Llava's images and joins Qwen2-VL's patch rows alike.
    """
    pad_id = processor.tokenizer.pad_token_id
    rows, vision = [], {}
    for image, prompt, answer in examples:
        enc = processor(text=[prompt_text(processor, prompt)], images=[image], return_tensors="pt")
        length = enc["input_ids"].shape[1]
        extra = answer_ids(processor, answer) if with_answers else []
        row = {}
        for key, value in enc.items():
            if value.dim() == 2 and value.shape == (1, length) and key != "image_grid_thw":
                tail = {"input_ids": extra, "attention_mask": [1] * len(extra)}.get(key, [0] * len(extra))
                row[key] = value[0].tolist() + tail
            else:
                vision.setdefault(key, []).append(value)
        row["labels"] = [IGNORE_INDEX] * length + extra
        rows.append(row)
    width = max(len(r["input_ids"]) for r in rows)
    batch = {}
    for key in rows[0]:
        fill = {"input_ids": pad_id, "labels": IGNORE_INDEX}.get(key, 0)
        padded = []
        for r in rows:
            pad = [fill] * (width - len(r[key]))
            padded.append(r[key] + pad if with_answers else pad + r[key])
        batch[key] = torch.tensor(padded, dtype=torch.long)
    if not with_answers:
        del batch["labels"]
    for key, values in vision.items():
        batch[key] = torch.cat(values, dim=0)
    return batch


STAND_IN_EDGE = 56  # pixels a side: Qwen2-VL's smallest image (min_pixels 56 * 56); resized elsewhere


def stand_in() -> tuple[Image.Image, str, str]:
    """The sample that takes a too-long sample's place in its micro batch: a blank image, empty prompt and
    answer. Under ZeRO-3 every rank must run the same forward and backward passes, so the row is kept,
    vision tower and all, and `limit_length` sets all its labels to IGNORE_INDEX."""
    return Image.new("RGB", (STAND_IN_EDGE, STAND_IN_EDGE), (127, 127, 127)), "", ""


def check_max_length(processor, max_length: int) -> None:
    """`ConfigError` when even the stand-in sample is longer than `max_length` (data.max_length)."""
    batch = make_batch(processor, [stand_in()])
    length = int(batch["attention_mask"].sum())
    if length > max_length:
        image_id = getattr(processor, "image_token_id", None)
        images = f", {int((batch['input_ids'] == image_id).sum())} of them image tokens" if image_id else ""
        raise ConfigError(
            f"data.max_length ({max_length}) is shorter than the shortest possible sample: a blank "
            f"{STAND_IN_EDGE}x{STAND_IN_EDGE} image with an empty prompt and answer takes {length} tokens"
            f"{images}"
        )


def limit_length(processor, examples: list, max_length: int | None) -> tuple[dict, list[int]]:
    """`make_batch`, with every example longer than `max_length` tokens (prompt, image tokens, answer,
    EOS) replaced by `stand_in()` with no labels. Returns the batch and the replaced rows.

    Too-long samples are skipped, not truncated: cutting image tokens breaks the model's image-token
    count, and cutting an answer would train on part of it.
    """
    batch = make_batch(processor, examples)
    if max_length is None:
        return batch, []
    too_long = [i for i, n in enumerate(batch["attention_mask"].sum(dim=1).tolist()) if n > max_length]
    if too_long:
        blank = stand_in()
        batch = make_batch(processor, [blank if i in too_long else e for i, e in enumerate(examples)])
        batch["labels"][too_long] = IGNORE_INDEX
    return batch, too_long
