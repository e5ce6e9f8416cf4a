"""`raylora demo` end to end at a small size: assets, 2 workers, a killed worker, resume, evaluation."""

from __future__ import annotations

import json

import pytest

from raylora.demo import demo
from tests.run_logs import tensorboard_scalars, wandb_history

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_demo_survives_a_killed_worker_and_writes_its_summary(ray_cluster, tmp_path, capfd):
    from transformers import AutoModelForImageTextToText

    from raylora.data.processor import load_processor
    from raylora.evaluate import evaluate

    summary = demo(
        tmp_path,
        failure=True,
        overrides=["train.max_steps=12", "train.checkpoint_every=5", "fault.kill_at_steps=7"],
    )
    console = "".join(capfd.readouterr())
    assert summary == json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["restarts"] == 1
    # 12 steps already lower the held-out answer loss below the base model's (the adapter starts at 0)
    base = AutoModelForImageTextToText.from_pretrained(tmp_path / "model")
    before = evaluate(base, load_processor(str(tmp_path / "model")), str(tmp_path / "data" / "eval.parquet"))
    assert summary["eval_loss"] < before["loss"]
    assert summary["eval_samples"] == 359 and round(summary["eval_accuracy"] * 359, 6).is_integer()
    # the console shows raylora's progress lines, not Ray Train's line per report
    assert "step 3/12" in console
    assert "Reporting training result" not in console
    assert summary["final_loss"] > 0
    # adapter-only: 12 bytes per trainable parameter plus small files, far below the base model
    assert 12 * summary["trainable_params"] < summary["checkpoint_bytes"] < 13 * summary["trainable_params"]
    for key in ("trainable_params", "base_model_bytes", "wall_s", "checkpoint_path"):
        assert summary[key]


def test_evaluation_during_training_and_metric_sinks(ray_cluster, tiny_models, digits, tmp_path, monkeypatch):
    import torch
    from ray.train import UserCallback
    from transformers import get_cosine_schedule_with_warmup

    from raylora.driver import run
    from raylora.evaluate import evaluate, load_for_inference
    from raylora.progress import read_metrics
    from raylora.reporting import rows as report_rows
    from tests.support import tiny_run_config

    cfg = tiny_run_config(
        tiny_models("llava"),
        digits[0],
        tmp_path,
        "evals",
        "train.max_steps=4",
        "train.checkpoint_every=4",
        "train.vision_lr=3e-4",
        # reports at the first step and at the last (its checkpoint) only: steps 2 and 3 ride with step 4's
        "run.report_every_s=3600",
        f"data.eval={digits[1]}",
        "train.eval_every=2",
        "train.eval_samples=7",
        "run.tensorboard=true",
        f"run.mlflow_tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        "run.wandb_project=raylora-test",
    )
    for key, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(key, value)  # the W&B sink takes the driver's WANDB_* settings with it
    reports = tmp_path / "reports.jsonl"

    class ReportSteps(UserCallback):  # runs in Ray Train's controller: the steps each report carried
        def after_report(self, run_context, metrics, checkpoint) -> None:
            with open(reports, "a") as f:
                f.write(json.dumps([r["step"] for r in report_rows(metrics[0])]) + "\n")

    result = run(cfg, [ReportSteps()])
    assert [json.loads(line) for line in reports.read_text().splitlines()] == [[1], [2, 3, 4]]
    logged = read_metrics(str(tmp_path), "evals")
    assert [r["step"] for r in logged] == [1, 2, 3, 4], "one row per step, none lost, none twice"
    rows = {r["step"]: r for r in logged}
    # each row is its own step's: the workers' losses, the learning rates of the schedule at that step
    trained = {r["step"]: r for r in result.return_value}
    groups = [{"params": [torch.zeros(1)], "lr": 1e-3}, {"params": [torch.zeros(1)], "lr": 3e-4}]
    schedule = get_cosine_schedule_with_warmup(torch.optim.SGD(groups), 2, 4)
    for step in range(1, 5):
        lr, vision_lr = schedule.get_last_lr()
        assert (rows[step]["lr"], rows[step]["vision_lr"]) == pytest.approx((lr, vision_lr)), step
        assert rows[step]["loss"] == trained[step]["loss"], step
        schedule.optimizer.step()
        schedule.step()
    assert rows[1]["lr"] != rows[2]["lr"] != rows[3]["lr"] != rows[4]["lr"]
    assert len({rows[s]["loss"] for s in rows}) == 4
    assert "eval_accuracy" in rows[2] and "eval_accuracy" in rows[4] and "eval_accuracy" not in rows[3]
    with result.checkpoint.as_directory() as folder:
        model, processor = load_for_inference(folder)
    # 7 samples over 2 ranks (one padded slot) under ZeRO-3 == one process with plain PEFT
    alone = evaluate(model, processor, str(digits[1]), batch_size=4, max_samples=7)
    assert rows[4]["eval_accuracy"] == pytest.approx(alone["accuracy"])
    assert rows[4]["eval_loss"] == pytest.approx(alone["loss"], rel=1e-4)
    # the same metrics went to TensorBoard (tensorboardX event file) and MLflow (its own client)
    scalars = tensorboard_scalars(tmp_path / "evals" / "tensorboard")
    assert sorted(scalars["eval_accuracy"]) == [2, 4]
    for key in ("loss", "lr"):
        assert scalars[key] == {s: pytest.approx(rows[s][key], rel=1e-6) for s in rows}, key
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name("raylora").experiment_id])
    for key in ("loss", "lr"):
        history = client.get_metric_history(mlflow_run.info.run_id, key)
        assert {m.step: m.value for m in history} == {s: pytest.approx(rows[s][key]) for s in rows}, key
        assert len(history) == 4, key
    assert mlflow_run.data.params["lora.r"] == "4"
    # and to Weights & Biases, in its offline mode, against raylora's step
    history = {int(r["step"]): r for r in wandb_history(tmp_path) if "step" in r}  # not W&B's own rows
    assert sorted(history) == [1, 2, 3, 4]
    for step in rows:
        assert float(history[step]["loss"]) == pytest.approx(rows[step]["loss"]), step
        assert float(history[step]["lr"]) == pytest.approx(rows[step]["lr"]), step
    assert float(history[4]["eval_accuracy"]) == pytest.approx(rows[4]["eval_accuracy"])


def test_a_failing_metrics_sink_never_stops_training(tmp_path, monkeypatch):
    from raylora.progress import WandbLog

    monkeypatch.setenv("WANDB_MODE", "no-such-mode")  # wandb.init refuses it
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    sink = WandbLog("raylora-test", "broken", {})
    sink.after_report(None, [{"step": 1, "loss": 1.0, "max_steps": 2}], None)  # warns, does not raise
    assert sink._warned
