"""train.deterministic's settings (raylora.determinism): what they set, and that on the CPU they change
no bit of a training step. They are process-wide, so every test here puts torch's back as it found them
(`restored_torch_settings`); `tests/test_gpu.py` checks them on CUDA."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch

from raylora import determinism

ENV = ("CUBLAS_WORKSPACE_CONFIG", "FLASH_ATTENTION_DETERMINISTIC")


@contextlib.contextmanager
def restored_torch_settings() -> Iterator[None]:
    """Run the body, then put back torch's deterministic mode, cuDNN's flags and the variables
    `use_deterministic_kernels` sets, as they were before it."""
    mode = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    cudnn = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    fill = torch.utils.deterministic.fill_uninitialized_memory
    env = {key: os.environ.get(key) for key in ENV}
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
        torch.use_deterministic_algorithms(mode[0], warn_only=mode[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_sets_what_cuda_needs_and_is_undone_after(monkeypatch):
    for key in ENV:
        monkeypatch.delenv(key, raising=False)
    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
    with restored_torch_settings():
        determinism.use_deterministic_kernels(True)
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # strict: see the module
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert os.environ["FLASH_ATTENTION_DETERMINISTIC"] == "1"
        # buffers allocated ahead (DeepSpeed's 2 GB reduce bucket) stay untouched pages, not NaN-filled
        assert not torch.utils.deterministic.fill_uninitialized_memory
    assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark) == before
    assert not any(key in os.environ for key in ENV)


@pytest.mark.parametrize("given, kept", [(":16:8", ":16:8"), (":4096:8", ":4096:8"), (":0:0", ":4096:8")])
def test_keeps_a_deterministic_cublas_setting_it_finds(monkeypatch, given, kept):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", given)
    with restored_torch_settings():
        determinism.use_deterministic_kernels(True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == kept


def test_off_leaves_torch_alone(monkeypatch):
    for key in ENV:
        monkeypatch.delenv(key, raising=False)
    with restored_torch_settings():
        torch.backends.cudnn.benchmark = True
        determinism.use_deterministic_kernels(False)
        assert not torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.benchmark
        assert not any(key in os.environ for key in ENV)


def _tiny_step(model_dir: str, train_file: str) -> dict[str, torch.Tensor]:
    """Loss and gradients of one bf16 step of the tiny Llava on the CPU: LoRA with dropout, vision tower
    and aligner trained, gradient checkpointing, raylora's answer-token loss."""
    from transformers import AutoModelForImageTextToText

    from raylora import config
    from raylora.arch import REGISTRY
    from raylora.data.batches import make_batch, read
    from raylora.data.formats import open_rows
    from raylora.data.processor import load_processor
    from raylora.loss import answer_token_losses
    from raylora.model import add_lora, mark_trained, prepare_for_training

    cfg = config.load(
        None,
        [
            f"model.path={model_dir}",
            f"data.train={train_file}",
            "train.precision=bf16",
            "train.gradient_checkpointing=true",
            "train.freeze_vision=false",
            "train.freeze_aligner=false",
            "lora.r=4",
            "lora.dropout=0.1",
        ],
    )
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.bfloat16)
    prepare_for_training(model, cfg)
    torch.manual_seed(0)
    model = add_lora(model, cfg, REGISTRY["llava"])
    params = mark_trained(model, REGISTRY["llava"], cfg)
    rows = open_rows(train_file, None, None)
    batch = make_batch(load_processor(model_dir, None, None, False), [read(rows, i) for i in range(4)])
    labels = batch.pop("labels")
    torch.manual_seed(1)  # the dropout masks
    loss = answer_token_losses(model, batch, labels)[0].sum()
    loss.backward()
    # (CLIP's post_layernorm gets none: Llava reads the second-to-last layer)
    return {"loss": loss.detach(), **{n: p.grad for n, p in params.items() if p.grad is not None}}


def test_cpu_step_is_bitwise_the_same_with_it(tiny_models, digits):
    """The CPU tests' runs are bitwise repeatable with train.deterministic off (before it existed) and
    keep every bit with it on: no op of the step raises, and none changes its result."""
    model_dir = tiny_models("llava")
    plain = _tiny_step(model_dir, str(digits[0]))
    with restored_torch_settings():
        determinism.use_deterministic_kernels(True)
        strict = _tiny_step(model_dir, str(digits[0]))
    assert plain.keys() == strict.keys() and len(plain) > 20
    for name, value in plain.items():
        assert torch.equal(value, strict[name]), name
