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

from tests.ray_env import RAY_TEST_ENV

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


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """bench/smoke.py: every script at its --tiny size in one process on one Ray (shared assets)."""
    out, work = tmp_path_factory.mktemp("bench-results"), tmp_path_factory.mktemp("bench-work")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "smoke.py"), "--out", str(out), "--work", str(work)]
        + ["on_paper", "padding", "padding --turns 2", "gpu_throughput", *RAY_SCRIPTS]
        + ["throughput --where", "throughput --floor"],
        cwd=ROOT,
        env={**os.environ, **RAY_TEST_ENV},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out, json.loads((out / "smoke.json").read_text())


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
    if script in ("restore_collectives", "save_collectives"):  # collective counts, not times
        assert result["goal"]["met"], json.dumps(result["goal"])
    if script == "scale":
        assert (smoke[0] / "scale.png").stat().st_size > 0
    if script == "memory":  # max_length skips the long samples; the peaks are figures, not checked here
        assert result["configurations"]["all on"]["too_long_samples"] > 0
        assert result["configurations"]["all off"]["too_long_samples"] == 0
    if script == "data_scale":  # every size trained its first step; the ratios are figures, not checked here
        assert set(result["layouts"]["raylora"]) == {"64", "640"}
        assert set(result["ratios"]["raylora"]) == {"memory_640_over_64", "startup_640_over_64"}


@pytest.mark.slow
@pytest.mark.distributed
def test_throughput_alongside_pairs_take_turns_on_whole_runs(smoke):
    """bench/throughput.py's goal figure: each pair a whole raylora run and the plain loop, up at once,
    taking turns; both sides stepped in their own turns, which add up to the turns asked for, and the
    goal is the median of the pairs' ratios. Having half of the wall time, the run reports and is polled
    at twice a lone run's intervals, so per step of its own as often as alone."""
    from raylora.config import RunConfig
    from raylora.ray_runtime import controller_poll_s

    result = _result(smoke, "throughput")
    size = result["sizes"]["tiny"]
    along = size["figures"]["alongside"]
    assert len(along["pairs"]) == result["setup"]["repeats"]
    alone = RunConfig().report_every_s
    for pair in along["pairs"]:
        assert pair["raylora_report_every_s"] == 2 * alone, pair
        assert pair["raylora_controller_poll_s"] == 2 * controller_poll_s(alone), pair
        for side in ("raylora", "plain"):
            assert pair["steps_counted"][side] >= 1, pair
            assert pair["seconds_of_turns"][side] == pytest.approx(
                along["turns_per_side"] * along["seconds_per_turn"], rel=0.2
            )
        assert pair["raylora_over_plain"] == pytest.approx(
            pair["raylora_steps_per_s"] / pair["plain_steps_per_s"]
        )
        # raylora's own loop binds each worker's training thread (scaling.bind_cores), and with it the
        # threads it starts later (torch's inter-op pool, at the first step; not Ray's at a report): on 2
        # cores, which the 2 workers' CPUs fill, one core each; on more, none
        cores = sorted(os.sched_getaffinity(0))
        bound = sorted(pair["raylora_bound_threads"])
        if len(cores) == 2:
            assert [{tuple(t) for t in threads} for threads in bound] == [{(core,)} for core in cores], bound
        else:
            assert bound == [[], []], bound
    ratios = size["ratios"]
    assert ratios["alongside"] == pytest.approx(statistics.median(ratios["alongside_per_pair"]))
    assert result["goal"]["value_by_size"]["tiny"] == ratios["alongside"]


@pytest.mark.slow
@pytest.mark.distributed
def test_throughput_floor_takes_turns_with_each_variant(smoke):
    """bench/throughput.py --floor: pairs taking turns of raylora's run as it runs and of the run with the
    least that raylora decides about Ray, alternating. Each pair's run reported and was polled as its
    variant says (the least one at its first and last step only, polled every 1 s alone), both sides
    stepped in their own turns, and the figures are the medians of the pairs."""
    sys.path.insert(0, str(ROOT / "bench"))
    import throughput

    from raylora.config import RunConfig
    from raylora.ray_runtime import controller_poll_s

    result = _result(smoke, "throughput --floor", "throughput_floor")
    figures, reps = result["figures"], result["setup"]["repeats"]
    alone = RunConfig().report_every_s
    expected_poll = {"raylora": controller_poll_s(alone), "least": throughput.FLOOR_POLL_S}
    assert [v for v, _ in figures["order_of_pairs"]] == [
        v for rep in range(reps) for v in (["raylora", "least"] if rep % 2 == 0 else ["least", "raylora"])
    ]
    for variant, pairs in figures["pairs"].items():
        assert len(pairs) == reps, variant
        for pair in pairs:
            assert pair["raylora_controller_poll_s"] == 2 * expected_poll[variant], (variant, pair)
            assert all(pair["steps_counted"][side] >= 1 for side in ("raylora", "plain")), (variant, pair)
            if variant == "raylora":
                assert pair["raylora_report_every_s"] == 2 * alone, pair
            else:  # its first step's report, then its last step's, with the rows of every step between
                assert pair["raylora_reports"] == 2, pair
        ratios = [p["raylora_over_plain"] for p in pairs]
        assert figures["ratios"][f"{variant}_per_pair"] == ratios
        assert figures["ratios"][variant] == pytest.approx(statistics.median(ratios))
    assert figures["ratios"]["least_over_raylora"] == pytest.approx(
        figures["ratios"]["least"] / figures["ratios"]["raylora"]
    )


