"""Tiny models of the other families (`raylora.tiny`): Idefics3 / SmolVLM, Gemma 3, Gemma 4, InternVL,
Mistral 3 (Pixtral vision)."""

from __future__ import annotations

from raylora.tiny_parts import (
    IMAGE_SIZE,
    PATCH_SIZE,
    _text_config,
    _vision,
)
from raylora.tiny_text import (
    GEMMA3_CHAT_TEMPLATE,
    GEMMA3_TOKENS,
    GEMMA3_TURN_TOKENS,
    GEMMA4_CHAT_TEMPLATE,
    GEMMA4_TOKENS,
    GEMMA4_TURN_TOKENS,
    IDEFICS3_TOKENS,
    INTERNVL_CHAT_TEMPLATE,
    INTERNVL_TOKENS,
    MISTRAL3_CHAT_TEMPLATE,
    MISTRAL3_TOKENS,
    SMOLVLM_CHAT_TEMPLATE,
    build_tokenizer,
)


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


def _gemma4(width: int, layers: int, moe: bool = False):
    """Gemma 4 as its smaller checkpoints are built: decoder layers whose attributes differ by layer type
    (sliding and full attention layers with their own head_dim and rotary settings; `config.head_dim`
    raises), per-layer input embeddings, a vision tower of 2-D positioned patches pooled into soft tokens,
    `embed_vision` into the text width, and an audio tower with `embed_audio` beside it (which raylora
    never trains). The processor is transformers' own: its torchvision image and video processors and its
    audio feature extractor. An 8x8 digit fills the smallest budget the processor allows (70 soft tokens):
    64 soft tokens. `moe`: Gemma 4's mixture-of-experts layers (`enable_moe_block`: 4 fused experts, 2 per
    token, beside the dense MLP, with a `router`), still model_type gemma4."""
    from transformers import (
        Gemma4AudioFeatureExtractor,
        Gemma4Config,
        Gemma4ImageProcessor,
        Gemma4Processor,
        Gemma4VideoProcessor,
    )

    tokenizer = build_tokenizer(
        extra_tokens=GEMMA4_TURN_TOKENS, named_tokens=GEMMA4_TOKENS, extra_words=["model"]
    )
    ids = tokenizer.convert_tokens_to_ids
    head_dim = width // 4
    text = _text_config(tokenizer, width, layers)
    text.update(
        head_dim=head_dim,
        global_head_dim=2 * head_dim,  # full-attention layers' head_dim (512 against 256 in the real ones)
        layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"],
        sliding_window=64,
        vocab_size_per_layer_input=len(tokenizer),
        hidden_size_per_layer_input=width // 4,
    )
    if moe:
        text.update(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=width // 4)
    vision = dict(
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=head_dim,
        patch_size=PATCH_SIZE,
        pooling_kernel_size=2,
        position_embedding_size=64,
    )
    audio = dict(
        hidden_size=width // 2,
        num_hidden_layers=1,
        num_attention_heads=2,
        subsampling_conv_channels=[8, 4],
        output_proj_dims=width // 2,
    )
    config = Gemma4Config(
        text_config=text,
        vision_config=vision,
        audio_config=audio,
        image_token_id=ids(GEMMA4_TOKENS["image_token"]),
        boi_token_id=ids(GEMMA4_TOKENS["boi_token"]),
        eoi_token_id=ids(GEMMA4_TOKENS["eoi_token"]),
        audio_token_id=ids(GEMMA4_TOKENS["audio_token"]),
        boa_token_id=ids(GEMMA4_TOKENS["boa_token"]),
        eoa_token_index=ids(GEMMA4_TOKENS["eoa_token"]),
        video_token_id=ids("<|video|>"),
        tie_word_embeddings=False,
    )
    shape = dict(patch_size=PATCH_SIZE, pooling_kernel_size=2, max_soft_tokens=70)
    processor = Gemma4Processor(
        feature_extractor=Gemma4AudioFeatureExtractor(),
        image_processor=Gemma4ImageProcessor(**shape),
        tokenizer=tokenizer,
        video_processor=Gemma4VideoProcessor(**shape),
        image_seq_length=70,
        chat_template=GEMMA4_CHAT_TEMPLATE,
    )
    return config, processor


def _internvl(width: int, layers: int, text_model: str = "qwen2"):
    """InternVL3 (-hf folders: a Qwen2 text model) or, with `text_model="qwen3"`, InternVL3.5 (-HF folders:
    the same `internvl` model type and classes around a Qwen3 text model)."""
    from transformers import (
        GotOcr2ImageProcessorPil,
        InternVLConfig,
        InternVLProcessor,
        InternVLVideoProcessor,
        Qwen2Config,
        Qwen3Config,
    )

    tokenizer = build_tokenizer(named_tokens=INTERNVL_TOKENS)
    tokens_per_image = (IMAGE_SIZE // PATCH_SIZE // 2) ** 2  # downsample_ratio 0.5: 4x4 patches -> 2x2
    text = _text_config(tokenizer, width, layers)
    if text_model == "qwen3":
        text["head_dim"] = width // 4
    config = InternVLConfig(
        vision_config=_vision(width, layers),
        text_config={"qwen2": Qwen2Config, "qwen3": Qwen3Config}[text_model](**text),
        image_token_id=tokenizer.convert_tokens_to_ids(INTERNVL_TOKENS["context_image_token"]),
        image_seq_length=tokens_per_image,
        downsample_ratio=0.5,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )
    image_processor = GotOcr2ImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, crop_to_patches=False, max_patches=1
    )
    processor = InternVLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=InternVLVideoProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
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
