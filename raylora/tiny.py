"""Tiny vision-language models from transformers' own config classes: one builder per architecture.

Each builder returns the config and the processor of a real model family, shrunk (width 64, 2 layers
by default): a word-level tokenizer over the demo's words (a byte-level BPE for Qwen3.5, whose folders
transformers loads with its own BPE class), and an image processor that upscales the 8x8 digits to
16x16 pixels, 4x4 patches, 4 image tokens (16 for Llava, which does not merge patches; Pixtral keeps the
8x8 size, with 2 px patches; Gemma 4's processor fills its smallest budget, 64 tokens). Tokenizer and chat
templates: raylora.tiny_text. Processors are built as the Hub's folders hold them: with torchvision
installed (raylora's own runtime), the Qwen and GLM families' torchvision image processor and their video
processor, Gemma 4's with its audio feature extractor; on a node without
torchvision, the PIL image processor and no video part (`image_only_processor_class`), the fallback
raylora loads such folders with. Imports are lazy so that the CLI can list the architectures without
importing transformers.
"""

from __future__ import annotations

from raylora.tiny_text import (
    GEMMA3_CHAT_TEMPLATE,
    GEMMA3_TOKENS,
    GEMMA3_TURN_TOKENS,
    GEMMA4_CHAT_TEMPLATE,
    GEMMA4_TOKENS,
    GEMMA4_TURN_TOKENS,
    GLM4V_CHAT_TEMPLATE,
    GLM4V_TOKENS,
    IDEFICS3_TOKENS,
    INTERNVL_CHAT_TEMPLATE,
    INTERNVL_TOKENS,
    LLAVA_CHAT_TEMPLATE,
    MISTRAL3_CHAT_TEMPLATE,
    MISTRAL3_TOKENS,
    QWEN2_VL_CHAT_TEMPLATE,
    QWEN3_VL_CHAT_TEMPLATE,
    SMOLVLM_CHAT_TEMPLATE,
    build_byte_level_tokenizer,
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
    return config, _qwen_vl_processor(processor_cls, video_processor_cls, tokenizer, template)


def _qwen2_vl(width: int, layers: int):
    from transformers import Qwen2VLConfig, Qwen2VLProcessor

    return _qwen_vl(Qwen2VLConfig, Qwen2VLProcessor, dict(depth=layers, embed_dim=width, hidden_size=width))


def _qwen3_vl(width: int, layers: int, moe: bool = False):
    """Qwen3-VL (dense): Qwen3 decoder layers (q/k norms, explicit head_dim), interleaved M-RoPE, a vision
    tower with learned position embeddings and DeepStack mergers after each of its blocks. `moe`:
    Qwen3-VL-MoE (30B-A3B, 235B-A22B), every decoder layer's MLP a mixture of experts, 4 experts here, 2 per
    token, fused into 3-D tensors, with a top-k router (`mlp.gate`)."""
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig, Qwen3VLProcessor

    vision = dict(
        depth=layers,
        hidden_size=width,
        intermediate_size=2 * width,
        out_hidden_size=width,
        num_position_embeddings=(IMAGE_SIZE // PATCH_SIZE) ** 2,
        deepstack_visual_indexes=list(range(layers)),
    )
    text = dict(head_dim=width // 4)
    if moe:
        text |= dict(decoder_sparse_step=1) | _moe_text(width)
    config, processor = _qwen_vl(Qwen3VLMoeConfig if moe else Qwen3VLConfig, Qwen3VLProcessor, vision, text)
    config.text_config.rope_parameters["mrope_interleaved"] = True
    return config, processor


def _qwen3_vl_moe(width: int, layers: int):
    return _qwen3_vl(width, layers, moe=True)


def _qwen3_5(width: int, layers: int, moe: bool = False):
    """Qwen3.5 (dense): decoder layers of Gated DeltaNet linear attention (`linear_attn`, with a causal
    conv1d) and gated full attention (`self_attn`, partial rotary), as `layer_types` says; Qwen3-VL's
    vision tower without DeepStack mergers. `moe`: Qwen3.5-MoE, every layer's MLP 4 fused experts (2 per
    token) beside a shared expert and its gate."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig, Qwen3VLProcessor

    head_dim = width // 2  # Qwen3.5 rotates a quarter of each head: mrope_section adds up to head_dim / 8
    vision = dict(
        depth=layers,
        hidden_size=width,
        intermediate_size=2 * width,
        out_hidden_size=width,
        num_position_embeddings=(IMAGE_SIZE // PATCH_SIZE) ** 2,
    )
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
    return _qwen_vl(config_cls, Qwen3VLProcessor, vision, text, build_byte_level_tokenizer())


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


def _qwen3_5_moe(width: int, layers: int):
    return _qwen3_5(width, layers, moe=True)


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


def _internvl(width: int, layers: int, text_model: str = "qwen2"):
    """InternVL3 (-hf folders: a Qwen2 text model) or, with `text_model="qwen3"`, InternVL3.5 (-HF folders:
    the same `internvl` model type and classes around a Qwen3 text model)."""
    from transformers import (
        GotOcr2ImageProcessorPil,
        InternVLConfig,
        InternVLProcessor,
        Qwen2Config,
        Qwen3Config,
    )

    from raylora.data.processor import image_only_processor_class

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
    processor = image_only_processor_class(InternVLProcessor)(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_length=tokens_per_image,
        chat_template=INTERNVL_CHAT_TEMPLATE,
    )
    return config, processor


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
# Weights that transformers' initialisation leaves unlike any trained model's, set after `from_config`.
FIX_WEIGHTS = {"gemma3": _gemma3_weights}
