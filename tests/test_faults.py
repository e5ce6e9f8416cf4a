"""What raylora survives: many faults in one run, other worker counts, damaged checkpoints, mismatches.

Real Ray workers and DeepSpeed ZeRO-3 on CPU. Each test compares against an uninterrupted run.
"""

from __future__ import annotations

import json
import random
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from ray.train import TrainingFailedError

from raylora import checkpoint
from raylora.config import ConfigError
from raylora.driver import run
from raylora.failures import PermanentError
from raylora.progress import read_metrics
from tests.probes import assert_weights_close
from tests.run_logs import final_checkpoint as _final
from tests.support import tiny_run_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 10


def _checkpoints(run_dir: Path) -> list[Path]:
    return sorted(p for p in run_dir.glob("checkpoint_*") if p.is_dir())


@pytest.fixture(scope="module")
def straight(ray_cluster, tiny_models, digits, tmp_path_factory):
    """The uninterrupted reference run (2 workers, dropout on)."""
    storage = tmp_path_factory.mktemp("faults")
    result = run(
        tiny_run_config(tiny_models("llava"), digits[0], storage, "straight", f"train.max_steps={STEPS}")
    )
    assert result.error is None
    return storage, _final(result)


def _alive_workers() -> set[int]:
    """Pids of the live Ray Train workers on this driver's Ray (via its GCS), of every run on it."""
    import ray

    return {
        a["Pid"]
        for a in ray._private.state.actors().values()
        if a["ActorClassName"] == "RayTrainWorker" and a["State"] == "ALIVE" and a.get("Pid")
    }


def _kill_random_workers(
    run_dir: Path,
    times: int,
    stop: threading.Event,
    others: set[int],
    seed: int = 7,
    after_attempt: int = 0,
    num_workers: int = 2,
) -> list[int]:
    """Kill a random live Ray Train worker of the run at a random moment of each of `times` worker
    groups, the first of them the group that starts after attempt `after_attempt`.

    `others` are the pids of workers that are not the run's (alive before it started): the shared
    Ray also holds the session's probe group, whose two workers are Ray Train workers too, and a kill
    of one of them costs the run nothing. After each kill it waits for Ray to start a new worker
    group (the run folder's attempt count rises) before the next one, so that every kill hits a
    different group.
    """
    import os
    import signal

    from raylora.resume import ATTEMPTS_FILE

    def attempts() -> int:
        try:
            return json.loads((run_dir / ATTEMPTS_FILE).read_text())["attempts"]
        except (OSError, ValueError):
            return 0

    rng, killed, seen = random.Random(seed), [], after_attempt
    while len(killed) < times and not stop.is_set():
        while attempts() <= seen and not stop.is_set():
            time.sleep(0.2)
        seen = attempts()
        # A moment in the group's first 1.5 s after rank 0 counted its attempt (building the model,
        # DeepSpeed's start, the restore, the first steps): a later group may have only two steps left
        # to run, about 2 s on 2 cores, and a kill after the run ended would miss.
        time.sleep(rng.uniform(0.3, 1.5))
        workers = []
        # the new group's actors may take a moment to be listed, and the last group's a moment to go
        for _ in range(50):
            workers = sorted(_alive_workers() - others)
            if len(workers) == num_workers or stop.is_set():
                break
            time.sleep(0.2)
        if len(workers) != num_workers:
            continue
        pid = rng.choice(workers)
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
    return killed


