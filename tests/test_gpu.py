"""`make gpu-check`: the GPU path on real CUDA devices, skipped (not failed) on a machine without them.

On 1 GPU one worker, on 2 or more two workers, one GPU each: Ray Train's NCCL process group, bf16,
tiny Llava and Qwen2-VL, and the newer families: Qwen3-VL (dense) and Qwen3-VL-MoE (LoRA on its fused
experts, gathered by ZeRO-3 inside the engine's forward; the load-balancing loss). Each check prints one
line (`pytest -v`):
- collectives: one step and a checkpoint gather run on NCCL with device tensors, weights in bf16 on CUDA,
  with the GPU settings in force on the worker (ZeRO-3's overlap_comm, train.deterministic's flags);
- kernels: under train.deterministic, attention (memory-efficient with a padding mask, flash, and torch's
  own choice) and a patch-embedding convolution give the same bits forward and backward twice;
- kill and resume: 4 steps with a checkpoint at step 2 and the last worker killed before step 3, Ray
  restarts the group, the run resumes, and the final trainable state equals an uninterrupted run's: bit
  for bit with train.deterministic on, within the tolerances below with it off.
"""

from __future__ import annotations

import os

import pytest
import torch

from raylora import determinism
from raylora.driver import run
from tests import whole_checkpoint
from tests.probes import on_workers
from tests.support import tiny_run_config
from tests.test_determinism import restored_torch_settings

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORKERS = min(GPUS, 2)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.distributed,
    pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU on this machine (make gpu-check needs one)"),
]


# train.deterministic=false: the kernels sum in an order that changes from run to run, so in bf16 an
# element's gradient can move by a rounding step, and Adam normalises each element's step. Relative L2
# over all trainable tensors together: the weights within WEIGHTS_RTOL (the worst case, every key bias,
# whose gradient is zero but for rounding, stepping the other way at each of the 4 steps, is about 2e-3
# on these tiny models at lr 1e-3), the Adam moments within MOMENTS_RTOL. Held on one H200 (one worker).
WEIGHTS_RTOL, MOMENTS_RTOL = 1e-2, 5e-2


