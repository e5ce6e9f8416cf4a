"""Permanent errors not retried: a worker start that every attempt would repeat ends the run after one
attempt (real Ray workers and DeepSpeed ZeRO-3 on CPU).

A rank whose read of the newest checkpoint fails for a moment, and the leftovers of crashed attempts, are
in tests/test_resume.py's killed run.
"""

from __future__ import annotations

import json
import shutil

import pytest

from raylora import driver
from raylora.driver import run
from raylora.failures import PermanentError
from raylora.resume import ATTEMPTS_FILE
from tests.support import tiny_run_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


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
