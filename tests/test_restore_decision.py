"""One restore decision for all ranks, leftovers of crashed attempts cleared, permanent errors not retried.

Real Ray workers and DeepSpeed ZeRO-3 on CPU: a rank whose read of the newest checkpoint fails for a
moment retries it instead of falling back to an older step than the other ranks restore, and the run
ends bitwise equal to an uninterrupted one; a worker start that every attempt would repeat ends the
run after one attempt.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.fs
import pytest
import torch

from raylora import checkpoint, driver, resume
from raylora.driver import run
from raylora.failures import PermanentError
from raylora.progress import ATTEMPTS_FILE, read_metrics
from raylora.storage import recorded_checkpoints
from tests.support import final_checkpoint as _final
from tests.support import tiny_run_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


# The vision tower and aligner on a schedule of their own, as in tests/test_resume.py: the two modules then
# compare against one uninterrupted run (conftest's `straight_runs`), trained once per session.
VISION_LR = "train.vision_lr=5e-4"


@pytest.fixture(scope="module")
def straight(ray_cluster, straight_runs, tmp_path_factory):
    """The uninterrupted reference run: 6 steps on 2 workers, checkpoints at 2, 4, 6; and a folder for
    this module's runs."""
    result = straight_runs("llava", VISION_LR)
    assert _final(result).state.restarts == 0
    return tmp_path_factory.mktemp("decision"), _final(result)


def test_transient_read_error_on_one_rank_still_restores_the_newest(straight, tiny_models, digits):
    storage, reference = straight
    cfg = tiny_run_config(
        tiny_models("llava"),
        digits[0],
        storage,
        "read-error",
        VISION_LR,
        "fault.kill_at_steps=5",  # rank 1 dies after the step-4 checkpoint
        "fault.read_errors=2",  # then rank 1's first two reads of a checkpoint fail
        "fault.read_error_rank=1",
    )
    run_dir = storage / "read-error"
    # What crashed attempts leave: a checkpoint folder whose upload never completed, and a local
    # folder rank 0 was writing a checkpoint into.
    partial = run_dir / "checkpoint_0000-partial"
    partial.mkdir(parents=True)
    (partial / checkpoint.ADAPTER_WEIGHTS).write_bytes(b"cut short")
    staged = Path(resume.new_staging_folder(cfg, 4))
    (staged / checkpoint.STATE).write_text("{")

    result = run(cfg)
    assert result.error is None
    assert (run_dir / ".raylora-drill-read-errors").read_text() == "2", "the read drill did not fire twice"
    rows = read_metrics(str(storage), "read-error")
    # rank 1's failed reads were retried, not taken for damage: every rank resumed from step 4
    assert [r["step"] for r in rows if r["restarts"] == 1][0] == 5
    final = _final(result)
    assert final.state.step == 6 and final.state.restarts == 1
    for name, value in reference.weights.items():
        assert torch.equal(value, final.weights[name]), name
    for name, value in reference.moments.items():
        assert torch.equal(value, final.moments[name]), name
    assert not partial.exists() and not staged.exists()
    # the checkpoints Ray recorded, as raylora reads Ray's snapshot, are the ones in the run folder
    kept = {p.name for p in run_dir.glob("checkpoint_*") if p.is_dir()}
    assert recorded_checkpoints(pyarrow.fs.LocalFileSystem(), str(run_dir)) == kept and len(kept) == 3


def test_start_error_every_attempt_would_repeat_ends_the_run_once(
    ray_cluster, tiny_models, digits, tmp_path, monkeypatch
):
    model = shutil.copytree(tiny_models("llava"), tmp_path / "model")
    cfg = tiny_run_config(model, digits[0], tmp_path, "gone", "run.max_failures=3")
    checked = driver.preflight

    def preflight_then_lose_the_model(cfg):
        # The model folder passes the driver's checks, then is missing where the workers run (a node
        # without the shared disk would see the same).
        arch = checked(cfg)
        shutil.rmtree(model)
        return arch

    monkeypatch.setattr(driver, "preflight", preflight_then_lose_the_model)
    with pytest.raises(PermanentError, match=f"ConfigError: model.path: model folder not found: {model}"):
        run(cfg)
    assert json.loads((tmp_path / "gone" / ATTEMPTS_FILE).read_text())["attempts"] == 1
