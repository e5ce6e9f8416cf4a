"""raylora.zero reads and writes DeepSpeed ZeRO-3 internals; check it against DeepSpeed's public API.

If a DeepSpeed upgrade moves the flat fp32 partitions, `grad_position`, the optimizer state keys or
the layout of a parameter's partition, this test fails loudly. Three workers, so that partitions carry
padding (64-wide tensors do not split evenly in three).
"""

from __future__ import annotations

import pytest
import ray.train
import torch
from ray.train.torch import TorchTrainer

from raylora.assets import tiny_run_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _probe(cfg) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from raylora import zero
    from raylora.worker import setup, train_step

    s = setup(cfg, None)
    train_step(s)
    ours = zero.gather_trainable_state(s.engine, s.params)
    public = {
        n: (
            safe_get_full_fp32_param(p),
            safe_get_full_optimizer_state(p, "exp_avg"),
            safe_get_full_optimizer_state(p, "exp_avg_sq"),
        )
        for n, p in s.params.items()
    }
    padded = any(p.ds_numel % s.world_size for p in s.params.values())
    report = {}
    if s.rank == 0:
        weights, moments = ours
        report["gather_matches"] = all(
            torch.equal(weights[n], w)
            and torch.equal(moments[f"{n}.exp_avg"], m)
            and torch.equal(moments[f"{n}.exp_avg_sq"], v)
            for n, (w, m, v) in public.items()
        )
        report["moments_nonzero"] = any(m.abs().sum() > 0 for m in moments.values())  # lora_A: 0 at step 1
    # write known values through raylora, read them back through DeepSpeed
    new_w = {
        n: torch.full(zero.full_shape(p), 0.5) + torch.arange(p.ds_numel).reshape(zero.full_shape(p)) * 1e-3
        for n, p in s.params.items()
    }
    new_m = {f"{n}.{k}": w * (2.0 if k == "exp_avg" else 3.0) for n, w in new_w.items() for k in zero.MOMENTS}
    zero.set_trainable_state(s.engine, s.params, new_w, new_m, step=7)
    back = {
        n: (
            safe_get_full_fp32_param(p),
            safe_get_full_optimizer_state(p, "exp_avg"),
            safe_get_full_optimizer_state(p, "exp_avg_sq"),
        )
        for n, p in s.params.items()
    }
    if s.rank == 0:
        report["set_matches"] = all(
            torch.equal(w, new_w[n])
            and torch.equal(m, new_m[f"{n}.exp_avg"])
            and torch.equal(v, new_m[f"{n}.exp_avg_sq"])
            for n, (w, m, v) in back.items()
        )
        report["padded"] = padded
        report["num_params"] = len(s.params)
    # the restore's partition load, read back through GatheredParameters (LoRA is partitioned by now too)
    zero.partition_load(s.params, {n: -w for n, w in new_w.items()})
    loaded = zero.read_params(s.params)
    if s.rank == 0:
        report["load_matches"] = all(torch.equal(loaded[n], -w) for n, w in new_w.items())
    return report


def test_zero_state_helpers_match_deepspeed_public_api(ray_cluster, tiny_models, digits, tmp_path):
    cfg = tiny_run_config(
        tiny_models("llava"),
        digits[0],
        tmp_path,
        "zero-internals",
        "scaling.num_workers=3",
        "train.global_batch_size=6",
    )
    trainer = TorchTrainer(
        lambda: _probe(cfg),
        scaling_config=ray.train.ScalingConfig(num_workers=3),
        run_config=ray.train.RunConfig(name="zero-internals", storage_path=str(tmp_path)),
    )
    report = trainer.fit().return_value
    assert report["padded"], "the probe should include partitions with padding"
    assert report["num_params"] > 20
    assert report["moments_nonzero"]
    assert report["gather_matches"], "batched gather differs from safe_get_full_fp32_param/optimizer_state"
    assert report["set_matches"], "set_trainable_state differs from what DeepSpeed reads back"
    assert report["load_matches"], "partition_load differs from what GatheredParameters reads back"
