"""The per-rank training function Ray Train runs: build, restore, loop, report.

Restore order (DeepSpeed's engine builds its fp32 masters from the parameter values it sees at
`deepspeed.initialize`, so a load after it would be overwritten by the next optimizer step):
1. build the base model (ZeRO-3 partitioned) and LoRA;
2. mark what is trained (PEFT froze the vision tower and aligner when it wrapped the model);
3. check the checkpoint's trainable names and shapes against the model's, before touching anything;
4. partial load of the saved weights into each rank's ZeRO-3 partitions (no collectives);
5. `deepspeed.initialize`, then the fp32 masters, Adam moments, scheduler, step and sampler position.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import ray.train
import torch
import torch.distributed as dist
from transformers import get_cosine_schedule_with_warmup

from raylora import checkpoint, console, determinism, failures, hub, moe, resume, zero
from raylora.arch import Architecture, for_model
from raylora.config import Config
from raylora.data import lengths, packing, video
from raylora.data.batches import (
    budgeted_micro_batches,
    check_max_length,
    limit_length,
    packed_passes,
    read,
    sorted_micro_batches,
    stand_in_micro_batch,
    use_video_stand_in,
)
from raylora.data.formats import BadRow, Rows, open_rows
from raylora.data.labels import Decoded, check_chat_template
from raylora.data.pipeline import step_inputs
from raylora.data.processor import load_processor
from raylora.data.sampler import GlobalSampler
from raylora.drills import maybe_kill
from raylora.ds import deepspeed, tell_local_size
from raylora.evaluate import evaluate_sharded
from raylora.loss import answer_positions, answer_token_losses
from raylora.model import build_model, mark_trained, shapes
from raylora.progress import bad_rows_before, count_attempt
from raylora.redact import redact
from raylora.reporting import Reporter
from raylora.resume import base_model_fingerprint

log = logging.getLogger("raylora")
UPLOAD_MODES = {
    "async": ray.train.CheckpointUploadMode.ASYNC,
    "sync": ray.train.CheckpointUploadMode.SYNC,
}


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


def setup(cfg: Config, restore_from: checkpoint.Ranges | checkpoint.Loaded | None) -> Setup:
    """Build the model and engine on this rank and, when given a checkpoint, restore it exactly (reading
    only this rank's slices of it from a `checkpoint.Ranges`)."""
    determinism.use_deterministic_kernels(cfg.train.deterministic)  # first: before any cuBLAS call
    # DeepSpeed adopts the process group Ray Train set up (gloo on CPU, nccl on GPU); zero.Init inside
    # from_pretrained needs it to know the world size.
    tell_local_size()
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    rank, world = dist.get_rank(), dist.get_world_size()
    started = [count_attempt(cfg.run.storage_path, cfg.run.name) if rank == 0 else 0]
    dist.broadcast_object_list(started, src=0)
    arch = for_model(hub.resolve(cfg.model.path, cfg.model.revision), cfg.model)
    ds_config = zero.deepspeed_config(cfg, world)
    model, zero3 = build_model(cfg, arch, ds_config)
    params = mark_trained(model, arch, cfg)  # PEFT froze the vision tower and aligner: re-enable them
    if restore_from is not None:
        checkpoint.check_compatible(restore_from.state, shapes(params))
        zero.partition_load(params, restore_from)

    def schedule(optimizer):
        return get_cosine_schedule_with_warmup(optimizer, cfg.train.warmup_steps, cfg.train.max_steps)

    # the adapter (modules_to_save copies included) at train.lr; the vision tower and aligner at vision_lr
    lora = [p for n, p in params.items() if checkpoint.is_adapter(n)]
    modules = [p for n, p in params.items() if not checkpoint.is_adapter(n)]
    groups = [{"params": lora, "lr": cfg.train.lr}]
    if modules:
        groups.append({"params": modules, "lr": cfg.train.vision_lr or cfg.train.lr})
    engine, _, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=groups, config=ds_config, lr_scheduler=schedule
    )
    del zero3  # transformers no longer needs to see the ZeRO-3 config once the engine exists

    # Rows are read when a step uses them: a bad one is met (and skipped) there, not looked for here.
    d = cfg.data
    data = open_rows(d.train, d.format, d.image_root)
    processor = load_processor(
        hub.resolve(cfg.model.path, cfg.model.revision),
        cfg.data.max_pixels,
        cfg.data.min_pixels,
        cfg.model.trust_remote_code,
    )
    check_chat_template(processor)  # a template whose turns cannot be labelled fails the start, not a step
    # before any batch: every rank's passes alike
    use_video_stand_in(processor, d.video_stand_in, video.Sampling.of(d))
    if cfg.data.max_length is not None:
        check_max_length(processor, cfg.data.max_length)
    s = Setup(
        cfg=cfg,
        engine=engine,
        scheduler=scheduler,
        params=params,
        processor=processor,
        data=data,
        sampler=GlobalSampler(
            len(data),
            cfg.train.global_batch_size,
            cfg.train.seed,
            lengths.grouping_keys(cfg, processor, data, engine.device) if cfg.train.group_by_length else None,
        ),
        rank=rank,
        world_size=world,
        arch=arch,
        restarts=started[0] - 1,
        eval_data=open_rows(cfg.data.eval, d.format, d.image_root) if cfg.train.eval_every else None,
    )
    s.aux_coef = moe.aux_loss_coef(engine.module)
    if cfg.train.packing:
        s.rope_index = packing.rope_index_of(engine.module)
    if cfg.uneven_passes:
        # every rank creates the group (a collective); on CPUs the default group is gloo already
        s.cpu_group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
        stand_in = stand_in_micro_batch(processor)
        s.stand_in = _with_positions(
            packing.packed(stand_in, s.rope_index) if cfg.train.packing else stand_in
        )
    if restore_from is not None:
        st = restore_from.state
        zero.set_trainable_state(engine, params, restore_from, st.step)
        if isinstance(restore_from, checkpoint.Ranges):
            restore_from.close()
        scheduler.load_state_dict(st.scheduler)
        for group, lr in zip(engine.optimizer.param_groups, scheduler.get_last_lr(), strict=True):
            group["lr"] = lr  # load_state_dict restores the schedule but not the optimizer's current lr
        s.step, s.resumed = st.step, True
    return s


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


