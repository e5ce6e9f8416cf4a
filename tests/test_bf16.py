"""The bf16 path, on CPU: DeepSpeed's CPU accelerator runs ZeRO-3 in bf16, so what a GPU run does with
its weights, masters, gradients and checkpoints is tested here (NCCL itself is `make gpu-check`'s).

bf16 weights and activations, LoRA in bf16 beside a trained bf16 vision tower and aligner, fp32 masters,
Adam moments; a worker killed after a checkpoint; the resumed run must equal the uninterrupted one bit for
bit. What a bf16 restore puts into DeepSpeed's engine (masters, moments, weights as the masters' bf16
rounding) and the fp32 gradient accumulation and reduction are tests/test_zero_internals.py's probe.
"""

from __future__ import annotations

import pytest
import torch

from tests.run_logs import final_checkpoint as _final
from tests.support import straight_and_killed

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
