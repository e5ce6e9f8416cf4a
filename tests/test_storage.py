"""Run storage and data on a pyarrow filesystem URI (here `file://`, the same code path as s3:// or gs://)."""

from __future__ import annotations

import pytest

from raylora import checkpoint
from raylora.driver import run
from raylora.progress import read_metrics
from tests.support import tiny_run_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_run_resumes_from_uri_storage(ray_cluster, tiny_models, digits, tmp_path):
    storage = f"file://{tmp_path / 'uri-storage'}"
    cfg = tiny_run_config(
        tiny_models("llava"),
        f"file://{digits[0]}",
        storage,
        "uri",
        "train.max_steps=4",
        "fault.kill_at_steps=3",
    )
    result = run(cfg)
    assert result.error is None
    assert result.checkpoint.path.startswith(str(tmp_path / "uri-storage" / "uri"))
    with result.checkpoint.as_directory() as folder:
        final = checkpoint.load(folder)
    assert final.state.step == 4 and final.state.restarts == 1
    rows = read_metrics(storage, "uri")
    assert [r["step"] for r in rows if r["restarts"] == 1] == [3, 4]
