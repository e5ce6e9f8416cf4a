"""Tiny GLM-4V family models (`raylora.tiny`): GLM-4.1V, GLM-4.5V (MoE), GLM-4.6V."""

from __future__ import annotations

from raylora.tiny_parts import (
    IMAGE_SIZE,
    PATCH_SIZE,
    _moe_text,
    _text_config,
)
from raylora.tiny_text import (
    GLM4V_CHAT_TEMPLATE,
    GLM4V_TOKENS,
    build_tokenizer,
)


def _glm4v(width: int, layers: int, model_type: str = "glm4v"):
    """GLM-4.1V / GLM-4.5V-style dense model (`glm4v`) or GLM-4.6V's (`glm46v`: its own model class, the
    same modules): a GLM-4 decoder (fused gate_up_proj, four norms a layer, partial M-RoPE), a vision tower
    whose 2x2 patch merge is a strided Conv2d (`downsample`) before the patch merger. The processor is
    transformers' own, with its torchvision image and video processors (16x16 images, 2x2 tokens)."""
    import transformers

    names = {
        "glm4v": ("Glm4vConfig", "Glm4vProcessor", "Glm4vImageProcessor", "Glm4vVideoProcessor"),
        "glm4v_moe": ("Glm4vMoeConfig", "Glm4vProcessor", "Glm4vImageProcessor", "Glm4vVideoProcessor"),
        "glm46v": ("Glm46VConfig", "Glm46VProcessor", "Glm46VImageProcessor", "Glm46VVideoProcessor"),
    }[model_type]
    config_cls, processor_cls, image_cls, video_cls = (getattr(transformers, n) for n in names)
    tokenizer = build_tokenizer(extra_tokens=GLM4V_TOKENS)
    ids = tokenizer.convert_tokens_to_ids
    head_dim = width // 4
    text = _text_config(tokenizer, width, layers)
    # GLM rotates half of each head: the three M-RoPE sections add up to head_dim / 4
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [head_dim // 8, head_dim // 16, head_dim // 16],
    }
    if model_type == "glm4v_moe":  # GLM-4.5V: a dense first layer, then MoE layers with a shared expert
        moe = _moe_text(width)
        text |= dict(
            moe_intermediate_size=moe["moe_intermediate_size"],
            n_routed_experts=moe["num_experts"],
            num_experts_per_tok=moe["num_experts_per_tok"],
            n_shared_experts=1,
            first_k_dense_replace=1,
            router_aux_loss_coef=0.0001,  # GLM-4.5V's
        )
    vision = dict(
        depth=layers,
        hidden_size=width,
        intermediate_size=2 * width,
        num_heads=4,
        image_size=IMAGE_SIZE,  # the learned position embeddings' grid: 4x4 patches
        patch_size=PATCH_SIZE,
        temporal_patch_size=2,
        spatial_merge_size=2,
        out_hidden_size=width,
    )
    config = config_cls(
        text_config=text,
        vision_config=vision,
        image_token_id=ids("<|image|>"),
        video_token_id=ids("<|video|>"),
        image_start_token_id=ids("<|begin_of_image|>"),
        image_end_token_id=ids("<|end_of_image|>"),
        video_start_token_id=ids("<|begin_of_video|>"),
        video_end_token_id=ids("<|end_of_video|>"),
        tie_word_embeddings=False,
    )
    # the processors' pixel budget counts an image twice (its temporal patch of 2 frames): 16x16 pixels
    pixels = 2 * IMAGE_SIZE * IMAGE_SIZE
    shape = dict(patch_size=PATCH_SIZE, merge_size=2, temporal_patch_size=2)
    processor = processor_cls(
        image_processor=image_cls(**shape, size={"shortest_edge": pixels, "longest_edge": pixels}),
        tokenizer=tokenizer,
        video_processor=video_cls(**shape, size={"shortest_edge": pixels, "longest_edge": 8 * pixels}),
        chat_template=GLM4V_CHAT_TEMPLATE,
    )
    return config, processor


def _glm46v(width: int, layers: int):
    return _glm4v(width, layers, "glm46v")


def _glm4v_moe(width: int, layers: int):
    return _glm4v(width, layers, "glm4v_moe")
