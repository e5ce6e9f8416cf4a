"""Building the model on a worker: base model partitioned by ZeRO-3 as it loads, then LoRA.

`from_pretrained` runs while an `HfDeepSpeedConfig` is alive, so transformers loads under
`deepspeed.zero.Init` and no worker ever holds a full copy of the base model (the path that lets a 7B
model fit). The returned handle must stay referenced until `deepspeed.initialize` has run.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import peft
import torch
from peft.tuners.lora import LoraLayer
from transformers.integrations import HfDeepSpeedConfig

from raylora import hub, moe, quant
from raylora.arch import Architecture, auto_model_class, base_on_meta, lora_targets, remote_code
from raylora.checkpoint import is_adapter
from raylora.config import Config, ConfigError
from raylora.data import packing
from raylora.zero import full_shape

log = logging.getLogger("raylora")

PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the base model's parameter names


def build_model(
    cfg: Config, arch: Architecture, ds_config: dict, model_dir: str | None = None
) -> tuple[peft.PeftModel, HfDeepSpeedConfig]:
    """The base model (ZeRO-3 partitioned) with a fresh LoRA adapter on its language model; `model_dir`:
    model.path as the worker resolved it (default: resolved here)."""
    model_dir = model_dir or hub.resolve(cfg.model.path, cfg.model.revision)
    four_bit = quantized(cfg, arch, model_dir)  # before ZeRO-3 is on: it builds a model on the meta device
    zero3 = HfDeepSpeedConfig(ds_config)  # must outlive from_pretrained: it is how transformers sees ZeRO-3
    moe.fix_expert_layouts()  # MoE folders in either expert layout load under ZeRO-3 (raylora.moe)
    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    model, loading = auto_model_class(remote_code(model_dir)).from_pretrained(
        model_dir,
        dtype=dtype,
        attn_implementation=attention(model_dir, cfg.model.attn_implementation),
        trust_remote_code=cfg.model.trust_remote_code,
        output_loading_info=True,
        **four_bit,
    )
    # transformers initialises a weight the files lack at random and only warns: a base model trained so
    # would look fine and be wrong (a remote-code class whose names differ from its files', a partial copy)
    if loading["missing_keys"]:
        missing = sorted(loading["missing_keys"])
        unexpected = sorted(loading["unexpected_keys"])
        raise ConfigError(
            f"model.path: {model_dir}: {len(missing)} weight(s) of the model are not in its files and would "
            f"be initialised at random: {', '.join(missing[:5])}"
            + (f"; the files hold instead: {', '.join(unexpected[:5])}" if unexpected else "")
        )
    if cfg.model.quantization:
        quant.prepare(model)
    if cfg.train.packing and cfg.model.attn_implementation == "sdpa":
        packing.use_packed_attention(model)  # each packed sample's attention on its own
    prepare_for_training(model, cfg)
    return add_lora(model, cfg, arch), zero3


def quantized(cfg: Config, arch: Architecture, model_dir: str | Path) -> dict:
    """`from_pretrained`'s arguments for model.quantization (none without it): the language model in 4 bits
    (`raylora.quant`), loaded on this worker's GPU where it has one, so that bitsandbytes quantizes there."""
    if not cfg.model.quantization:
        return {}
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(model_dir, trust_remote_code=cfg.model.trust_remote_code)
    skipped = quant.skipped_modules(base_on_meta(model_config), arch)
    kwargs = {"quantization_config": quant.bnb_config(cfg, skipped)}
    if torch.cuda.is_available():
        kwargs["device_map"] = {"": torch.cuda.current_device()}
    return kwargs


