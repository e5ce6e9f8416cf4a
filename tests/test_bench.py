"""Every benchmark script runs at its --tiny size and writes its JSON (a smoke test, not a timing).

The figures themselves come from `make bench`; here only that each script works end to end, records the
machine and the command, and keeps its raw samples.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import RAY_TEST_ENV

ROOT = Path(__file__).resolve().parent.parent
RAY_SCRIPTS = [
    "checkpoint_size",
    "restore_collectives",
    "save_collectives",
    "throughput",
    "recovery",
    "scale",
    "memory",
    "data_scale",
    "pipeline",
]


def _run(script: str, tmp_path: Path) -> dict:
    out, work = tmp_path / "results", tmp_path / "work"
    env = {**os.environ, **RAY_TEST_ENV}
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / f"{script}.py"),
            "--tiny",
            "--out",
            str(out),
            "--work",
            str(work),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads((out / f"{script}.json").read_text())
    assert result["machine"]["cpu_count"] == os.cpu_count()
    assert f"bench/{script}.py" in result["command"] and "--tiny" in result["command"]
    return result


def _figures(node):
    """Every `{"median": ..., "samples": [...]}` figure anywhere in a benchmark's JSON."""
    if isinstance(node, dict):
        if "median" in node:
            yield node
        for value in node.values():
            yield from _figures(value)
    elif isinstance(node, list):
        for value in node:
            yield from _figures(value)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("script", RAY_SCRIPTS)
def test_bench_script_runs_tiny(script, tmp_path):
    result = _run(script, tmp_path)
    assert "goal" in result
    figures = list(_figures(result))
    assert figures, "a benchmark writes figures"
    for figure in figures:  # every figure keeps its raw samples, and is their median
        assert figure["samples"], figure
        assert figure["median"] == pytest.approx(statistics.median(figure["samples"])), figure
    if script in ("restore_collectives", "save_collectives"):  # collective counts, not times
        assert result["goal"]["met"], json.dumps(result["goal"])
    if script == "scale":
        assert (tmp_path / "results" / "scale.png").stat().st_size > 0
    if script == "memory":  # max_length skips the long samples; the peaks are figures, not checked here
        assert result["configurations"]["all on"]["too_long_samples"] > 0
        assert result["configurations"]["all off"]["too_long_samples"] == 0
    if script == "data_scale":  # every size trained its first step; the ratios are figures, not checked here
        assert set(result["layouts"]["raylora"]) == {"64", "640"}
        assert set(result["ratios"]["raylora"]) == {"memory_640_over_64", "startup_640_over_64"}


@pytest.mark.slow
def test_on_paper_runs_tiny(tmp_path):
    result = _run("on_paper", tmp_path)
    frozen, trained = result["models"]
    assert frozen["lora_params"] == 39_976_960  # llava-1.5-7b, r=16 on q,k,v,o,gate,up,down of 32 layers
    assert trained["trainable_params"] > frozen["trainable_params"]
    llava = result["memory_per_gpu"][0]
    layer = llava["decoder_layer_bytes_per_token"]
    assert layer["bytes"] == 30 * 4096 + 4 * 4096 + 9 * 11008 == sum(layer["terms"].values())
    scenarios = llava["scenarios"]
    shipped, no_checkpointing = scenarios["shipped"], scenarios["gradient_checkpointing off"]
    assert shipped["gradient_checkpointing"] and shipped["fits"]["80 GB"]
    assert no_checkpointing["activations_gb"] > 10 * shipped["activations_gb"]