def test_many_faults_in_one_run_end_bitwise_equal(straight, tiny_models, digits):
    storage, reference = straight
    # drills: rank 0 dies before step 3 (ending worker group 1) and while writing the step-6 checkpoint
    # (ending group 2); then a random worker of group 3 is killed at a random moment from outside:
    # three faults, three distinct groups, three restarts (each restart is a worker group's start)
    cfg = tiny_run_config(
        tiny_models("llava"),
        digits[0],
        storage,
        "many",
        f"train.max_steps={STEPS}",
        "run.max_failures=10",
        "fault.kill_rank=0",
        "fault.kill_at_steps=3",
        "fault.kill_checkpoint_steps=6",
    )
    stop, killed, errors, others = threading.Event(), [], [], _alive_workers()

    def killer_main():
        try:
            killed.extend(_kill_random_workers(storage / "many", 1, stop, others, after_attempt=2))
        except Exception as err:  # surfaced below: a silent killer would make the test vacuous
            errors.append(repr(err))

    killer = threading.Thread(target=killer_main, daemon=True)
    killer.start()
    try:
        result = run(cfg)
    finally:
        stop.set()
        killer.join()
    assert result.error is None
    assert not errors, errors
    assert len(killed) == 1, "the random killer should have struck during the run"
    final = _final(result)
    assert final.state.step == STEPS
    assert final.state.restarts == 3, final.state.restarts
    rows = read_metrics(str(storage), "many")
    # the kill before step 3 resumed from step 2's checkpoint; the kill while writing step 6's lost that
    # checkpoint (never reported), so the groups after it resumed from step 4's (group 3 may die before
    # it reports a row: then the first row after the second restart is group 4's, from step 4's too)
    assert next(r["step"] for r in rows if r["restarts"] >= 1) == 3
    assert next(r["step"] for r in rows if r["restarts"] >= 2) == 5
    for name, value in reference.weights.items():
        assert torch.equal(value, final.weights[name]), (
            f"{name} differs after {final.state.restarts} restarts"
        )
    for name, value in reference.moments.items():
        assert torch.equal(value, final.moments[name]), name


def test_other_worker_counts_2_1_3(straight, tiny_models, digits):
    storage, _ = straight
    base = [f"train.max_steps={STEPS}", "lora.dropout=0.0", "run.max_failures=0", "fault.kill_rank=0"]
    model, data = tiny_models("llava"), digits[0]
    # the reference is also the elastic case: a [1, 2] range on a Ray with room for 2 runs on 2 throughout
    reference = run(tiny_run_config(model, data, storage, "elastic-ref", *base, "scaling.num_workers=[1,2]"))
    assert reference.error is None
    assert [m["world_size"] for m in reference.return_value] == [2] * STEPS
    assert _final(reference).state.world_size == 2
    # 2 workers until step 4 (the drill then fails the run), 1 worker until step 8, 3 workers to the end:
    # 8 samples over 3 ranks are shares of 3, 3 and 2, so the last rank's second pass is a stand-in
    with pytest.raises(TrainingFailedError):
        run(tiny_run_config(model, data, storage, "elastic", *base, "fault.kill_at_steps=5"))
    with pytest.raises(TrainingFailedError):
        run(
            tiny_run_config(
                model, data, storage, "elastic", *base, "fault.kill_at_steps=9", "scaling.num_workers=1"
            )
        )
    third = run(tiny_run_config(model, data, storage, "elastic", *base, "scaling.num_workers=3"))
    assert third.error is None
    ref, got = _final(reference), _final(third)
    assert got.state.step == STEPS and got.state.world_size == 3 and got.state.restarts == 2
    rows = read_metrics(str(storage), "elastic")
    assert [r["step"] for r in rows if r["restarts"] == 1][0] == 5  # resumed on 1 worker at the step-4 ckpt
    assert [r["world_size"] for r in rows if r["restarts"] == 2] == [3] * (STEPS - 8)
    assert_weights_close(ref.weights, got.weights, 1e-5)


def test_damaged_latest_checkpoint_falls_back_to_intact_one(straight, tiny_models, digits, caplog):
    storage, _ = straight
    model, data = tiny_models("llava"), digits[0]
    run_dir = storage / "damaged"
    # the uninterrupted run's folder under another name (Ray's snapshot names its checkpoints relative
    # to it): checkpoints of steps 2, 4, 6, 8 and 10, without training them again
    shutil.copytree(storage / "straight", run_dir)
    folders = _checkpoints(run_dir)
    assert len(folders) == STEPS // 2
    (folders[-1] / checkpoint.OPTIMIZER).write_bytes((folders[-1] / checkpoint.OPTIMIZER).read_bytes()[:-100])
    (folders[-2] / checkpoint.STATE).write_text("{ not json")
    # longer schedule on the same run: it must resume from the step-6 checkpoint, the newest intact one
    result = run(tiny_run_config(model, data, storage, "damaged", f"train.max_steps={STEPS + 2}"))
    assert result.error is None
    rows = read_metrics(str(storage), "damaged")
    assert [r["step"] for r in rows if r["restarts"] == 1][0] == STEPS - 3
    # every checkpoint damaged: the run stops at once with an error that says so (every attempt would
    # find the same damage, so it is not retried)
    for folder in _checkpoints(run_dir):
        (folder / checkpoint.ADAPTER_WEIGHTS).unlink(missing_ok=True)
    with pytest.raises(PermanentError, match="no intact checkpoint"):
        run(
            tiny_run_config(
                model, data, storage, "damaged", f"train.max_steps={STEPS + 4}", "run.max_failures=0"
            )
        )