def step_batches(s: Setup, step: int) -> StepBatches:
    """This rank's micro batches of `step`, every one built before the first backward.

    No collectives here: the input pipeline's processes, which have no process group, call this too.
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
        samples = [None if i is None else _read(s, i, built.reasons) for i in micro]
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
            _bad_row(s, micro[pos], reason, built.reasons)
        for batch in batches:
            batch, positions = _with_positions(batch)
            built.batches.append(batch)
            built.positions_of.append(positions)
            built.tokens += len(positions["targets"])
            # a packed pass has no attention mask: every position is a token
            mask = batch.get("attention_mask")
            built.positions += int(mask.sum()) if mask is not None else batch["input_ids"].numel()
        built.too_long += len(too_long)
    built.bad_rows = len(built.reasons)
    return built


def _with_positions(batch: dict) -> tuple[dict, dict]:
    """(the model's inputs, the answer positions and labels), counted here, on the CPU (in the input
    pipeline's process when there is one), so that the training step does not wait on the device."""
    batch = dict(batch)
    labels = batch.pop("labels")
    return batch, {**answer_positions(labels), "labels": labels}


def _read(s: Setup, i: int, bad: list[tuple[int, str]] | None = None) -> Decoded | None:
    """Row `i` decoded, or None (its slot gets the stand-in) for a bad row under data.on_bad_row: skip,
    which goes into `bad` with its reason."""
    try:
        return read(s.data, i, video.Sampling.of(s.cfg.data))
    except BadRow as err:
        _bad_row(s, i, err.reason, bad, cause=err)
        return None


def _bad_row(
    s: Setup, i: int, reason: str, bad: list[tuple[int, str]] | None, cause: Exception | None = None
) -> None:
    """Row `i` is bad: a warning and an entry in `bad` (data.on_bad_row: skip), or `PermanentError`."""
    where = f"data.train {s.data.uri}: row {i}: {reason}"
    if s.cfg.data.on_bad_row == "error":
        # the same row fails every attempt: end the run once rather than retry it
        raise failures.PermanentError(f"{where} (data.on_bad_row: error)") from cause
    log.warning("%s; skipped", where)
    if bad is not None:
        bad.append((i, reason))


def save_checkpoint(s: Setup) -> ray.train.Checkpoint | None:
    """Gather the trainable state (every rank takes part) and write it on rank 0 as it arrives."""
    writer = None
    if s.rank == 0:
        folder = resume.new_staging_folder(s.cfg, s.step)  # removed at the next start if this rank dies
        resume.hold_until_uploaded(folder)
        writer = checkpoint.Writer(folder, shapes(s.params))
    zero.stream_trainable_state(s.engine, s.params, writer.write if writer is not None else None)
    if s.rank != 0:
        maybe_kill(s.cfg, s.step, s.rank, while_checkpointing=True)
        return None
    state = checkpoint.TrainState(
        step=s.step,
        epoch=s.sampler.epoch(s.step),
        sampler=resume.sampler_fields(s.sampler),
        scheduler=s.scheduler.state_dict(),
        world_size=s.world_size,
        trainable=shapes(s.params),
        config=redact(s.cfg.to_dict()),
        versions=checkpoint.versions(),
        restarts=s.restarts,
        arch=s.arch.model_type,
        base_model=base_model_fingerprint(hub.resolve(s.cfg.model.path, s.cfg.model.revision)),
        data_rows=len(s.data),
    )
    writer.finish(state, s.engine.module.peft_config["default"])
    maybe_kill(s.cfg, s.step, s.rank, while_checkpointing=True)  # written locally, not yet handed to Ray
    return ray.train.Checkpoint.from_directory(folder)


def log_preemption(info: ray.train.PreemptionInfo, step: int) -> None:
    """Say which nodes and ranks a coming preemption takes, and by when."""
    left = f"in {info.deadline_ms / 1000 - time.time():.0f} s" if info.deadline_ms else "at an unknown time"
    log.warning(
        "node(s) %s (ranks %s) will be preempted %s: checkpointing at every step from step %d until then",
        ", ".join(info.preempted_node_ids),
        info.preempted_ranks,
        left,
        step,
    )


def core_share(
    local_rank: int, local_world: int, cpus_per_worker: float, cores: list[int]
) -> list[int] | None:
    """The cores that worker `local_rank` of the run's `local_world` workers on a node trains on
    (scaling.bind_cores): `cores`, those the process may run on, cut in order into one equal share per
    worker (an odd core left over goes to none). None (left to the OS) where the workers ask Ray for
    fewer CPUs than there are cores, which leaves room on the node for other work, or where there are
    fewer cores than workers. The rule reads the cores, not Ray's count of the node's CPUs: on a node
    that Ray was told has more CPUs than cores (`ray start --num-cpus` above them), runs side by side
    each fill it and bind the same shares; under a container's CPU quota (not a cpuset) every core of the
    host is visible, so workers that hold the quota's CPUs are left to the OS."""
    share = len(cores) // local_world if local_world > 0 else 0
    # the tolerance: 100 workers of 0.29 CPUs hold 29 of them, which in floats is 28.999...
    if share == 0 or not 0 <= local_rank < local_world or local_world * cpus_per_worker < len(cores) - 1e-6:
        return None
    return cores[local_rank * share : (local_rank + 1) * share]


def bind_cores(cfg: Config, local_rank: int, local_world: int) -> list[int] | None:
    """scaling.bind_cores on a CPU worker: the calling thread, the training function's, onto the
    `core_share` of worker `local_rank` of the run's `local_world` on its node. Only this thread, unlike
    DeepSpeed's launcher, whose --bind_cores_to_rank binds the whole process: Ray's threads in the worker
    (its task loop, gRPC) and gloo's stay free to run where a core is idle, and so do torch's intra-op
    threads that the setup already started (with more than one CPU per worker). Threads that this thread
    starts later inherit the binding: report with `unbound` around `ray.train.report`, whose checkpoint
    uploads start threads of Ray's. On 2 cores with 2 workers, training threads that the scheduler moved
    between the cores among Ray's threads ran their steps about 2% slower (README: "Where raylora
    loses"). Call it once the input pipeline's processes have started, so that they are not bound with
    it. Returns the cores, or None where the thread is left to the OS."""
    if cfg.scaling.use_gpu or not cfg.scaling.bind_cores or not hasattr(os, "sched_setaffinity"):
        return None
    cores = core_share(local_rank, local_world, cfg.scaling.cpus_per_worker, sorted(os.sched_getaffinity(0)))
    if cores is not None:
        os.sched_setaffinity(0, cores)  # pid 0: the calling thread alone, not the whole process
    return cores


@contextlib.contextmanager
def unbound(every: set[int] | None):
    """The calling thread on the cores `every` (the process's, from before `bind_cores`; None: left as
    it is) while the block runs, then bound again: for calls that start threads which must not inherit
    the binding (Ray's checkpoint upload threads, started by the first `ray.train.report` that uploads,
    would upload on rank 0's training core)."""
    if every is None:
        yield
        return
    bound = os.sched_getaffinity(0)
    os.sched_setaffinity(0, every)
    try:
        yield
    finally:
        os.sched_setaffinity(0, bound)


def train_loop_per_worker(cfg: Config) -> list[dict]:
    """Ray Train entry point. Returns this attempt's per-step metrics (from rank 0)."""
    console.setup_worker_logging(cfg.run.verbose)
    # Ray Train has set up the process group before this function runs.
    rank = dist.get_rank()
    try:
        resume.remove_leftovers(cfg, rank)
        # rank 0 chooses (falling back past damaged checkpoints), every rank restores that one
        restore_from = resume.restore_agreed(cfg, ray.train.get_checkpoint())
        s = setup(cfg, restore_from)
        if restore_from is not None:  # the exact count of usable rows is known only once decoded
            sampler = resume.sampler_fields(s.sampler)
            where = f"the checkpoint of step {restore_from.state.step}"
            resume.check_sampler(restore_from.state.sampler, sampler, where)
    except failures.PERMANENT as err:
        raise failures.PermanentError.at_start(err, rank) from err
    if s.rank == 0 and s.resumed:
        log.info("resumed from checkpoint at step %d (restart %d)", s.step, s.restarts)
    # Started after the restore, so the prepared steps begin at the restored one.
    s.inputs = step_inputs(
        functools.partial(step_batches, s), range(s.step, cfg.train.max_steps), cfg.data.workers
    )
    context, every_core = ray.train.get_context(), os.sched_getaffinity(0)
    cores = bind_cores(cfg, context.get_local_rank(), context.get_local_world_size())
    if cores is not None:
        log.info("rank %d trains on core(s) %s (scaling.bind_cores)", s.rank, ",".join(map(str, cores)))
    history, started = [], time.perf_counter()
    first_step = s.step
    # bad rows of the run so far: the steps before a restore as the metrics log has them
    bad_so_far = bad_rows_before(cfg.run.storage_path, cfg.run.name, s.step) if s.resumed else 0
    reporter = Reporter(cfg.run.report_every_s, s.engine.device, s.step)
    preempting: ray.train.PreemptionInfo | None = None
    # On a Ray that raylora started itself, Ray Train's preemption watcher is off (driver.LOCAL_RAY_ENV):
    # nothing there announces a drain, so the ask, a barrier through Ray's synchronization actor, is left
    # out. The mark comes with the job's runtime env, so every rank decides alike.
    from raylora.driver import started_here  # here: the driver imports this module

    asks_preemption = not started_here()
    while s.step < cfg.train.max_steps:
        maybe_kill(cfg, s.step, s.rank)
        metrics = train_step(s)
        bad_so_far += metrics["bad_rows"]
        metrics["bad_rows_so_far"] = bad_so_far
        done = s.step == cfg.train.max_steps
        if cfg.train.eval_every and (done or s.step % cfg.train.eval_every == 0):
            metrics.update(
                evaluate_sharded(
                    s.engine, s.processor, s.eval_data, cfg.train.eval_samples, cfg.train.micro_batch_size
                )
            )
            if s.rank == 0:
                log.info(
                    "step %d eval accuracy %.3f loss %.4f stopped %.3f",
                    s.step,
                    metrics["eval_accuracy"],
                    metrics["eval_loss"],
                    metrics["eval_stopped"],
                )
        history.append(metrics)
        # Asked at the steps that report anyway, not at every step: each ask is a barrier through Ray's
        # synchronization actor that costs about what a report does, and Ray's watcher itself looks for
        # drains only every few seconds. An announcement stands until the group is torn down.
        if asks_preemption and preempting is None and not done and reporter.due(s.step):
            preempting = ray.train.get_preemption_info()  # the same answer on every rank
            if preempting is not None and s.rank == 0:
                log_preemption(preempting, s.step)
        reporter.add(metrics)
        # From the announcement until the node goes, every step ends with a checkpoint (reported with
        # it), so the resume redoes at most the step in progress instead of up to train.checkpoint_every.
        periodic = done or s.step % cfg.train.checkpoint_every == 0
        saving = periodic or preempting is not None
        ckpt = save_checkpoint(s) if saving else None
        # `saving`, not `ckpt`: only rank 0 gets a checkpoint back, and every rank must report alike
        if saving or done or reporter.due(s.step):
            with unbound(every_core if cores is not None else None):  # Ray's upload threads start here
                ray.train.report(
                    reporter.take(s.step),
                    checkpoint=ckpt,
                    # async: rank 0's folder is uploaded while training goes on; Ray records the
                    # checkpoint (and hands it out for a resume) only once the upload completed. Both
                    # modes delete the local folder once it is in storage.
                    checkpoint_upload_mode=UPLOAD_MODES[cfg.run.checkpoint_upload],
                    delete_local_checkpoint_after_upload=True,
                )
        if s.rank == 0 and (done or s.step % max(1, cfg.train.max_steps // 20) == 0):
            rate = (s.step - first_step) / (time.perf_counter() - started)
            log.info(
                "step %d/%d loss %.4f lr %.2e %.1f samples/s %.0f tokens/s bad rows %d eta %.0fs",
                s.step,
                cfg.train.max_steps,
                metrics["loss"],
                metrics["lr"],
                metrics["samples_per_s"],
                metrics["tokens_per_s"],
                bad_so_far,
                (cfg.train.max_steps - s.step) / max(rate, 1e-9),
            )
    return history
