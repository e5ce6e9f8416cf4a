"""Which modules of a vision-language model are its language model, vision tower and aligner.

One entry per `config.model_type`. Prefixes are parameter-name prefixes of the model as
`AutoModelForImageTextToText` builds it in transformers 5; a part may span several prefixes (Qwen3-VL's
aligner is its merger and its DeepStack mergers). Where the aligner sits inside the vision tower
(Qwen2-VL's merger), the aligner wins: a parameter belongs to the longest matching prefix. A parameter
under no prefix (lm_head, Gemma 4's audio tower) is neither part: frozen, never trained.
Entries marked `tested=False` have no tiny model that trains here (see each entry's comment); their
prefixes are taken from the model code but no raylora test has trained one.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch.nn as nn

from raylora.config import ConfigError, ModelConfig

log = logging.getLogger("raylora")


PARTS = ("language_model", "vision_tower", "aligner")


def prefixes(value: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """One part's prefixes as a tuple: a registry entry or the config may name one prefix or several."""
    return (value,) if isinstance(value, str) else tuple(value)


@dataclass(frozen=True)
class Architecture:
    model_type: str
    language_model: tuple[str, ...]
    vision_tower: tuple[str, ...]
    aligner: tuple[str, ...]
    tested: bool = True  # a tiny model of it trains on 2 workers under ZeRO-3 in tests/test_architectures.py

    def __post_init__(self) -> None:
        for part in PARTS:  # a single prefix may be given as a string
            object.__setattr__(self, part, prefixes(getattr(self, part)))

    def part_of(self, name: str) -> str | None:
        """`language_model`, `vision_tower`, `aligner` or None (e.g. lm_head) for a base parameter name."""
        best, best_len = None, -1
        for part in PARTS:
            for prefix in getattr(self, part):
                if name.startswith(prefix + ".") and len(prefix) > best_len:
                    best, best_len = part, len(prefix)
        return best


REGISTRY: dict[str, Architecture] = {
    a.model_type: a
    for a in [
        Architecture("llava", "model.language_model", "model.vision_tower", "model.multi_modal_projector"),
        Architecture("qwen2_vl", "model.language_model", "model.visual", "model.visual.merger"),
        Architecture("qwen2_5_vl", "model.language_model", "model.visual", "model.visual.merger"),
        # Qwen3-VL: the vision tower's final merger and its DeepStack mergers (which feed features of early
        # vision blocks into the first decoder layers) all map vision features into the language model's
        # width: the aligner. The rest of `model.visual` (patch embedding, position embedding, blocks) is
        # the vision tower.
        Architecture(
            "qwen3_vl",
            "model.language_model",
            "model.visual",
            ("model.visual.merger", "model.visual.deepstack_merger_list"),
        ),
        # Qwen3-VL-MoE: Qwen3-VL's parts; its decoder layers' experts are fused 3-D tensors that LoRA reaches
        # through PEFT's target_parameters, its routers (`mlp.gate`) frozen unless train.train_router.
        Architecture(
            "qwen3_vl_moe",
            "model.language_model",
            "model.visual",
            ("model.visual.merger", "model.visual.deepstack_merger_list"),
        ),
        # Qwen3.5 (dense; natively multimodal): Qwen3-VL's vision tower without DeepStack mergers, so the
        # aligner is its merger alone. The language model's decoder layers hold Gated DeltaNet linear
        # attention (`linear_attn`: in_proj_qkv, in_proj_z, in_proj_a, in_proj_b, out_proj, all nn.Linear
        # called as modules, so LoRA adapts them like q/k/v/o; its causal conv1d, decay A_log, dt_bias and
        # gated norm are not linear layers and stay frozen) or gated full attention (`self_attn`).
        Architecture("qwen3_5", "model.language_model", "model.visual", "model.visual.merger"),
        # Qwen3.5-MoE: Qwen3.5's parts; each layer's MLP is fused experts (LoRA through target_parameters)
        # beside a shared expert (nn.Linear: LoRA) and its one-output gate `shared_expert_gate`, a router
        # like `mlp.gate` (raylora.moe): never a LoRA target, frozen unless train.train_router.
        Architecture("qwen3_5_moe", "model.language_model", "model.visual", "model.visual.merger"),
        # GLM-4.1V and GLM-4.5V/4.6V-style dense models (glm4v), and GLM-4.6V's own model type (glm46v:
        # Glm46VModel builds the same two sub-models from its sub-configs, dense with a glm4v_text config,
        # MoE with glm4v_moe_text). The vision tower ends in a strided Conv2d (`downsample`) that merges
        # 2x2 patches into the language model's width, then the patch merger (`merger`, a gated MLP at that
        # width): together they do what Qwen2-VL's merger does alone, so both are the aligner (LLaMA-Factory
        # and ms-swift name the merger only, which leaves the downsample frozen with the tower). The rest
        # of `model.visual` (patch and position embeddings, blocks, their norms) is the vision tower.
        Architecture(
            "glm4v",
            "model.language_model",
            "model.visual",
            ("model.visual.downsample", "model.visual.merger"),
        ),
        # GLM-4.5V (glm4v_moe): glm4v's parts; its first layer dense, the others fused experts beside shared
        # experts (nn.Linear), routed by `mlp.gate`
        Architecture(
            "glm4v_moe",
            "model.language_model",
            "model.visual",
            ("model.visual.downsample", "model.visual.merger"),
        ),
        Architecture(
            "glm46v",
            "model.language_model",
            "model.visual",
            ("model.visual.downsample", "model.visual.merger"),
        ),
        # Idefics3 and SmolVLM (model_type idefics3): SigLIP vision model, pixel-shuffle connector
        Architecture("idefics3", "model.text_model", "model.vision_model", "model.connector"),
        Architecture("gemma3", "model.language_model", "model.vision_tower", "model.multi_modal_projector"),
        # Gemma 4: `embed_vision` (a norm and a projection into the text width) is the aligner. The audio
        # tower and `embed_audio` beside them are neither part: no raylora sample holds audio, so they
        # take no part in a forward pass; frozen and never trained (nor in checkpoints). The language
        # model includes the per-layer input embeddings and their projections (nn.Linear: LoRA adapts them).
        Architecture("gemma4", "model.language_model", "model.vision_tower", "model.embed_vision"),
        # InternVL3 and InternVL3.5 (-HF folders: model_type internvl, a Qwen2 or Qwen3 text model)
        Architecture("internvl", "model.language_model", "model.vision_tower", "model.multi_modal_projector"),
        # Mistral3 (Mistral-Small-3.1; Pixtral vision tower, the patch merger is in the projector)
        Architecture("mistral3", "model.language_model", "model.vision_tower", "model.multi_modal_projector"),
        # Phi-3 / Phi-3.5-vision: remote code (trust_remote_code, AutoModelForCausalLM), bridged for
        # transformers 5 by raylora.remote_compat and trained in tests/test_phi3_vision.py on a stand-in
        # folder (not a raylora.tiny model, hence tested=False). Its embeddings and final norm sit beside
        # the decoder layers under `model.`, so the language model is the decoder layers, where LoRA goes.
        # The CLIP tower is `img_processor`, the MLP projection `img_projection`; the HD transform's
        # separators (`vision_embed_tokens.glb_GN`, `.sub_GN`) are parameters of neither: frozen.
        Architecture(
            "phi3_v",
            "model.layers",
            "model.vision_embed_tokens.img_processor",
            "model.vision_embed_tokens.img_projection",
            tested=False,
        ),
    ]
}


