"""Functions run on Ray Train workers: a one-off group (`on_workers`), a group kept for many probes
(`ProbeGroup`), and the probes of raylora's training path (train and save, resume, restore).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests import whole_checkpoint

if TYPE_CHECKING:
    import torch


def on_workers(
    fn: Callable[[], Any],
    storage: str | Path,
    name: str,
    num_workers: int = 2,
    use_gpu: bool = False,
    poll_s: float = 0.1,
) -> Any:
    """Run `fn()` on `num_workers` Ray Train workers (gloo on CPU, NCCL with `use_gpu`, as raylora
    trains), the controller polling every `poll_s` seconds; returns rank 0's return value."""
    import ray.train

    from raylora import storage as storages
    from raylora.ray_runtime import Trainer  # Ray's TorchTrainer less the helper actors raylora does not use

    trainer = Trainer(
        fn,
        poll_s=poll_s,
        scaling_config=ray.train.ScalingConfig(num_workers=num_workers, use_gpu=use_gpu),
        # a URI (s3://) as it is: pathlib would fold its "//" into a local folder named "s3:"
        run_config=ray.train.RunConfig(name=name, storage_path=storages.absolute(str(storage))),
    )
    return trainer.fit().return_value


def _serve(requests, replies) -> None:
    """A probe group's training function: run each broadcast function until a None comes."""
    import torch.distributed as dist
    from ray import cloudpickle  # the functions are lambdas and closures, which pickle refuses

    rank = dist.get_rank()
    while True:
        box = [cloudpickle.dumps(requests.get()) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        fn = cloudpickle.loads(box[0])
        if fn is None:
            return
        # an exception ends this rank's training function, and Ray Train the group: rank 0 is not left
        # waiting in a collective of the function for a rank that gave up
        out = fn()
        if rank == 0:
            replies.put(("ok", out))


class ProbeGroup:
    """One Ray Train worker group, kept up in a thread of the driver, that runs function after function:
    `call(fn)` is `on_workers(fn, ...)` without a new group's start.

    A group's start costs about 13 s on 2 cores, nearly all of it fresh processes importing torch,
    transformers, PEFT and DeepSpeed, and the tests' and benchmarks' probes need only the workers. Ray
    Train has no call that runs a function on a group it keeps, so the group's training function serves:
    rank 0 takes each function from a Ray queue and broadcasts it to the other ranks, every rank runs it,
    and rank 0 puts its return value on the reply queue. A function that raises ends the group (the call
    raises, naming the error); `alive` then says so, and its user starts another.
    """

    def __init__(self, storage: str | Path, num_workers: int) -> None:
        from ray.util.queue import Queue

        from raylora.ray_runtime import POLL_ENV

        self.num_workers = num_workers
        self.requests, self.replies = Queue(), Queue()
        requests, replies = self.requests, self.replies

        def serve() -> None:
            try:
                on_workers(lambda: _serve(requests, replies), storage, "probe-group", num_workers)
                replies.put(("ended", "the probe group ended"))
            except Exception as err:  # the waiting call raises it
                replies.put(("ended", f"the probe group failed: {err!r}"))

        # Idle between probes, the group's controller still polls its workers every
        # RAY_TRAIN_HEALTH_CHECK_INTERVAL_S: at the 0.1 s of raylora's `Trainer` (for reports) that took
        # 0.03 cores here for as long as the group lives, most of a test session. The controller reads the
        # variable from this process's environment as it starts, so the group starts with 1 s, and the
        # environment is as it was once the group answers its first call: later runs poll as raylora's do.
        before = os.environ.get(POLL_ENV)
        os.environ[POLL_ENV] = "1"
        try:
            self.thread = threading.Thread(target=serve, name="probe-group", daemon=True)
            self.thread.start()
            self.call(lambda: None)
        finally:
            if before is None:
                os.environ.pop(POLL_ENV)
            else:
                os.environ[POLL_ENV] = before

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def call(self, fn: Callable[[], Any]) -> Any:
        self.requests.put(fn)
        kind, value = self.replies.get(timeout=1800)
        if kind != "ok":
            raise RuntimeError(value)
        return value

    def close(self) -> None:
        self.requests.put(None)
        self.thread.join(timeout=120)
        self.requests.shutdown()
        self.replies.shutdown()


def read_params(params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    """Full copies of the model's (not the optimizer's) parameter values, gathered per call, in fp32 on
    the CPU; every rank."""
    import deepspeed

    from raylora.zero import is_partitioned

    out = {}
    partitioned = [p for p in params.values() if is_partitioned(p)]
    with deepspeed.zero.GatheredParameters(partitioned):
        for name, param in params.items():
            out[name] = param.detach().float().cpu().clone()
    return out


def train_and_save(cfg, steps: int, out: str | Path, keep: bool = False) -> list:
    """On each Ray Train worker: raylora's training path without its loop (`worker.setup`, `steps` x
    `worker.train_step`, `worker.save_checkpoint`), the checkpoint moved to `out` by rank 0; returns the
    steps' metrics (and, with `keep`, the worker's `Setup` after them, to train on). Several of these in
    one `on_workers` function start one worker group, not one each."""
    import shutil

    import torch.distributed as dist

    from raylora import worker

    s = worker.setup(cfg, None)
    metrics = [worker.train_step(s) for _ in range(steps)]
    ckpt = worker.save_checkpoint(s)
    if s.rank == 0:
        shutil.move(ckpt.path, out)
    dist.barrier()  # the other ranks read `out` next
    return [*metrics, s] if keep else metrics


def resume_probe(cfg, steps: int, folder: str | Path, keep: str | Path | None = None) -> dict:
    """On each Ray Train worker: train `steps` steps, save the checkpoint to `folder` (rank 0 moves it
    there), train one step more; then build a fresh engine restored from `folder`, read back what it holds
    (`restored`: as `restore_probe` returns it), and train that step again. Rank 0 returns each step's
    metrics and whether the resumed step's loss, fp32 masters and Adam moments equal the uninterrupted
    ones bit for bit (what a killed and restarted worker resumes from). Given `keep`, the uninterrupted run
    trains one step further first (its metrics: `after`), and rank 0 writes its masters and moments there
    (safetensors, keys `weight.<name>` and `moment.<name>.<kind>`), for a real killed run to compare with."""
    import torch
    from safetensors.torch import save_file

    from raylora import zero
    from raylora.worker import setup, train_step

    metrics = train_and_save(cfg, steps, folder, keep=True)
    s = metrics.pop()
    straight = train_step(s)
    uninterrupted = zero.gather_trainable_state(s.engine, s.params)  # on rank 0, None elsewhere
    if keep is not None:
        after = train_step(s)
        state = zero.gather_trainable_state(s.engine, s.params)
        if s.rank == 0:
            kept = {f"weight.{n}": v for n, v in state[0].items()}
            save_file(kept | {f"moment.{n}": v for n, v in state[1].items()}, str(keep))
    s.engine.destroy()
    del s
    loaded = whole_checkpoint.load(folder)
    resumed_setup = setup(cfg, loaded)
    restored = _restored(resumed_setup, loaded)
    resumed = train_step(resumed_setup)
    again = zero.gather_trainable_state(resumed_setup.engine, resumed_setup.params)
    if resumed_setup.rank != 0:
        return {}
    (masters, moments), (got_masters, got_moments) = uninterrupted, again
    return {
        "metrics": [*metrics, straight],
        "after": after if keep is not None else None,
        "restored": restored,
        "resumed": resumed,
        "masters_equal": masters.keys() == got_masters.keys()
        and all(torch.equal(v, got_masters[n]) for n, v in masters.items()),
        "moments_equal": moments.keys() == got_moments.keys()
        and all(torch.equal(v, got_moments[n]) for n, v in moments.items()),
    }


def restore_probe(cfg, folder: str | Path, examples: list | None = None) -> dict:
    """On each Ray Train worker: restore from `folder` as `worker.setup` does, then read back what the
    engine holds before any step (and, given `examples`, the restored ZeRO-3 model's logits on them, in
    eval mode); rank 0 returns whether each part equals the checkpoint, the others `{}`."""
    from raylora.worker import setup

    loaded = whole_checkpoint.load(folder)
    return _restored(setup(cfg, loaded), loaded, examples)


def _restored(s, loaded, examples: list | None = None) -> dict:
    """What the restored engine of Setup `s` holds against checkpoint `loaded`, before any step (every rank
    calls it; rank 0 gets the answer, the others `{}`)."""
    import torch

    from raylora import zero
    from raylora.data.batches import make_batch

    model_values = read_params(s.params)
    gathered = zero.gather_trainable_state(s.engine, s.params)
    logits = None
    if examples is not None:  # every rank takes part in a ZeRO-3 forward pass
        batch = make_batch(s.processor, examples)
        batch.pop("labels")
        s.engine.module.eval()
        with torch.no_grad():
            logits = s.engine.module(**{k: v.to(s.engine.device) for k, v in batch.items()}).logits
        logits = logits.cpu().numpy()  # Ray Train refuses tensors in a training function's return value
        s.engine.module.train()
    if s.rank != 0:
        return {}
    masters, moments = gathered
    return {
        "logits": logits,
        "step": s.step,
        "lr": s.scheduler.get_last_lr()[0],
        # the model holds the masters in its own dtype (bf16 under train.precision=bf16)
        "params_equal": all(
            torch.equal(model_values[n], loaded.weights[n].to(s.params[n].dtype).float())
            for n in loaded.weights
        ),
        "masters_equal": all(torch.equal(masters[n], loaded.weights[n]) for n in loaded.weights),
        "moments_equal": all(torch.equal(moments[n], loaded.moments[n]) for n in loaded.moments),
        "moments_nonzero": any(bool(t.abs().sum() > 0) for t in loaded.moments.values()),
    }


def assert_weights_close(
    reference: dict[str, torch.Tensor], got: dict[str, torch.Tensor], tol: float
) -> None:
    """Every tensor of `got` within a relative `tol` of `reference` (max abs difference over the reference's
    max abs value); runs on other worker counts sum gradients in another order, so not bitwise."""
    worst = 0.0
    for name, value in reference.items():
        diff = float((value - got[name]).abs().max())
        if name.endswith("k_proj.bias"):
            # Softmax ignores a bias added to every key, so these get a zero gradient in exact arithmetic:
            # their updates are summation-order noise that Adam normalises up to the learning rate.
            # They stay at ~1e-6 in both runs; bound them absolutely.
            assert diff <= tol, name
            continue
        worst = max(worst, diff / float(value.abs().max().clamp_min(1e-12)))
    assert worst <= tol, f"relative difference {worst:.2e} (tolerance {tol:.0e})"
