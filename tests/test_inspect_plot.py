"""`raylora inspect` on real checkpoints (intact and altered) and `raylora plot` on a synthetic log."""

from __future__ import annotations

import json
import math

import pytest
from PIL import Image
from transformers import AutoModelForImageTextToText

from raylora import checkpoint, cli
from raylora.inspection import inspect_checkpoint
from raylora.plot import attempts, restart_steps
from raylora.progress import METRICS_FILE
from tests.test_export import make_checkpoint

PARTS = {
    "llava": {"vision_tower": "model.vision_tower.", "aligner": "model.multi_modal_projector."},
    "qwen2_vl": {"vision_tower": "model.visual.", "aligner": "model.visual.merger."},
}


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl"])
def test_inspect_groups_and_counts(arch, tiny_models, digits, tmp_path, capsys):
    model_dir = tiny_models(arch)
    ckpt = make_checkpoint(tmp_path / "ckpt", model_dir, digits[0])
    report = inspect_checkpoint(ckpt)
    assert report["manifest"] == {"ok": True, "error": None}
    assert report["step"] == 5 and report["world_size"] == 1
    assert set(report["files"]) == {
        checkpoint.ADAPTER_CONFIG,
        checkpoint.ADAPTER_WEIGHTS,
        checkpoint.TRAINED_MODULES,
        checkpoint.OPTIMIZER,
        checkpoint.STATE,
        checkpoint.MANIFEST,
    }
    assert report["files"][checkpoint.STATE] == (ckpt / checkpoint.STATE).stat().st_size

    # Expected counts from the base model itself: the vision tower and aligner are trained whole
    # (Qwen2-VL's merger sits inside its vision tower and counts as aligner); LoRA adds r x (in + out)
    # per adapted linear layer (every one of the language model's 2 layers x 7 projections).
    base = AutoModelForImageTextToText.from_pretrained(model_dir)
    sizes = {n: p.numel() for n, p in base.named_parameters()}
    aligner = sum(v for n, v in sizes.items() if n.startswith(PARTS[arch]["aligner"]))
    tower = sum(
        v
        for n, v in sizes.items()
        if n.startswith(PARTS[arch]["vision_tower"]) and not n.startswith(PARTS[arch]["aligner"])
    )
    linears = {
        n: m
        for n, m in base.named_modules()
        if n.startswith("model.language_model.") and hasattr(m, "in_features")
    }
    lora = sum(4 * (m.in_features + m.out_features) for m in linears.values())
    groups = report["trainable"]
    assert list(groups) == ["language_model", "vision_tower", "aligner"]
    assert groups["language_model"]["parameters"] == lora
    assert sorted(groups["language_model"]["modules"]) == sorted(linears) and len(linears) == 14
    assert groups["vision_tower"]["parameters"] == tower
    assert groups["aligner"]["parameters"] == aligner
    assert report["lora"]["r"] == 4 and report["lora"]["lora_alpha"] == 8
    assert report["config"]["model"]["path"] == model_dir and "torch" in report["versions"]

    assert cli.main(["inspect", str(ckpt)]) == 0
    text = capsys.readouterr().out
    assert "manifest   ok" in text and "step       5" in text
    assert "LoRA on the language model" in text and f"model.path={model_dir}" in text
    assert cli.main(["inspect", str(ckpt), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["trainable"] == groups


def test_inspect_altered_byte_exits_1(tiny_models, digits, tmp_path, capsys):
    ckpt = make_checkpoint(tmp_path / "ckpt", tiny_models("llava"), digits[0])
    path = ckpt / checkpoint.TRAINED_MODULES
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert cli.main(["inspect", str(ckpt)]) == 1
    text = capsys.readouterr().out
    assert "manifest   FAILED" in text and "trained_modules.safetensors does not match its sha256" in text
    assert "step       5" in text  # the rest of the report is still there
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["inspect", str(empty)]) == 2
    assert "is not a raylora checkpoint" in capsys.readouterr().err


def _rows() -> list[dict]:
    """Steps 1-6, a crash, resume from the checkpoint at step 4; again at step 8 after reaching 9."""
    rows = []
    for restarts, steps in ((0, range(1, 7)), (1, range(5, 10)), (2, range(9, 13))):
        for step in steps:
            rows.append(
                {
                    "step": step,
                    "loss": 2.0 / step,
                    "lr": 1e-3,
                    "max_steps": 12,
                    "epoch": 0,
                    "restarts": restarts,
                }
            )
    rows[5]["eval_accuracy"] = 0.25
    rows[-1]["eval_accuracy"] = 0.75
    return rows


def test_restart_steps_and_attempts():
    rows = _rows()
    assert restart_steps(rows) == [4, 8]
    assert [[r["step"] for r in a] for a in attempts(rows)] == [
        [1, 2, 3, 4, 5, 6],
        [5, 6, 7, 8, 9],
        [9, 10, 11, 12],
    ]
    assert restart_steps([{"step": s, "loss": 1.0} for s in range(1, 5)]) == []  # rows without `restarts`


def test_plot_writes_png(tmp_path, capsys):
    run_dir = tmp_path / "runs" / "myrun"
    run_dir.mkdir(parents=True)
    (run_dir / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    assert cli.main(["plot", str(run_dir)]) == 0
    png = run_dir / "loss.png"
    assert capsys.readouterr().out.strip() == str(png)
    assert png.stat().st_size > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(png) as image:
        image.verify()
        assert image.format == "PNG" and math.prod(image.size) > 0

    other = tmp_path / "elsewhere.png"
    assert cli.main(["plot", str(run_dir), "--out", str(other)]) == 0
    assert other.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert cli.main(["plot", str(tmp_path / "runs" / "missing")]) == 2
    assert "no metrics in" in capsys.readouterr().err