def for_model(model_path: str | Path, model: ModelConfig) -> Architecture:
    """`detect` with what the config says of the model (model.arch, its prefixes, trust_remote_code)."""
    parts = (model.language_model, model.vision_tower, model.aligner)
    named = tuple(prefixes(p) for p in parts) if all(parts) else None  # hashable, for detect's cache
    return detect(model_path, model.arch, named, model.trust_remote_code)


def remote_code(model_path: str | Path) -> dict[str, str]:
    """The folder's `auto_map` (config.json): the classes it brings in its own modeling files; {} if none."""
    config_file = Path(model_path) / "config.json"
    try:
        return json.loads(config_file.read_text()).get("auto_map") or {}
    except (OSError, ValueError) as err:
        raise ConfigError(f"model.path: cannot read {config_file}: {err}") from err


def base_on_meta(model_config):
    """The base model `model_config` describes, on the meta device: structure and shapes, no weights."""
    import torch

    with torch.device("meta"):
        auto_map = getattr(model_config, "auto_map", None) or {}
        return auto_model_class(auto_map).from_config(model_config, trust_remote_code=bool(auto_map))


def auto_model_class(auto_map: dict[str, str]):
    """`AutoModelForImageTextToText`, or `AutoModelForCausalLM` for a model whose own modeling code
    (`auto_map` in its config.json) registers only that, as Phi-3-vision's does: bridged for transformers 5
    where raylora knows its code (`raylora.remote_compat`)."""
    import transformers

    if auto_map and "AutoModelForImageTextToText" not in auto_map and "AutoModelForCausalLM" in auto_map:
        from raylora import remote_compat

        if remote_compat.bridged(auto_map["AutoModelForCausalLM"]):
            return remote_compat.BridgedAutoModel(
                transformers.AutoModelForCausalLM, auto_map["AutoModelForCausalLM"]
            )
        return transformers.AutoModelForCausalLM
    return transformers.AutoModelForImageTextToText


