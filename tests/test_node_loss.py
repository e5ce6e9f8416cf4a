"""Losing a whole node: several Ray nodes on one machine, one worker per node, shared storage.

A fixed-size group of 2 on 3 one-CPU nodes loses a node and comes back on the 2 left. An elastic group
that shrinks when its node goes (and ends within 1e-5 of an uninterrupted run) is tests/test_multinode.py's.
"""

from __future__ import annotations

import threading
import time

import pytest

from raylora.progress import read_metrics
from tests import whole_checkpoint
from tests.ray_env import start_ray
from tests.support import tiny_run_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()  # the other tests' single-node Ray
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [c.add_node(num_cpus=1) for _ in range(3)]
    c.wait_for_nodes()
    start_ray(address=c.address)
    yield c, nodes
    ray.shutdown()
    c.shutdown()


def _worker_nodes() -> set[str]:
    import ray

    return {
        a["Address"]["NodeID"]
        for a in ray._private.state.actors().values()
        if a["ActorClassName"] == "RayTrainWorker" and a["State"] == "ALIVE"
    }


def _run_losing_a_node(cfg, cluster, when) -> tuple:
    """Run `cfg`, removing (ungracefully) a node that holds a worker once `when(last metrics row)` holds.

    Returns the run's result and the metrics row seen when the node went (None if it never did).
    """
    from raylora.driver import run

    c, nodes = cluster
    lost = []

    def kill_a_node():
        deadline = time.time() + 300
        while time.time() < deadline:
            rows = read_metrics(cfg.run.storage_path, cfg.run.name)
            if rows and when(rows[-1]):
                busy = _worker_nodes()
                victim = next(n for n in nodes if n.node_id in busy)
                lost.append(rows[-1])
                c.remove_node(victim, allow_graceful=False)
                nodes.remove(victim)
                return
            time.sleep(0.2)

    killer = threading.Thread(target=kill_a_node, daemon=True)
    killer.start()
    result = run(cfg)
    killer.join()
    return result, (lost[0] if lost else None)


def test_run_finishes_after_losing_a_node(cluster, tiny_models, digits, tmp_path):
    cfg = tiny_run_config(
        tiny_models("llava"),
        digits[0],
        tmp_path,
        "nodes",
        "train.max_steps=24",
        "train.checkpoint_every=3",
        "scaling.num_workers=2",
    )
    result, lost = _run_losing_a_node(cfg, cluster, lambda row: row["step"] >= 4)
    assert lost, "no node was removed"
    with result.checkpoint.as_directory() as folder:
        final = whole_checkpoint.load(folder)
    assert final.state.step == 24 and final.state.restarts >= 1
    rows = read_metrics(str(tmp_path), "nodes")
    resumed_at = next(r["step"] for r in rows if r["restarts"] >= 1) - 1
    assert resumed_at % 3 == 0 and resumed_at >= lost["step"] - 3, "lost more than since the last checkpoint"
