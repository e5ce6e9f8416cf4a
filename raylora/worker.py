"""The per-rank training function Ray Train runs: setup, restore, loop, report.

Restore order (DeepSpeed's engine builds its fp32 masters from the parameter values it sees at
`deepspeed.initialize`, so a load after it would be overwritten by the next optimizer step):
1. build the base model (ZeRO-3 partitioned) and LoRA;
2. mark what is trained (PEFT froze the vision tower and aligner when it wrapped the model);
3. check the checkpoint's trainable names and shapes against the model's, before touching anything;
4. partial load of the saved weights into each rank's ZeRO-3 partitions (no collectives);
5. `deepspeed.initialize`, then the fp32 masters, Adam moments, scheduler, step and sampler position.
"""

from __future__ import annotations

import functools
import logging
import time

import ray.train
import torch.distributed as dist
from transformers import get_cosine_schedule_with_warmup

from raylora import checkpoint, console, determinism, failures, hub, moe, resume, zero
from raylora.arch import for_model
from raylora.config import Config
from raylora.data import lengths, packing, video
from raylora.data.batches import check_max_length, stand_in_micro_batch, use_video_stand_in
from raylora.data.formats import open_rows
from raylora.data.labels import check_chat_template
from raylora.data.pipeline import step_inputs
from raylora.data.processor import load_processor
from raylora.data.sampler import GlobalSampler
from raylora.data.steps import step_batches, with_positions
from raylora.drills import maybe_kill
from raylora.ds import deepspeed, tell_local_size
from raylora.evaluate import evaluate_sharded
from raylora.model import build_model, mark_trained, shapes
from raylora.progress import bad_rows_before
from raylora.redact import redact
from raylora.reporting import Reporter, log_preemption, log_progress
from raylora.step import Setup, train_step

log = logging.getLogger("raylora")
UPLOAD_MODES = {
    "async": ray.train.CheckpointUploadMode.ASYNC,
    "sync": ray.train.CheckpointUploadMode.SYNC,
}


def setup(cfg: Config, restore_from: checkpoint.Ranges | None) -> Setup:
    """Build the model and engine on this rank and, when given a checkpoint, restore it exactly (reading
    only this rank's slices of it from a `checkpoint.Ranges`, or from any `zero.Source` with a `state`)."""
    determinism.use_deterministic_kernels(cfg.train.deterministic)  # first: before any cuBLAS call
    # DeepSpeed adopts the process group Ray Train set up (gloo on CPU, nccl on GPU); zero.Init inside
    # from_pretrained needs it to know the world size.
    tell_local_size()
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    rank, world = dist.get_rank(), dist.get_world_size()
    started = [resume.count_attempt(cfg.run.storage_path, cfg.run.name) if rank == 0 else 0]
    dist.broadcast_object_list(started, src=0)
    model_dir = hub.resolve(cfg.model.path, cfg.model.revision)
    arch = for_model(model_dir, cfg.model)
    ds_config = zero.deepspeed_config(cfg, world)
    model, zero3 = build_model(cfg, arch, ds_config, model_dir)
    params = mark_trained(model, arch, cfg)  # PEFT froze the vision tower and aligner: re-enable them
    if restore_from is not None:  # before `deepspeed.initialize`, which builds the fp32 masters from these
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
        model_dir,
        d.max_pixels,
        d.min_pixels,
        cfg.model.trust_remote_code,
        video.PixelCaps.of(d),
        d.chat_template_kwargs,
    )
    check_chat_template(processor)  # a template whose turns cannot be labelled fails the start, not a step
    # before any batch: every rank's passes alike
    use_video_stand_in(processor, d.video_stand_in, video.Sampling.of(d))
    if d.max_length is not None:
        check_max_length(processor, d.max_length)
    by_length = cfg.train.group_by_length
    grouping = lengths.grouping_keys(cfg, processor, data, engine.device) if by_length else None
    s = Setup(
        cfg=cfg,
        engine=engine,
        scheduler=scheduler,
        params=params,
        processor=processor,
        data=data,
        sampler=GlobalSampler(len(data), cfg.train.global_batch_size, cfg.train.seed, grouping),
        rank=rank,
        world_size=world,
        arch=arch,
        restarts=started[0] - 1,
        eval_data=open_rows(d.eval, d.format, d.image_root) if cfg.train.eval_every else None,
        model_dir=model_dir,
        # rank 0 writes the checkpoints: the base model it trains on, identified once
        base_model=hub.base_model_fingerprint(model_dir) if rank == 0 else None,
    )
    s.aux_coef = moe.aux_loss_coef(engine.module)
    if cfg.train.packing:
        s.rope_index = packing.rope_index_of(engine.module)
    if cfg.uneven_passes:
        # every rank creates the group (a collective); on CPUs the default group is gloo already
        s.cpu_group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
        stand_in = stand_in_micro_batch(processor)
        s.stand_in = with_positions(packing.packed(stand_in, s.rope_index) if cfg.train.packing else stand_in)
    if restore_from is not None:
        restore(s, restore_from)
    return s


