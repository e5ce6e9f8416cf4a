"""Memory controls: answer-only logits, gradient checkpointing, pixel caps, max_length.

Single-process tests on every tiny architecture. On 2 ZeRO-3 workers, gradient checkpointing and too-long
samples are killed and resumed against a straight run in tests/test_batches.py (its mixed-data runs).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from transformers import AutoModelForImageTextToText
from transformers.modeling_layers import GradientCheckpointingLayer

from raylora import config
from raylora.arch import detect
from raylora.assets import PROMPT, TINY_ARCHS
from raylora.config import ConfigError
from raylora.data.batches import check_max_length, limit_length, make_batch, read
from raylora.data.formats import open_rows
from raylora.data.labels import IGNORE_INDEX
from raylora.data.processor import load_processor
from raylora.driver import preflight
from raylora.loss import answer_positions, answer_token_losses, predicts_answer
from raylora.model import add_lora, base_name, prepare_for_training, set_trainable
from tests.support import tiny_processor, tiny_run_config

LONG_PROMPT = " ".join([PROMPT] * 4)


def _examples(digits, n: int = 3) -> list:
    data = open_rows(str(digits[0]))
    examples = [read(data, j) for j in range(n)]
    # prompts of different lengths, so rows are padded and answers sit at different positions
    for messages, _ in examples[::2]:
        messages[0]["content"][1]["text"] = LONG_PROMPT
    return examples


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_answer_only_loss_equals_full_logits_loss(arch, tiny_models, digits):
    folder = tiny_models(arch)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    processor = tiny_processor(folder)
    batch = make_batch(processor, _examples(digits))
    labels = batch.pop("labels")
    lm_head_rows = []
    model.lm_head.register_forward_hook(lambda m, i, out: lm_head_rows.append(out.shape[:-1].numel()))
    with torch.no_grad():
        logits = model(**batch).logits.float()
        full = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]),
            labels[:, 1:].reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        losses, rows = answer_token_losses(model, batch, labels)
    answers = labels != IGNORE_INDEX
    assert lm_head_rows == [labels.numel(), int(answers.sum())], (
        "logits of non-answer positions were computed"
    )
    assert rows.tolist() == answers.nonzero()[:, 0].tolist()
    torch.testing.assert_close(losses.sum(), full, rtol=1e-6, atol=1e-6)


def test_answer_positions_select_what_the_boolean_mask_selects():
    """The index tensors the training step builds on the CPU pick the same hidden states, in the same order,
    as indexing with the boolean mask: rows of several answer lengths, a row without any, multi-turn."""
    labels = torch.full((4, 9), IGNORE_INDEX)
    labels[0, 3:5] = torch.tensor([7, 8])
    labels[2, 1:8] = torch.arange(1, 8)
    labels[3, [2, 3, 6, 8]] = torch.tensor([4, 5, 6, 2])  # two answers of one conversation
    keep = predicts_answer(labels)
    pos = answer_positions(labels)
    hidden = torch.randn(4, 9, 5)
    assert torch.equal(hidden.flatten(0, 1).index_select(0, pos["flat"]), hidden[keep])
    assert torch.equal(pos["targets"], labels[:, 1:][keep[:, :-1]])
    assert pos["rows"].tolist() == [0, 0] + [2] * 7 + [3] * 4
    nothing = answer_positions(torch.full((2, 5), IGNORE_INDEX))  # a step of stand-ins only
    assert [len(v) for v in nothing.values()] == [0, 0, 0]


def test_precomputed_positions_give_the_same_losses_bitwise(tiny_models, digits):
    folder = tiny_models("qwen2_vl")
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    batch = make_batch(load_processor(folder), _examples(digits))
    labels = batch.pop("labels")
    keep = predicts_answer(labels)
    with torch.no_grad():
        by_mask = F.cross_entropy(
            model(**batch, logits_to_keep=keep).logits.float(), labels[:, 1:][keep[:, :-1]], reduction="none"
        )
        losses, rows = answer_token_losses(model, batch, labels, answer_positions(labels))
        assert model(**batch).logits.shape[:2] == labels.shape, "the lm_head hook must not outlive its pass"
    assert torch.equal(losses, by_mask)
    assert torch.equal(rows, keep.nonzero()[:, 0])


def _checkpointed_layers(model, prefixes: tuple[str, ...]) -> list:
    under = tuple(p + "." for p in prefixes)
    return [
        m
        for n, m in model.named_modules()
        if n.startswith(under) and isinstance(m, GradientCheckpointingLayer)
    ]


def _one_step(folder: str, examples: list, on: bool) -> tuple[float, dict, dict]:
    """Loss, trainable gradients, and forward calls per part, of a LoRA model with a trained vision tower."""
    cfg = config.from_dict(
        {
            "model": {"path": folder},
            # LoRA on a mixture of experts' fused tensors takes no dropout (raylora.moe)
            "lora": {"r": 4, "dropout": 0.0 if detect(folder).model_type.endswith("_moe") else 0.1},
            "train": {"gradient_checkpointing": on, "freeze_vision": False, "freeze_aligner": False},
        }
    )
    arch = detect(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    prepare_for_training(model, cfg)
    model = add_lora(model, cfg, arch)
    set_trainable(model, arch, cfg)
    base = model.get_base_model()
    calls = {}
    for part in ("vision_tower", "language_model"):
        layers = _checkpointed_layers(base, getattr(arch, part))
        assert layers, f"no checkpointable layers in the {part}"
        first_linear = next(m for m in layers[0].modules() if isinstance(m, torch.nn.Linear))
        calls[part] = 0

        def count(*_, part=part):
            calls[part] += 1

        first_linear.register_forward_hook(count)
    if on:
        assert getattr(base, "_require_grads_hooks", None), "PEFT did not enable the input embeddings' grads"
    batch = make_batch(tiny_processor(folder), examples)
    labels = batch.pop("labels")
    torch.manual_seed(0)
    loss = answer_token_losses(model, batch, labels)[0].sum()
    loss.backward()
    # some trained parameters take no part (e.g. CLIP's post_layernorm, which Llava skips): no gradient
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads, calls


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_gradient_checkpointing_same_loss_and_gradients(arch, tiny_models, digits):
    folder, examples = tiny_models(arch), _examples(digits, 2)
    loss_off, grads_off, calls_off = _one_step(folder, examples, on=False)
    loss_on, grads_on, calls_on = _one_step(folder, examples, on=True)
    # each checkpointed layer runs again in the backward pass: the vision tower's as well as the decoder's
    assert calls_off == {"vision_tower": 1, "language_model": 1}
    assert calls_on == {"vision_tower": 2, "language_model": 2}
    assert loss_on == pytest.approx(loss_off, rel=1e-6)
    assert grads_on.keys() == grads_off.keys()
    part = detect(folder).part_of
    nonzero = {part(base_name(n)) or "lora" for n, g in grads_off.items() if g.abs().sum() > 0}
    assert {"vision_tower", "language_model"} <= nonzero, "LoRA and the vision tower both get gradients"
    for name in grads_off:
        torch.testing.assert_close(grads_on[name], grads_off[name], rtol=1e-5, atol=1e-7, msg=name)


def _image_tokens(processor, image) -> int:
    batch = processor(
        text=["<|vision_start|><|image_pad|><|vision_end|>"], images=[image], return_tensors="pt"
    )
    return int((batch["input_ids"] == processor.image_token_id).sum())


def test_max_pixels_bounds_image_tokens_qwen2_vl(tiny_models):
    folder = tiny_models("qwen2_vl")
    large = Image.new("RGB", (640, 640), (200, 10, 10))
    per_token = (4 * 2) ** 2  # pixels per image token: 4 px patches, 2x2 merged
    assert _image_tokens(load_processor(folder), large) == 256 // per_token  # the tiny folder's own cap
    for max_pixels in (1024, 4096):
        tokens = _image_tokens(load_processor(folder, max_pixels=max_pixels), large)
        assert max_pixels // per_token // 2 <= tokens <= max_pixels // per_token
    processor = load_processor(folder, max_pixels=4096, min_pixels=1024)
    assert _image_tokens(processor, Image.new("RGB", (8, 8))) >= 1024 // per_token  # upscaled to min_pixels


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.attn_implementation=flash"], "model.attn_implementation: expected one of sdpa"),
        (["model.attn_implementation=flash_attention_2"], "needs scaling.use_gpu and bf16"),
        (["data.max_length=0"], "data.max_length must be positive"),
        (["data.max_pixels=100", "data.min_pixels=200"], "data.min_pixels (200) exceeds data.max_pixels"),
    ],
)
def test_memory_config_errors(overrides, message, tmp_path):
    with pytest.raises(ConfigError) as err:
        tiny_run_config(tmp_path, tmp_path / "train.parquet", tmp_path, "bad", *overrides)
    assert message in str(err.value)


def test_gradient_checkpointing_default_follows_the_device(tmp_path):
    on_cpu = tiny_run_config(tmp_path, tmp_path / "t.parquet", tmp_path, "x")
    on_gpu = tiny_run_config(tmp_path, tmp_path / "t.parquet", tmp_path, "x", "scaling.use_gpu=true")
    assert on_cpu.train.gradient_checkpointing is None and on_gpu.train.gradient_checkpointing is None
    assert not on_cpu.gradient_checkpointing and on_gpu.gradient_checkpointing


@pytest.mark.parametrize(
    "arch, overrides, message",
    [
        ("llava", ["data.max_pixels=4096"], "resizes every image to 16x16"),
        ("gemma3", ["data.min_pixels=64"], "resizes every image to 16x16"),
        ("internvl", ["data.max_pixels=4096"], "resizes every image to 16x16"),
        ("mistral3", ["data.min_pixels=64"], "has no minimum image size"),
        (
            "qwen2_vl",
            ["data.min_pixels=4096"],
            "data.min_pixels (4096) exceeds the most pixels per image (256",
        ),
        (
            "qwen2_vl",
            ["model.attn_implementation=flash_attention_2", "scaling.use_gpu=true"],
            "needs the flash_attn package",
        ),
    ],
)
def test_refused_before_ray_starts(arch, overrides, message, tiny_models, digits, tmp_path):
    cfg = tiny_run_config(tiny_models(arch), digits[0], tmp_path, "refused", *overrides)
    with pytest.raises(ConfigError) as err:
        preflight(cfg)
    assert message in str(err.value)


def test_too_long_samples_are_replaced_by_a_blank_row(tiny_models, digits):
    processor = load_processor(tiny_models("qwen2_vl"))
    examples = _examples(digits, 3)  # rows 0 and 2 have the long prompt
    lengths = make_batch(processor, examples)["attention_mask"].sum(dim=1).tolist()
    assert lengths[0] == lengths[2] > lengths[1]
    batch, too_long = limit_length(processor, examples, max_length=lengths[1])
    assert too_long == [0, 2]
    assert batch["input_ids"].shape[1] == lengths[1]
    assert (batch["labels"][too_long] == IGNORE_INDEX).all() and (batch["labels"][1] != IGNORE_INDEX).any()
    assert batch["image_grid_thw"].shape[0] == 3, "the stand-in rows still carry an image"
    unlimited, none = limit_length(processor, examples, max_length=None)
    assert none == [] and torch.equal(unlimited["input_ids"], make_batch(processor, examples)["input_ids"])
    check_max_length(processor, lengths[1])
    with pytest.raises(ConfigError, match=r"data.max_length \(5\).*takes \d+ tokens, 4 of them image tokens"):
        check_max_length(processor, 5)
