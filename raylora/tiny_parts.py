"""The parts the tiny model builders share (`raylora.tiny`): a text config, a vision tower, the Qwen-style
multimodal rotary text config and processor, a small mixture of experts; and the Llava builder."""

from __future__ import annotations

from raylora.tiny_text import (
    LLAVA_CHAT_TEMPLATE,
    build_tokenizer,
)

IMAGE_SIZE = 16  # pixels a side after the processor's resize: 4x4 patches of 4 px
PATCH_SIZE = 4


def _text_config(tokenizer, width: int, layers: int) -> dict:
    return dict(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def _vision(width: int, layers: int, **kwargs) -> dict:
    """A ViT-style vision config (CLIP, SigLIP, Idefics3, InternVL name their fields alike)."""
    return dict(
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        **kwargs,
    )


def _mrope_text_config(tokenizer, width: int, layers: int) -> dict:
    text = _text_config(tokenizer, width, layers)
    head_dim = width // 4
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        # the three M-RoPE sections (time, height, width) must add up to head_dim / 2
        "mrope_section": [head_dim // 4, head_dim // 8, head_dim // 8],
    }
    return text


def _moe_text(width: int) -> dict:
    """A tiny mixture of experts: 4 experts, 2 per token; 2 x intermediate != hidden, as in the real
    models (transformers tells the two expert layouts apart by shape alone, which a square gate_up_proj
    would not show); the real models' load-balancing weight."""
    return dict(
        moe_intermediate_size=width // 4,
        num_experts=4,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.001,
    )


def _qwen_vl_tokens(tokenizer) -> dict:
    ids = tokenizer.convert_tokens_to_ids
    return dict(
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )


def _qwen_vl_processor(processor_cls, video_processor_cls, tokenizer, chat_template: str):
    """A Qwen-VL family processor: every digit becomes a 16x16 image, 4x4 patches, 2x2 tokens after
    merging; a video frame the same size. With torchvision, transformers' own image (torchvision) and
    video processors; without it, the PIL image processor and no video part."""
    from transformers.utils import is_torchvision_available

    from raylora.data.processor import image_only_processor_class

    pixels = IMAGE_SIZE * IMAGE_SIZE
    shape = dict(patch_size=PATCH_SIZE, merge_size=2, temporal_patch_size=2)
    if not is_torchvision_available():
        from transformers import Qwen2VLImageProcessorPil

        return image_only_processor_class(processor_cls)(
            image_processor=Qwen2VLImageProcessorPil(**shape, min_pixels=pixels, max_pixels=pixels),
            tokenizer=tokenizer,
            chat_template=chat_template,
        )
    from transformers import Qwen2VLImageProcessor

    return processor_cls(
        image_processor=Qwen2VLImageProcessor(**shape, min_pixels=pixels, max_pixels=pixels),
        # Qwen2-VL's video processor caps each frame (min_pixels/max_pixels); Qwen3-VL's caps the whole video
        # (`size`, frames times pixels, min_pixels unread): 16x16 a frame either way, for up to 8 frames
        video_processor=video_processor_cls(
            **shape,
            min_pixels=pixels,
            max_pixels=8 * pixels,
            size={"shortest_edge": pixels, "longest_edge": 8 * pixels},
        )
        if video_processor_cls.__name__.startswith("Qwen3")
        else video_processor_cls(**shape, min_pixels=pixels, max_pixels=8 * pixels),
        tokenizer=tokenizer,
        chat_template=chat_template,
    )


def _llava(width: int, layers: int):
    from transformers import CLIPImageProcessorPil, CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaProcessor

    tokenizer = build_tokenizer()
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**_vision(width, layers)),
        text_config=LlamaConfig(**_text_config(tokenizer, width, layers)),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # the CLS token, which the "default" strategy then drops
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    return config, processor