@pytest.mark.slow
@pytest.mark.distributed
def test_throughput_splits_the_workers_cores_by_thread(smoke):
    """bench/throughput.py's per-thread split of the workers' CPU (where a Ray worker spends what a plain
    process does not): on both sides gloo's threads are found by name and the training thread has the
    most of the workers' cores; the kinds add up to the workers' cores."""
    figures = _result(smoke, "throughput")["sizes"]["tiny"]["figures"]
    for side in ("raylora", "plain"):
        kinds = {k: v["samples"] for k, v in figures["worker_threads_while_training"][side].items()}
        assert set(kinds) == {"training", "ray_main", "gloo", "other_threads"}, side
        workers = figures["cores_while_training"][side]["workers"]["samples"]
        for run, total in enumerate(workers):
            by_thread = {k: v[run] for k, v in kinds.items()}
            assert by_thread["gloo"] > 0 and by_thread["training"] > 0.5 * total, (side, by_thread, total)
            assert sum(by_thread.values()) == pytest.approx(total), (side, by_thread)


@pytest.mark.slow
@pytest.mark.distributed
def test_throughput_where_takes_turns_in_each_comparison(smoke):
    """bench/throughput.py --where: Ray Train workers, plain Ray actor processes and plain processes, two
    at a time, each pair taking turns block by block; every block timed on both sides."""
    result = _result(smoke, "throughput --where", "throughput_where")
    figures = result["figures"]
    blocks = result["setup"]["blocks"]
    in_worker = figures["ray_train_over_plain"]
    assert len(in_worker["ray_over_plain_per_block"]) == blocks
    assert in_worker["ray_over_plain"] == pytest.approx(
        statistics.median(in_worker["ray_over_plain_per_block"])
    )
    # the training thread's own CPU per step: some, and never more than the step's wall time (a whole
    # process's CPU, gloo's threads included, could be)
    for side, key in (("ray", "ray_worker_steps_per_s"), ("plain", "plain_process_steps_per_s")):
        cpu = in_worker["training_thread_cpu_ms_per_step_rank0"][side]["samples"]
        wall = [1000 / rate for rate in in_worker[key]["samples"]]
        assert len(cpu) == blocks and all(0 < c <= w * 1.001 for c, w in zip(cpu, wall, strict=True)), side
    assert in_worker["training_thread_cpu_ray_over_plain"] == pytest.approx(
        statistics.median(in_worker["training_thread_cpu_ray_over_plain_per_block"])
    )
    # the Ray Train workers' training threads bound as raylora's loop binds them (scaling.bind_cores: on 2
    # cores, which their 2 CPUs fill, rank 0 on the first), the plain processes' left where the OS puts them
    cores = sorted(os.sched_getaffinity(0))
    bound = in_worker["training_thread_cores_rank0"]
    assert bound == {"ray": cores[:1] if len(cores) == 2 else cores, "plain": cores}
    for name in ("actor_over_plain", "train_over_actor"):
        pair = figures[name]
        assert len(pair["per_block"]) == blocks and all(r > 0 for r in pair["per_block"]), name
        assert pair["median"] == pytest.approx(statistics.median(pair["per_block"])), name
        assert all(s > 0 for s in pair["process_switches_per_step"]), name  # each side's rank 0 counted


@pytest.mark.slow
def test_on_paper_runs_tiny(smoke):
    result = _result(smoke, "on_paper")
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


