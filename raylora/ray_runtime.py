"""The Ray a run trains on: starting a local one or joining a cluster (`init_ray`), and the settings
raylora gives Ray Train's controller and workers (`Trainer`, `worker_env`, core pinning).
"""

from __future__ import annotations

import contextlib
import copy
import os

import ray
import ray.train
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

from raylora.config import Config

# Ray Train's controller polls the workers every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (Ray's default 2 s)
# and takes one reported result per poll, while a worker's report waits until the previous one was taken
# (a queue of one): a poll as slow as the reports would hold training back, at one step per poll when
# every step reports. Each poll also wakes the controller and, with an actor call, every worker process:
# CPU that workers filling a small machine's cores lose. So a run polls at half its report interval,
# from 0.1 s (every step reporting) to 0.25 s (the 2-s default and slower); the controller took 0.025,
# 0.017 and 0.013 cores here polling every 0.1, 0.25 and 0.5 s beside the demo's training. Slower costs
# more than CPU: Ray registers a checkpoint only when a poll takes its report, so with checkpoints coming
# faster than the polls a fault or a stopped job goes back further. Polling every 1 s at the 2-s default
# (2026-12-05) gave no established gain (bench/throughput.py `alongside`: 0.961 of the plain loop, 0.965
# polling every 0.25 s), and tests/test_faults.py's many-faults run then resumed from step 2's checkpoint
# instead of step 4's and a stopped job in tests/test_jobs.py redid two checkpoint intervals instead of one.
POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"

# torch's CPU allocator keeps no cache of its own: every tensor is a glibc malloc, freed when the tensor goes.
# glibc gives an allocation above its mmap threshold (128 KiB at start, raised as such blocks are freed, 32
# MiB at most) a fresh mmap, which the kernel fills at first touch, one page fault per 4 KiB page, and takes
# back at the free; it gives its heap's free top back to the kernel past a trim threshold (twice the mmap
# threshold); and a thread other than the main one (Ray Train runs the training function in one) allocates
# from an arena of its own, made of 64 MiB heaps that glibc unmaps as soon as one is empty, whatever the trim
# threshold (its heap_trim). A training step on CPU allocates its activations and gradients anew each time, so
# a rank took 65,000-130,000 minor page faults per 16 steps of bench/padding.py's tiny models (the HF
# Trainer's processes 2,000-27,000, its passes smaller), and kernel time with them. With the mmap threshold at
# glibc's largest, the trim threshold out of reach and every thread on the main arena (grown by brk, never
# unmapped), tensors under 32 MiB come from heap memory the process keeps. In a Train worker
# (tests/test_config.py), over twenty step-like rounds of 160-184 MiB of tensors freed last first, after three
# of each pattern to warm up, the training thread faulted in 7,000-32,000 pages (6 runs; the median round
# none: the heap grows when one of Ray's threads takes a block of its free memory), against 70,000-80,000 with
# torch's THP_MEM_ALLOC_ENABLE=1 (raylora's setting before: big tensors on transparent huge pages, still
# mapped anew at every step), 43,000-68,000 with glibc's defaults and 34,000-57,000 with the two thresholds
# alone (the thread's own arena then drops each of its 64 MiB heaps that empties). The threads then share one
# arena's lock; beside one training thread the others allocate little. Against the HF Trainer at
# bench/padding.py's steps (Qwen2-VL-like mix, 4 rows per micro batch, taking turns), raylora's ranks went
# from 1.62-1.63 cores of 2 busy to 1.67-1.68, and from 0.972-0.995 of the Trainer's useful tokens per second
# (6 runs) to level or ahead (README); peak memory per rank grew by 1-3% in scratch runs of 24 padded steps
# (the heap holds the steps' peak and what its free blocks cannot serve) and came out 3-4% lower than with THP
# in bench/padding.py --repeats 6 (runs of different days). glibc reads the variables once, as the process
# starts, so they can only be set in the environment the worker process starts with: Ray's worker runtime env
# (`Trainer`). CPU workers only: on a GPU the step's tensors are on the device. A value that the driver's
# environment holds is passed on instead (`worker_env`).
CPU_WORKER_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
    "MALLOC_ARENA_MAX": "1",
}


def worker_env(use_gpu: bool = False) -> dict[str, str]:
    """The environment variables raylora sets for its Train workers: `CPU_WORKER_ENV` on CPU workers
    (none on GPU workers), where the driver's environment holds one of them, with the driver's value (the
    workers of a cluster inherit their raylet's environment, not the driver's)."""
    return {} if use_gpu else {key: os.environ.get(key, value) for key, value in CPU_WORKER_ENV.items()}