def attention(model_dir: str | Path, implementation: str) -> str | dict[str, str]:
    """model.attn_implementation as `from_pretrained` takes it: for the model and its sub-models, except an
    audio tower (Gemma 4's, which supports neither sdpa nor flash attention and is never trained), which
    keeps transformers' own choice."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if not isinstance(config.get("audio_config"), dict):
        return implementation
    subs = [
        k for k, v in config.items() if k.endswith("_config") and isinstance(v, dict) and k != "audio_config"
    ]
    return {"": implementation} | dict.fromkeys(subs, implementation)


def prepare_for_training(model: torch.nn.Module, cfg: Config) -> None:
    """Training mode, no KV cache, and activation checkpointing when `cfg.gradient_checkpointing`.

    transformers checkpoints every layer class it marks as such (`GradientCheckpointingLayer`): the
    language model's decoder layers and the vision tower's encoder layers (CLIP, SigLIP, Qwen2-VL's
    blocks, InternVL's, Pixtral's), so a trained vision tower recomputes its activations too. It wraps
    the layer's `forward`, not its `__call__`, so ZeRO-3's module hooks gather the parameters again for
    the recomputation. Enabled before LoRA is added because PEFT, wrapping a model with checkpointing
    on, makes the input embeddings' outputs require gradients (`enable_input_require_grads`), which
    checkpointed layers need for the LoRA weights inside them to get gradients.
    """
    # the language model reads its own (text) config's use_cache: a cache would be built in every forward
    model.config.use_cache = model.config.get_text_config().use_cache = False
    if cfg.gradient_checkpointing:
        # `activation_checkpointing_enable` is transformers 5's name for `gradient_checkpointing_enable`
        # (now a deprecated alias); non-reentrant checkpointing is the one torch recommends.
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    # from_pretrained returns the model in eval mode, and transformers recomputes a layer only in training
    # mode; training mode also turns on the base model's own dropout where its config has any.
    model.train()


def add_lora(model: torch.nn.Module, cfg: Config, arch: Architecture) -> peft.PeftModel:
    """Wrap the base model with a fresh LoRA adapter on its language model's linear layers and, in a
    mixture-of-experts model, its fused expert tensors (PEFT's target_parameters: a rank-r adapter per
    expert)."""
    regex, experts = lora_targets(model, arch, cfg.lora.target_modules, cfg.lora.parts)
    if experts:
        moe.check_expert_lora(cfg)
    lora = peft.LoraConfig(
        r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=regex,
        target_parameters=experts or None,
        bias="none",
        use_dora=cfg.lora.use_dora,
        use_rslora=cfg.lora.use_rslora,
        init_lora_weights=cfg.lora.init,
        # PEFT deep-copies each of these inside GatheredParameters, so the copy is whole (not a ZeRO-3
        # partition) and, like the LoRA tensors, partitioned at `deepspeed.initialize`.
        modules_to_save=cfg.lora.modules_to_save,
    )
    # LoRA tensors are created as plain tensors on every rank; the same seed makes them identical,
    # which ZeRO-3 assumes when it partitions them at `deepspeed.initialize`.
    torch.manual_seed(cfg.train.seed)
    # PEFT upcasts adapter weights to fp32 by default; under ZeRO-3 init DeepSpeed no longer casts
    # parameters, so a bf16 base would reach the optimizer with fp32 LoRA beside a bf16 trained aligner:
    # two dtypes among its flat partitions. Keep the adapter in the base model's dtype instead: the
    # fp32 precision lives in DeepSpeed's masters, which the checkpoint stores.
    model = peft.get_peft_model(model, lora, autocast_adapter_dtype=False)
    _check_modules_to_save(model, cfg.lora.modules_to_save or [])
    adapted = [n for n, m in model.named_modules() if isinstance(m, LoraLayer) and "lora_A" in m._modules]
    kinds = moe.adapted_kinds(adapted)
    log.info("LoRA adapts %s", ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items())))
    return model


def _check_modules_to_save(model: peft.PeftModel, names: list[str]) -> None:
    """PEFT silently skips a modules_to_save name that matches no module: refuse it instead."""
    wrapped = [n for n, m in model.named_modules() if isinstance(m, peft.utils.other.ModulesToSaveWrapper)]
    unmatched = [n for n in names if not any(w == n or w.endswith("." + n) for w in wrapped)]
    if unmatched:
        raise ConfigError(f"lora.modules_to_save: {', '.join(unmatched)} match no module of the model")


def base_name(name: str) -> str:
    """A PeftModel parameter name as the base model (plus LoRA) names it: `model.language_model...`."""
    return name[len(PEFT_PREFIX) :] if name.startswith(PEFT_PREFIX) else name


def is_lora(name: str) -> bool:
    return ".lora_" in name


def set_trainable(model: torch.nn.Module, arch: Architecture, cfg: Config) -> None:
    """The adapter (LoRA, DoRA magnitudes, modules_to_save copies) trainable; vision tower and aligner
    trainable unless frozen; everything else frozen.

    PEFT freezes every non-adapter parameter when it wraps the model; this re-enables the vision tower
    and aligner as the config says, after a restore as well as on a fresh start. The original of a
    modules_to_save copy stays frozen even there: the copy replaces it in the forward pass.
    """
    trained_parts = {
        "vision_tower": not cfg.train.freeze_vision,
        "aligner": not cfg.train.freeze_aligner,
    }
    routers = tuple(r + "." for r in moe.router_modules(model, arch)) if cfg.train.train_router else ()
    for name, param in model.named_parameters():
        name = base_name(name)
        trained_part = trained_parts.get(arch.part_of(name), False) and ".original_module." not in name
        router = bool(routers) and name.startswith(routers) and not is_adapter(name)
        param.requires_grad_(is_adapter(name) or trained_part or router)


def trainable_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Trainable parameters by base name, in the model's order."""
    return {base_name(n): p for n, p in model.named_parameters() if p.requires_grad}


def shapes(params: dict[str, torch.nn.Parameter]) -> dict[str, list[int]]:
    return {name: list(full_shape(p)) for name, p in params.items()}


def mark_trained(model: torch.nn.Module, arch: Architecture, cfg: Config) -> dict[str, torch.nn.Parameter]:
    """The one definition of what a run trains: mark it (`set_trainable`) and return it by base name.

    The workers call it on the real model, the driver's pre-flight check and `bench/on_paper.py` on a
    model built on the meta device (`meta_model`), so all three agree by construction.
    """
    set_trainable(model, arch, cfg)
    return trainable_parameters(model)


def meta_model(cfg: Config, arch: Architecture, model_config) -> peft.PeftModel:
    """The run's model with LoRA, on the meta device: structure and shapes only, no weights, no memory."""
    model = base_on_meta(model_config)
    quant.check(cfg, model, arch)
    with torch.device("meta"):
        return add_lora(model, cfg, arch)


def trainable_shapes(cfg: Config, arch: Architecture, model_config) -> dict[str, list[int]]:
    """Names and full shapes of what `cfg` trains on the model `model_config` describes (meta device)."""
    return shapes(mark_trained(meta_model(cfg, arch, model_config), arch, cfg))
