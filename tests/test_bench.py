"""Every benchmark script runs at its --tiny size and writes its JSON (a smoke test, not a timing).

The figures themselves come from `make bench`; here only that each script works end to end, records the
machine and the command, and keeps its raw samples. The tiny runs (marked `bench`, about 5 minutes on 2
cores) run with `make bench-smoke`, not in `make test`, which keeps CI within its time: there every script
is imported (a renamed import or option fails there) and `on_paper.py`, arithmetic whose figures the docs
quote, runs whole.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ray_env import RAY_TEST_ENV

ROOT = Path(__file__).resolve().parent.parent
# restore_collectives and save_collectives run in `make bench` only: their counts, the figures they publish,
# are asserted by tests/test_collectives.py on the same runs
RAY_SCRIPTS = [
    "checkpoint_size",
    "throughput",
    "recovery",
    "scale",
    "memory",
    "data_scale",
    "pipeline",
]


def _smoke(tmp_path_factory, scripts: list[str]):
    """bench/smoke.py: `scripts` at their --tiny size in one process on one Ray (shared assets)."""
    out, work = tmp_path_factory.mktemp("bench-results"), tmp_path_factory.mktemp("bench-work")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "smoke.py"), "--out", str(out), "--work", str(work), *scripts],
        cwd=ROOT,
        env={**os.environ, **RAY_TEST_ENV},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out, json.loads((out / "smoke.json").read_text())


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    return _smoke(tmp_path_factory, ["padding", "gpu_throughput", *RAY_SCRIPTS])


@pytest.fixture(scope="module")
def on_paper(tmp_path_factory):
    return _smoke(tmp_path_factory, ["on_paper"])


def test_every_bench_script_imports():
    """Each script's imports resolve (in a process of its own: bench/common sets Ray's environment)."""
    scripts = sorted(p.stem for p in (ROOT / "bench").glob("*.py"))
    code = "import importlib, sys; [importlib.import_module(name) for name in sys.argv[1:]]"
    proc = subprocess.run(
        [sys.executable, "-c", code, *scripts],
        cwd=ROOT / "bench",
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(scripts) >= 15


def _result(smoke, script: str, written: str | None = None) -> dict:
    """The JSON that `script` (a name, or a name and flags) wrote to `written`.json (default: its name)."""
    out, status = smoke
    assert status[script]["ok"], status[script].get("error")
    name, *flags = script.split()
    result = json.loads((out / f"{written or name}.json").read_text())
    assert result["machine"]["cpu_count"] == os.cpu_count()
    assert f"bench/{name}.py" in result["command"] and "--tiny" in result["command"]
    assert all(flag in result["command"] for flag in flags)
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


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("script", RAY_SCRIPTS)
def test_bench_script_runs_tiny(script, smoke):
    result = _result(smoke, script)
    assert "goal" in result
    figures = list(_figures(result))
    assert figures, "a benchmark writes figures"
    for figure in figures:  # every figure keeps its raw samples, and is their median
        assert figure["samples"], figure
        assert figure["median"] == pytest.approx(statistics.median(figure["samples"])), figure
    if script == "scale":
        assert (smoke[0] / "scale.png").stat().st_size > 0
    if script == "memory":  # max_length skips the long samples; the peaks are figures, not checked here
        assert result["configurations"]["all on"]["too_long_samples"] > 0
        assert result["configurations"]["all off"]["too_long_samples"] == 0
    if script == "data_scale":  # every size trained its first step; the ratios are figures, not checked here
        assert set(result["layouts"]["raylora"]) == {"64", "640"}
        assert set(result["ratios"]["raylora"]) == {"memory_640_over_64", "startup_640_over_64"}


@pytest.mark.bench
@pytest.mark.slow
@pytest.mark.distributed
def test_throughput_pairs_flip_their_order(smoke):
    """bench/throughput.py: each repeat a raylora run and the plain loop back to back, the order flipping
    from one pair to the next; the goal's figure is the median of the pairs' ratios."""
    result = _result(smoke, "throughput")
    size = result["sizes"]["tiny"]
    reps = result["setup"]["repeats"]
    assert size["order_of_runs"] == [
        ["raylora", "plain"] if rep % 2 == 0 else ["plain", "raylora"] for rep in range(reps)
    ]
    figures, ratios = size["figures"], size["ratios"]
    raylora, plain = (
        figures["raylora_steps_per_s"]["samples"],
        figures["plain_deepspeed_steps_per_s"]["samples"],
    )
    pairs = zip(raylora, plain, strict=True)
    assert ratios["raylora_over_plain_per_pair"] == pytest.approx([r / p for r, p in pairs])
    assert ratios["raylora_over_plain"] == pytest.approx(
        statistics.median(ratios["raylora_over_plain_per_pair"])
    )
    assert result["goal"]["value_by_size"]["tiny"] == ratios["raylora_over_plain"]


@pytest.mark.slow
def test_on_paper_runs_tiny(on_paper):
    result = _result(on_paper, "on_paper")
    frozen, trained, moe = result["models"]
    assert frozen["lora_params"] == 39_976_960  # llava-1.5-7b, r=16 on q,k,v,o,gate,up,down of 32 layers
    assert trained["trainable_params"] > frozen["trainable_params"]
    llava = result["memory_per_gpu"][0]
    layer = llava["decoder_layer_bytes_per_token"]
    assert layer["bytes"] == 30 * 4096 + 4 * 4096 + 9 * 11008 == sum(layer["terms"].values())
    scenarios = llava["scenarios"]
    shipped, no_checkpointing = scenarios["shipped"], scenarios["gradient_checkpointing off"]
    assert shipped["gradient_checkpointing"] and shipped["fits"]["80 GB"]
    assert no_checkpointing["activations_gb"] > 10 * shipped["activations_gb"]
    # Qwen3-VL-30B-A3B: PEFT's rank r per expert on both fused expert tensors of its 48 layers, lora_A
    # [r x 128, in] and lora_B [out, r x 128]: (2048 + 1536) for gate_up_proj, (768 + 2048) for down_proj
    assert moe["model"] == "Qwen3-VL-30B-A3B-Instruct"
    assert moe["expert_lora_params"] == 48 * 16 * 128 * ((2048 + 1536) + (768 + 2048)) == 629_145_600
    assert moe["raylora_checkpoint_gb"] > 12 * moe["expert_lora_params"] / 1e9  # several GB
    scenarios = result["memory_per_gpu"][1]["scenarios"]
    per_layer = 2 * 128 * (1536 * 2048 + 2048 * 768)  # W + dW of one layer's experts, bf16
    assert scenarios["shipped"]["expert_weights"]["bytes"] == 2 * per_layer  # and one layer's gradient
    assert scenarios["gradient_checkpointing off"]["expert_weights"]["bytes"] == 49 * per_layer
    assert scenarios["shipped"]["fits"]["80 GB"]
    assert not scenarios["gradient_checkpointing off"]["fits"]["80 GB"]


@pytest.mark.bench
@pytest.mark.slow
def test_gpu_throughput_runs_tiny(smoke):
    """bench/gpu_throughput.py --tiny, on the CPU: raylora's step padded and packed and the HF Trainer's
    train the same rows and count the same tokens per step (within the rows each side draws)."""
    result = _result(smoke, "gpu_throughput")
    sides = result["sides"]
    assert set(sides) == {"raylora_padded", "raylora_packed", "hf_trainer"}
    for side in sides.values():
        assert side["tokens_per_s"] > 0 and side["mfu"] is None  # no GPU, no peak to divide by
        assert side["tokens_per_step"]["median"] > 0
    assert result["flops"]["model_flops_per_token"] < result["flops"]["hardware_flops_per_token"]
    assert set(result["ratios"]) == {"raylora_padded_over_hf_trainer", "raylora_packed_over_hf_trainer"}


@pytest.mark.bench
@pytest.mark.slow
def test_padding_runs_tiny(smoke):
    """bench/padding.py: the 7B configs' padding on paper (sorting, grouping by length and packing each
    pad less than the plain cut), and real steps padded, grouped, cut by a token budget and packed on both
    mixes."""
    result = _result(smoke, "padding")
    for kind, mix in result["mixes"].items():
        cut = {k: mix[k]["padding_fraction"]["median"] for k in ("as_cut_today", "grouped_by_length")}
        assert cut["grouped_by_length"] < cut["as_cut_today"], (kind, cut)
        assert mix["sorted_within_rank"]["padding_fraction"]["median"] < cut["as_cut_today"], kind
        assert mix["packed"]["padding_fraction"]["median"] < cut["as_cut_today"], kind
    for kind, measured in result["measured"].items():
        modes = {"padded", "padded_grouped", "padded_budgeted", "packed"}
        assert set(measured["useful_tokens_per_s"]) == modes, kind
        assert all(v["median"] > 0 for v in measured["useful_tokens_per_s"].values()), kind
        share = measured["padding_share"]
        assert share["packed"] == 0 < share["padded_grouped"] < share["padded"], (kind, share)
        assert 0 < share["padded_budgeted"] < share["padded"], (kind, share)
