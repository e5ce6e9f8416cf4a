"""What the benchmarks share: tiny assets, the run they measure, raylora's own Ray, a probe on Ray Train
workers, a collective counter, JSON results.

Every benchmark drives raylora as a user does: a config (`bench/run.yaml` plus dotted overrides, loaded by
`raylora.config.load`), raylora's driver (`raylora.driver`) and its public modules. Run the scripts from
the repository root (`python bench/x.py`): Ray puts the driver's working directory on its workers' path.

Each figure a benchmark writes is a median of several samples, the raw samples sit beside it, and the
JSON says which machine and which command made it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.elastic.utils.distributed import get_free_port as free_port  # noqa: F401 (scripts)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
WORK = ROOT / "runs" / "bench"  # scratch: models, data, checkpoints (git-ignored)
RUN_CONFIG = ROOT / "bench" / "run.yaml"

# Ray's default, stated: what ~/.ray holds must not decide whether the benchmarks' Ray asks for a token.
os.environ.setdefault("RAY_AUTH_MODE", "token")


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="smallest sizes and fewest repeats (smoke test)")
    p.add_argument("--repeats", type=int, default=None, help="samples per figure (default 3, --tiny 1)")
    p.add_argument("--out", default=str(RESULTS), help="folder for the JSON result (default bench/results)")
    p.add_argument("--work", default=str(WORK), help="scratch folder (default runs/bench)")
    return p


def repeats(args: argparse.Namespace, default: int = 3) -> int:
    return args.repeats or (1 if args.tiny else default)


def median(samples: list[float]) -> float:
    return float(statistics.median(samples))


def summary(samples: list[float]) -> dict[str, Any]:
    """A figure: its median and the raw samples it came from."""
    return {"median": median(samples), "samples": [float(s) for s in samples]}


def machine() -> dict[str, Any]:
    import deepspeed
    import ray
    import torch
    import transformers

    return {
        "cpu_count": os.cpu_count(),
        "load_average_1min_at_write": os.getloadavg()[0],
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "ray": ray.__version__,
        "transformers": transformers.__version__,
    }


def write_result(args: argparse.Namespace, name: str, data: dict[str, Any]) -> Path:
    """bench/results/NAME.json: the figures plus the machine and the command that made them."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(ROOT)
    except ValueError:
        pass
    record = {
        "benchmark": name,
        "command": shlex.join(["python", str(script), *sys.argv[1:]]),
        "tiny": bool(args.tiny),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "machine": machine(),
        **data,
    }
    path = out / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)
    print(f"wrote {path}")
    return path


