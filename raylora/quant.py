"""QLoRA: the frozen language model loaded in 4 bits by bitsandbytes, trained with LoRA under ZeRO-3.

What this takes, read in transformers 5.23, bitsandbytes 0.50 and DeepSpeed 0.19.8:
- transformers skips `deepspeed.zero.Init` for a quantized model, so every rank loads and quantizes the
  whole language model; ZeRO-3 partitions it only at `deepspeed.initialize` (`load_report` logs it).
- DeepSpeed casts the parameters it partitions to the run's dtype: the packed 4-bit weights are stored
  in that dtype (`bnb_4bit_quant_storage`), which the cast leaves alone.
- transformers quantizes every `nn.Linear` unless told otherwise: everything outside the language model
  (vision tower, aligner, an audio tower, lm_head) is named in `llm_int8_skip_modules`.
- In eval mode on a CPU with AVX512-BF16, `Linear4bit.forward` repacks `weight.data` in place and marks
  its quantization state; under ZeRO-3 the next gather brings back the old layout with the new mark.
  raylora turns the repack off (`no_cpu_repack`) and gives evaluation's copy its own quantization state
  (`copy_weight`).

The checkpoint is unchanged in kind: the quantized base is frozen, so it is never saved.
"""

from __future__ import annotations

import copy
import logging
import re

import torch

from raylora.arch import Architecture
from raylora.config import Config, ConfigError

log = logging.getLogger("raylora")

# lora.init values that compute the adapter from the base weight (an SVD or a QR of it): under ZeRO-3 with
# a 4-bit base that weight is packed, and PEFT would decompose the quantization error, not the model
_FROM_WEIGHTS = ("pissa", "olora", "corda", "eva")


def require_bitsandbytes() -> None:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as err:
        raise ConfigError(
            "model.quantization needs bitsandbytes on every node: pip install 'raylora[qlora]'"
        ) from err


def check(cfg: Config, model: torch.nn.Module, arch: Architecture) -> None:
    """Refuse, before Ray starts, a QLoRA run that cannot work; `model` is the run's model on the meta
    device (`raylora.model.meta_model`)."""
    if cfg.model.quantization is None:
        return
    require_bitsandbytes()
    from raylora import moe

    experts = list(moe.expert_parameters(model, arch))
    if experts:
        raise ConfigError(
            f"model.quantization={cfg.model.quantization}: this model's experts are fused 3-D tensors "
            f"({experts[0]}, ...), not linear layers: bitsandbytes would leave them, most of the model, in "
            "full precision, and PEFT's expert adapters do not take quantized tensors; train it without "
            "model.quantization"
        )
    if cfg.lora.use_dora:
        raise ConfigError(
            "lora.use_dora with model.quantization: PEFT computes DoRA's magnitudes by gathering the base "
            "weight through ZeRO-3 when it adds the adapter, and a 4-bit weight is not partitioned yet then "
            "(transformers loads a quantized model outside zero.Init): DeepSpeed fails on it"
        )
    if str(cfg.lora.init).startswith(_FROM_WEIGHTS):
        raise ConfigError(
            f"lora.init={cfg.lora.init} with model.quantization: it initialises the adapter from the base "
            "weights, which are 4-bit here (PEFT would decompose the quantization error); use lora.init=true"
        )


def skipped_modules(model: torch.nn.Module, arch: Architecture) -> list[str]:
    """What bitsandbytes must leave unquantized: the vision tower's and aligner's prefixes, and every other
    linear layer outside the language model (lm_head, an audio tower), as patterns transformers matches
    from the start of a module's name (`quantizers_utils.should_convert_module`)."""
    parts = [*arch.vision_tower, *arch.aligner]
    others = [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and arch.part_of(name + ".weight") != "language_model"
        and not any(name == p or name.startswith(p + ".") for p in parts)
    ]
    return [re.escape(name) for name in (*parts, *others)]


def bnb_config(cfg: Config, skipped: list[str]):
    """transformers' `BitsAndBytesConfig` for the run: 4-bit storage in the run's dtype, compute in it."""
    from transformers import BitsAndBytesConfig

    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=cfg.model.quantization,
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=dtype,
        llm_int8_skip_modules=skipped,
    )