def controller_poll_s(report_every_s: float) -> float:
    """Seconds between the controller's polls of a run that reports every `report_every_s`."""
    return min(max(report_every_s / 2, 0.1), 0.25)


class Trainer(TorchTrainer):
    """Ray Train's TorchTrainer less the helper actors that serve nothing in a raylora run, its
    controller polling every `poll_s` seconds (`fit`), its CPU workers started with `worker_env()` (beside
    any env_vars of the run config's worker_runtime_env, which win).

    Ray Train 2.60 starts, beside the controller and the workers, a DatasetManager at every worker-group
    start (for Ray Datasets handed to the trainer: raylora reads its own rows and hands none) and, per
    run, a detached placement-group cleaner that removes the workers' placement group should the
    controller die without doing so (a second guard: Ray itself deletes a placement group once its
    creator, the controller, is dead, `ray.util.placement_group`'s default lifetime). The cleaner is
    kept on a cluster that outlives the driver; a Ray that raylora started itself (`init_ray` without
    RAY_ADDRESS) ends with its driver, placement groups and all. Each helper is a Python process of
    its own, about 2 s of CPU to start on this 2-core machine, where the starting workers fill both
    cores: every start and every restart after a fault waits for it. Ray has no setting for either, so
    this drops them from the list of default callbacks that Ray builds (`_create_default_callbacks`,
    Ray pinned to 2.60; tests/test_config.py and tests/test_faults.py fail if an upgrade moves them).
    """

    def __init__(self, *args, poll_s: float = 0.1, run_config: ray.train.RunConfig | None = None, **kwargs):
        run_config = copy.copy(run_config or ray.train.RunConfig())
        runtime_env = dict(run_config.worker_runtime_env or {})
        scaling = kwargs.get("scaling_config")
        env = worker_env(use_gpu=bool(scaling and scaling.use_gpu))
        runtime_env["env_vars"] = {**env, **runtime_env.get("env_vars", {})}
        run_config.worker_runtime_env = runtime_env
        super().__init__(*args, run_config=run_config, **kwargs)
        self.poll_s = poll_s

    def fit(self) -> ray.train.Result:
        """Ray Train's fit, its controller polling the workers every `poll_s` seconds (`POLL_ENV`).

        The controller reads the interval from this process's environment as `fit` starts it (Ray
        Train's `get_env_vars_to_propagate`; Ray has no argument for it), so the variable is set for as
        long as `fit` runs. A value the environment already holds (the user's, or a probe group's) is
        left as it is."""
        if POLL_ENV in os.environ:
            return super().fit()
        os.environ[POLL_ENV] = f"{self.poll_s:g}"
        try:
            return super().fit()
        finally:
            os.environ.pop(POLL_ENV, None)

    def _create_default_callbacks(self):
        unneeded: tuple[type, ...] = () if self.datasets else (DatasetsCallback,)
        if started_here():
            unneeded += (PlacementGroupCleanerCallback,)
        return [cb for cb in super()._create_default_callbacks() if not isinstance(cb, unneeded)]


# A Ray that raylora starts itself is one node, this machine, and ends with its driver: no cloud
# provider drains it, so Ray Train's preemption watcher (an actor started with every worker group,
# polling for drains) has nothing to watch; nobody scrapes its metrics (the workers' and agents' export
# loop) or opens its dashboard (a dozen processes), and no placement group outlives it (`Trainer`
# leaves out the cleaner, whose polls were the dashboard's one user). All of them cost CPU that the
# workers fill on a small machine (bench/throughput.py). The mark tells a Tune trial's driver, which runs
# in a Ray worker process, that its Ray is one of these.
LOCAL_RAY_MARK = "RAYLORA_STARTED_THIS_RAY"
LOCAL_RAY_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", LOCAL_RAY_MARK: "1"}
LOCAL_RAY_SYSTEM_CONFIG = {"enable_metrics_collection": False}
_started_session: str | None = None  # the session of the Ray that init_ray started in this process


def init_ray(num_cpus: int | None = None) -> None:
    """Connect to the cluster in RAY_ADDRESS, or start a local one."""
    global _started_session
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
    else:
        # "local": a new Ray of our own, even if someone ran `ray start` here (RAY_ADDRESS=auto joins that)
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            runtime_env={"env_vars": LOCAL_RAY_ENV},
            _system_config=LOCAL_RAY_SYSTEM_CONFIG,
        )
        _started_session = ray.get_runtime_context().get_session_name()


def started_here() -> bool:
    """Whether the Ray this process is connected to is one that raylora's `init_ray` started (in this
    process, or, seen from one of its workers, by their driver)."""
    if os.environ.get(LOCAL_RAY_MARK) == "1":
        return True
    return ray.is_initialized() and ray.get_runtime_context().get_session_name() == _started_session


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
