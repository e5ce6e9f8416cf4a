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
from raylora.data.formats import BadRow, load_image, open_rows
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


def _reason(rows, i: int) -> str | None:
    try:
        for entry in rows.sample(i).images:
            load_image(entry)
    except BadRow as err:
        return err.reason
    return None


def test_bad_rows_name_their_reason_when_read(tmp_path):
    rows = open_rows(str(_table(tmp_path / "d.parquet")))
    assert len(rows) == 5  # every row counts: a bad one is met (and skipped) when a step reads it
    reasons = [_reason(rows, i) for i in range(5)]
    assert reasons[0] is None and reasons[3] is None and reasons[2] == "empty answer"
    assert "does not decode" in reasons[1] and "does not decode" in reasons[4]
    assert load_image(rows.sample(3).images[0]).size == (8, 8)


def test_preflight_reads_a_sample_and_refuses_bad_rows_before_ray(tmp_path, tiny_models):
    """The driver decodes, renders and tokenises a sample of the rows before Ray starts: with
    data.on_bad_row=error a bad row among them refuses the run there, naming it."""
    path = _table(tmp_path / "d.parquet")
    settings = [
        f"model.path={tiny_models('llava')}",
        f"data.train={path}",
        "train.global_batch_size=2",
        "train.micro_batch_size=1",
    ]
    with pytest.raises(config.ConfigError, match="row 1"):
        preflight(config.load(None, [*settings, "data.on_bad_row=error"]))
    # 3 of 5 rows bad is far over data.max_bad_fraction; allowed, the run starts and skips them
    assert preflight(config.load(None, [*settings, "data.max_bad_fraction=1.0"])).model_type == "llava"


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
    for path in (ROOT / "raylora").rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"\bpickle\b|torch\.load\(", text), path.name
        assert "trust_remote_code=True" not in text, path.name