@pytest.mark.slow
def test_padding_turns_against_the_hf_trainer(smoke):
    """bench/padding.py --turns: raylora and the HF Trainer taking turns block by block on both mixes;
    the goal's figure is each side's useful tokens per second over all its blocks, and the training
    threads' CPU of the two ranks is at most the blocks' wall time on each (it is their own CPU, not the
    process's)."""
    result = _result(smoke, "padding --turns 2", "padding_turns")
    sides = ("raylora", "hf_trainer")
    for kind, mix in result["mixes"].items():
        per_block = mix["raylora_grouped_over_hf_trainer_per_block"]
        assert len(per_block) == mix["setup"]["blocks"] and all(r > 0 for r in per_block), kind
        assert mix["raylora_grouped_over_hf_trainer"] == pytest.approx(statistics.median(per_block)), kind
        overall = mix["useful_tokens_per_s_all_blocks"]
        assert mix["raylora_grouped_over_hf_trainer_all_blocks"] == pytest.approx(
            overall["raylora"] / overall["hf_trainer"]
        ), kind
        for side in sides:
            assert mix["cpu_ms_per_useful_token"][side] > 0, (kind, side)
            assert 0 < mix["cpu_per_wall_second"][side] <= 2 * 1.001, (kind, side)
    assert result["goal"]["met"] == all(
        mix["raylora_grouped_over_hf_trainer_all_blocks"] > 1 for mix in result["mixes"].values()
    )


def _take_turns(side: str, path: str, blocks: int, log: str, fail_at: int | None) -> None:
    """One side of test_turns_alternate_block_by_block: a process group of its own (gloo, 1 rank)."""
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "bench"))
    import common

    dist.init_process_group("gloo", init_method=f"file://{path}.{side}.store", rank=0, world_size=1)
    turns = common.Turns(path, ("first", "second"), side)
    try:
        turns.ready()
        for block in range(blocks):
            turns.wait(block)
            if block == fail_at:
                raise RuntimeError(f"{side} fails in block {block}")
            with open(log, "a") as f:
                f.write(f"{side}:{block}\n")
            turns.done(block)
        turns.finish(blocks)
        with open(log, "a") as f:
            f.write(f"{side}:end\n")
    except BaseException:
        turns.fail()
        raise
    finally:
        dist.destroy_process_group()


def test_turns_alternate_block_by_block(tmp_path):
    """bench/common.py `Turns`, which the in_worker and padding --turns comparisons rest on: two process
    groups never train at once and alternate strictly, the first side first in each block, and the first
    one finishes after the second's last block; a side that fails stops the other instead of leaving it
    waiting."""
    import multiprocessing

    sys.path.insert(0, str(ROOT / "bench"))
    import common

    ctx = multiprocessing.get_context("spawn")

    def run(fail_at: int | None) -> tuple[list[str], list[int]]:
        path, log = str(tmp_path / f"turn-{fail_at}"), tmp_path / f"log-{fail_at}"
        common.Turns.start(path, ("first", "second"))
        procs = [
            ctx.Process(
                target=_take_turns, args=(side, path, 3, str(log), fail_at if side == "second" else None)
            )
            for side in ("second", "first")  # started out of order: the file decides who goes first
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        codes = [p.exitcode for p in procs]  # None: still waiting after 120 s
        for p in procs:
            if p.is_alive():
                p.kill()
        return (log.read_text().split() if log.exists() else []), codes

    order, codes = run(None)
    assert codes == [0, 0]
    blocks = ["first:0", "second:0", "first:1", "second:1", "first:2", "second:2"]
    # the first side goes on (and out) only once the second side's last block has ended
    assert order[:6] == blocks and sorted(order[6:]) == ["first:end", "second:end"]
    order, codes = run(1)  # the second side fails in its second block; the first stops waiting for it
    assert order == ["first:0", "second:0", "first:1"]
    assert codes[0] != 0 and codes[1] != 0 and None not in codes


def test_alongside_counts_each_side_over_its_own_turns_only():
    """bench/throughput.py `active_rate`: a side that steps every 0.1 s while it runs and is stopped
    between its turns is at 10 steps/s however long the other side's turns last; steps that ended outside
    its turns (before the first) are not its turns' work."""
    sys.path.insert(0, str(ROOT / "bench"))
    import throughput

    turns = [(10.0, 11.0), (15.0, 16.0), (30.0, 31.0)]
    # before the turns (warm-up), then 0.1 s of its own time per step, across the stopped gaps
    ticks = [1.0, 2.0, *(10.05 + 0.1 * i for i in range(10))]
    ticks += [15.05 + 0.1 * i for i in range(10)] + [30.05 + 0.1 * i for i in range(10)]
    rate, steps = throughput.active_rate(ticks, turns)
    assert steps == 29 and rate == pytest.approx(10.0)
    with pytest.raises(RuntimeError, match="1 step"):
        throughput.active_rate([1.0, 10.5, 20.0], turns)