def _relative_l2(reference: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    """||got - reference|| / ||reference||, over every tensor of `reference` together."""
    diff = sum(float((got[n].double() - t.double()).pow(2).sum()) for n, t in reference.items())
    return (diff / sum(float(t.double().pow(2).sum()) for t in reference.values())) ** 0.5


# Mixture-of-experts models: LoRA on the fused experts (PEFT's target_parameters) takes no dropout.
ARCH_OVERRIDES = {"qwen3_vl_moe": ("lora.dropout=0",)}


def _overrides(*extra: str, arch: str | None = None) -> list[str]:
    return [
        *ARCH_OVERRIDES.get(arch, ()),
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
        "overlap_comm": s.engine.zero_overlap_comm(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn": [torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark],
        "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }
    if s.rank == 0:
        weights, _ = gathered
        info["gathered_on_host"] = all(t.device.type == "cpu" for t in weights.values())
    return info


def _host_sync_probe(cfg) -> list[str]:
    """Where raylora's own code waited for the GPU during one training step (after a warm-up step):
    torch's sync debug mode warns at every synchronizing CUDA call, and a warning's location is the Python
    line that made the call. DeepSpeed's own syncs (its optimizer step) are not raylora's to remove."""
    import warnings

    from raylora.worker import setup, train_step

    s = setup(cfg, None)
    train_step(s)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train_step(s)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    return [f"{w.filename}:{w.lineno}" for w in syncs if f"{os.sep}raylora{os.sep}" in w.filename]


def test_gpu_step_waits_for_the_device_once(ray_cluster, tiny_models, digits, tmp_path):
    """One host sync per step in raylora's code (the step's metrics, read once at its end): no `.item()`
    per micro batch, no boolean-mask indexing, batches copied from pinned memory without blocking."""
    cfg = tiny_run_config(tiny_models("llava"), digits[0], tmp_path, "gpu-syncs", *_overrides())
    ours = on_workers(lambda: _host_sync_probe(cfg), tmp_path, "gpu-syncs", num_workers=WORKERS, use_gpu=True)
    assert len(ours) == 1 and f"raylora{os.sep}worker.py:" in ours[0], ours


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe"])
def test_gpu_collectives_on_nccl_in_bf16(arch, ray_cluster, tiny_models, digits, tmp_path):
    cfg = tiny_run_config(tiny_models(arch), digits[0], tmp_path, f"gpu-probe-{arch}", *_overrides(arch=arch))
    info = on_workers(
        lambda: _collective_probe(cfg), tmp_path, f"gpu-probe-{arch}", num_workers=WORKERS, use_gpu=True
    )
    assert info["backend"] == "nccl"
    assert info["device"].startswith("cuda")
    assert info["dtypes"] == ["torch.bfloat16"]
    assert info["gathered_on_host"]
    assert info["loss"] == info["loss"] and info["loss"] > 0  # finite, not NaN
    assert info["overlap_comm"] is True  # gradient reduce-scatters on their own stream
    assert info["deterministic"] and not info["warn_only"]  # train.deterministic's default
    assert info["cudnn"] == [True, False] and info["cublas"] in determinism.CUBLAS_WORKSPACES


def _kernel_grads(kernel: str, device: str = "cuda") -> list[torch.Tensor]:
    """Output and input gradients of one kernel, from fixed random inputs."""
    import contextlib

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16).requires_grad_()

    if kernel == "conv2d":  # CLIP ViT-L/14-336's patch embedding, its weight gradient as a trained tower's
        x, w = randn(8, 3, 336, 336), randn(1024, 3, 14, 14)
        out = F.conv2d(x, w, stride=14)
        inputs = [x, w]
    else:  # batch 2, 16 heads, 2048 tokens of width 64; the second row's last 548 keys are padding
        q, k, v = randn(2, 16, 2048, 64), randn(2, 16, 2048, 64), randn(2, 16, 2048, 64)
        lengths = torch.tensor([2048, 1500], device=device)
        mask = (torch.arange(2048, device=device) < lengths[:, None])[:, None, None, :]
        backends = {"efficient": SDPBackend.EFFICIENT_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
        chosen = sdpa_kernel(backends[kernel]) if kernel in backends else contextlib.nullcontext()
        with chosen:
            if kernel == "flash":  # no mask: flash takes none
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        inputs = [q, k, v]
    out.backward(torch.randn(out.shape, generator=gen, device=device, dtype=out.dtype))
    return [out.detach(), *(t.grad for t in inputs)]


@pytest.mark.parametrize("kernel", ["efficient", "flash", "torch_choice", "conv2d"])
def test_gpu_kernels_repeat_bit_for_bit_when_deterministic(kernel):
    with restored_torch_settings():
        determinism.use_deterministic_kernels(True)
        first, second = _kernel_grads(kernel), _kernel_grads(kernel)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b), f"{kernel}: two runs differ under train.deterministic"


# The newer families bit for bit only (train.deterministic, the default): each case is two Ray runs.
KILL_AND_RESUME = [
    *[(arch, deterministic) for arch in ("llava", "qwen2_vl") for deterministic in (True, False)],
    ("qwen3_vl", True),
    ("qwen3_vl_moe", True),
]


@pytest.mark.parametrize(
    ("arch", "deterministic"),
    KILL_AND_RESUME,
    ids=[f"{a}-{'deterministic' if d else 'nondeterministic'}" for a, d in KILL_AND_RESUME],
)
def test_gpu_kill_and_resume_equals_uninterrupted(
    arch, deterministic, ray_cluster, tiny_models, digits, tmp_path
):
    model, setting = tiny_models(arch), f"train.deterministic={str(deterministic).lower()}"
    straight = run(tiny_run_config(model, digits[0], tmp_path, "straight", *_overrides(setting, arch=arch)))
    killed = run(
        tiny_run_config(
            model, digits[0], tmp_path, "killed", *_overrides(setting, "fault.kill_at_steps=2", arch=arch)
        )
    )
    assert straight.error is None and killed.error is None
    with straight.checkpoint.as_directory() as a, killed.checkpoint.as_directory() as b:
        one, other = whole_checkpoint.load(a), whole_checkpoint.load(b)
    assert other.state.restarts == 1 and one.state.step == other.state.step == 4
    if not deterministic:
        assert _relative_l2(one.weights, other.weights) <= WEIGHTS_RTOL
        assert _relative_l2(one.moments, other.moments) <= MOMENTS_RTOL
        return
    for name, value in one.weights.items():
        assert torch.equal(value, other.weights[name]), f"{name} differs after resume"
    for name, value in one.moments.items():
        assert torch.equal(value, other.moments[name]), f"{name} differs after resume"


def test_gpu_qlora_kill_resume_and_evaluation(ray_cluster, tiny_models, digits, tmp_path):
    """model.quantization=nf4 on CUDA (bitsandbytes' CUDA kernels, bf16 storage and compute): the 4-bit
    language model loads on each worker's GPU, evaluation runs between steps, and a killed run resumes bit
    for bit."""
    pytest.importorskip("bitsandbytes")
    model = tiny_models("qwen3_vl")
    qlora = ("model.quantization=nf4", f"data.eval={digits[1]}", "train.eval_every=2", "train.eval_samples=8")
    straight = run(tiny_run_config(model, digits[0], tmp_path, "straight", *_overrides(*qlora)))
    killed = run(
        tiny_run_config(model, digits[0], tmp_path, "killed", *_overrides(*qlora, "fault.kill_at_steps=2"))
    )
    assert straight.error is None and killed.error is None
    with straight.checkpoint.as_directory() as a, killed.checkpoint.as_directory() as b:
        one, other = whole_checkpoint.load(a), whole_checkpoint.load(b)
    assert other.state.restarts == 1 and one.state.step == other.state.step == 4
    assert not any("base_layer" in name for name in one.weights), "a 4-bit base weight was saved"
    for name, value in one.weights.items():
        assert torch.equal(value, other.weights[name]), f"{name} differs after resume"
    assert "eval_loss" in straight.metrics


def _flash_attn_imports() -> bool:
    try:
        import flash_attn  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.parametrize("attn", ["sdpa", "flash_attention_2"])
@pytest.mark.parametrize("arch", ["llava", "qwen2_vl", "qwen3_vl"])
def test_gpu_packed_row_gives_the_padded_loss_and_gradients(arch, attn):
    """train.packing on CUDA: sdpa under the packed mask in fp32 (1e-5, as on the CPU), and
    flash_attention_2's varlen path, which transformers takes from the restarting position ids, in bf16
    (the padded batch's own bf16 rounding apart: 2e-2)."""
    from raylora.assets import build_tiny_model
    from raylora.data import packing
    from raylora.data.batches import _collate
    from raylora.data.labels import encode
    from tests.test_batches import SAMPLES
    from tests.test_packing import _loss_and_grads, _relative

    if attn == "flash_attention_2" and not _flash_attn_imports():
        pytest.skip("flash_attn is not installed here")
    dtype, tolerance = (torch.float32, 1e-5) if attn == "sdpa" else (torch.bfloat16, 2e-2)
    model, processor = build_tiny_model(arch, width=64, layers=2, seed=0)
    model.config.use_cache = model.config.get_text_config().use_cache = False
    model.set_attn_implementation(attn)
    model = model.to("cuda", dtype).eval()
    padded = _collate(processor, [encode(processor, s) for s in SAMPLES], with_answers=True)
    row = packing.packed(padded, packing.rope_index_of(model))

    def on_gpu(batch: dict) -> dict:
        return {k: v.to("cuda", dtype) if v.is_floating_point() else v.to("cuda") for k, v in batch.items()}

    loss, grads = _loss_and_grads(model, on_gpu(padded))
    packed_loss, packed_grads = _loss_and_grads(model, on_gpu(row))
    gap = _relative(grads.float(), packed_grads.float())
    print(f"{arch} {attn}: loss {_relative(loss, packed_loss):.1e}, gradients {gap:.1e}")
    assert _relative(loss, packed_loss) <= tolerance
    assert gap <= tolerance
