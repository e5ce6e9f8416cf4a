"""A spot node's preemption announced by a drain: a checkpoint at every step until it goes, its own budget."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from raylora.progress import read_metrics
from tests import whole_checkpoint
from tests.ray_env import start_ray
from tests.support import tiny_run_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

EVERY = 8  # train.checkpoint_every: the steps a resume would redo at most without the announcement
MAX_STEPS = 64  # steps after the drain outlast its deadline even on a quiet machine


@pytest.fixture(scope="module")
def cluster():
    """A head and two one-CPU nodes: a worker on a node that is drained, room for both workers after."""
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()  # the other tests' single-node Ray
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(2):
        c.add_node(num_cpus=1)
    c.wait_for_nodes()
    # Ray Train's watcher looks for drains every 5 s by default; the test's deadline is shorter.
    start_ray(address=c.address, env_vars={"RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.5"})
    yield c
    ray.shutdown()
    c.shutdown()


def _drain_a_worker_node(c, cfg, deadline_s: int) -> list[dict]:
    """Once the step-EVERY checkpoint is in, drain a non-head node holding a worker as a spot reclaim
    would: `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION`. Returns [the last row seen then]."""
    import ray

    drained = []
    give_up = time.time() + 300
    while time.time() < give_up and not drained:
        rows = read_metrics(cfg.run.storage_path, cfg.run.name)
        if rows and rows[-1]["step"] >= EVERY:
            busy = {
                a["Address"]["NodeID"]
                for a in ray._private.state.actors().values()
                if a["ActorClassName"] == "RayTrainWorker" and a["State"] == "ALIVE"
            }
            node = next(n for n in busy if n != c.head_node.node_id)
            subprocess.run(
                [
                    str(Path(sys.executable).parent / "ray"),
                    "drain-node",
                    f"--address={c.address}",
                    f"--node-id={node}",
                    "--reason=DRAIN_NODE_REASON_PREEMPTION",
                    "--reason-message=spot",
                    f"--deadline-remaining-seconds={deadline_s}",
                ],
                check=True,
            )
            drained.append(rows[-1])
        time.sleep(0.2)
    return drained


def test_preempted_node_costs_at_most_one_step(cluster, tiny_models, digits, tmp_path):
    """No fault budget (run.max_failures=0): the restart is charged to run.max_preemptions. From the
    announcement every step is checkpointed, so the resume redoes at most one step of the EVERY since the
    periodic checkpoint, and the final state equals an uninterrupted run's."""
    from raylora.driver import run

    def config(name):
        return tiny_run_config(
            tiny_models("llava"),
            digits[0],
            tmp_path,
            name,
            f"train.max_steps={MAX_STEPS}",
            f"train.checkpoint_every={EVERY}",
            "run.max_failures=0",
            "run.max_preemptions=1",
            "run.report_every_s=0",
        )

    cfg = config("preempted")
    drained = []
    drainer = threading.Thread(target=lambda: drained.extend(_drain_a_worker_node(cluster, cfg, 3)))
    drainer.start()
    result = run(cfg)
    drainer.join()
    assert drained, "the run never reached the step-8 checkpoint, or no node was drained"
    assert result.error is None
    rows = read_metrics(str(tmp_path), "preempted")
    resumed = [r for r in rows if r["restarts"] == 1]
    assert resumed and rows[-1]["step"] == MAX_STEPS, "the run should finish in a second worker group"
    before = [r for r in rows if r["restarts"] == 0]
    assert before[-1]["step"] >= EVERY + 2, "the group went too soon after the periodic checkpoint to tell"
    assert resumed[0]["steps_redone"] <= 1, resumed[0]
    assert resumed[0]["steps_redone"] == before[-1]["step"] - (resumed[0]["step"] - 1)
    with result.checkpoint.as_directory() as folder:
        final = whole_checkpoint.load(folder)
    assert final.state.step == MAX_STEPS and final.state.restarts == 1

    straight = run(config("straight"))  # on the head and the node left
    with straight.checkpoint.as_directory() as folder:
        expected = whole_checkpoint.load(folder)
    assert expected.state.restarts == 0
    for name, tensor in [*expected.weights.items(), *expected.moments.items()]:
        assert torch.equal({**final.weights, **final.moments}[name], tensor), name
