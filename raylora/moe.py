"""Mixture-of-experts language models: their fused expert tensors under ZeRO-3, LoRA on the experts,
the routers.

transformers 5.23 stores a MoE layer's experts as fused 3-D parameters (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`), and Qwen3-VL-MoE folders exist in two layouts: the Hub's older one ([experts, in,
out]) and the one transformers 5.23 writes ([experts, out, in]), raylora's own merged export included.
transformers' conversion (`conversion_mapping.py`: `Transpose(1, 2, check_dims=True)`) transposes a file's
tensor unless it already has the model parameter's shape. Under ZeRO-3 the parameter it compares with is
the rank's empty partition, so it always transposes and a folder in the new layout fails to load ("size
mismatch ... copying a param with shape [4, 32, 64]"); the HF Trainer fails alike. `fix_expert_layouts`
makes the comparison use the full shape that DeepSpeed keeps beside the partition (`ds_shape`).
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING

import torch.nn as nn

from raylora.config import Config, ConfigError

PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the base model's names (raylora.model)

if TYPE_CHECKING:
    from raylora.arch import Architecture

# The line of transformers' Transpose.convert that reads the (partitioned) parameter's shape: the patch
# below is only right for that code, so another version of it is refused rather than patched blindly.
_EXPECTED = 'expected_shape = kwargs["model"].get_parameter(kwargs["full_layer_name"]).shape'


@functools.cache
def fix_expert_layouts() -> None:
    """Make transformers' shape-checked expert transpose compare with a ZeRO-3 parameter's full shape.

    Idempotent; a no-op for parameters that are not partitioned (no `ds_shape`), so plain loading is
    unchanged. Raises `ConfigError` when transformers' code is not the one this was written against.
    """
    from transformers.core_model_loading import Transpose

    original = Transpose.convert
    if _EXPECTED not in inspect.getsource(original):
        raise ConfigError(
            "transformers.core_model_loading.Transpose.convert is not the code raylora patches for MoE "
            "expert layouts under ZeRO-3 (transformers 5.23); check raylora.moe against this version"
        )

    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        if self.check_dims:
            param = kwargs["model"].get_parameter(kwargs["full_layer_name"])
            full = getattr(param, "ds_shape", None)
            if full is not None:  # a ZeRO-3 partition: its own shape is empty
                tensors = next(iter(input_dict.values()))
                tensor = tensors[0] if isinstance(tensors, list) else tensors
                target = self.get_target_pattern(input_dict, source_patterns, target_patterns)
                if tuple(tensor.shape) == tuple(full):
                    return {target: tensor}
                return {target: tensor.transpose(self.dim0, self.dim1).contiguous()}
        return original(self, input_dict, source_patterns, target_patterns, **kwargs)

    Transpose.convert = convert


# ---------------------------------------------------------------------------------------------- experts


def expert_parameters(model: nn.Module, arch: Architecture) -> dict[str, str]:
    """The fused expert tensors of the language model by full parameter name, each with its leaf name
    (`gate_up_proj`, `down_proj`): the 3-D parameters (experts, out, in) that `nn.Linear` targeting never
    sees. {} for a dense model."""
    under = tuple(p + "." for p in arch.language_model)
    found = {}
    for module_name, module in model.named_modules():
        # transformers' fused experts modules (Qwen3VLMoeTextExperts, Glm4vMoeTextExperts, Gemma4TextExperts,
        # ...); other 3-D parameters, such as Qwen3.5's causal conv1d weight, are no experts
        if not module_name.startswith(under) or not type(module).__name__.endswith("Experts"):
            continue
        for leaf, param in module.named_parameters(recurse=False):
            if len(getattr(param, "ds_shape", param.shape)) == 3:
                found[f"{module_name}.{leaf}"] = leaf
    return found


def router_modules(model: nn.Module, arch: Architecture) -> list[str]:
    """Names of the language model's routers: the top-k gates of its MoE blocks (Qwen's and GLM's
    `mlp.gate`, Gemma 4's `router`, whose projection is an `nn.Linear`) and Qwen3.5-MoE's shared-expert
    gate. They pick experts rather than transform tokens: never a LoRA target, trained fully only with
    train.train_router."""
    under = tuple(p + "." for p in arch.language_model)
    found = []
    for name, module in model.named_modules():
        name = name.removeprefix(PEFT_PREFIX)  # the base model's names, wrapped by PEFT or not
        if name.startswith(under) and (
            "router" in type(module).__name__.lower() or name.endswith(".shared_expert_gate")
        ):
            found.append(name)
    return found


def check_expert_lora(cfg: Config) -> None:
    """Refuse LoRA options that PEFT's adapter for parameters (`ParamWrapper`, which adapts the fused expert
    tensors) does not take, naming the key: it cannot apply dropout to the expert's input (the input is
    not factored out of the fused weight), nor DoRA."""
    if cfg.lora.dropout:
        raise ConfigError(
            f"lora.dropout={cfg.lora.dropout}: LoRA on a mixture-of-experts model's experts (PEFT's "
            "target_parameters) takes no dropout; set lora.dropout=0, or leave the experts out with "
            "lora.target_modules naming other layers"
        )
    if cfg.lora.use_dora:
        raise ConfigError(
            "lora.use_dora: PEFT's LoRA on a mixture-of-experts model's experts (target_parameters) has no "
            "DoRA; set lora.use_dora=false, or leave the experts out with lora.target_modules"
        )


def adapted_kinds(names: list[str]) -> dict[str, int]:
    """How many adapted modules or tensors of each kind (attention, mlp, experts, linear attention,
    other), for the log line that says what LoRA reaches."""
    kinds: dict[str, int] = {}
    for name in names:
        if ".experts." in name or name.endswith(".experts"):
            kind = "experts"
        elif ".linear_attn." in name:
            kind = "linear attention"
        elif ".self_attn." in name or ".attn." in name:
            kind = "attention"
        elif ".mlp." in name or ".shared_expert" in name:
            kind = "mlp"
        else:
            kind = "other"
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


# ------------------------------------------------------------------------------------------ auxiliary loss


def aux_loss_coef(model: nn.Module) -> float | None:
    """The load-balancing loss's weight where the model computes one (`output_router_logits` in its
    forward, `router_aux_loss_coef` in its text config: Qwen3-VL-MoE, Qwen3.5-MoE, GLM-4.5V); None for a
    dense model and for MoE models whose forward returns none (Gemma 4, InternVL on a MoE text model).
    `model` may be wrapped (DeepSpeed, PEFT)."""
    base = getattr(model, "module", model)
    base = base.get_base_model() if hasattr(base, "get_base_model") else base
    coef = getattr(base.config.get_text_config(), "router_aux_loss_coef", None)
    takes = "output_router_logits" in inspect.signature(type(base).forward).parameters
    return float(coef) if coef is not None and takes else None
