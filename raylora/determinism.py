"""Repeatable kernels (`train.deterministic`), set on each worker before anything runs on its GPU.

raylora's resume is exact (`tests/test_resume.py`: a killed run ends bitwise equal to an uninterrupted
one), but only as exact as the kernels: on CUDA several of them sum in an order that changes from run to
run (atomics, cuBLAS split reductions, the algorithm cuDNN benchmarks for the fastest). These settings
choose the deterministic ones. On the CPU they change nothing raylora's runs can see: tiny Llava and
Qwen2-VL steps, and 3 ZeRO-3 ranks with padded partitions, gave the same bits with them and without.
"""

from __future__ import annotations

import os

import torch

# The cuBLAS workspace settings torch's deterministic mode accepts (at::Context::
# checkCuBLASConfigDeterministic); under any other value it raises at the first matmul on CUDA.
CUBLAS_WORKSPACES = (":4096:8", ":16:8")


def use_deterministic_kernels(enabled: bool) -> None:
    """Make this process's kernels repeatable when `enabled` (otherwise leave torch's defaults alone).

    Called before the model is built and before any CUDA kernel runs. The settings are process-wide;
    a Ray Train worker is a process of its own.
    """
    if not enabled:
        return
    # cuBLAS reduces in an order that depends on its workspace; a fixed one per stream (8 buffers of
    # 4 MiB) makes its GEMMs repeat bit for bit. Read when the process makes its first cuBLAS handle, so
    # this must come before the first matmul; a value the user set that is deterministic is kept.
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in CUBLAS_WORKSPACES:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACES[0]
    # model.attn_implementation=flash_attention_2: transformers passes `deterministic` to the flash_attn
    # package's backward from this variable (read at every call), whose default sums dQ with atomics.
    os.environ["FLASH_ATTENTION_DETERMINISTIC"] = "1"
    # Strict, not warn_only: only in strict mode does torch switch SDPA to deterministic backward
    # passes (memory-efficient attention, the kernel a padding mask selects, with one key split instead
    # of atomics across splits; flash with its deterministic flag) and leave cuDNN attention, which has
    # none, out of the choice; with warn_only they warn and stay nondeterministic. Scatter, index_add and
    # index_put (embedding and gather backward, the answer-row selection) switch to sorted,
    # deterministic versions. An op that has no deterministic version raises at its first use instead of
    # silently breaking the guarantee: train.deterministic=false is the way out.
    torch.use_deterministic_algorithms(True, warn_only=False)
    # In this mode torch also writes NaN into every `torch.empty` allocation, so that a read of
    # uninitialised memory shows. DeepSpeed allocates large buffers ahead with `torch.empty` (the whole
    # 5e8-element fp32 reduce bucket: 2 GB per rank), whose pages would then all be touched: on 2 CPU
    # workers that took each one's resident memory to 10 GB and the node into Ray's OOM killer; on a GPU,
    # ~14 GB of writes per gather of a 7B base. Nothing raylora computes reads uninitialised memory (the
    # runs are bitwise equal with the fill and without), so it is turned off: determinism of the kernels
    # stays as above.
    torch.utils.deterministic.fill_uninitialized_memory = False
    # cuDNN's convolutions (the vision tower's patch embedding, in its backward when the tower trains):
    # deterministic algorithms only, and no benchmarking, which could pick another of them on each run.
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
