"""Nodes that do not share a disk: a second Ray node in its own mount namespace, a tmpfs over one folder.

Its tasks see that folder empty while the driver sees its files, as a second machine would see its own
local disk. A run whose storage is that folder is refused before training; a run on storage both nodes
see trains on both, loses the second node, and resumes to the end.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from raylora.config import ConfigError
from raylora.progress import read_metrics
from tests import whole_checkpoint
from tests.probes import assert_weights_close
from tests.ray_env import start_ray
from tests.support import tiny_run_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 30  # long enough that the node is lost with most steps still to go


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _start_island(address: str, island: Path, temp_dir: Path) -> subprocess.Popen:
    """A one-CPU Ray node (custom resource `island`) whose processes see a tmpfs over `island`."""
    ray_cli = Path(sys.executable).parent / "ray"
    command = (
        f"mount -t tmpfs tmpfs {island} && exec {ray_cli} start --address={address} --num-cpus=1 "
        f"""--resources='{{"island": 1}}' --temp-dir={temp_dir} --block --disable-usage-stats """
        f"--dashboard-agent-listen-port={_free_port()} --object-store-memory={150 * 1024 * 1024}"
    )
    # a session of its own: the node's processes (raylet, agents, workers) form one process group
    return subprocess.Popen(
        ["unshare", "-m", "--propagation", "private", "bash", "-c", command], start_new_session=True
    )


def _kill_island(proc: subprocess.Popen, temp_dir: Path) -> None:
    """Kill the namespaced node's processes: its process group, and any process naming its temp dir."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if str(temp_dir).encode() in cmdline:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait(timeout=30)


def _alive_nodes() -> list[dict]:
    import ray

    return [n for n in ray.nodes() if n["Alive"]]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A one-CPU head and a one-CPU namespaced node with a tmpfs over `island`; yields (island, node_id,
    kill), where kill() removes the namespaced node ungracefully."""
    import ray
    from ray.cluster_utils import Cluster

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs in a mount namespace needs root")
    ray.shutdown()  # the other tests' single-node Ray
    root = tmp_path_factory.mktemp("multinode")
    island = root / "island"
    island.mkdir()
    # short: Ray's socket paths under it must stay within AF_UNIX's 107 bytes
    temp_dir = Path(tempfile.mkdtemp(prefix="rl-island-"))
    # A killed node is declared dead after about health_check_period_ms x failure_threshold: 5 s, not
    # Ray's 15 (not less: a loaded machine must not take the head for dead)
    fast = {
        "health_check_period_ms": 1000,
        "health_check_timeout_ms": 5000,
        "health_check_failure_threshold": 5,
    }
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "_system_config": fast})
    proc = _start_island(c.address, island, temp_dir)
    start_ray(address=c.address)
    deadline = time.time() + 120
    while len(_alive_nodes()) < 2:
        assert proc.poll() is None, "the namespaced Ray node did not start"
        assert time.time() < deadline, "the namespaced Ray node did not join the cluster"
        time.sleep(0.5)
    node_id = next(n["NodeID"] for n in _alive_nodes() if "island" in n["Resources"])
    try:
        yield island, node_id, lambda: _kill_island(proc, temp_dir)
    finally:
        _kill_island(proc, temp_dir)
        ray.shutdown()
        c.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_storage_a_node_does_not_see_is_refused(cluster, tiny_models, digits):
    from raylora.driver import run

    island, node_id, _ = cluster
    head_id = next(n["NodeID"] for n in _alive_nodes() if n["NodeID"] != node_id)
    cfg = tiny_run_config(tiny_models("llava"), digits[0], island, "island")
    with pytest.raises(ConfigError, match=r"run.storage_path: .* not the same storage on every node") as err:
        run(cfg)
    message = str(err.value)
    assert node_id in message and head_id not in message, message
    assert "NFS" in message and "s3://" in message
    assert list(island.iterdir()) == [], "the marker should be removed, and nothing trained"


def _worker_nodes() -> set[str]:
    import ray

    return {
        a["Address"]["NodeID"]
        for a in ray._private.state.actors().values()
        if a["ActorClassName"] == "RayTrainWorker" and a["State"] == "ALIVE"
    }


def test_shared_storage_trains_on_both_nodes_and_survives_losing_one(
    cluster, tiny_models, digits, tmp_path, monkeypatch
):
    """2 workers, one per node (each node has one CPU), lose the namespaced node mid-run: the elastic
    [1, 2] group comes back on the head alone and finishes within 1e-5 of the uninterrupted run (dropout
    off: its noise is drawn per rank). Runs after the refusal test: it removes the namespaced node."""
    from raylora.driver import run

    _, node_id, kill = cluster
    overrides = (
        f"train.max_steps={STEPS}",
        "run.report_every_s=0",  # a row per step: the node is killed at step 2, not at the next report
        "lora.dropout=0.0",
        "scaling.num_workers=[1,2]",
        "run.max_failures=3",
    )
    model, data = tiny_models("llava"), digits[0]
    reference = run(tiny_run_config(model, data, tmp_path, "straight", *overrides))
    assert reference.error is None
    assert [m["world_size"] for m in reference.return_value] == [2] * STEPS

    lost, errors = [], []

    def kill_the_island():
        try:
            deadline = time.time() + 300
            while time.time() < deadline:
                rows = read_metrics(str(tmp_path), "lost")
                if rows and rows[-1]["step"] >= 2 and rows[-1]["world_size"] == 2:
                    assert node_id in _worker_nodes(), "no worker ran on the namespaced node"
                    lost.append(rows[-1])
                    kill()
                    return
                time.sleep(0.1)
        except Exception as err:  # surfaced below: a silent killer would make the test vacuous
            errors.append(repr(err))

    # Ray Train restarts the group at once, while the node is not yet declared dead: it then waits this
    # long (60 s by default) for resources for 2 workers before sizing the group by what is left
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "5")
    killer = threading.Thread(target=kill_the_island, daemon=True)
    killer.start()
    result = run(tiny_run_config(model, data, tmp_path, "lost", *overrides))
    killer.join()
    assert not errors, errors
    assert lost and lost[0]["step"] < STEPS, "the namespaced node was not removed mid-run"
    assert result.error is None
    rows = read_metrics(str(tmp_path), "lost")
    after = [r for r in rows if r["restarts"] > lost[0]["restarts"]]
    assert after and all(r["world_size"] == 1 for r in after), "the group should go on on the head alone"
    resumed_at = after[0]["step"] - 1
    assert resumed_at % 2 == 0 and resumed_at >= lost[0]["step"] - 2, "lost more than the last checkpoint"
    straight_loss = {r["step"]: r["loss"] for r in reference.return_value}
    for row in rows:  # before the loss on 2 workers, after it on 1: the losses of the uninterrupted run
        assert abs(row["loss"] - straight_loss[row["step"]]) <= 1e-5 * straight_loss[row["step"]], row
    with reference.checkpoint.as_directory() as folder:
        ref = whole_checkpoint.load(folder)
    with result.checkpoint.as_directory() as folder:
        got = whole_checkpoint.load(folder)
    assert got.state.step == STEPS and got.state.world_size == 1
    assert_weights_close(ref.weights, got.weights, 1e-5)
