"""`raylora demo` end to end at a small size: assets, 2 workers, a killed worker, resume, evaluation."""

from __future__ import annotations

import json

import pytest

from raylora.demo import demo

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_demo_survives_a_killed_worker_and_writes_its_summary(ray_cluster, tmp_path):
    summary = demo(
        tmp_path,
        failure=True,
        overrides=["train.max_steps=12", "train.checkpoint_every=5", "fault.kill_at_steps=7"],
    )
    assert summary == json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["restarts"] == 1
    assert 0.0 <= summary["eval_accuracy"] <= 1.0 and summary["eval_samples"] == 359
    assert summary["final_loss"] > 0
    # adapter-only: 12 bytes per trainable parameter plus small files, far below the base model
    assert 12 * summary["trainable_params"] < summary["checkpoint_bytes"] < 13 * summary["trainable_params"]
    for key in ("trainable_params", "base_model_bytes", "wall_s", "checkpoint_path"):
        assert summary[key]
