"""`ray job submit` against a head started with `ray start` on loopback: run, stop, resubmit, resume."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from raylora import checkpoint
from raylora.progress import read_metrics
from tests import whole_checkpoint
from tests.ray_env import RAY_TEST_ENV, free_port

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _env() -> dict:
    # PATH already starts with BIN (tests.ray_env.use_ray_test_env): the entrypoint's `python` is this one
    return {**RAY_TEST_ENV, **{k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}}


@pytest.fixture(scope="module")
def head():
    """A Ray head of its own (temp dir, ports) on 127.0.0.1; its processes are killed afterwards.

    `ray stop` would stop every Ray on the machine, so the head is stopped by killing the processes
    that name its temp dir.
    """
    temp = tempfile.mkdtemp(prefix="rl-", dir="/tmp")  # short: Ray's socket paths have a length limit
    dash = free_port()
    cmd = [
        str(BIN / "ray"),
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        f"--port={free_port()}",
        f"--dashboard-port={dash}",
        "--dashboard-host=127.0.0.1",
        f"--temp-dir={temp}",
        "--num-cpus=4",
        "--disable-usage-stats",
        f"--ray-client-server-port={free_port()}",
        f"--dashboard-agent-listen-port={free_port()}",
    ]
    subprocess.run(cmd, check=True, env=_env(), capture_output=True)
    yield f"http://127.0.0.1:{dash}"
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(temp in part for part in proc.info["cmdline"] or []):
                proc.send_signal(signal.SIGKILL)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    shutil.rmtree(temp, ignore_errors=True)


def _job(address: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(BIN / "ray"), "job", args[0], "--address", address, *args[1:]],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"ray job {args[0]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def _submit(address: str, job_id: str, settings: list[str], wait: bool = True) -> subprocess.CompletedProcess:
    return _job(
        address,
        "submit",
        "--submission-id",
        job_id,
        "--working-dir",
        ".",
        "--runtime-env",
        "jobs/runtime_env.yaml",
        *([] if wait else ["--no-wait"]),
        "--",
        "python",
        "jobs/train.py",
        "jobs/tiny.yaml",
        *settings,
    )


def _status(address: str, job_id: str) -> str:
    from ray.job_submission import JobSubmissionClient

    return str(JobSubmissionClient(address).get_job_status(job_id).value)


@pytest.fixture(scope="module")
def settings(tiny_models, digits, tmp_path_factory):
    storage = tmp_path_factory.mktemp("job-storage")
    return storage, [
        f"model.path={tiny_models('llava')}",
        f"data.train={digits[0]}",
        f"data.eval={digits[1]}",
        f"run.storage_path={storage}",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "train.checkpoint_every=3",
        "train.param_persistence_threshold=0",
    ]


def _checkpoints(run_dir: Path) -> list[Path]:
    return sorted(p for p in run_dir.glob("checkpoint_*") if (p / checkpoint.MANIFEST).exists())


def _newest_intact_step(run_dir: Path) -> int:
    for folder in reversed(_checkpoints(run_dir)):
        try:
            return whole_checkpoint.load(folder).state.step
        except checkpoint.CheckpointError:  # a copy the stop cut short
            continue
    raise AssertionError(f"no intact checkpoint in {run_dir}")


def test_stopped_job_resumes_when_submitted_again(head, settings):
    """A job stopped mid-run, submitted again under the same run name, resumes and succeeds (the second
    submission is also the plain case: a job that runs to its last step and checkpoint)."""
    storage, base = settings
    run = base + ["run.name=stopped", "train.max_steps=300"]
    _submit(head, "raylora-stop-1", run, wait=False)
    deadline = time.time() + 300
    while not _checkpoints(storage / "stopped") and time.time() < deadline:
        assert _status(head, "raylora-stop-1") in ("PENDING", "RUNNING")
        time.sleep(1)
    assert _checkpoints(storage / "stopped"), "no checkpoint before the deadline"
    _job(head, "stop", "raylora-stop-1")
    deadline = time.time() + 60
    while _status(head, "raylora-stop-1") != "STOPPED" and time.time() < deadline:
        time.sleep(1)
    assert _status(head, "raylora-stop-1") == "STOPPED"
    saved = _newest_intact_step(storage / "stopped")
    assert 0 < saved < 300
    # the same run name again, with a shorter schedule so the test ends soon: it must resume, not restart
    _submit(head, "raylora-stop-2", base + ["run.name=stopped", f"train.max_steps={saved + 3}"])
    assert _status(head, "raylora-stop-2") == "SUCCEEDED"
    final = whole_checkpoint.load(_checkpoints(storage / "stopped")[-1]).state
    assert final.step == saved + 3 and final.restarts >= 1
    rows = read_metrics(str(storage), "stopped")
    second = [r for r in rows if r["restarts"] >= 1]
    assert second, "the resubmitted job did not run"
    resumed_at = second[0]["step"] - 1
    # it resumed from a checkpoint Ray had registered: the newest folder on disk may be one that the
    # stop interrupted before Ray recorded it, so at most one checkpoint interval (3 steps) is redone
    assert resumed_at > 0 and resumed_at % 3 == 0 and resumed_at >= saved - 3, (resumed_at, saved)
    logs = _job(head, "logs", "raylora-stop-2").stdout
    assert f"resumed from checkpoint at step {second[0]['step'] - 1}" in logs
