"""The driver: check everything cheap first, then hand the run to a Ray `TorchTrainer`."""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
import posixpath
import secrets
from pathlib import Path

import pyarrow as pa
import ray
import ray.train
from ray.exceptions import RayActorError, RayError
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raylora import hub, storage
from raylora.arch import Architecture, for_model
from raylora.config import Config, ConfigError
from raylora.data import packing
from raylora.data.batches import check_max_length
from raylora.data.formats import check_source, open_rows
from raylora.data.preflight import check_sample, check_unread_fields, checked_processor
from raylora.data.processor import check_image_caps
from raylora.failures import EndOnPermanentError, PermanentError
from raylora.progress import MetricsLog, MlflowLog, TensorBoardLog, WandbLog
from raylora.redact import redact
from raylora.resume import check_resume, expected_trainable
from raylora.worker import train_loop_per_worker

log = logging.getLogger("raylora")


def preflight(cfg: Config) -> Architecture:
    """Everything that can be checked before Ray starts, the cheap checks first: model folder, architecture,
    data files, checkpoint; then the processor and chat template, and a sample of data.train read, decoded,
    rendered and tokenised as a step would (`check_sample`)."""
    model_dir = Path(hub.resolve(cfg.model.path, cfg.model.revision, config_only=True))
    if not (model_dir / "config.json").is_file():
        raise ConfigError(
            f"model.path: {cfg.model.path} has no config.json (not a Hugging Face model folder)"
        )
    arch = for_model(model_dir, cfg.model)
    why = packing.refusal(arch.model_type) if cfg.train.packing else None
    if why:
        raise ConfigError(f"train.packing is not available for {arch.model_type}: {why}; train it padded")
    check_image_caps(model_dir, cfg.data.max_pixels, cfg.data.min_pixels)
    _, num_rows = check_source(cfg.data.train, "data.train", cfg.data.format, cfg.data.image_root)
    if num_rows < cfg.train.global_batch_size:
        raise ConfigError(
            f"data.train: {num_rows} rows, fewer than train.global_batch_size ({cfg.train.global_batch_size})"
        )
    if cfg.data.eval:
        check_source(cfg.data.eval, "data.eval", cfg.data.format, cfg.data.image_root)
    if (
        cfg.fault.kill_at_steps or cfg.fault.kill_checkpoint_steps
    ) and not 0 <= cfg.fault.kill_rank < cfg.world_sizes[0]:
        raise ConfigError(
            f"fault.kill_rank {cfg.fault.kill_rank} is not a rank of {cfg.world_sizes[0]} workers"
        )
    # The run's model with LoRA on the meta device: a lora.target_modules or modules_to_save name that matches
    # nothing, or a LoRA option that the model's experts do not take, fails here; it logs what LoRA adapts.
    expected_trainable(cfg)
    check_resume(cfg)
    # The dearer checks last (a second or a few): what every rank would otherwise meet only after loading
    # the model and setting up DeepSpeed on every node.
    processor = checked_processor(cfg, model_dir)
    if cfg.data.max_length is not None:
        check_max_length(processor, cfg.data.max_length)
    if cfg.train.max_tokens_per_micro_batch is not None:
        check_max_length(processor, cfg.train.max_tokens_per_micro_batch, "train.max_tokens_per_micro_batch")
    rows = open_rows(cfg.data.train, cfg.data.format, cfg.data.image_root)
    check_unread_fields(rows)
    check_sample(cfg, rows, processor)
    # Last: on a cluster whose GPU nodes are yet to start, it waits for the first one to boot.
    check_flash_attention(cfg)
    return arch


FLASH_ATTENTION_WAIT_S = 1800.0  # an autoscaled GPU node boots and runs cluster.yaml's setup first


def flash_attn_status() -> tuple[str, str]:
    """This node's address, and why flash_attn does not import here ("" when it does)."""
    node = ray.util.get_node_ip_address()
    if importlib.util.find_spec("flash_attn") is None:
        return node, "the flash_attn package is not installed"
    try:
        import flash_attn  # noqa: F401
    except Exception as err:  # a build for another torch or CUDA fails here, not in find_spec
        return node, f"import flash_attn failed: {type(err).__name__}: {err}"
    return node, ""


# num_gpus=1 places it on a GPU node, where the workers will run, and makes an autoscaler start one
# when none is up yet (training would wait for that node anyway).
_flash_attn_on_gpu_node = ray.remote(num_cpus=0, num_gpus=1, max_retries=0)(flash_attn_status)