def restore(s: Setup, restore_from: checkpoint.Ranges) -> None:
    """The rest of a checkpoint, into the engine `setup` built: fp32 masters and Adam moments, the
    schedule, the step (the weights went into the partitions before `deepspeed.initialize`)."""
    st = restore_from.state
    zero.set_trainable_state(s.engine, s.params, restore_from, st.step)
    if isinstance(restore_from, checkpoint.Ranges):
        restore_from.close()
    s.scheduler.load_state_dict(st.scheduler)
    for group, lr in zip(s.engine.optimizer.param_groups, s.scheduler.get_last_lr(), strict=True):
        group["lr"] = lr  # load_state_dict restores the schedule but not the optimizer's current lr
    s.step, s.resumed = st.step, True


def train_loop_per_worker(cfg: Config, asks_preemption: bool = True) -> list[dict]:
    """Ray Train entry point. Returns this attempt's per-step metrics (from rank 0).

    `asks_preemption`: whether the ranks ask Ray Train about a coming preemption (the driver says no on a
    Ray that raylora started itself, where nothing announces a drain and the ask would be a barrier for
    nothing)."""
    console.setup_worker_logging(cfg.run.verbose)
    rank = dist.get_rank()  # Ray Train has set up the process group before this function runs
    try:
        resume.remove_leftovers(cfg, rank)
        # rank 0 chooses (falling back past damaged checkpoints), every rank restores that one
        restore_from = resume.restore_agreed(cfg, ray.train.get_checkpoint())
        s = setup(cfg, restore_from)
        if restore_from is not None:  # the exact count of usable rows is known only once decoded
            where = f"the checkpoint of step {restore_from.state.step}"
            resume.check_sampler(restore_from.state.sampler, resume.sampler_fields(s.sampler), where)
    except failures.PERMANENT as err:
        raise failures.PermanentError.at_start(err, rank) from err
    if s.rank == 0 and s.resumed:
        log.info("resumed from checkpoint at step %d (restart %d)", s.step, s.restarts)
    # Started after the restore, so the prepared steps begin at the restored one.
    s.inputs = step_inputs(
        functools.partial(step_batches, s), range(s.step, cfg.train.max_steps), cfg.data.workers
    )
    history, started, first_step = [], time.perf_counter(), s.step
    # bad rows of the run so far: the steps before a restore as the metrics log has them
    bad_so_far = bad_rows_before(cfg.run.storage_path, cfg.run.name, s.step) if s.resumed else 0
    reporter = Reporter(cfg.run.report_every_s, s.engine.device, s.step)
    preempting: ray.train.PreemptionInfo | None = None
    while s.step < cfg.train.max_steps:
        maybe_kill(cfg, s.step, s.rank)
        metrics = train_step(s)
        bad_so_far += metrics["bad_rows"]
        metrics["bad_rows_so_far"] = bad_so_far
        done = s.step == cfg.train.max_steps
        if cfg.train.eval_every and (done or s.step % cfg.train.eval_every == 0):
            metrics.update(evaluate(s))
        history.append(metrics)
        # Asked at the steps that report anyway: each ask is a barrier through Ray's synchronization
        # actor. An announcement stands until the group is torn down.
        if asks_preemption and preempting is None and not done and reporter.due(s.step):
            preempting = ray.train.get_preemption_info()  # the same answer on every rank
            if preempting is not None and s.rank == 0:
                log_preemption(preempting, s.step)
        reporter.add(metrics)
        # From a preemption's announcement on, every step ends with a checkpoint, so the resume redoes at
        # most the step in progress instead of up to train.checkpoint_every.
        saving = done or s.step % cfg.train.checkpoint_every == 0 or preempting is not None
        ckpt = save_checkpoint(s) if saving else None
        # `saving`, not `ckpt`: only rank 0 gets a checkpoint back, and every rank must report alike
        if saving or done or reporter.due(s.step):
            report(s, reporter.take(s.step), ckpt)
        if s.rank == 0 and (done or s.step % max(1, cfg.train.max_steps // 20) == 0):
            log_progress(metrics, bad_so_far, (s.step - first_step) / (time.perf_counter() - started))
    return history


def evaluate(s: Setup) -> dict[str, float]:
    """The held-out metrics at this step (every rank takes part), logged on rank 0."""
    t = s.cfg.train
    metrics = evaluate_sharded(s.engine, s.processor, s.eval_data, t.eval_samples, t.micro_batch_size)
    if s.rank == 0:
        log.info(
            "step %d eval accuracy %.3f loss %.4f stopped %.3f",
            s.step,
            metrics["eval_accuracy"],
            metrics["eval_loss"],
            metrics["eval_stopped"],
        )
    return metrics


def report(s: Setup, metrics: dict, ckpt: ray.train.Checkpoint | None) -> None:
    """Hand the steps' metrics, and rank 0's checkpoint when there is one, to Ray Train (every rank)."""
    ray.train.report(
        metrics,
        checkpoint=ckpt,
        # async: rank 0's folder is uploaded while training goes on; Ray records the checkpoint (and hands
        # it out for a resume) only once the upload completed. Both modes delete the local folder after.
        checkpoint_upload_mode=UPLOAD_MODES[s.cfg.run.checkpoint_upload],
        delete_local_checkpoint_after_upload=True,
    )


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
        base_model=s.base_model,
        data_rows=len(s.data),
    )
    writer.finish(state, s.engine.module.peft_config["default"])
    maybe_kill(s.cfg, s.step, s.rank, while_checkpointing=True)  # written locally, not yet handed to Ray
    return ray.train.Checkpoint.from_directory(folder)