def inference_kwargs(trained: dict, model_dir: str, dtype: torch.dtype, device: torch.device) -> dict:
    """`from_pretrained`'s arguments to load, for inference in `dtype` on `device`, the base of a checkpoint
    whose run config is `trained` as that run trained it: in 4 bits where it used model.quantization."""
    from transformers import AutoConfig

    from raylora import config
    from raylora.arch import base_on_meta, for_model

    if not (trained.get("model") or {}).get("quantization"):
        return {}  # without parsing: a checkpoint of an older raylora may hold keys since retired
    run = config.from_dict(trained)
    require_bitsandbytes()
    model_config = AutoConfig.from_pretrained(model_dir, trust_remote_code=run.model.trust_remote_code)
    skipped = skipped_modules(base_on_meta(model_config), for_model(model_dir, run.model))
    bnb = bnb_config(run, skipped)
    bnb.bnb_4bit_compute_dtype = bnb.bnb_4bit_quant_storage = dtype
    return {"quantization_config": bnb, "device_map": {"": str(device)}}


def is_4bit(param: torch.nn.Parameter) -> bool:
    return type(param).__name__ == "Params4bit"


def prepare(model: torch.nn.Module) -> None:
    """The loaded 4-bit model, ready for ZeRO-3: no in-place CPU repack in eval mode (the module docstring
    says why), and its load-time size logged."""
    if not no_cpu_repack(model):
        raise ConfigError("model.quantization: no linear layer of the language model was quantized")
    log.info(load_report(model))


def no_cpu_repack(model: torch.nn.Module) -> int:
    """Keep `model`'s 4-bit layers in the layout training computes with, in eval mode too; returns how many
    there are. The CPU repack (module docstring) would break ZeRO-3's gathers, gives evaluation other
    numerics than training's, and fails on widths that are no multiple of the quantization block."""
    layers = [m for m in model.modules() if type(m).__name__ == "Linear4bit"]
    for layer in layers:
        layer.support_avx512bf16_for_cpu = False
    return len(layers)


def load_report(model: torch.nn.Module) -> str:
    """What every rank holds after loading a 4-bit model, before ZeRO-3 partitions it."""
    packed = sum(p.numel() * p.element_size() for p in model.parameters() if is_4bit(p))
    states = sum(
        t.numel() * t.element_size()
        for p in model.parameters()
        if is_4bit(p) and p.quant_state is not None
        for t in _state_tensors(p.quant_state)
    )
    other = sum(p.numel() * p.element_size() for p in model.parameters() if not is_4bit(p))
    return (
        f"model.quantization: every rank loaded the whole model before ZeRO-3 partitions it: "
        f"{_size(packed + states + other)} ({_size(packed)} of 4-bit weights, {_size(states)} of their "
        f"scales, {_size(other)} unquantized)"
    )


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def _state_tensors(state) -> list[torch.Tensor]:
    tensors = [state.absmax, state.code]
    if state.nested:
        tensors += [state.offset, state.state2.absmax, state.state2.code]
    return tensors


def quantize_like(skeleton: torch.nn.Module, model: torch.nn.Module) -> None:
    """Turn `skeleton`'s linear layers into 4-bit ones where the loaded `model`'s are (both before PEFT
    wraps them), as transformers did at load, so that values gathered from `model` fit it (`copy_weight`)."""
    from transformers import BitsAndBytesConfig
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    quantized = _4bit_layers(model)
    if not quantized:
        return
    config = model.config.quantization_config
    if isinstance(config, dict):
        config = BitsAndBytesConfig.from_dict(config)
    skip = [*(config.llm_int8_skip_modules or []), *(getattr(skeleton, "_keep_in_fp32_modules", None) or [])]
    replace_with_bnb_linear(skeleton, modules_to_not_convert=skip, quantization_config=config)
    if _4bit_layers(skeleton) != quantized:
        raise RuntimeError("model.quantization: the copy's 4-bit layers differ from the trained model's")


def _4bit_layers(model: torch.nn.Module) -> set[str]:
    """Names of the 4-bit linear layers, as the base model names them (a LoRA layer's `base_layer` folded)."""
    return {
        n.removesuffix(".base_layer") for n, m in model.named_modules() if type(m).__name__ == "Linear4bit"
    }


def copy_weight(param: torch.nn.Parameter, value: torch.Tensor, device: torch.device) -> torch.nn.Parameter:
    """A parameter of a standalone copy holding `value` (gathered from `param`): a 4-bit weight gets its own
    copy of the quantization state, so an eval-mode repack of the copy never reaches `param`."""
    if not is_4bit(param):
        return torch.nn.Parameter(value, requires_grad=False)
    from bitsandbytes.nn import Params4bit

    state = copy.deepcopy(param.quant_state)
    state.to(device)
    return Params4bit(
        value,
        requires_grad=False,
        quant_state=state,
        blocksize=param.blocksize,
        compress_statistics=param.compress_statistics,
        quant_type=param.quant_type,
        quant_storage=param.quant_storage,
        bnb_quantized=True,
    )
