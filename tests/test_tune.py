"""Ray Tune sweeps of raylora runs: a failed trial resumes its own run; a killed Tune driver resumes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raylora import checkpoint
from raylora.config import ConfigError
from raylora.progress import read_metrics
from tests import whole_checkpoint

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


def _final(storage: Path, run_name: str) -> whole_checkpoint.Loaded:
    folders = sorted(
        p for p in (storage / run_name).glob("checkpoint_*") if (p / checkpoint.MANIFEST).exists()
    )
    return whole_checkpoint.load(folders[-1])


def test_bad_space_is_a_config_error(tiny_models, digits, tmp_path):
    from raylora.tune import run_tune

    space = tmp_path / "space.yaml"
    space.write_text("train.learning_rate: {choice: [1, 2]}\n")
    with pytest.raises(ConfigError, match="train.learning_rate is not a config key"):
        run_tune(None, _base(tiny_models, digits, tmp_path, "bad"), str(space))


def test_failed_trial_is_retried_then_killed_driver_resumes_both_trials(
    ray_cluster, tiny_models, digits, tmp_path
):
    """One sweep, two faults in turn: each trial's worker dies before step 3 (run.max_failures=0 fails the
    Train run, so the trial fails and Tune retries it from its own step-2 checkpoint); once both retried
    trials have checkpointed again, the Tune driver itself is killed, and `raylora tune --resume` finishes
    both from their newest checkpoints (or, where one had already finished, leaves that one as it was)."""
    space = tmp_path / "space.yaml"
    lrs = [1.0e-3, 2.0e-3]
    space.write_text(f"train.lr: {{grid: {lrs}}}\n")
    # Uploads are synchronous so that step 2's checkpoint is recorded before the kill at step 3 (with the
    # asynchronous default a kill during the upload rightly resumes from nothing).
    overrides = _base(
        tiny_models,
        digits,
        tmp_path,
        "drv",
        "train.max_steps=12",
        "run.max_failures=0",
        "fault.kill_at_steps=3",
        "fault.kill_rank=0",
        "run.checkpoint_upload=sync",
    )
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

    def recorded_by_run() -> dict[str, int]:
        """Each trial's run and the newest step whose checkpoint Ray has recorded (a resume's start)."""
        from raylora.storage import recorded_steps, run_folder

        found = {}
        for folder in tmp_path.glob("drv-*_*"):  # not drv-tune, Tune's own
            if folder.is_dir():
                found[folder.name] = max(recorded_steps(*run_folder(str(tmp_path), folder.name)), default=0)
        return found

    def train_actors() -> dict[str, tuple[str, int]]:
        """{actor id: (class, pid)} of the Ray Train workers and controllers alive on the test's Ray (not
        Ray Data's detached helpers, which rightly outlive a driver)."""
        import ray

        return {
            actor_id: (a["ActorClassName"], a.get("Pid") or 0)
            for actor_id, a in ray._private.state.actors().items()
            if a["State"] == "ALIVE" and a["ActorClassName"] in ("RayTrainWorker", "TrainController")
        }

    def sweep_actors() -> dict[str, tuple[str, int]]:
        return {k: v for k, v in train_actors().items() if k not in before}

    before = set(train_actors())
    root = Path(__file__).resolve().parent.parent
    log = open(tmp_path / "driver.log", "w")
    driver = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    # step 4's checkpoint recorded: only after the trial failed before step 3 and Tune retried it
    while time.time() < deadline:
        recorded = recorded_by_run()
        if len(recorded) == 2 and min(recorded.values()) >= 4:
            break
        assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
        time.sleep(0.5)
    # The driver dies with its machine: its Train workers with it. Ray tears down the actors a dead driver
    # owned only seconds later, and a worker left running meanwhile goes on recording checkpoints (CI saw a
    # trial record steps 5 and 6 after the kill), so the resume's starting point is read once every actor
    # of the sweep is gone.
    driver.send_signal(signal.SIGKILL)
    for name, pid in sweep_actors().values():
        if name == "RayTrainWorker" and pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    driver.wait()
    gone_by = time.time() + 120
    while sweep_actors():
        assert time.time() < gone_by, sweep_actors()
        time.sleep(0.5)
    interrupted = recorded_by_run()
    assert len(interrupted) == 2 and min(interrupted.values()) >= 4, interrupted
    # The trials run side by side, but their retries start when Tune gets to them: where one retry started
    # seconds after the other, the first trial can finish all 12 steps before the second records step 4.
    # The second is then always mid-run (the kill comes within a poll of its step 4), and the finished
    # trial must come out of the resume as it was: not trained again.
    finished = {name for name, step in interrupted.items() if step == 12}
    assert len(finished) < 2, interrupted
    resumed = subprocess.run(
        cmd + ["--resume"], cwd=root, env=env, capture_output=True, text=True, timeout=900
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "best trial: loss=" in resumed.stdout and '"errors": 0' in resumed.stdout
    assert re.search(r"best trial: loss=\S+ checkpoint=\S*drv-", resumed.stdout), resumed.stdout[-2000:]
    runs = sorted(p.name for p in tmp_path.glob("drv-*_*") if p.is_dir())  # not drv-tune, Tune's own
    assert runs == sorted(interrupted)
    trained_lrs = []
    for run_name in runs:
        final = _final(tmp_path, run_name)
        rows = read_metrics(str(tmp_path), run_name)
        trace = [(r["step"], r["restarts"]) for r in rows]
        steps = {k: [r["step"] for r in rows if r["restarts"] == k] for k in (0, 1)}
        # the retry went on from step 2's checkpoint
        assert steps[0][-1] == 2 and steps[1][0] == 3, trace
        after = [r["step"] for r in rows if r["restarts"] >= 2]
        if run_name in finished:
            assert final.state.step == 12 and final.state.restarts == 1 and not after, (run_name, trace)
        else:
            # one restart for Tune's retry, at least one more for the killed driver, whose resume went on
            # from the newest recorded checkpoint
            assert final.state.step == 12 and final.state.restarts >= 2, (run_name, final.state.restarts)
            assert after[0] == interrupted[run_name] + 1, trace
        trained_lrs.append(final.state.config["train"]["lr"])
    assert sorted(trained_lrs) == lrs, "each trial trained at its own point of the space"
