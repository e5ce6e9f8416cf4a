"""The driver: check everything cheap first (`raylora.preflight`), then hand the run to Ray Train."""

from __future__ import annotations

import logging
import os

import ray
import ray.train
from ray.exceptions import RayActorError
from ray.train.torch import TorchTrainer

from raylora import storage
from raylora.config import Config
from raylora.failures import EndOnPermanentError, PermanentError
from raylora.preflight import check_shared_storage, preflight
from raylora.progress import MetricsLog, MlflowLog, TensorBoardLog, WandbLog
from raylora.ray_runtime import Trainer, controller_poll_s, init_ray, started_here
from raylora.redact import redact
from raylora.worker import train_loop_per_worker

log = logging.getLogger("raylora")


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


def make_trainer(cfg: Config, callbacks: list | None = None) -> TorchTrainer:
    """A TorchTrainer whose run resumes from its latest checkpoint when one with this name exists.

    `cfg` crosses to the workers as it is: `config.load` already made its local paths absolute. On a Ray
    that raylora started itself no cloud provider drains a node, so the workers do not ask about
    preemption (Ray Train's watcher is off there: `ray_runtime.LOCAL_RAY_ENV`)."""
    asks_preemption = not started_here()
    return Trainer(
        lambda: train_loop_per_worker(cfg, asks_preemption),
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
