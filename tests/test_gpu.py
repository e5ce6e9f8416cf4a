"""`make gpu-check`: the GPU path on real CUDA devices, skipped (not failed) on a machine without them.

On 1 GPU one worker, on 2 or more two workers, one GPU each: Ray Train's NCCL process group, bf16,
tiny Llava and Qwen2-VL. Each check prints one line (`pytest -v`):
- collectives: one step and a checkpoint gather run on NCCL with device tensors, weights in bf16 on CUDA;
- kill and resume: 4 steps with a checkpoint at step 2 and the last worker killed before step 3, Ray
  restarts the group, the run resumes, and the final trainable state equals an uninterrupted run's.
"""

from __future__ import annotations

import pytest
import torch

from raylora import checkpoint
from raylora.driver import run
from tests.support import on_workers, tiny_run_config

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORKERS = min(GPUS, 2)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.distributed,
    pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU on this machine (make gpu-check needs one)"),
]


def _overrides(*extra: str) -> list[str]:
    return [
        "scaling.use_gpu=true",  # bf16 by default on GPU
        f"scaling.num_workers={WORKERS}",
        f"train.global_batch_size={4 * WORKERS}",
        "train.micro_batch_size=2",
        "train.max_steps=4",
        "train.checkpoint_every=2",
        f"fault.kill_rank={WORKERS - 1}",
        *extra,
    ]


def _collective_probe(cfg) -> dict:
    import torch.distributed as dist

    from raylora import zero
    from raylora.worker import setup, train_step

    s = setup(cfg, None)
    metrics = train_step(s)  # all-reduces the step's loss and token counts
    gathered = zero.gather_trainable_state(s.engine, s.params)  # what a checkpoint save gathers
    info = {
        "backend": dist.get_backend(),
        "device": str(s.engine.device),
        "dtypes": sorted({str(p.dtype) for p in s.params.values()}),
        "loss": metrics["loss"],
    }
    if s.rank == 0:
        weights, _ = gathered
        info["gathered_on_host"] = all(t.device.type == "cpu" for t in weights.values())
    return info


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl"])
def test_gpu_collectives_on_nccl_in_bf16(arch, ray_cluster, tiny_models, digits, tmp_path):
    cfg = tiny_run_config(tiny_models(arch), digits[0], tmp_path, f"gpu-probe-{arch}", *_overrides())
    info = on_workers(
        lambda: _collective_probe(cfg), tmp_path, f"gpu-probe-{arch}", num_workers=WORKERS, use_gpu=True
    )
    assert info["backend"] == "nccl"
    assert info["device"].startswith("cuda")
    assert info["dtypes"] == ["torch.bfloat16"]
    assert info["gathered_on_host"]
    assert info["loss"] == info["loss"] and info["loss"] > 0  # finite, not NaN


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl"])
def test_gpu_kill_and_resume_equals_uninterrupted(arch, ray_cluster, tiny_models, digits, tmp_path):
    model = tiny_models(arch)
    straight = run(tiny_run_config(model, digits[0], tmp_path, "straight", *_overrides()))
    killed = run(tiny_run_config(model, digits[0], tmp_path, "killed", *_overrides("fault.kill_at_steps=2")))
    assert straight.error is None and killed.error is None
    with straight.checkpoint.as_directory() as a, killed.checkpoint.as_directory() as b:
        one, other = checkpoint.load(a), checkpoint.load(b)
    assert other.state.restarts == 1 and one.state.step == other.state.step == 4
    for name, value in one.weights.items():
        assert torch.equal(value, other.weights[name]), f"{name} differs after resume"
    for name, value in one.moments.items():
        assert torch.equal(value, other.moments[name]), f"{name} differs after resume"
