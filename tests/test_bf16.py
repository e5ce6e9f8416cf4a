"""The bf16 path, on CPU: DeepSpeed's CPU accelerator runs ZeRO-3 in bf16, so what a GPU run does with
its weights, masters, gradients and checkpoints is tested here (NCCL itself is `make gpu-check`'s).

bf16 weights and activations, LoRA in bf16 beside a trained bf16 vision tower and aligner, fp32 masters,
Adam moments, gradient accumulation and reduction; a worker killed after a checkpoint; the resumed run
must equal the uninterrupted one bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from raylora import checkpoint
from tests.support import final_checkpoint as _final
from tests.support import on_workers, read_params, straight_and_killed, tiny_run_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

KILL_AT = 3  # rank 1 dies before step 4; the last checkpoint was at step 2
BF16 = "train.precision=bf16"


# Qwen2-VL, whose aligner (the merger) sits inside the vision tower; Llava's resume is tests/test_resume.py.
@pytest.fixture(scope="module", params=["qwen2_vl"])
def runs(request, ray_cluster, tiny_models, digits, tmp_path_factory):
    arch = request.param
    storage = tmp_path_factory.mktemp(f"bf16-{arch}")
    model_dir = tiny_models(arch)
    straight, killed = straight_and_killed(model_dir, digits[0], storage, KILL_AT, BF16)
    return {"model_dir": model_dir, "straight": straight, "killed": killed, "digits": digits[0]}


def test_bf16_resume_equals_uninterrupted_bitwise(runs):
    straight, killed = _final(runs["straight"]), _final(runs["killed"])
    assert killed.state.restarts == 1 and straight.state.restarts == 0
    assert straight.state.step == killed.state.step == 6
    assert any(".lora_" not in n and "projector" in n or ".merger." in n for n in straight.weights), (
        "the aligner should be trained"
    )
    assert straight.weights.keys() == killed.weights.keys()
    for name, value in straight.weights.items():
        assert torch.equal(value, killed.weights[name]), f"{name} differs after resume"
    for name, value in straight.moments.items():
        assert torch.equal(value, killed.moments[name]), f"{name} differs after resume"
    resumed = runs["killed"].return_value
    losses = {m["step"]: m["loss"] for m in runs["straight"].return_value}
    assert [m["step"] for m in resumed] == [3, 4, 5, 6]
    assert all(m["loss"] == losses[m["step"]] for m in resumed)


def test_bf16_checkpoint_holds_fp32_masters_beyond_bf16(runs):
    final = _final(runs["straight"])
    assert all(t.dtype == torch.float32 for t in final.weights.values())
    assert all(t.dtype == torch.float32 for t in final.moments.values())
    # masters that were only bf16 values cast up would equal their bf16 rounding everywhere; every
    # parameter that received gradients (llava's unused vision post_layernorm does not) must not
    updated = [n for n in final.weights if final.moments[f"{n}.exp_avg_sq"].abs().sum() > 0]
    assert len(updated) > len(final.weights) // 2
    bf16_only = [n for n in updated if torch.equal(final.weights[n], final.weights[n].bfloat16().float())]
    assert not bf16_only, f"masters with bf16 precision only: {bf16_only}"


def _bf16_probe(cfg, folder: str) -> dict:
    """On each rank: restore from `folder` in bf16 and report what the engine holds before any step."""
    from raylora import zero
    from raylora.worker import setup

    loaded = checkpoint.load(folder)
    s = setup(cfg, loaded)
    model_values = {n: p for n, p in read_params(s.params).items()}
    dtypes = {str(p.dtype) for p in s.params.values()}
    gathered = zero.gather_trainable_state(s.engine, s.params)
    if s.rank != 0:
        return {}
    masters, moments = gathered
    w = loaded.weights
    return {
        "param_dtypes": sorted(dtypes),
        "grad_accum_dtype": str(s.engine.optimizer.gradient_accumulation_dtype),
        "communication_dtype": str(s.engine.communication_data_type),
        "params_are_bf16_rounding": all(
            torch.equal(model_values[n], w[n].to(torch.bfloat16).float()) for n in w
        ),
        "masters_equal": all(torch.equal(masters[n], w[n]) for n in w),
        "moments_equal": all(torch.equal(moments[n], loaded.moments[n]) for n in loaded.moments),
    }


def test_bf16_restore_keeps_fp32_masters_and_accumulates_in_fp32(runs, tmp_path):
    mid = runs["straight"].best_checkpoints[0][0]  # the step-2 checkpoint
    cfg = tiny_run_config(runs["model_dir"], runs["digits"], tmp_path, "probe", BF16)
    with mid.as_directory() as folder:
        probe = on_workers(lambda: _bf16_probe(cfg, folder), tmp_path, "probe")
    assert probe["param_dtypes"] == ["torch.bfloat16"], "LoRA and trained modules should share bf16"
    assert probe["grad_accum_dtype"] == "torch.float32"
    assert probe["communication_dtype"] == "torch.float32"
    assert probe["params_are_bf16_rounding"]
    assert probe["masters_equal"], "fp32 masters lost precision on restore (rebuilt from bf16 weights?)"
    assert probe["moments_equal"]
