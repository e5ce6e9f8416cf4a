"""One optimizer step over the global batch, and the `Setup` a rank trains with.

The loss is a mean over the global batch's answer tokens whatever the number of workers and micro batches:
the ranks agree on the counts before the first backward, and every rank reads the device once, at the end.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from raylora import failures
from raylora.arch import Architecture
from raylora.config import Config
from raylora.data.formats import Rows
from raylora.data.sampler import GlobalSampler
from raylora.data.steps import StepBatches, step_batches, to_device
from raylora.ds import deepspeed
from raylora.loss import answer_token_losses


@dataclass
class Setup:
    """Everything one rank trains with."""

    cfg: Config
    engine: deepspeed.DeepSpeedEngine
    scheduler: torch.optim.lr_scheduler.LRScheduler
    params: dict[str, torch.nn.Parameter]
    processor: object
    data: Rows
    sampler: GlobalSampler
    rank: int
    world_size: int
    arch: Architecture
    eval_data: Rows | None = None
    # the steps' micro batches, prepared beside training (raylora.data.pipeline); None: built inline
    inputs: Iterator[StepBatches] | None = None
    step: int = 0
    restarts: int = 0
    resumed: bool = False
    # train.packing: the model's multimodal position function (None: one position per token); packed or
    # under a token budget (`Config.uneven_passes`): the process group the ranks agree on their pass counts
    # in (CPU tensors: no wait on the GPU), and the pass a rank with fewer passes runs to stay in step
    rope_index: object = None
    cpu_group: object = None
    stand_in: tuple[dict, dict] | None = None
    # mixture-of-experts models whose forward computes a load-balancing loss: its weight (raylora.moe)
    aux_coef: float | None = None
    # the base model's folder (a Hub id resolved once, at the start) and, on rank 0, its fingerprint for
    # the checkpoints (`hub.base_model_fingerprint`)
    model_dir: str = ""
    base_model: dict | None = None


def train_step(s: Setup) -> dict[str, float]:
    """One optimizer step over this rank's share of the global batch; returns metrics (same on every rank)."""
    cfg, engine, step = s.cfg, s.engine, s.step
    # Dropout noise from (seed, step, rank) alone, so a resumed run draws what the uninterrupted one drew.
    torch.manual_seed(hash((cfg.train.seed, step, s.rank)) & 0x7FFF_FFFF_FFFF)
    # The learning rates this step trains at (engine.step() moves the schedule on at the step's end):
    # the LoRA group's, then the trained vision tower/aligner group's when there is one.
    lrs = s.scheduler.get_last_lr()
    start = time.perf_counter()
    built = next(s.inputs) if s.inputs is not None else step_batches(s, step)
    device = engine.device
    # Collectives carry tensors on the device the process group serves: NCCL (GPU) rejects CPU tensors.
    # One small all_reduce before the first backward: the loss is normalised by the global batch's answer
    # tokens, which only the built batches know (multi-turn, skipped and bad samples, rows read lazily).
    counts = [built.tokens, built.too_long, built.bad_rows, built.positions, len(built.batches)]
    counts = to_device({"counts": torch.tensor(counts, dtype=torch.float64)}, device)["counts"]
    dist.all_reduce(counts)
    # The loss is a mean over the global batch's answer tokens. DeepSpeed divides by the accumulation
    # steps and averages over ranks, so scale each micro batch's token sum to undo both: the gradient
    # then does not depend on how the batch is split over workers. The scale stays on the device: the
    # step reads the device once, at its end (reading the counts here would wait for the GPU to finish
    # the previous step's optimizer before queueing this step's first forward). A step with no answer
    # token anywhere gets a scale of 0 and is refused below, before anything is saved or reported.
    scale = torch.where(counts[0] > 0, s.world_size * cfg.grad_accum_steps(s.world_size) / counts[0], 0.0)
    scale = scale.float()
    # A MoE model's load-balancing loss is a mean over each pass's tokens: averaged over the global batch's
    # passes (not the stand-ins), which in the same frame as above is a scale of world * accumulation /
    # passes (1 for padded micro batches), so that a step's loss does not depend on the worker count.
    aux_scale = torch.where(counts[4] > 0, s.world_size * cfg.grad_accum_steps(s.world_size) / counts[4], 0.0)
    aux_scale = aux_scale.float()
    loss_sum = torch.zeros(2, dtype=torch.float64, device=device)  # answer-token loss, load-balancing loss
    passes = list(zip(built.batches, built.positions_of, strict=True))
    if cfg.uneven_passes:  # every rank runs as many passes as the rank with the most
        most = torch.tensor([len(passes)])
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=s.cpu_group)
        passes += [s.stand_in] * (int(most) - len(passes))
    for k, (batch, positions) in enumerate(passes):
        if cfg.uneven_passes:  # the optimizer steps after the last pass, however many there are
            engine.set_gradient_accumulation_boundary(k == len(passes) - 1)
        batch, positions = to_device(batch, device), to_device(dict(positions), device)
        aux = [] if s.aux_coef is not None else None
        token_loss = answer_token_losses(engine, batch, positions.pop("labels"), positions, aux)[0].sum()
        objective = token_loss * scale
        loss_sum[0] += token_loss.detach()
        if aux and k < len(built.batches):  # a stand-in pass adds nothing
            objective = objective + s.aux_coef * aux_scale * aux[0].float()
            loss_sum[1] += aux[0].detach()
        engine.backward(objective)
        engine.step()
    dist.all_reduce(loss_sum)
    # the step's one read of the device
    global_tokens, too_long, bad_rows, positions_done, passes, loss, aux_loss = torch.cat(
        [counts, loss_sum]
    ).tolist()
    # Every sample skipped: the counts are global, so every rank raises here, at the same step.
    if global_tokens == 0:
        raise failures.PermanentError(nothing_to_train(s, step, built, counts))
    elapsed = time.perf_counter() - start
    s.step += 1
    return {
        "step": s.step,
        "loss": loss / global_tokens,
        "lr": lrs[0],
        **({"vision_lr": lrs[1]} if len(lrs) > 1 else {}),
        "samples_per_s": cfg.train.global_batch_size / elapsed,
        "tokens_per_s": positions_done / elapsed,
        "max_steps": cfg.train.max_steps,
        "epoch": s.sampler.epoch(step),
        "restarts": s.restarts,
        "world_size": s.world_size,  # changes within a run when an elastic [min, max] group is resized
        "bad_rows": int(bad_rows),  # rows of this step that do not read, decode or encode, skipped
        "too_long": int(too_long),  # samples of this step longer than data.max_length, skipped
        **({"aux_loss": aux_loss / passes} if s.aux_coef is not None and passes else {}),
    }


def nothing_to_train(s: Setup, step: int, built: StepBatches, counts: torch.Tensor) -> str:
    """Why step `step` has no answer token in its whole global batch, with the bad rows of every rank.

    A run that trained on such steps would report a loss of 0.0 and leave a checkpoint that looks like a
    trained one: it ends instead, once (every attempt would meet the same rows). Every rank calls this at
    the same step (the counts are global), so the gather of the reasons is a collective they all join.
    """
    reasons: list[list[tuple[int, str]]] = [[] for _ in range(s.world_size)]
    dist.all_gather_object(reasons, built.reasons)
    bad = sorted(r for rank in reasons for r in rank)
    examples = f" ({'; '.join(f'row {row}: {reason}' for row, reason in bad[:3])})" if bad else ""
    limit = s.cfg.length_limit
    too_long = f", {int(counts[1].item())} longer than {limit[0]} ({limit[1]})" if limit else ""
    return (
        f"step {step + 1}: every sample of the global batch ({s.cfg.train.global_batch_size}) was skipped, "
        f"so there is nothing to train on: {int(counts[2].item())} bad row(s) of data.train{examples}"
        f"{too_long}. The run stops rather than train on nothing and report a loss of 0"
    )