@functools.cache
def detect(
    model_path: str | Path,
    arch: str | None = None,
    parts: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]] | None = None,
    trust_remote_code: bool = False,
) -> Architecture:
    """The registry entry named by `arch`, or by the folder's config.json `model_type`; for a model_type
    not in the registry, `parts` (language model, vision tower, aligner prefixes: model.language_model, ...).

    A folder with its own modeling code (`auto_map`) is refused unless `trust_remote_code`. Once per
    process for each folder: the driver's checks and a worker's build ask it several times.
    """
    auto_map = remote_code(model_path)
    if auto_map and not trust_remote_code:
        raise ConfigError(
            f"model.trust_remote_code: {model_path} carries its own modeling code (config.json auto_map: "
            f"{', '.join(sorted(set(auto_map.values())))}); set model.trust_remote_code: true to load it "
            f"through transformers' remote-code path, which runs that code on every node"
        )
    if arch is None:
        config_file = Path(model_path) / "config.json"
        try:
            arch = json.loads(config_file.read_text())["model_type"]
        except (OSError, ValueError, KeyError) as err:
            raise ConfigError(f"model.path: cannot read model_type from {config_file}: {err}") from err
    if parts is not None and arch not in REGISTRY:
        log.warning("architecture %s is not in raylora's registry: using the prefixes the config names", arch)
        return Architecture(arch, *parts, tested=False)
    if arch not in REGISTRY:
        raise ConfigError(
            f"model.arch: unsupported architecture {arch!r}{_shipped(arch)} (supported: "
            f"{', '.join(sorted(REGISTRY))}); to train it, name its parts by the prefixes of its parameter "
            f"names (model.named_parameters()): model.language_model, model.vision_tower and model.aligner, "
            f"each one prefix or a list of them where a part spans several modules, e.g. "
            f"model.aligner=[model.visual.merger,model.visual.deepstack_merger_list]; parameters under none "
            f"of them stay frozen"
        )
    if not REGISTRY[arch].tested:
        log.warning("architecture %s is registered but not tested with raylora", arch)
    return REGISTRY[arch]


def _shipped(model_type: str) -> str:
    """', which transformers X ships' where the installed transformers builds `model_type` itself."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type in CONFIG_MAPPING_NAMES:
        return f", which transformers {transformers.__version__} ships but raylora does not register"
    return ""


def lora_targets(
    model: nn.Module,
    arch: Architecture,
    names: list[str] | None,
    parts: tuple[str, ...] | list[str] = ("language_model",),
) -> tuple[str | None, list[str]]:
    """What LoRA adapts: a PEFT `target_modules` regex over the linear layers of `parts` (lora.parts) and
    the full names of the language model's fused expert tensors for PEFT's `target_parameters`
    (mixture-of-experts models, raylora.moe). A layer belongs to the part `part_of` gives it, so LoRA on
    Qwen's vision tower leaves its aligner, which sits inside the tower, alone. `names`
    (lora.target_modules) picks among both by leaf name (q_proj, gate_up_proj, ...); unset: every linear
    layer and every expert tensor. Routers are never targets (raylora.moe)."""
    from raylora import moe

    routers = tuple(r + "." for r in moe.router_modules(model, arch))  # a router may be a Linear itself
    linear = [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear)
        and arch.part_of(n + ".weight") in parts
        and not (n + ".").startswith(routers)
    ]
    leaves = sorted({n.rsplit(".", 1)[-1] for n in linear})
    experts = moe.expert_parameters(model, arch) if "language_model" in parts else {}
    if names:
        known = set(leaves) | set(experts.values())
        unknown = sorted(set(names) - known)
        if unknown:
            raise ConfigError(
                f"lora.target_modules: {', '.join(unknown)} not linear layers or expert tensors of "
                f"{' / '.join(parts)} (found: {', '.join(sorted(known))})"
            )
        leaves = sorted(set(names) & set(leaves))
    targets = [full for full, leaf in experts.items() if not names or leaf in names]
    chosen = [n for n in linear if n.rsplit(".", 1)[-1] in leaves]
    if not chosen and not targets:
        raise ConfigError(f"no linear layers found in {' / '.join(parts)} ({arch.model_type})")
    if not chosen:
        return None, targets
    escaped = "|".join(re.escape(p) for p in arch.language_model)
    regex = rf"^({escaped})\.(.*\.)?({'|'.join(leaves)})$"
    # The compact form where it matches exactly the chosen layers (LoRA on the language model, no router
    # sharing a leaf name); otherwise every layer by its full name.
    every = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if [n for n in every if re.match(regex, n)] != chosen:
        regex = rf"^({'|'.join(re.escape(n) for n in chosen)})$"
    return regex, targets


def lora_target_regex(model: nn.Module, arch: Architecture, names: list[str] | None) -> str:
    """A PEFT `target_modules` regex: the named (default: every) linear layer of the language model only
    (`lora_targets` without the expert tensors)."""
    regex, _ = lora_targets(model, arch, names)
    if regex is None:
        raise ConfigError(f"lora.target_modules: {', '.join(names or [])} name no linear layer")
    return regex
