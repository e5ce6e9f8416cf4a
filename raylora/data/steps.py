"""One rank's share of a training step: its rows read, cut into micro batches (padded, sorted, under a
token budget, or packed) and counted for the loss and the metrics; and the batches moved to the device.

No collectives here: the input pipeline's processes (`raylora.data.pipeline`), which have no process group,
build steps too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from raylora import failures
from raylora.config import Config
from raylora.data import video
from raylora.data.batches import (
    budgeted_micro_batches,
    limit_length,
    packed_passes,
    read,
    sorted_micro_batches,
)
from raylora.data.formats import BadRow, Rows
from raylora.data.labels import Decoded
from raylora.data.sampler import GlobalSampler
from raylora.loss import answer_positions

log = logging.getLogger("raylora")


class StepSource(Protocol):
    """What building a step reads of a rank's setup (`raylora.worker.Setup` has it)."""

    cfg: Config
    data: Rows
    processor: object
    sampler: GlobalSampler
    rank: int
    world_size: int
    rope_index: object  # train.packing: the model's multimodal position function (None: one per token)


@dataclass
class StepBatches:
    """This rank's share of one step, with what the step's metrics and loss need counted."""

    batches: list[dict]  # the model's inputs of each micro batch, labels left out
    positions_of: list[dict]  # each micro batch's loss.answer_positions, and its labels
    tokens: int  # answer tokens the loss covers
    positions: int  # token positions the passes compute (padding left out): the tokens_per_s metric
    too_long: int  # samples longer than data.max_length or a pass's token budget (`Config.length_limit`)
    bad_rows: int  # rows that do not read or decode, or that the processor rejects: replaced by the stand-in
    reasons: list[tuple[int, str]]  # (row, why) of each bad row

    def pin_memory(self) -> StepBatches:
        """A copy whose tensors are in page-locked memory (the DataLoader's pin thread calls this on a GPU
        node), so that the copies to the GPU are asynchronous."""
        pin = _pinned
        return StepBatches(
            [pin(b) for b in self.batches], [pin(p) for p in self.positions_of], self.tokens, self.positions,
            self.too_long, self.bad_rows, self.reasons,
        )  # fmt: skip


def step_batches(s: StepSource, step: int) -> StepBatches:
    """This rank's micro batches of `step`, every one built before the first backward.

    What a slot holds depends on its row alone (too long, bad), so every rank and a resumed run skip
    the same; an empty slot of the global sampler (`None`) becomes the stand-in as well.
    """
    built = StepBatches([], [], 0, 0, 0, 0, [])
    t = s.cfg.train
    micro_batches = s.sampler.micro_batches(step, s.rank, s.world_size, t.micro_batch_size)
    count = len(micro_batches)
    budget = t.max_tokens_per_micro_batch
    # the whole share at once: packed, or sorted by length and cut (by count, or by a token budget)
    if t.sort_by_length or s.cfg.uneven_passes:
        micro_batches = [[i for micro in micro_batches for i in micro]]
    for micro in micro_batches:
        samples = [None if i is None else read_row(s, i, built.reasons) for i in micro]
        rejected: dict[int, str] = {}  # positions whose sample the processor rejects: bad rows as well
        if t.packing:
            batches, too_long = packed_passes(
                s.processor, samples, budget, s.cfg.data.max_length, s.rope_index, rejected=rejected
            )
        elif budget is not None:
            batches, too_long = budgeted_micro_batches(
                s.processor, samples, budget, s.cfg.data.max_length, rejected=rejected
            )
        elif t.sort_by_length:
            batches, too_long = sorted_micro_batches(
                s.processor, samples, t.micro_batch_size, count, s.cfg.data.max_length, rejected=rejected
            )
        else:
            batch, too_long = limit_length(s.processor, samples, s.cfg.data.max_length, rejected=rejected)
            batches = [batch]
        for pos, reason in rejected.items():
            bad_row(s, micro[pos], reason, built.reasons)
        for batch in batches:
            batch, positions = with_positions(batch)
            built.batches.append(batch)
            built.positions_of.append(positions)
            built.tokens += len(positions["targets"])
            # a packed pass has no attention mask: every position is a token
            mask = batch.get("attention_mask")
            built.positions += int(mask.sum()) if mask is not None else batch["input_ids"].numel()
        built.too_long += len(too_long)
    built.bad_rows = len(built.reasons)
    return built


def with_positions(batch: dict) -> tuple[dict, dict]:
    """(the model's inputs, the answer positions and labels), counted here, on the CPU (in the input
    pipeline's process when there is one), so that the training step does not wait on the device."""
    batch = dict(batch)
    labels = batch.pop("labels")
    return batch, {**answer_positions(labels), "labels": labels}


def read_row(s: StepSource, i: int, bad: list[tuple[int, str]] | None = None) -> Decoded | None:
    """Row `i` decoded, or None (its slot gets the stand-in) for a bad row under data.on_bad_row: skip,
    which goes into `bad` with its reason."""
    try:
        return read(s.data, i, video.Sampling.of(s.cfg.data))
    except BadRow as err:
        bad_row(s, i, err.reason, bad, cause=err)
        return None


def bad_row(
    s: StepSource, i: int, reason: str, bad: list[tuple[int, str]] | None, cause: Exception | None = None
) -> None:
    """Row `i` is bad: a warning and an entry in `bad` (data.on_bad_row: skip), or `PermanentError`."""
    where = f"data.train {s.data.uri}: row {i}: {reason}"
    if s.cfg.data.on_bad_row == "error":
        # the same row fails every attempt: end the run once rather than retry it
        raise failures.PermanentError(f"{where} (data.on_bad_row: error)") from cause
    log.warning("%s; skipped", where)
    if bad is not None:
        bad.append((i, reason))


def _pinned(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v if v.is_pinned() else v.pin_memory() for k, v in tensors.items()}


# Read on the host by the attention (packing.packed_sdpa, every layer): on a GPU it would wait each time.
HOST_ONLY = ("cu_seq_lens_q",)


def to_device(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """`tensors` on `device`: on a GPU from page-locked memory and `non_blocking`, so that the host queues
    the step's kernels without waiting for each copy; on the CPU as they are (and `HOST_ONLY` always)."""
    if device.type != "cuda":
        return tensors
    return {k: v if k in HOST_ONLY else v.to(device, non_blocking=True) for k, v in _pinned(tensors).items()}
