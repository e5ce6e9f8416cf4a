"""Bad rows, secrets and what restore reads: the input-side guarantees, single process."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from raylora import config
from raylora.data import BadRowError, ImageTextData
from raylora.driver import preflight
from raylora.redact import redact

ROOT = Path(__file__).resolve().parent.parent


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 10, 10)).save(buf, format="PNG")
    return buf.getvalue()


def _table(path: Path) -> Path:
    good = _png()
    pq.write_table(
        pa.table(
            {
                "image": [good, b"\x89PNG not really", good, good, good[: len(good) // 2]],
                "prompt": ["Which digit is this?"] * 5,
                "answer": ["one", "two", "   ", "four", "five"],
            }
        ),
        path,
    )
    return path


def test_bad_rows_are_skipped_and_counted(tmp_path):
    data = ImageTextData(str(_table(tmp_path / "d.parquet")))
    assert len(data) == 2 and data.answers == ["one", "four"]
    assert [row for row, _ in data.bad_rows] == [1, 2, 4]
    reasons = dict(data.bad_rows)
    assert (
        "does not decode" in reasons[1] and reasons[2] == "empty answer" and "does not decode" in reasons[4]
    )
    image, prompt, answer = data.example(1)
    assert image.size == (8, 8) and answer == "four"


def test_bad_row_with_error_mode_names_the_row_before_ray_starts(tmp_path, tiny_models):
    path = _table(tmp_path / "d.parquet")
    with pytest.raises(BadRowError, match=r"d.parquet: row 1: image does not decode"):
        ImageTextData(str(path), on_bad_row="error")
    cfg = config.load(
        None,
        [
            f"model.path={tiny_models('llava')}",
            f"data.train={path}",
            "data.on_bad_row=error",
            "train.global_batch_size=2",
            "train.micro_batch_size=1",
        ],
    )
    with pytest.raises(config.ConfigError, match="row 1"):
        preflight(cfg)


def test_saved_config_is_redacted(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnop")
    monkeypatch.setenv("MY_API_KEY", "sk-1234567890")
    data = {
        "run": {"storage_path": "s3://AKIAXXXX:topsecret@bucket/runs"},
        "data": {"train": "gs://bucket/train.parquet?access_key=abc&region=eu", "eval": None},
        "model": {"path": "/models/hf_abcdefghijklmnop/llava"},
        "lora": {"target_modules": ["q_proj"]},
    }
    clean = json.dumps(redact(data))
    for secret in ("topsecret", "AKIAXXXX", "access_key=abc", "hf_abcdefghijklmnop"):
        assert secret not in clean
    assert "s3://***@bucket/runs" in clean and "region=eu" in clean and "q_proj" in clean


def test_restore_path_reads_no_pickle():
    """Checkpoints are read with safetensors and json only: no torch.load or pickle anywhere in raylora."""
    for path in (ROOT / "raylora").glob("*.py"):
        text = path.read_text()
        assert not re.search(r"\bpickle\b|torch\.load\(", text), path.name
        assert "trust_remote_code=True" not in text, path.name
