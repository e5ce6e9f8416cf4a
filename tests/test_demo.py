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


def test_evaluation_during_training_and_metric_sinks(ray_cluster, tiny_models, digits, tmp_path):
    from raylora.assets import tiny_run_config
    from raylora.driver import run
    from raylora.evaluate import evaluate, load_for_inference
    from raylora.progress import read_metrics

    cfg = tiny_run_config(
        tiny_models("llava"),
        digits[0],
        tmp_path,
        "evals",
        "train.max_steps=4",
        f"data.eval={digits[1]}",
        "train.eval_every=2",
        "train.eval_samples=7",
        "run.tensorboard=true",
        f"run.mlflow_tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
    )
    result = run(cfg)
    rows = {r["step"]: r for r in read_metrics(str(tmp_path), "evals")}
    assert "eval_accuracy" in rows[2] and "eval_accuracy" in rows[4] and "eval_accuracy" not in rows[3]
    with result.checkpoint.as_directory() as folder:
        model, processor = load_for_inference(folder)
    # 7 samples over 2 ranks (one padded slot) under ZeRO-3 == one process with plain PEFT
    alone = evaluate(model, processor, str(digits[1]), batch_size=4, max_samples=7)
    assert rows[4]["eval_accuracy"] == pytest.approx(alone["accuracy"])
    assert rows[4]["eval_loss"] == pytest.approx(alone["loss"], rel=1e-4)
    # the same metrics went to TensorBoard (tensorboardX event file) and MLflow (its own client)
    events = list((tmp_path / "evals" / "tensorboard").glob("events.out.tfevents.*"))
    assert events and b"eval_accuracy" in events[0].read_bytes() and b"loss" in events[0].read_bytes()
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name("raylora").experiment_id])
    history = client.get_metric_history(mlflow_run.info.run_id, "loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4]
    assert mlflow_run.data.params["lora.r"] == "4"
