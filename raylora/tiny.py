"""Tiny vision-language models from transformers' own config classes: one builder per architecture.

Each builder returns the config and the processor of a real model family, shrunk (width 64, 2 layers
by default): a word-level tokenizer over the demo's words (a byte-level BPE for Qwen3.5, whose folders
transformers loads with its own BPE class), and an image processor that upscales the 8x8 digits to
16x16 pixels, 4x4 patches, 4 image tokens (16 for Llava, which does not merge patches; Pixtral keeps the
8x8 size, with 2 px patches; Gemma 4's processor fills its smallest budget, 64 tokens). The builders live
by family: `tiny_parts` (shared parts, Llava), `tiny_qwen`, `tiny_glm`, `tiny_others`; tokenizers and chat
templates in `tiny_text`. Processors are built as the Hub's folders hold them: with torchvision installed
(raylora's own runtime), the Qwen and GLM families' torchvision image processor and their video processor,
Gemma 4's with its audio feature extractor; on a node without torchvision, the PIL image processor and no
video part (`image_only_processor_class`), the fallback raylora loads such folders with. Imports are lazy
so that the CLI can list the architectures without importing transformers.
"""

from __future__ import annotations

from raylora.tiny_glm import _glm4v, _glm4v_moe, _glm46v
from raylora.tiny_others import _gemma3, _gemma3_weights, _gemma4, _idefics3, _internvl, _mistral3
from raylora.tiny_parts import _llava
from raylora.tiny_qwen import _qwen2_5_vl, _qwen2_vl, _qwen3_5, _qwen3_5_moe, _qwen3_vl, _qwen3_vl_moe

# model_type -> a builder of (config, processor); raylora.assets.build_tiny_model turns them into a model.
BUILDERS = {
    "llava": _llava,
    "qwen2_vl": _qwen2_vl,
    "qwen2_5_vl": _qwen2_5_vl,
    "qwen3_vl": _qwen3_vl,
    "qwen3_vl_moe": _qwen3_vl_moe,
    "qwen3_5": _qwen3_5,
    "qwen3_5_moe": _qwen3_5_moe,
    "glm4v": _glm4v,
    "glm4v_moe": _glm4v_moe,
    "glm46v": _glm46v,
    "idefics3": _idefics3,
    "gemma3": _gemma3,
    "gemma4": _gemma4,
    "internvl": _internvl,
    "mistral3": _mistral3,
}
# data.chat_template_kwargs that a run of the tiny model needs: the digits' answers hold no reasoning, and
# Qwen3.5's template is a reasoning one (docs/data.md: Reasoning templates).
TEMPLATE_KWARGS = {arch: {"enable_thinking": False} for arch in ("qwen3_5", "qwen3_5_moe")}
# Weights that transformers' initialisation leaves unlike any trained model's, set after `from_config`.
FIX_WEIGHTS = {"gemma3": _gemma3_weights}
