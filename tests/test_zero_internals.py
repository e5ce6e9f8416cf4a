"""raylora.zero reads and writes DeepSpeed ZeRO-3 internals; check it against DeepSpeed itself.

If a DeepSpeed upgrade moves the flat fp32 partitions, `grad_position`, the optimizer state keys or
the layout of a parameter's partition, the distributed test fails loudly. Three workers, so that
partitions carry padding (64-wide tensors do not split evenly in three); bf16, so that the model's
weights and the fp32 masters differ; a persistence threshold that keeps the small parameters whole
(gathered) beside partitioned ones. The save's gather runs twice: in its real messages, and in messages
of 100 elements per rank that cut through parameters. The restore runs in the order training uses
(partition load before `deepspeed.initialize`, masters and moments after it), and the optimizer step
that follows it must give exactly what DeepSpeed's own uninterrupted step gave.

The single-process tests check the DeepSpeed config raylora writes and the gather's byte budget.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from raylora import checkpoint, config, zero
from tests import whole_checkpoint
from tests.probes import on_workers, read_params
from tests.support import tiny_run_config

PERSIST = 100  # parameters under 100 elements (biases, norms of the 64-wide tiny model) stay whole


def _public_state(params) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Masters and moments read through DeepSpeed's public per-parameter API (every rank)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    return {
        n: (
            safe_get_full_fp32_param(p),
            safe_get_full_optimizer_state(p, "exp_avg"),
            safe_get_full_optimizer_state(p, "exp_avg_sq"),
        )
        for n, p in params.items()
    }


def _same(ours: tuple[dict, dict] | None, public: dict) -> bool:
    weights, moments = ours
    return all(
        torch.equal(weights[n], w)
        and torch.equal(moments[f"{n}.exp_avg"], m)
        and torch.equal(moments[f"{n}.exp_avg_sq"], v)
        for n, (w, m, v) in public.items()
    )


def _probe(cfg) -> dict:
    from raylora.model import shapes
    from raylora.worker import setup, train_step

    # DeepSpeed's own run: two steps; raylora's gather checked against the public API after each
    s = setup(cfg, None)
    train_step(s)
    after_one = zero.gather_trainable_state(s.engine, s.params)
    public_one = _public_state(s.params)
    budget = zero.GATHER_BYTES  # every rank sets the same, so every rank sends as many messages
    zero.GATHER_BYTES = s.world_size * zero.GATHER_ROWS * 4 * 100  # 100 elements per rank per message
    in_small_chunks = zero.gather_trainable_state(s.engine, s.params)
    zero.GATHER_BYTES = budget
    scheduler_one = s.scheduler.state_dict()
    report = {
        "padded": any(p.ds_numel % s.world_size for p in s.params.values()),
        "persistent": sum(bool(getattr(p, "ds_persist", False)) for p in s.params.values()),
        "partitioned": sum(not getattr(p, "ds_persist", False) for p in s.params.values()),
        "dtypes": sorted({str(p.dtype) for p in s.params.values()}),
        # bf16 weights, but gradients accumulated and reduced in fp32 (raylora.zero's DeepSpeed config)
        "grad_accum_dtype": str(s.engine.optimizer.gradient_accumulation_dtype),
        "communication_dtype": str(s.engine.communication_data_type),
    }
    train_step(s)
    after_two = zero.gather_trainable_state(s.engine, s.params)
    # every rank restores step 1's state (rank 0 gathered it: hand it to the others, as a checkpoint would)
    state = [after_one]
    torch.distributed.broadcast_object_list(state, src=0)
    weights, moments = state[0]
    loaded = whole_checkpoint.Loaded(
        weights=weights,
        moments=moments,
        state=checkpoint.TrainState(
            step=1,
            epoch=0,
            sampler={},
            scheduler=scheduler_one,
            world_size=s.world_size,
            trainable=shapes(s.params),
            config={},
            versions={},
        ),
    )
    r = setup(cfg, loaded)  # partition_load before initialize, masters and moments after it
    restored_public = _public_state(r.params)
    model_values = read_params(r.params)
    train_step(r)
    resumed_two = zero.gather_trainable_state(r.engine, r.params)
    if s.rank == 0:
        report["gather_matches_public_api"] = _same(after_one, public_one)
        report["small_chunks_match_public_api"] = _same(in_small_chunks, public_one)
        report["moments_nonzero"] = any(m.abs().sum() > 0 for m in after_one[1].values())
        report["restore_matches_public_api"] = _same(after_one, restored_public)
        report["model_is_bf16_of_masters"] = all(
            torch.equal(model_values[n], w.to(torch.bfloat16).float()) for n, w in weights.items()
        )
        report["step_after_restore_equals_deepspeed"] = all(
            torch.equal(after_two[0][n], resumed_two[0][n]) for n in after_two[0]
        ) and all(torch.equal(after_two[1][n], resumed_two[1][n]) for n in after_two[1])
        report["num_params"] = len(s.params)
    return report


@pytest.mark.distributed
@pytest.mark.slow
def test_zero_state_helpers_match_deepspeed(ray_cluster, tiny_models, digits, tmp_path):
    cfg = tiny_run_config(
        tiny_models("llava"),
        digits[0],
        tmp_path,
        "zero-internals",
        "scaling.num_workers=3",
        "train.global_batch_size=6",
        "train.precision=bf16",
        "train.warmup_steps=0",  # step 1 already moves the masters beyond their bf16 rounding
        f"train.param_persistence_threshold={PERSIST}",
    )
    report = on_workers(lambda: _probe(cfg), tmp_path, "zero-internals", num_workers=3)
    assert report["padded"], "the probe should include partitions with padding"
    assert report["persistent"] > 0 and report["partitioned"] > 0, report
    assert report["dtypes"] == ["torch.bfloat16"]
    assert report["grad_accum_dtype"] == report["communication_dtype"] == "torch.float32", report
    assert report["num_params"] > 20
    assert report["moments_nonzero"]
    assert report["gather_matches_public_api"], "batched gather differs from DeepSpeed's per-parameter API"
    assert report["small_chunks_match_public_api"], "the gather in many messages differs from one message"
    assert report["restore_matches_public_api"], "restored masters/moments differ from what DeepSpeed reads"
    assert report["model_is_bf16_of_masters"], "partition_load's model weights differ from the masters"
    assert report["step_after_restore_equals_deepspeed"], (
        "the step after a restore differs from DeepSpeed's uninterrupted step"
    )


def _config(*overrides: str) -> config.Config:
    return config.load(None, ["model.path=m", "data.train=t.parquet", *overrides])


def test_deepspeed_config_overlaps_communication_on_gpus_only():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    gpu = zero.deepspeed_config(_config("scaling.use_gpu=true"), 8)
    cpu = zero.deepspeed_config(_config(), 2)
    assert gpu["zero_optimization"]["overlap_comm"] is True
    assert cpu["zero_optimization"]["overlap_comm"] is False  # as the CPU runs are tested
    # on GPUs, what DeepSpeed itself does at stage 3 (its default, resolved by its config validator)
    assert DeepSpeedZeroConfig(stage=3).overlap_comm is True
    assert DeepSpeedZeroConfig(**gpu["zero_optimization"]).overlap_comm is True
    assert gpu["bf16"] == {"enabled": True} and gpu["communication_data_type"] == "fp32"
    assert {k: v for k, v in gpu["zero_optimization"].items() if k != "overlap_comm"} == {
        k: v for k, v in cpu["zero_optimization"].items() if k != "overlap_comm"
    }


@pytest.mark.parametrize("world", [1, 2, 3, 8, 16, 64, 1000])
def test_gather_messages_are_a_byte_budget_whatever_the_world_size(world):
    chunk = zero.gather_chunk(world)
    per_message = world * zero.GATHER_ROWS * 4 * chunk  # what rank 0 receives: every rank's 3 fp32 rows
    assert zero.GATHER_ROWS == 3 and chunk > 0
    assert zero.GATHER_BYTES - world * zero.GATHER_ROWS * 4 < per_message <= zero.GATHER_BYTES


def test_stream_in_chunks_that_cut_through_parameters(one_rank, monkeypatch):
    """`stream_trainable_state` over messages of 4 elements, against the flat partitions it reads."""
    numels = {"a": 7, "b": 10, "c": 5}
    slots = {"a": (0, 0, 7), "b": (0, 7, 10), "c": (1, 0, 5)}  # (group, offset, length): one rank
    gen = torch.Generator().manual_seed(0)
    flats = [torch.randn(17, generator=gen), torch.randn(5, generator=gen)]
    state = {f: {k: torch.randn(f.numel(), generator=gen) for k in zero.MOMENTS} for f in flats}
    params = {}
    for name, numel in numels.items():
        params[name] = torch.nn.Parameter(torch.empty(numel))
        params[name].ds_numel = numel
    # the parts of DeepSpeed's stage-3 optimizer (and engine) that the gather reads
    optimizer = SimpleNamespace(
        fp32_partitioned_groups_flat=flats,
        grad_position={id(p): list(slots[n]) for n, p in params.items()},
        get_param_id=id,
        optimizer=SimpleNamespace(state=state),
    )
    engine = SimpleNamespace(optimizer=optimizer, device=torch.device("cpu"))
    monkeypatch.setattr(zero, "GATHER_BYTES", zero.GATHER_ROWS * 4 * 4)
    assert zero.gather_chunk(1) == 4
    pieces: list[tuple[str, str, int, int]] = []
    got = {(n, k): torch.full((numels[n],), float("nan")) for n in numels for k in ("weight", *zero.MOMENTS)}

    def sink(name: str, kind: str, start: int, values: torch.Tensor) -> None:
        pieces.append((name, kind, start, values.numel()))
        got[name, kind][start : start + values.numel()] = values

    zero.stream_trainable_state(engine, params, sink)
    for name, (group, offset, length) in slots.items():
        flat = flats[group]
        assert torch.equal(got[name, "weight"], flat[offset : offset + length])
        for kind in zero.MOMENTS:
            assert torch.equal(got[name, kind], state[flat][kind][offset : offset + length])
    # b spans elements 7..16 of group 0: messages [4, 8), [8, 12), [12, 16), [16, 17)
    assert [(start, n) for name, kind, start, n in pieces if name == "b" and kind == "weight"] == [
        (0, 1),
        (1, 4),
        (5, 4),
        (9, 1),
    ]
