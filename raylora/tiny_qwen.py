"""Tiny Qwen-VL family models (`raylora.tiny`): Qwen2-VL, Qwen2.5-VL, Qwen3-VL (dense and MoE), Qwen3.5
(dense and MoE)."""

from __future__ import annotations

from raylora.tiny_parts import (
    IMAGE_SIZE,
    PATCH_SIZE,
    _moe_text,
    _mrope_text_config,
    _qwen_vl_processor,
    _qwen_vl_tokens,
)
from raylora.tiny_text import (
    QWEN2_VL_CHAT_TEMPLATE,
    QWEN3_5_CHAT_TEMPLATE,
    QWEN3_VL_CHAT_TEMPLATE,
    build_byte_level_tokenizer,
    build_tokenizer,
)


def _qwen_vl(config_cls, processor_cls, vision_config: dict, text: dict | None = None, tokenizer=None):
    """Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5: M-RoPE text model, a patch-merging vision tower."""
    from transformers import Qwen2VLVideoProcessor

    tokenizer = tokenizer or build_tokenizer()
    config = config_cls(
        text_config=_mrope_text_config(tokenizer, vision_config["hidden_size"], vision_config["depth"])
        | (text or {}),
        vision_config=dict(num_heads=4, patch_size=PATCH_SIZE, spatial_merge_size=2, temporal_patch_size=2)
        | vision_config,
        tie_word_embeddings=False,
        **_qwen_vl_tokens(tokenizer),
    )
    video_processor_cls = Qwen2VLVideoProcessor
    template = QWEN2_VL_CHAT_TEMPLATE
    if config_cls.model_type.startswith(("qwen3_vl", "qwen3_5")):  # Qwen3.5 carries Qwen3-VL's processors
        from transformers import Qwen3VLVideoProcessor

        video_processor_cls, template = Qwen3VLVideoProcessor, QWEN3_VL_CHAT_TEMPLATE
        if config_cls.model_type.startswith("qwen3_5"):  # a reasoning model's template
            template = QWEN3_5_CHAT_TEMPLATE
    return config, _qwen_vl_processor(processor_cls, video_processor_cls, tokenizer, template)


def _qwen2_vl(width: int, layers: int):
    from transformers import Qwen2VLConfig, Qwen2VLProcessor

    return _qwen_vl(Qwen2VLConfig, Qwen2VLProcessor, dict(depth=layers, embed_dim=width, hidden_size=width))


def _qwen2_5_vl(width: int, layers: int):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLProcessor

    vision = dict(
        depth=layers,
        hidden_size=width,
        intermediate_size=2 * width,
        out_hidden_size=width,
        window_size=2 * PATCH_SIZE * 2,  # windows of 2x2 merged tokens; the last block attends fully
        fullatt_block_indexes=[layers - 1],
    )
    return _qwen_vl(Qwen2_5_VLConfig, Qwen2_5_VLProcessor, vision)


def _qwen3_vl(width: int, layers: int, moe: bool = False):
    """Qwen3-VL (dense): Qwen3 decoder layers (q/k norms, explicit head_dim), interleaved M-RoPE, a vision
    tower with learned position embeddings and DeepStack mergers after each of its blocks. `moe`:
    Qwen3-VL-MoE (30B-A3B, 235B-A22B), every decoder layer's MLP a mixture of experts, 4 experts here, 2 per
    token, fused into 3-D tensors, with a top-k router (`mlp.gate`)."""
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig, Qwen3VLProcessor

    vision = _qwen3_vision(width, layers) | dict(deepstack_visual_indexes=list(range(layers)))
    text = dict(head_dim=width // 4)
    if moe:
        text |= dict(decoder_sparse_step=1) | _moe_text(width)
    config, processor = _qwen_vl(Qwen3VLMoeConfig if moe else Qwen3VLConfig, Qwen3VLProcessor, vision, text)
    config.text_config.rope_parameters["mrope_interleaved"] = True
    return config, processor


def _qwen3_vision(width: int, layers: int) -> dict:
    """The vision tower Qwen3-VL and Qwen3.5 share: learned position embeddings, one width throughout."""
    return dict(
        depth=layers,
        hidden_size=width,
        intermediate_size=2 * width,
        out_hidden_size=width,
        num_position_embeddings=(IMAGE_SIZE // PATCH_SIZE) ** 2,
    )


def _qwen3_vl_moe(width: int, layers: int):
    return _qwen3_vl(width, layers, moe=True)


def _qwen3_5(width: int, layers: int, moe: bool = False):
    """Qwen3.5 (dense): decoder layers of Gated DeltaNet linear attention (`linear_attn`, with a causal
    conv1d) and gated full attention (`self_attn`, partial rotary), as `layer_types` says; Qwen3-VL's
    vision tower without DeepStack mergers. `moe`: Qwen3.5-MoE, every layer's MLP 4 fused experts (2 per
    token) beside a shared expert and its gate."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig, Qwen3VLProcessor

    head_dim = width // 2  # Qwen3.5 rotates a quarter of each head: mrope_section adds up to head_dim / 8
    vision = _qwen3_vision(width, layers)
    text = dict(
        head_dim=head_dim,
        # the real models alternate 3 linear-attention layers with 1 full-attention layer; 2 layers: one each
        layer_types=["linear_attention", "full_attention"] * (layers // 2)
        + ["linear_attention"] * (layers % 2),
        linear_conv_kernel_dim=4,
        linear_key_head_dim=width // 4,
        linear_value_head_dim=width // 4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [head_dim // 16, head_dim // 32, head_dim // 32],
            "mrope_interleaved": True,
        },
    )
    if moe:
        text |= _moe_text(width) | dict(shared_expert_intermediate_size=width // 2)
    # Qwen3.5 folders load with transformers' Qwen3_5Tokenizer (byte-level BPE) whatever they declare
    config_cls = Qwen3_5MoeConfig if moe else Qwen3_5Config
    tokenizer = build_byte_level_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])  # added tokens, not special ones, as in Qwen3.5's tokenizer
    return _qwen_vl(config_cls, Qwen3VLProcessor, vision, text, tokenizer)


def _qwen3_5_moe(width: int, layers: int):
    return _qwen3_5(width, layers, moe=True)