def flash_attention_site(attn_implementation: str, use_gpu: bool, cluster_gpus: float) -> str | None:
    """Where flash_attn must import: None for another attention kernel; "gpu_node" when training runs on
    GPUs of a cluster that has GPUs or can add them (its driver may be a CPU head); "here" otherwise,
    where the workers run in a Ray on this machine or no GPU can be asked."""
    if attn_implementation != "flash_attention_2":
        return None
    return "gpu_node" if use_gpu and cluster_gpus > 0 else "here"


def cluster_gpus() -> float:
    """The GPUs of the Ray this process is connected to, or that its autoscaler can add; 0 with no Ray."""
    if not ray.is_initialized():
        return 0.0
    gpus = ray.cluster_resources().get("GPU", 0.0)
    try:  # the autoscaler's node types, as Ray Train's own resource check reads them (a private API)
        from ray._private.state import state

        gpus = max(gpus, (state.get_max_resources_from_cluster_config() or {}).get("GPU", 0))
    except Exception:  # moved in another Ray: the GPUs that are up still count
        pass
    return gpus


def check_flash_attention(cfg: Config, timeout_s: float = FLASH_ATTENTION_WAIT_S) -> None:
    """`ConfigError` when model.attn_implementation=flash_attention_2 and flash_attn does not import where
    the workers run: on a GPU node of the cluster, by a Ray task, not on the driver (a cluster's CPU head),
    and here when the cluster has no GPUs. Joins the cluster in RAY_ADDRESS first when flash is asked for."""
    if cfg.model.attn_implementation != "flash_attention_2":
        return
    if os.environ.get("RAY_ADDRESS"):
        init_ray()  # the cluster the run trains on; run() and tune join it next anyway
    site = flash_attention_site(cfg.model.attn_implementation, cfg.scaling.use_gpu, cluster_gpus())
    if site == "here":
        if importlib.util.find_spec("flash_attn") is None:
            raise ConfigError(
                "model.attn_implementation=flash_attention_2 needs the flash_attn package (pip install "
                "flash-attn) on every node; it is not importable here. sdpa is PyTorch's own fused attention."
            )
        return
    log.info("checking flash_attn on a GPU node (an autoscaler may start one first)")
    answer = _ask_a_gpu_node(timeout_s)
    if answer is None:
        log.warning("no GPU node answered the flash_attn check within %.0f s; not checked", timeout_s)
        return
    node, why = answer
    if why:
        raise ConfigError(
            f"model.attn_implementation=flash_attention_2 needs the flash_attn package on every GPU node; "
            f"on {node}: {why}. cluster.yaml builds it on its GPU nodes with FLASH_ATTN=1 "
            f"(worker_setup_commands). sdpa is PyTorch's own fused attention."
        )


def _ask_a_gpu_node(timeout_s: float) -> tuple[str, str] | None:
    """`flash_attn_status` from a task on a GPU node; None when none answered within `timeout_s`."""
    ref = _flash_attn_on_gpu_node.remote()
    done, _ = ray.wait([ref], timeout=timeout_s)
    if not done:
        ray.cancel(ref, force=True)
        return None
    try:
        return ray.get(ref)
    except RayError:  # the node left while the check ran
        return None


STORAGE_MARKER = ".raylora-storage-check-"  # + a random token: a file the driver writes, every node reads


@ray.remote(num_cpus=0, max_retries=0)
def _read_marker(uri: str) -> tuple[str | None, str]:
    """The marker's contents as this node sees them (None if it cannot read it), and why not."""
    fs, path = storage.filesystem(uri)
    try:
        with fs.open_input_stream(path) as f:
            return f.read().decode(), ""
    except (OSError, pa.ArrowException) as err:
        return None, f"{type(err).__name__}: {err}"


