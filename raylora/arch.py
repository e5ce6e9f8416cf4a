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
        # Idefics3 and SmolVLM (model_type idefics3): SigLIP vision model, pixel-shuffle connector
        Architecture("idefics3", "model.text_model", "model.vision_model", "model.connector"),
        Architecture("gemma3", "model.language_model", "model.vision_tower", "model.multi_modal_projector"),
        Architecture("internvl", "model.language_model", "model.vision_tower", "model.multi_modal_projector"),
        # Mistral3 (Mistral-Small-3.1; Pixtral vision tower, the patch merger is in the projector)
        Architecture("mistral3", "model.language_model", "model.vision_tower", "model.multi_modal_projector"),
        # Phi-3 / Phi-3.5-vision: remote code (trust_remote_code, AutoModelForCausalLM), which raylora does
        # not load. Its embeddings and final norm sit beside the decoder layers under `model.`, so the
        # language model is the decoder layers, where LoRA goes.
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


def auto_model_class(auto_map: dict[str, str]):
    """`AutoModelForImageTextToText`, or `AutoModelForCausalLM` for a model whose own modeling code
    (`auto_map` in its config.json) registers only that, as Phi-3-vision's does."""
    import transformers

    if auto_map and "AutoModelForImageTextToText" not in auto_map and "AutoModelForCausalLM" in auto_map:
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
            f"model.arch: unsupported architecture {arch!r} (supported: {', '.join(sorted(REGISTRY))}; for "
            f"another, name its parts' prefixes: model.language_model, model.vision_tower, model.aligner)"
        )
    if not REGISTRY[arch].tested:
        log.warning("architecture %s is registered but not tested with raylora", arch)
    return REGISTRY[arch]


def lora_target_regex(model: nn.Module, arch: Architecture, names: list[str] | None) -> str:
    """A PEFT `target_modules` regex: the named (default: every) linear layer of the language model only."""
    under = tuple(p + "." for p in arch.language_model)
    leaves = sorted(
        {
            n.rsplit(".", 1)[-1]
            for n, m in model.named_modules()
            if n.startswith(under) and isinstance(m, nn.Linear)
        }
    )
    if names:
        unknown = sorted(set(names) - set(leaves))
        if unknown:
            raise ConfigError(
                f"lora.target_modules: {', '.join(unknown)} not linear layers of the language model "
                f"(found: {', '.join(leaves)})"
            )
        leaves = sorted(set(names))
    if not leaves:
        raise ConfigError(f"no linear layers found under {', '.join(arch.language_model)}")
    escaped = "|".join(re.escape(p) for p in arch.language_model)
    return rf"^({escaped})\.(.*\.)?({'|'.join(leaves)})$"
