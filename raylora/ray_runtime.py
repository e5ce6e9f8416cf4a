"""The Ray a run trains on: starting a local one or joining a cluster (`init_ray`), and the settings raylora
gives Ray Train's controller (`Trainer`: its poll, the helper actors left out).
"""

from __future__ import annotations

import os

import ray
import ray.train
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

# Ray Train's controller takes one report per poll and a worker's report waits for the previous one to be
# taken: the controller polls at half the report interval, and Ray registers a checkpoint only when a poll
# takes it, so slower polls make a fault go back further (dev/LOG.md, "Ray runtime settings").
POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"


def controller_poll_s(report_every_s: float) -> float:
    """Seconds between the controller's polls of a run that reports every `report_every_s`."""
    return min(max(report_every_s / 2, 0.1), 0.25)


class Trainer(TorchTrainer):
    """Ray Train's TorchTrainer, its controller polling every `poll_s` seconds (`fit`), less two helper
    actors that serve nothing in a raylora run: the DatasetManager (raylora hands Ray no datasets) and, on
    a Ray that raylora started itself (it ends with its driver, placement groups and all), the
    placement-group cleaner. Each is a process whose start every worker-group start waits for; Ray has no
    setting for them, so they leave Ray's list of default callbacks (`_create_default_callbacks`, Ray
    pinned to 2.60; tests/test_config.py and tests/test_faults.py fail if an upgrade moves them)."""

    def __init__(self, *args, poll_s: float = 0.1, **kwargs):
        super().__init__(*args, **kwargs)
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


# A Ray that raylora starts itself is one node that ends with its driver: no provider drains it and nobody
# reads its metrics or dashboard, so the preemption watcher, the metrics export and the dashboard, which
# take CPU from the workers, stay off. The mark tells a Tune trial's driver (a Ray worker) it runs on one.
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