def check_shared_storage(storage_path: str, timeout_s: float = 120.0) -> None:
    """`ConfigError` naming the nodes that do not see `run.storage_path` as the driver sees it.

    A local path that is not shared storage is each node's own disk: every rank would then upload its
    checkpoint files to its own node, and a restarted worker would resume from whatever its node holds.
    Ray finds that out only at the first checkpoint upload, then retries it run.max_failures times, so
    the driver writes a marker there and a task pinned to each alive node reads it back before training.
    Nodes that join later (autoscaling) are not checked. One node: nothing to compare, nothing written.
    """
    nodes = [n for n in ray.nodes() if n["Alive"]]
    if len(nodes) < 2:
        return
    token = secrets.token_hex(16)
    marker = posixpath.join(storage_path, STORAGE_MARKER + token)
    fs, path = storage.filesystem(marker)
    fs.create_dir(posixpath.dirname(path), recursive=True)
    with fs.open_output_stream(path) as f:
        f.write(token.encode())
    try:
        reads = {
            _read_marker.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
            ).remote(marker): node
            for node in nodes
        }
        done, late = ray.wait(list(reads), num_returns=len(reads), timeout=timeout_s)
        blind = []
        for ref in done:
            try:
                seen, why = ray.get(ref)
            except RayError:  # the node left while the check ran: it runs no workers either
                continue
            if seen != token:
                node = reads[ref]
                blind.append(f"{node['NodeID']} ({node['NodeManagerAddress']}: {why or 'other contents'})")
        for ref in late:
            ray.cancel(ref, force=True)
            log.warning(
                "node %s did not answer the shared-storage check within %.0f s; not checked",
                reads[ref]["NodeID"],
                timeout_s,
            )
    finally:
        fs.delete_file(path)
    if blind:
        raise ConfigError(
            f"run.storage_path: {storage_path} is not the same storage on every node of the cluster: "
            f"node(s) {', '.join(blind)} do not see the file the driver wrote there. Each node would keep "
            f"its own checkpoints and a restarted worker would resume from its node's copy. Use shared "
            f"storage that every node mounts at this path (NFS) or a URI (s3://, gs://)."
        )


def metric_callbacks(cfg: Config) -> list:
    """Where the per-step metrics go: the run folder's log always; TensorBoard, MLflow, W&B when asked."""
    callbacks = [MetricsLog(cfg.run.storage_path, cfg.run.name)]
    if cfg.run.tensorboard:
        root = os.path.abspath("runs") if storage.is_uri(cfg.run.storage_path) else cfg.run.storage_path
        callbacks.append(TensorBoardLog(os.path.join(root, cfg.run.name, "tensorboard")))
    params = {f"{s}.{k}": v for s, sec in redact(cfg.to_dict()).items() for k, v in sec.items()}
    if cfg.run.mlflow_tracking_uri:
        callbacks.append(MlflowLog(cfg.run.mlflow_tracking_uri, cfg.run.name, params))
    if cfg.run.wandb_project:
        callbacks.append(WandbLog(cfg.run.wandb_project, cfg.run.name, params))
    return callbacks


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


def make_trainer(cfg: Config, callbacks: list | None = None) -> TorchTrainer:
    """A TorchTrainer whose run resumes from its latest checkpoint when one with this name exists.

    `cfg` crosses to the workers as it is: `config.load` already made its local paths absolute."""
    return Trainer(
        lambda: train_loop_per_worker(cfg),
        poll_s=controller_poll_s(cfg.run.report_every_s),
        scaling_config=ray.train.ScalingConfig(
            num_workers=tuple(n) if isinstance(n := cfg.scaling.num_workers, list) else n,
            use_gpu=cfg.scaling.use_gpu,
            resources_per_worker={"CPU": cfg.scaling.cpus_per_worker},
        ),
        run_config=ray.train.RunConfig(
            name=cfg.run.name,
            storage_path=cfg.run.storage_path,
            # A preempted node (announced by a drain, or dead with Ray's preemption mark) is charged to its
            # own budget: a spot reclaim is not a fault and must not use up the run's retries for faults.
            failure_config=ray.train.FailureConfig(
                max_failures=cfg.run.max_failures, max_preemption_failures=cfg.run.max_preemptions
            ),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.run.num_to_keep),
            # last, so that the metrics callbacks still see the error that ends the run
            callbacks=[*metric_callbacks(cfg), *(callbacks or []), EndOnPermanentError()],
        ),
    )


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


def run(cfg: Config, callbacks: list | None = None) -> ray.train.Result:
    """Validate, connect to (or start) Ray, train. Uses the cluster in RAY_ADDRESS when set.

    Raises `ray.train.TrainingFailedError` when the run fails for good, or `failures.PermanentError`
    after one attempt when a worker's start failed in a way that every attempt would repeat.
    """
    preflight(cfg)
    init_ray()
    check_shared_storage(cfg.run.storage_path)
    relaunches = 0
    while True:
        try:
            return make_trainer(cfg, callbacks).fit()
        except ray.train.ControllerError as err:
            if isinstance(getattr(err, "controller_failure", None), PermanentError):
                raise err.controller_failure from None  # the worker's own message, not Ray's wrapping
            # Ray Train 2.60 retries a worker that dies while training, but not one that dies in the
            # moment its training function is being launched: that surfaces as a non-retryable
            # controller error. The run's checkpoints are intact, so start it again under the same
            # name (it resumes), within the same failure budget.
            if not isinstance(getattr(err, "controller_failure", None), RayActorError):
                raise
            relaunches += 1
            if relaunches > cfg.run.max_failures:
                raise
            log.warning("a worker died while Ray Train launched the run; relaunching (%d)", relaunches)