def folder_bytes(folder: str | Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------------- assets


def tiny_model(work: str | Path, width: int = 64, layers: int = 2, arch: str = "llava") -> str:
    """A tiny model folder from raylora.assets, built once per (arch, width, layers)."""
    from raylora.assets import make_tiny_model

    folder = Path(work) / "models" / f"{arch}-w{width}-l{layers}"
    if not (folder / "config.json").is_file():
        make_tiny_model(folder, arch, width=width, layers=layers)
    return str(folder)


def digits(work: str | Path) -> str:
    """The digits' training Parquet file, built once."""
    from raylora.assets import make_digits

    folder = Path(work) / "digits"
    if not (folder / "train.parquet").is_file():
        make_digits(folder)
    return str(folder / "train.parquet")


def run_config(
    model_dir: str | Path, train_file: str | Path, storage: str | Path, name: str, *overrides: str
):
    """The run a benchmark measures: `bench/run.yaml` on `model_dir` and `train_file`, stored under
    `storage` as run `name`, then `overrides` (dotted `key=value`, as `raylora train` takes them)."""
    from raylora import config

    return config.load(
        RUN_CONFIG,
        [
            f"model.path={model_dir}",
            f"data.train={train_file}",
            f"run.storage_path={storage}",
            f"run.name={name}",
            *overrides,
        ],
    )


# An override for `run_config`: a benchmark's run writes no checkpoints unless a later override asks.
NO_CHECKPOINTS = "train.checkpoint_every=1000"


# ------------------------------------------------------------------------------------------------ Ray


@contextmanager
def local_ray():
    """raylora's own Ray (`init_ray`: the cluster in RAY_ADDRESS, or a new local one of 4 logical CPUs
    with the runtime env raylora's driver sets), shut down at the end; the Ray this process is already
    connected to (bench/smoke.py's, shared by every script) is used and left running."""
    import ray

    from raylora.ray_runtime import init_ray

    if ray.is_initialized():
        yield ray
        return
    init_ray(num_cpus=4)
    try:
        yield ray
    finally:
        ray.shutdown()


def on_workers(
    fn, storage: str | Path, name: str, num_workers: int = 2, use_gpu: bool = False, env: dict | None = None
) -> Any:
    """`fn()` on `num_workers` Ray Train workers of a worker group of its own, started as raylora starts
    its runs' (`raylora.ray_runtime.Trainer`: gloo on CPU, NCCL with `use_gpu`), `env` in their
    environment; rank 0's return value. Put every measurement of a figure in one `fn`: each call starts
    fresh processes (about 13 s here)."""
    import ray.train

    from raylora import storage as storages
    from raylora.ray_runtime import Trainer

    trainer = Trainer(
        fn,
        scaling_config=ray.train.ScalingConfig(num_workers=num_workers, use_gpu=use_gpu),
        run_config=ray.train.RunConfig(
            name=name,
            storage_path=storages.absolute(str(storage)),
            worker_runtime_env={"env_vars": env or {}},
        ),
    )
    return trainer.fit().return_value


def barrier_time(fn) -> tuple[float, Any]:
    """Wall time of `fn()` over all ranks: barriers before and after, so the slowest rank counts."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - start, out


# -------------------------------------------------------------------------------------- collectives

# What counts as a collective: every torch.distributed collective named below, and DeepSpeed's comm
# layer (deepspeed.comm), which the ZeRO-3 code calls. deepspeed.comm forwards to torch.distributed,
# except that its TorchBackend keeps references to all_gather_into_tensor / reduce_scatter_tensor taken
# at start-up; those references are wrapped too. A call is counted once, where it enters the
# outermost wrapped layer (a deepspeed.comm.broadcast that calls torch.distributed.broadcast is one
# call). `bypass` counts deepspeed.comm calls that reached no wrapped torch.distributed function.
TORCH_COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "all_gather_coalesced",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "all_reduce",
    "all_reduce_coalesced",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "all_to_all",
    "all_to_all_single",
    "barrier",
)
DEEPSPEED_COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "allgather_fn",
    "all_gather_coalesced",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "all_reduce",
    "all_reduce_coalesced",
    "inference_all_reduce",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_fn",
    "gather",
    "scatter",
    "all_to_all_single",
    "barrier",
)


class CollectiveCounter:
    """Counts collective calls on this rank while active; `calls` by layer.name, `total` outermost."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.inner_torch: Counter[str] = Counter()
        self.bypass = 0
        self._local = threading.local()
        self._patched: list[tuple[object, str, object]] = []
        self.active = False

    @property
    def total(self) -> int:
        return sum(v for k, v in self.calls.items() if not k.endswith(".barrier"))

    def snapshot(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "by_call": dict(sorted(self.calls.items())),
            "barriers": sum(v for k, v in self.calls.items() if k.endswith(".barrier")),
            "deepspeed_calls_that_bypassed_torch_distributed": self.bypass,
        }

    def reset(self) -> None:
        self.calls.clear()
        self.inner_torch.clear()
        self.bypass = 0

    def _wrap(self, fn, label: str, is_torch: bool):
        counter = self

        def wrapped(*args, **kwargs):
            if not counter.active:
                return fn(*args, **kwargs)
            local = counter._local
            depth = getattr(local, "depth", 0)
            if depth == 0:
                counter.calls[label] += 1
                local.torch_seen = False
            if is_torch:
                local.torch_seen = True
                counter.inner_torch[label] += 1
            local.depth = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                local.depth = depth
                if depth == 0 and not is_torch and not local.torch_seen:
                    counter.bypass += 1

        wrapped.__wrapped__ = fn
        return wrapped

    def _patch(self, owner, attr: str, label: str, is_torch: bool, cache: dict) -> None:
        fn = getattr(owner, attr, None)
        if fn is None or not callable(fn):
            return
        key = id(fn)
        if key not in cache:
            cache[key] = self._wrap(fn, label, is_torch)
        self._patched.append((owner, attr, fn))
        setattr(owner, attr, cache[key])

    def install(self) -> CollectiveCounter:
        import deepspeed.comm
        import deepspeed.comm.comm as ds_comm
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        cache: dict[int, object] = {}
        for name in TORCH_COLLECTIVES:
            for owner in (c10d, dist):
                self._patch(owner, name, f"torch.{name}", True, cache)
        for name in DEEPSPEED_COLLECTIVES:
            for owner in (ds_comm, deepspeed.comm):
                self._patch(owner, name, f"deepspeed.{name}", False, cache)
        backend = getattr(ds_comm, "cdb", None)
        for attr in ("all_gather_function", "reduce_scatter_function"):
            if backend is not None and getattr(backend, attr, None) is not None:
                self._patch(backend, attr, f"torch.{attr}", True, cache)
        return self

    def uninstall(self) -> None:
        for owner, attr, fn in reversed(self._patched):
            setattr(owner, attr, fn)
        self._patched.clear()

    @contextmanager
    def counting(self):
        """Count the calls made inside the block (from zero)."""
        self.reset()
        self.active = True
        try:
            yield self
        finally:
            self.active = False


def counted_time(counter: CollectiveCounter, fn) -> tuple[float, dict[str, Any], Any]:
    """(wall seconds over all ranks, collectives this rank made, result) of `fn()`."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    with counter.counting():
        out = fn()
    dist.barrier()
    return time.perf_counter() - start, counter.snapshot(), out


def collective_figures(samples: list[tuple[float, dict[str, Any]]]) -> dict[str, Any]:
    """Medians and raw samples of `(seconds, counter.snapshot())` pairs from `counted_time`."""
    last = samples[-1][1]
    return {
        "collectives": summary([c["total"] for _, c in samples]),
        "seconds": summary([t for t, _ in samples]),
        "by_call_last_repeat": last["by_call"],
        "bypassed_torch_distributed": last["deepspeed_calls_that_bypassed_torch_distributed"],
    }


def step_clock(path: str | Path):
    """A Ray Train callback (it runs in the controller) that appends `{t, reported, step, restarts}` to
    `path` for every step row of rank 0's reports: `t` when the step ended on rank 0 (its `wall_time`; a
    report carries the rows of the steps since the previous one), `reported` when the report reached
    the controller."""
    from ray.train import UserCallback

    from raylora.reporting import rows

    class StepClock(UserCallback):
        def __init__(self, path: str):
            self.path = path

        def after_report(self, run_context, metrics, checkpoint) -> None:
            reported = time.time()
            with open(self.path, "a") as f:
                for row in rows(metrics[0]) if metrics else []:
                    clock = {
                        "t": row.get("wall_time", reported),
                        "reported": reported,
                        "step": row.get("step"),
                        "restarts": row.get("restarts"),
                    }
                    f.write(json.dumps(clock) + "\n")

    return StepClock(str(path))


def read_clock(path: str | Path) -> list[dict]:
    p = Path(path)
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.is_file() else []


def peak_rss_reset() -> None:
    """Reset this process's peak resident memory (VmHWM) to its current resident size (Linux)."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss_bytes() -> int:
    """This process's peak resident memory since the start or the last `peak_rss_reset`."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


PLAIN_THREADS = 1  # Ray sets OMP_NUM_THREADS=1 for a worker that holds 1 CPU; the plain processes match it


def raylora_worker_env():
    """The environment variables raylora adds to its Train workers' (none, on CPU and on GPU), for the
    plain processes that stand in for them to start as they do."""
    import contextlib

    return contextlib.nullcontext()


def rendezvous() -> str:
    """Where the ranks of a `plain_process_group` meet: a fresh file for torch's FileStore rather than a
    TCP port, which Ray's processes beside the benchmark can take between a check and rank 0's listen."""
    return f"file://{tempfile.mkdtemp(prefix='raylora-bench-pg-')}/store"


def plain_process_group(rank: int, world: int, rendezvous: str) -> None:
    """A rank of the loop without Ray (torch.multiprocessing): the rank variables Ray Train sets, one
    intra-op thread as Ray gives a worker holding 1 CPU (OMP_NUM_THREADS=1), gloo on this machine, meeting
    at `rendezvous` (`rendezvous()`)."""
    import torch
    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)
    )
    torch.set_num_threads(PLAIN_THREADS)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
