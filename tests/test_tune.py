"""Ray Tune sweeps of raylora runs: a failed trial resumes its own run; a killed Tune driver resumes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raylora import checkpoint
from raylora.config import ConfigError
from raylora.progress import read_metrics

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _base(tiny_models, digits, storage, name, *extra):
    return [
        f"model.path={tiny_models('llava')}",
        f"data.train={digits[0]}",
        f"run.storage_path={storage}",
        f"run.name={name}",
        "data.eval=",
        "scaling.num_workers=1",
        "train.global_batch_size=4",
        "train.micro_batch_size=4",
        "train.checkpoint_every=2",
        "train.warmup_steps=1",
        *extra,
    ]


def _final(storage: Path, run_name: str) -> checkpoint.Loaded:
    folders = sorted(
        p for p in (storage / run_name).glob("checkpoint_*") if (p / checkpoint.MANIFEST).exists()
    )
    return checkpoint.load(folders[-1])


def test_failed_trial_is_retried_and_resumes_its_own_run(ray_cluster, tiny_models, digits, tmp_path):
    from raylora.tune import best, run_tune

    space = tmp_path / "space.yaml"
    space.write_text("train.lr: {grid: [1.0e-3, 2.0e-3]}\n")
    # run.max_failures=0: the killed worker fails the Train run, so the trial fails and Tune retries it.
    # Uploads are synchronous here so that step 2's checkpoint is recorded before the kill at step 3 (with
    # the asynchronous default a kill during the upload rightly resumes from nothing).
    overrides = _base(
        tiny_models,
        digits,
        tmp_path,
        "sweep",
        "train.max_steps=4",
        "run.max_failures=0",
        "fault.kill_at_steps=3",
        "fault.kill_rank=0",
        "run.checkpoint_upload=sync",
    )
    results = run_tune(None, overrides, str(space), num_samples=1, max_concurrent=2)
    assert len(results) == 2 and not any(r.error for r in results)
    for result in results:
        run_name = f"sweep-{result.metrics['trial_id']}"
        final = _final(tmp_path, run_name)
        assert final.state.step == 4 and final.state.restarts == 1, run_name
        rows = read_metrics(str(tmp_path), run_name)
        resumed = [r["step"] for r in rows if r["restarts"] == 1]
        assert resumed == [3, 4], "the retried trial must continue from its step-2 checkpoint"
        assert final.state.config["train"]["lr"] == result.config["train.lr"]
    summary = best(results)
    assert summary["checkpoint"] and summary["errors"] == 0 and "sweep-" in summary["checkpoint"]


def test_bad_space_is_a_config_error(tiny_models, digits, tmp_path):
    from raylora.tune import run_tune

    space = tmp_path / "space.yaml"
    space.write_text("train.learning_rate: {choice: [1, 2]}\n")
    with pytest.raises(ConfigError, match="train.learning_rate is not a config key"):
        run_tune(None, _base(tiny_models, digits, tmp_path, "bad"), str(space))


def test_killed_tune_driver_resumes_unfinished_trials(ray_cluster, tiny_models, digits, tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text("train.lr: {grid: [1.0e-3, 2.0e-3]}\n")
    overrides = _base(tiny_models, digits, tmp_path, "drv", "train.max_steps=12")
    env = dict(os.environ, RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address)
    cmd = [
        sys.executable,
        "-m",
        "raylora.cli",
        "tune",
        "--space",
        str(space),
        "--num-samples",
        "1",
        "--max-concurrent",
        "2",  # both trials at once (1 worker each): the kill catches both mid-run, in half the time
        "jobs/tiny.yaml",
        *overrides,
    ]
    root = Path(__file__).resolve().parent.parent
    log = open(tmp_path / "driver.log", "w")
    driver = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while time.time() < deadline and not list(tmp_path.glob("drv-*/checkpoint_*/manifest.json")):
        assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
        time.sleep(0.5)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    interrupted = {p.parent.parent.name for p in tmp_path.glob("drv-*/checkpoint_*/manifest.json")}
    assert interrupted, "no trial had a checkpoint before the driver was killed"
    resumed = subprocess.run(
        cmd + ["--resume"], cwd=root, env=env, capture_output=True, text=True, timeout=900
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "best trial: loss=" in resumed.stdout
    runs = sorted(p.name for p in tmp_path.glob("drv-*_*") if p.is_dir())  # not drv-tune, Tune's own
    assert len(runs) == 2
    for run_name in runs:
        final = _final(tmp_path, run_name)
        assert final.state.step == 12
    for run_name in interrupted:  # these continued from their checkpoints instead of starting over
        assert _final(tmp_path, run_name).state.restarts >= 1
