"""Losing a whole node: several Ray nodes on one machine, one worker per node, shared storage."""

from __future__ import annotations

import threading
import time

import pytest

from raylora import checkpoint
from raylora.assets import tiny_run_config
from raylora.progress import read_metrics

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    from raylora.driver import RAY_ENV

    ray.shutdown()  # the other tests' single-node Ray
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [c.add_node(num_cpus=1) for _ in range(3)]
    c.wait_for_nodes()
    ray.init(address=c.address, runtime_env={"env_vars": RAY_ENV})
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


def test_run_finishes_after_losing_a_node(cluster, tiny_models, digits, tmp_path):
    from raylora.driver import run

    c, nodes = cluster
    cfg = tiny_run_config(
        tiny_models("llava"),
        digits[0],
        tmp_path,
        "nodes",
        "train.max_steps=60",
        "train.checkpoint_every=3",
        "scaling.num_workers=2",
    )
    lost = {}

    def kill_a_node():
        deadline = time.time() + 300
        while time.time() < deadline:
            rows = read_metrics(str(tmp_path), "nodes")
            if rows and rows[-1]["step"] >= 4:
                busy = _worker_nodes()
                victim = next(n for n in nodes if n.node_id in busy)
                lost["last_step"] = rows[-1]["step"]
                c.remove_node(victim, allow_graceful=False)
                lost["node"] = victim.node_id
                return
            time.sleep(0.2)

    killer = threading.Thread(target=kill_a_node, daemon=True)
    killer.start()
    result = run(cfg)
    killer.join()
    assert lost, "no node was removed"
    with result.checkpoint.as_directory() as folder:
        final = checkpoint.load(folder)
    assert final.state.step == 60 and final.state.restarts >= 1
    rows = read_metrics(str(tmp_path), "nodes")
    resumed_at = next(r["step"] for r in rows if r["restarts"] >= 1) - 1
    assert resumed_at % 3 == 0 and resumed_at >= lost["last_step"] - 3, (
        "lost more than the steps since a checkpoint"
    )
