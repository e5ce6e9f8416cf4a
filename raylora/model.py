"""Building the model on a worker: base model partitioned by ZeRO-3 as it loads, then LoRA.

`from_pretrained` runs while an `HfDeepSpeedConfig` is alive, so transformers loads under
`deepspeed.zero.Init` and no worker ever holds a full copy of the base model (the path that lets a 7B
model fit). The returned handle must stay referenced until `deepspeed.initialize` has run.
"""

from __future__ import annotations

import peft
import torch
from transformers import AutoModelForImageTextToText
from transformers.integrations import HfDeepSpeedConfig

from raylora.arch import Architecture, lora_target_regex
from raylora.config import Config
from raylora.zero import full_shape

PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the base model's parameter names


def build_model(cfg: Config, arch: Architecture, ds_config: dict) -> tuple[peft.PeftModel, HfDeepSpeedConfig]:
    """The base model (ZeRO-3 partitioned) with a fresh LoRA adapter on its language model."""
    zero3 = HfDeepSpeedConfig(ds_config)  # must outlive from_pretrained: it is how transformers sees ZeRO-3
    dtype = torch.bfloat16 if cfg.scaling.use_gpu else torch.float32
    model = AutoModelForImageTextToText.from_pretrained(cfg.model.path, dtype=dtype)
    model.config.use_cache = False
    return add_lora(model, cfg, arch), zero3


def add_lora(model: torch.nn.Module, cfg: Config, arch: Architecture) -> peft.PeftModel:
    """Wrap the base model with a fresh LoRA adapter on its language model's linear layers."""
    lora = peft.LoraConfig(
        r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=lora_target_regex(model, arch, cfg.lora.target_modules),
        bias="none",
    )
    # LoRA tensors are created as plain tensors on every rank; the same seed makes them identical,
    # which ZeRO-3 assumes when it partitions them at `deepspeed.initialize`.
    torch.manual_seed(cfg.train.seed)
    return peft.get_peft_model(model, lora)


def base_name(name: str) -> str:
    """A PeftModel parameter name as the base model (plus LoRA) names it: `model.language_model...`."""
    return name[len(PEFT_PREFIX) :] if name.startswith(PEFT_PREFIX) else name


def is_lora(name: str) -> bool:
    return ".lora_" in name


def set_trainable(model: torch.nn.Module, arch: Architecture, cfg: Config) -> None:
    """LoRA trainable; vision tower and aligner trainable unless frozen; everything else frozen.

    PEFT freezes every non-adapter parameter when it wraps the model; this re-enables the vision tower
    and aligner as the config says, after a restore as well as on a fresh start.
    """
    trained_parts = {
        "vision_tower": not cfg.train.freeze_vision,
        "aligner": not cfg.train.freeze_aligner,
    }
    for name, param in model.named_parameters():
        name = base_name(name)
        param.requires_grad_(is_lora(name) or trained_parts.get(arch.part_of(name), False))


def trainable_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Trainable parameters by base name, in the model's order."""
    return {base_name(n): p for n, p in model.named_parameters() if p.requires_grad}


def shapes(params: dict[str, torch.nn.Parameter]) -> dict[str, list[int]]:
    return {name: list(full_shape(p)) for name, p in params.items()}