@pytest.mark.parametrize(
    "change, message",
    [
        ("lora.r=8", r"expected shape \[8, \d+\], checkpoint has \[4, \d+\]"),
        ("lora.target_modules=q_proj,v_proj", "checkpoint has trainable parameter .*(k|o|up|down|gate)_proj"),
        ("train.freeze_vision=true", "checkpoint has trainable parameter model.vision_tower"),
    ],
)
def test_mismatched_checkpoint_is_refused_naming_it(straight, tiny_models, digits, change, message):
    storage, _ = straight
    with pytest.raises(ConfigError, match=message):
        run(
            tiny_run_config(
                tiny_models("llava"), digits[0], storage, "straight", f"train.max_steps={STEPS + 2}", change
            )
        )


def test_other_base_model_or_architecture_is_refused(straight, tiny_models, digits, tmp_path):
    storage, _ = straight
    with pytest.raises(ConfigError, match="made for architecture llava; model.path is a qwen2_vl model"):
        run(tiny_run_config(tiny_models("qwen2_vl"), digits[0], storage, "straight"))
    from raylora.assets import make_tiny_model

    other = make_tiny_model(tmp_path / "other-llava", "llava", seed=1)  # same shapes, other weights
    with pytest.raises(ConfigError, match="made on another base model"):
        run(tiny_run_config(str(other), digits[0], storage, "straight"))


def test_checkpoints_hold_only_json_and_safetensors(straight):
    storage, _ = straight
    for folder in _checkpoints(storage / "straight"):
        names = {p.name for p in folder.iterdir()}
        assert all(n.endswith((".json", ".safetensors")) for n in names), names


def test_a_ray_of_raylora_own_starts_no_helper_actors_it_does_not_use(straight):
    """The shared Ray here is `init_ray`'s own one-node Ray: the runs this process started (its job; a
    driver that joins by address is another job) come without Ray Train's preemption watcher (no provider
    drains this machine), its DatasetManager (raylora hands Ray no datasets) and its placement-group
    cleaner (this Ray ends with its driver): actors each run or worker group would start."""
    import ray

    job = ray.get_runtime_context().get_job_id()
    classes = {a["ActorClassName"] for a in ray._private.state.actors().values() if a["JobID"] == job}
    assert "RayTrainWorker" in classes and "TrainController" in classes, classes  # dead ones are listed too
    assert not {"PreemptionWatcher", "DatasetManager", "PlacementGroupCleaner"} & classes, classes


def test_workers_of_raylora_own_ray_ask_for_no_preemption(ray_cluster, probes):
    """The workers leave out `ray.train.get_preemption_info` (a barrier at every report) where raylora
    started Ray itself: the driver tells them so (`make_trainer`, from `started_here`), and the mark that
    a Tune trial's driver goes by comes in the same runtime env as the preemption watcher's off switch,
    so the ask is never skipped where a watcher could announce a drain. (On a cluster that raylora joins,
    tests/test_preemption.py sees the ask answered.)"""
    from raylora.ray_runtime import started_here

    assert started_here()  # the driver's answer, which make_trainer hands the workers

    def seen() -> tuple:
        import os

        from ray.train.v2._internal.constants import ENABLE_PREEMPTION_WATCHER_ENV_VAR

        from raylora.ray_runtime import started_here

        return started_here(), os.environ.get(ENABLE_PREEMPTION_WATCHER_ENV_VAR)

    assert probes(seen) == (True, "0")
