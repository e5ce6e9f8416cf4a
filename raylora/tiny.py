"""Tiny vision-language models from transformers' own config classes: one builder per architecture.

Each builder returns the config and the processor of a real model family, shrunk (width 64, 2 layers
by default): a word-level tokenizer over the demo's words, and an image processor that upscales the
8x8 digits to 16x16 pixels, 4x4 patches, 4 image tokens (16 for Llava, which does not merge patches;
Pixtral keeps the 8x8 size, with 2 px patches). Tokenizer and chat templates: raylora.tiny_text.
Processors are built as the Hub's folders hold them: with torchvision installed (raylora's own
runtime), the Qwen families' torchvision image processor and their video processor; on a node without
torchvision, the PIL image processor and no video part (`image_only_processor_class`), the fallback
raylora loads such folders with. Imports are lazy so that the CLI can list the architectures without
importing transformers.
"""

from __future__ import annotations

from raylora.tiny_text import (
    GEMMA3_CHAT_TEMPLATE,
    GEMMA3_TOKENS,
    GEMMA3_TURN_TOKENS,
    IDEFICS3_TOKENS,
    INTERNVL_CHAT_TEMPLATE,
    INTERNVL_TOKENS,
    LLAVA_CHAT_TEMPLATE,
    MISTRAL3_CHAT_TEMPLATE,
    MISTRAL3_TOKENS,
    QWEN2_VL_CHAT_TEMPLATE,
    QWEN3_VL_CHAT_TEMPLATE,
    SMOLVLM_CHAT_TEMPLATE,
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
        # a video's pixel budget covers all its frames: 16x16 a frame for up to 8 frames
        video_processor=video_processor_cls(**shape, min_pixels=pixels, max_pixels=8 * pixels),
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


def _qwen_vl(config_cls, processor_cls, vision_config: dict, text: dict | None = None):
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL: M-RoPE text model, a patch-merging vision tower."""
    from transformers import Qwen2VLVideoProcessor

    tokenizer = build_tokenizer()
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
    if config_cls.model_type == "qwen3_vl":
        from transformers import Qwen3VLVideoProcessor

        video_processor_cls, template = Qwen3VLVideoProcessor, QWEN3_VL_CHAT_TEMPLATE
    return config, _qwen_vl_processor(processor_cls, video_processor_cls, tokenizer, template)


def _qwen2_vl(width: int, layers: int):
    from transformers import Qwen2VLConfig, Qwen2VLProcessor

    return _qwen_vl(Qwen2VLConfig, Qwen2VLProcessor, dict(depth=layers, embed_dim=width, hidden_size=width))


def _qwen3_vl(width: int, layers: int):
    """Qwen3-VL (dense): Qwen3 decoder layers (q/k norms, explicit head_dim), interleaved M-RoPE, a vision
    tower with learned position embeddings and DeepStack mergers after each of its blocks."""
    from transformers import Qwen3VLConfig, Qwen3VLProcessor

    head_dim = width // 4
    vision = dict(
        depth=layers,
        hidden_size=width,
        intermediate_size=2 * width,
        out_hidden_size=width,
        num_position_embeddings=(IMAGE_SIZE // PATCH_SIZE) ** 2,
        deepstack_visual_indexes=list(range(layers)),
    )
    text = dict(head_dim=head_dim)
    config, processor = _qwen_vl(Qwen3VLConfig, Qwen3VLProcessor, vision, text)
    config.text_config.rope_parameters["mrope_interleaved"] = True
    return config, processor


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


def _idefics3(width: int, layers: int):
    from transformers import Idefics3Config, Idefics3ImageProcessorPil, Idefics3Processor, LlamaConfig

    tokenizer = build_tokenizer(extra_tokens=IDEFICS3_TOKENS, extra_words=["User", "Assistant"])
    scale_factor = 2  # the connector's pixel shuffle: 4x4 patches become 2x2 image tokens
    config = Idefics3Config(
        vision_config=_vision(width, layers),
        text_config=LlamaConfig(**_text_config(tokenizer, width, layers)),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=scale_factor,
        tie_word_embeddings=False,
    )
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
        do_image_splitting=False,  # one global image; splitting would add <row_i_col_j> tiles
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=(IMAGE_SIZE // PATCH_SIZE // scale_factor) ** 2,
        chat_template=SMOLVLM_CHAT_TEMPLATE,
    )
    return config, processor


def _gemma3(width: int, layers: int):
    from transformers import Gemma3Config, Gemma3ImageProcessorPil, Gemma3Processor, Gemma3TextConfig

    tokenizer = build_tokenizer(
        extra_tokens=GEMMA3_TURN_TOKENS, named_tokens=GEMMA3_TOKENS, extra_words=["model"]
    )
    tokens_per_image = 4  # the projector average-pools 4x4 patches down to 2x2 soft tokens
    head_dim = width // 4
    text = _text_config(tokenizer, width, layers)
    text.update(head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=64)
    ids = tokenizer.convert_tokens_to_ids
    config = Gemma3Config(
        text_config=Gemma3TextConfig(**text),
        # SigLIP without its pooling head, which Gemma3 does not use (its weights would get no gradient)
        vision_config=dict(model_type="siglip_vision_model", vision_use_head=False, **_vision(width, layers)),
        mm_tokens_per_image=tokens_per_image,
        boi_token_index=ids(GEMMA3_TOKENS["boi_token"]),
        eoi_token_index=ids(GEMMA3_TOKENS["eoi_token"]),
        image_token_index=ids(GEMMA3_TOKENS["image_token"]),
        tie_word_embeddings=False,
    )
    image_processor = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_length=tokens_per_image,
        chat_template=GEMMA3_CHAT_TEMPLATE,
    )
    return config, processor


def _gemma3_weights(model) -> None:
    """Gemma3 zero-initialises its image projection (real checkpoints hold trained values); a zero
    projection would hide the image from the language model and give the vision tower no gradient."""
    import torch

    with torch.no_grad():
        weight = model.model.multi_modal_projector.mm_input_projection_weight
        weight.normal_(std=model.config.initializer_range)


def _internvl(width: int, layers: int):
    from transformers import GotOcr2ImageProcessorPil, InternVLConfig, InternVLProcessor, Qwen2Config

    from raylora.data.processor import image_only_processor_class

    tokenizer = build_tokenizer(named_tokens=INTERNVL_TOKENS)
    tokens_per_image = (IMAGE_SIZE // PATCH_SIZE // 2) ** 2  # downsample_ratio 0.5: 4x4 patches -> 2x2
    config = InternVLConfig(
        vision_config=_vision(width, layers),
        text_config=Qwen2Config(**_text_config(tokenizer, width, layers)),
        image_token_id=tokenizer.convert_tokens_to_ids(INTERNVL_TOKENS["context_image_token"]),
        image_seq_length=tokens_per_image,
        downsample_ratio=0.5,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )
    image_processor = GotOcr2ImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, crop_to_patches=False, max_patches=1
    )
    processor = image_only_processor_class(InternVLProcessor)(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_length=tokens_per_image,
        chat_template=INTERNVL_CHAT_TEMPLATE,
    )
    return config, processor


def _mistral3(width: int, layers: int):
    from transformers import Mistral3Config, MistralConfig, PixtralImageProcessorPil, PixtralVisionConfig

    from raylora.data.processor import pixtral_processor_class

    tokenizer = build_tokenizer(extra_tokens=MISTRAL3_TOKENS)
    # Pixtral keeps an image's own size (8x8 digits, no upscaling): 2 px patches, merged 2x2 by the
    # projector, give 2x2 image tokens, each row closed by [IMG_BREAK] and the image by [IMG_END].
    patch_size, merge = 2, 2
    text = _text_config(tokenizer, width, layers)
    text["head_dim"] = width // 4
    config = Mistral3Config(
        vision_config=PixtralVisionConfig(
            **_vision(width, layers, head_dim=width // 4) | {"patch_size": patch_size}
        ),
        text_config=MistralConfig(**text),
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=merge,
        vision_feature_layer=-1,
        tie_word_embeddings=False,
    )
    image_processor = PixtralImageProcessorPil(
        size={"longest_edge": IMAGE_SIZE}, patch_size={"height": patch_size, "width": patch_size}
    )
    processor = pixtral_processor_class()(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        spatial_merge_size=merge,
        chat_template=MISTRAL3_CHAT_TEMPLATE,
    )
    return config, processor


# model_type -> a builder of (config, processor); raylora.assets.build_tiny_model turns them into a model.
BUILDERS = {
    "llava": _llava,
    "qwen2_vl": _qwen2_vl,
    "qwen2_5_vl": _qwen2_5_vl,
    "qwen3_vl": _qwen3_vl,
    "idefics3": _idefics3,
    "gemma3": _gemma3,
    "internvl": _internvl,
    "mistral3": _mistral3,
}
# Weights that transformers' initialisation leaves unlike any trained model's, set after `from_config`.
FIX_WEIGHTS = {"gemma3": _gemma3_weights}
