"""raylora.zero reads and writes DeepSpeed ZeRO-3 internals; check it against DeepSpeed itself.

If a DeepSpeed upgrade moves the flat fp32 partitions, `grad_position`, the optimizer state keys or
the layout of a parameter's partition, this test fails loudly. Three workers, so that partitions carry
padding (64-wide tensors do not split evenly in three); bf16, so that the model's weights and the fp32
masters differ; a persistence threshold that keeps the small parameters whole (gathered) beside
partitioned ones. The restore runs in the order training uses (partition load before
`deepspeed.initialize`, masters and moments after it), and the optimizer step that follows it must
give exactly what DeepSpeed's own uninterrupted step gave.
"""

from __future__ import annotations

import pytest
import torch

from raylora import checkpoint
from tests.support import on_workers, read_params, tiny_run_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

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
    from raylora import zero
    from raylora.model import shapes
    from raylora.worker import setup, train_step

    # DeepSpeed's own run: two steps; raylora's gather checked against the public API after each
    s = setup(cfg, None)
    train_step(s)
    after_one = zero.gather_trainable_state(s.engine, s.params)
    public_one = _public_state(s.params)
    scheduler_one = s.scheduler.state_dict()
    report = {
        "padded": any(p.ds_numel % s.world_size for p in s.params.values()),
        "persistent": sum(bool(getattr(p, "ds_persist", False)) for p in s.params.values()),
        "partitioned": sum(not getattr(p, "ds_persist", False) for p in s.params.values()),
        "dtypes": sorted({str(p.dtype) for p in s.params.values()}),
    }
    train_step(s)
    after_two = zero.gather_trainable_state(s.engine, s.params)
    # every rank restores step 1's state (rank 0 gathered it: hand it to the others, as a checkpoint would)
    state = [after_one]
    torch.distributed.broadcast_object_list(state, src=0)
    weights, moments = state[0]
    loaded = checkpoint.Loaded(
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
    assert report["num_params"] > 20
    assert report["moments_nonzero"]
    assert report["gather_matches_public_api"], "batched gather differs from DeepSpeed's per-parameter API"
    assert report["restore_matches_public_api"], "restored masters/moments differ from what DeepSpeed reads"
    assert report["model_is_bf16_of_masters"], "partition_load's model weights differ from the masters"
    assert report["step_after_restore_equals_deepspeed"], (
        "the step after a restore differs from DeepSpeed's uninterrupted step"
    )
