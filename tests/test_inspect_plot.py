"""`raylora inspect` on real checkpoints (intact and altered) and `raylora plot` on a synthetic log, on a
local folder and on a real S3 endpoint (tests.s3_server.S3Server)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pyarrow.fs
import pytest
from PIL import Image
from transformers import AutoModelForImageTextToText

from raylora import checkpoint, cli
from raylora.inspection import inspect_checkpoint
from raylora.plot import attempts, restart_steps
from raylora.progress import MetricsLog
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


def _log(storage_path: str, name: str) -> None:
    """The rows of `_rows()` written by the callback that writes a run's log, one report per step."""
    log = MetricsLog(storage_path, name)
    for row in _rows():
        log.after_report(None, [dict(row)], None)


def _is_png(data: bytes) -> bool:
    return data[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_writes_png(tmp_path, capsys):
    run_dir = tmp_path / "runs" / "myrun"
    run_dir.mkdir(parents=True)
    _log(str(tmp_path / "runs"), "myrun")
    assert cli.main(["plot", str(run_dir)]) == 0
    png = run_dir / "loss.png"
    assert capsys.readouterr().out.strip() == str(png)
    assert png.stat().st_size > 0
    assert _is_png(png.read_bytes())
    with Image.open(png) as image:
        image.verify()
        assert image.format == "PNG" and math.prod(image.size) > 0

    other = tmp_path / "elsewhere.png"
    assert cli.main(["plot", str(run_dir), "--out", str(other)]) == 0
    assert _is_png(other.read_bytes())

    assert cli.main(["plot", str(tmp_path / "runs" / "missing")]) == 2
    assert "no metrics in" in capsys.readouterr().err


def test_plot_on_s3(s3, tmp_path, capsys):
    _log(s3.uri("runs"), "myrun")
    assert cli.main(["plot", s3.uri("runs", "myrun")]) == 0
    assert capsys.readouterr().out.strip() == s3.uri("runs", "myrun", "loss.png")
    with s3.fs().open_input_stream(f"{s3.bucket}/runs/myrun/loss.png") as f:
        assert _is_png(f.read())
    local = tmp_path / "loss.png"  # a cluster's run drawn on a laptop
    assert cli.main(["plot", s3.uri("runs", "myrun") + "/", "--out", str(local)]) == 0
    assert _is_png(local.read_bytes())
    assert cli.main(["plot", s3.uri("runs", "missing")]) == 2
    assert f"no metrics in {s3.uri('runs', 'missing')}/" in capsys.readouterr().err


def test_inspect_on_s3(s3, tiny_models, digits, tmp_path, capsys):
    ckpt = make_checkpoint(tmp_path / "ckpt", tiny_models("llava"), digits[0])
    uri = s3.uri("runs", "inspected", "checkpoint_000005")
    pyarrow.fs.copy_files(
        str(ckpt),
        uri.removeprefix("s3://"),
        source_filesystem=pyarrow.fs.LocalFileSystem(),
        destination_filesystem=s3.fs(),
    )
    local = inspect_checkpoint(ckpt)
    # As a user runs it: the command, in a process of its own, with the endpoint in its environment.
    proc = subprocess.run(
        [sys.executable, "-m", "raylora.cli", "inspect", uri, "--json"],
        env={**os.environ, **s3.env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    remote = json.loads(proc.stdout)
    assert remote["folder"] == uri and remote["manifest"] == {"ok": True, "error": None}
    assert {**remote, "folder": None} == {**local, "folder": None}

    path = f"{uri.removeprefix('s3://')}/{checkpoint.TRAINED_MODULES}"
    data = bytearray((ckpt / checkpoint.TRAINED_MODULES).read_bytes())
    data[len(data) // 2] ^= 0x01
    with s3.fs().open_output_stream(path) as f:
        f.write(bytes(data))
    assert cli.main(["inspect", uri]) == 1
    text = capsys.readouterr().out
    assert f"manifest   FAILED: {uri}: file {checkpoint.TRAINED_MODULES} does not match its sha256" in text
    assert "step       5" in text
    assert cli.main(["inspect", s3.uri("runs", "inspected")]) == 2
    assert f"{s3.uri('runs', 'inspected')} is not a raylora checkpoint" in capsys.readouterr().err
