"""What every benchmark shares: tiny assets, a local Ray, a collective counter, JSON results.

The tiny run, the probe that runs a function on Ray Train workers and the Ray settings are the tests'
own (tests/support.py): this module puts the repository root on sys.path, so a benchmark imports them
as `from tests.support import ...` after `import common`. Run the scripts from the repository root
(`python bench/x.py`): Ray puts the driver's working directory on its workers' path.

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

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python bench/x.py` puts only bench/ on the path
    sys.path.insert(0, str(ROOT))

from tests.support import ProbeGroup, free_port, use_ray_test_env  # noqa: E402, F401 (free_port: for the scripts)

use_ray_test_env()

RESULTS = ROOT / "bench" / "results"
WORK = ROOT / "runs" / "bench"  # scratch: models, data, checkpoints (git-ignored)


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


# An override for `tests.support.tiny_run_config`: a benchmark's run writes no checkpoints unless a later
# override asks for them.
NO_CHECKPOINTS = "train.checkpoint_every=1000"


# ------------------------------------------------------------------------------------------------ Ray


@contextmanager
def local_ray():
    """raylora's own Ray (`init_ray`: the cluster in RAY_ADDRESS, or a new local one of 4 logical CPUs
    with the runtime env raylora's driver sets), shut down at the end; the Ray this process is already
    connected to (bench/smoke.py's, shared by every script) is used and left running."""
    import ray

    from raylora.driver import init_ray

    if ray.is_initialized():
        yield ray
        return
    init_ray(num_cpus=4)
    try:
        yield ray
    finally:
        ray.shutdown()


# One worker group for many probes. bench/smoke.py runs every script in one process, and the scripts'
# probes (`on_workers`) each started a worker group of their own: about 13 s apiece on 2 cores, nearly all
# of it fresh processes importing torch, transformers, PEFT and DeepSpeed. Inside `probe_group()` they
# all run, one after the other, in one group that stays up (`tests.support.ProbeGroup`). A smoke run
# checks that each script works; the figures that depend on fresh processes (startup, peak memory) come
# from the scripts' own runs, outside it.
_probe_group: ProbeGroup | None = None


def on_workers(fn, storage: str | Path, name: str, num_workers: int = 2, use_gpu: bool = False) -> Any:
    """`tests.support.on_workers`: `fn()` on Ray Train workers, rank 0's return value. Inside
    `probe_group()`, and for its worker count on CPU, on that group rather than a new one."""
    from tests.support import on_workers as in_new_group

    group = _probe_group
    if group is not None and not use_gpu and num_workers == group.num_workers:
        return group.call(fn)
    return in_new_group(fn, storage, name, num_workers, use_gpu)


@contextmanager
def probe_group(storage: str | Path, num_workers: int = 2):
    """Within it, `on_workers` calls for `num_workers` CPU workers run on one worker group."""
    global _probe_group
    _probe_group = ProbeGroup(storage, num_workers)
    try:
        yield _probe_group
    finally:
        group, _probe_group = _probe_group, None
        group.close()


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


def processes(cpu: bool = False) -> list[tuple]:
    """(pid, command line, CPU times or None) of every process on the machine that can still be read."""
    import psutil

    out = []
    for proc in psutil.process_iter():
        try:
            out.append((proc.pid, " ".join(proc.cmdline()), proc.cpu_times() if cpu else None))
        except (psutil.Error, OSError):  # ended meanwhile, or not ours to read
            continue
    return out


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # /proc's unit of CPU time


class CpuSampler:
    """CPU time of every process on the machine, sampled every `every_s` seconds in a thread, grouped by
    what the process is: `cores(t0, t1)` gives each group's cores in use between two moments.

    Groups (GROUPS): `workers` (Ray Train workers, the plain loop's processes, and the input-pipeline
    processes forked from either), `ray_train_controller`, then each of Ray's own processes by kind
    (`raylet`, `gcs_server`, `dashboard` with its module subprocesses, `dashboard_agent`,
    `runtime_env_agent`, `log_monitor`, `autoscaler_monitor`, `idle_workers` (prestarted, not leased),
    `other_ray` (helper actors such as Ray Train's placement-group cleaner)), `benchmark_driver` (this
    process) and `rest`.

    `worker_threads(t0, t1)` splits the workers' cores by thread (THREAD_KINDS): `training` (the plain
    process's main thread, the Ray Train worker's training thread: what the other kinds leave),
    `ray_main` (a Ray worker's main thread: Ray's task loop, which runs the controller's polls and, every
    10 ms, takes the GIL to check for signals), `gloo` (gloo's transport threads) and `other_threads`
    (Ray's core-worker threads, gRPC's, idle Python helpers). The kernel counts CPU per thread, so this is
    where a Ray worker's CPU goes that a plain process does not spend.
    """

    GROUPS = (
        "workers",
        "ray_train_controller",
        "raylet",
        "gcs_server",
        "dashboard",
        "dashboard_agent",
        "runtime_env_agent",
        "log_monitor",
        "autoscaler_monitor",
        "idle_workers",
        "other_ray",
        "benchmark_driver",
        "rest",
    )
    # (group, what its command line holds), first match wins; after the workers and the controller
    _RAY_KINDS = (
        ("raylet", "/raylet/raylet"),
        ("gcs_server", "/gcs/gcs_server"),
        ("dashboard_agent", "ray::DashboardAgent"),
        ("runtime_env_agent", "ray::RuntimeEnvAgent"),
        ("dashboard", "dashboard/dashboard.py"),
        ("dashboard", "ray-dashboard-"),
        ("dashboard", "ray.dashboard.subprocesses"),
        ("log_monitor", "log_monitor.py"),
        ("autoscaler_monitor", "autoscaler/_private/monitor.py"),
        ("idle_workers", "ray::IDLE"),
    )

    THREAD_KINDS = ("training", "ray_main", "gloo", "other_threads")

    def __init__(self, every_s: float = 0.5):
        self.every_s, self.snapshots = every_s, []
        self.thread_snapshots: list[tuple[float, dict]] = []  # with `snapshots`: workers' and idle workers'
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _group(pid: int, cmdline: str) -> str:
        if pid == os.getpid():
            return "benchmark_driver"
        if "RayTrainWorker" in cmdline or "multiprocessing.spawn" in cmdline:
            return "workers"
        if "TrainController" in cmdline:
            return "ray_train_controller"
        for group, marker in CpuSampler._RAY_KINDS:
            if marker in cmdline:
                return group
        if "ray::" in cmdline or "/ray/" in cmdline:
            return "other_ray"
        return "rest"

    @staticmethod
    def _threads(pid: int) -> dict[int, tuple[str, float]]:
        """{thread id: (name, CPU seconds)} of one process; {} once it has ended. One read of each
        thread's /proc stat, which holds both (psutil's `threads()` reads it for the times only)."""
        out = {}
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return {}
        for tid in tids:
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            except OSError:  # the thread ended meanwhile
                continue
            name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
            # utime and stime, fields 14 and 15 of proc(5), counted from field 3 after the name
            out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            snapshot = {
                pid: (self._group(pid, cmdline), cpu.user + cpu.system, "RayTrainWorker" in cmdline)
                for pid, cmdline, cpu in processes(cpu=True)
            }
            now = time.time()
            # idle workers too: Ray starts a run's workers in processes it had started idle
            threads = {
                pid: self._threads(pid) for pid, v in snapshot.items() if v[0] in ("workers", "idle_workers")
            }
            self.snapshots.append((now, snapshot))
            self.thread_snapshots.append((now, threads))
            self._stop.wait(self.every_s)

    def _window(self, snapshots: list, t0: float, t1: float) -> tuple:
        """The first and the last snapshot inside [t0, t1] (see `cores`)."""
        inside = [s for s in snapshots if t0 <= s[0] <= t1]
        if len(inside) < 2:
            before = [s for s in snapshots if s[0] < t0] or snapshots[:1]
            after = [s for s in snapshots if s[0] > t1] or snapshots[-1:]
            inside = [before[-1], after[0]]
        (a_t, a), (b_t, b) = inside[0], inside[-1]
        assert b_t > a_t, "the sampler saw the window only once"
        return a_t, a, b_t, b

    def cores(self, t0: float, t1: float) -> dict[str, float]:
        """Stop sampling; each group's CPU seconds per second between the first and the last snapshot
        inside [t0, t1] (processes that lived through both). A window too short for two snapshots (the
        smoke test's) takes the snapshots around it instead, where a process may start or end between."""
        self._stop.set()
        self._thread.join()
        a_t, a, b_t, b = self._window(self.snapshots, t0, t1)
        out = dict.fromkeys(self.GROUPS, 0.0)
        for pid, (group, cpu, _) in b.items():
            if pid in a:
                out[group] += (cpu - a[pid][1]) / (b_t - a_t)
        return out

    def worker_threads(self, t0: float, t1: float) -> dict[str, float]:
        """Cores of the workers' threads by kind (THREAD_KINDS) between two moments, summed over the
        processes that `cores` counts as workers; call after `cores`, which stops the sampling.

        `ray_main`, `gloo` and `other_threads` are threads that live as long as their process. `training`
        is the rest of the process's CPU: its training thread, which in a short window can start after
        the first snapshot and end before the last (Ray Train's, around a `--tiny` run), and any thread
        that came and went between two snapshots."""
        a_t, a, b_t, b = self._window(self.snapshots, t0, t1)
        # Each thread's CPU at the last snapshot of the window that saw it, from 0 if it started inside.
        last: dict[int, dict[int, tuple[str, float]]] = {}
        for t, snap in self.thread_snapshots:
            if a_t <= t <= b_t:
                for pid, threads in snap.items():
                    last.setdefault(pid, {}).update(threads)
        first = dict(next(snap for t, snap in self.thread_snapshots if t == a_t))
        out = dict.fromkeys(self.THREAD_KINDS, 0.0)
        for pid, (group, cpu, ray_worker) in b.items():
            if group != "workers" or pid not in a:
                continue
            total = (cpu - a[pid][1]) / (b_t - a_t)
            used = {
                tid: (name, (c - first.get(pid, {}).get(tid, (name, 0.0))[1]) / (b_t - a_t))
                for tid, (name, c) in last.get(pid, {}).items()
            }
            kinds: dict[int, str] = {}
            for tid, (name, _) in used.items():
                # gloo's threads are named by gloo (gloo_tcp_loop) and torch's wrapper (pt_gloo_runloop)
                if name.startswith(("gloo", "pt_gloo")):
                    kinds[tid] = "gloo"
                elif tid == pid and ray_worker:
                    kinds[tid] = "ray_main"
            rest = {tid: c for tid, (_, c) in used.items() if tid not in kinds}
            if rest:  # the busiest of the rest is the training thread, counted below with the remainder
                del rest[max(rest, key=rest.get)]
            kinds.update(dict.fromkeys(rest, "other_threads"))
            for tid, kind in kinds.items():
                out[kind] += used[tid][1]
            out["training"] += total - sum(used[tid][1] for tid in kinds)
        return out


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
    """Within it, this process's environment holds what raylora's Train workers start with
    (`raylora.driver.worker_env`), and so do processes spawned in it: the plain processes that stand in
    for raylora's workers. glibc reads its MALLOC_ variables as a process starts, so they
    cannot be set from inside a spawned rank."""
    from unittest import mock

    from raylora.driver import worker_env

    return mock.patch.dict(os.environ, worker_env())


def rendezvous() -> str:
    """Where the ranks of a `plain_process_group` meet: a fresh file for torch's FileStore rather than a
    TCP port. A port found free here can be taken before rank 0 listens on it (Ray's processes open ports
    all the time beside the benches): a CI run failed so with EADDRINUSE (2026-12-06). gloo's own
    connections then take ports the system gives out at bind time."""
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


class Turns:
    """Two process groups, both up, taking turns on the machine block by block, so that a comparison of
    the two is not swamped by the machine's drift (on this shared machine a whole run's speed moves by
    up to 2x from one minute to the next). The file at `path` names whose block is next ("side:block");
    each side's rank 0 polls it every `POLL_S` while the other side trains, and its other ranks wait in a
    barrier (gloo's wait sleeps). The poll is all that the waiting side does, and each of its wakeups can
    preempt a rank of the side whose turn it is (sooner if that side runs at a higher nice, as Ray's
    workers do at 15 against a plain process's 0), so it polls seldom: at 20 ms, 50 wakeups a second, and
    a turn passes up to 20 ms late, outside the timed blocks. Sides go in the order of `sides`, the first
    one first in each block. Every rank of a side calls each method at the same points;
    `torch.distributed` is set up.
    """

    POLL_S = 0.02

    def __init__(self, path: str | Path, sides: tuple[str, str], side: str) -> None:
        self.path, self.sides, self.side = str(path), sides, side
        self.other = sides[1 - sides.index(side)]
        self.first = sides.index(side) == 0

    @staticmethod
    def start(path: str | Path, sides: tuple[str, str]) -> None:
        """Before either side starts: leftovers of an earlier comparison removed, the first block given."""
        path = Path(path)
        for leftover in path.parent.glob(path.name + "*"):
            leftover.unlink()
        path.write_text(f"{sides[0]}:0")

    def _rank0(self) -> bool:
        import torch.distributed as dist

        return dist.get_rank() == 0

    def _wait(self, ok, what: str, timeout_s: float = 900) -> None:
        deadline = time.monotonic() + timeout_s
        while not ok():
            if Path(self.path).read_text() == "failed":
                raise RuntimeError(f"{self.other}, the other side of the comparison, failed")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.side}: no {what} after {timeout_s:.0f} s")
            time.sleep(self.POLL_S)

    def ready(self) -> None:
        """This side has set up and warmed up: wait until the other has too."""
        if self._rank0():
            Path(f"{self.path}.{self.side}").touch()
            self._wait(lambda: all(Path(f"{self.path}.{s}").exists() for s in self.sides), "ready side")

    def wait(self, block: int) -> None:
        """Until it is this side's turn for `block`."""
        import torch.distributed as dist

        if self._rank0():
            mine = f"{self.side}:{block}"
            self._wait(lambda: Path(self.path).read_text() == mine, f"turn {mine}")
        dist.barrier()

    def done(self, block: int, record=None) -> None:
        """This side's `block` has ended on every rank (then `record()`, to time it before the other side
        starts): the turn goes to the other side."""
        import torch.distributed as dist

        dist.barrier()
        if record is not None:
            record()
        if self._rank0():
            tmp = f"{self.path}.next"
            Path(tmp).write_text(f"{self.other}:{block if self.first else block + 1}")
            os.replace(tmp, self.path)

    def finish(self, blocks: int) -> None:
        """After this side's last block of `blocks`: the first side waits until the other side's last
        block has ended too, so that what it does on its way out (freeing its memory, a Ray run shutting
        down) does not run beside that block. Without it the second side's last block ran 1.0-1.5 s
        (30-65%) slower than its others (bench/padding.py --turns, 2026-12-06)."""
        if self.first:
            self.wait(blocks)

    def fail(self) -> None:
        """Tell the other side that this one failed, so that it stops waiting."""
        Path(self.path).write_text("failed")
