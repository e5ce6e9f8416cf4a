"""Offline demo assets: a tiny vision-language model folder and the handwritten digits as Parquet.

Nothing here downloads. The model folder is a real Hugging Face folder (config, safetensors weights,
tokenizer, processor with a chat template), so everything downstream loads it with `from_pretrained`
exactly as it would load llava-1.5-7b or Qwen2-VL-7B.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image

from raylora.processor import image_only_processor_class

DIGIT_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
PROMPT = "Which digit is this?"

# Chat templates modelled on the real models' ones, so the tiny models are prompted the same way.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}USER: "
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}<image>\n{% else %}{{ c['text'] }}"
    "{% endif %}{% endfor %} {% else %}ASSISTANT: {% for c in message['content'] %}{{ c['text'] }}"
    "{% endfor %}</s>{% endif %}{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
QWEN2_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SPECIAL_TOKENS = [
    "<pad>",
    "<s>",
    "</s>",
    "<unk>",
    "<image>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
WORDS = ["USER", "ASSISTANT", "user", "assistant", ":", "?", ".", ",", "Which", "digit", "is", "this", "a"]


def build_tokenizer():
    """A word-level tokenizer over the demo's vocabulary, saved and loaded like any HF tokenizer.

    Written by hand because no pretrained tokenizer can be downloaded here; a word-level vocabulary of
    a few dozen entries also keeps the tiny model's embedding small.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + WORDS + DIGIT_NAMES)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(behavior="isolated")]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL_TOKENS[4:],
    )
    return tokenizer


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


def build_tiny_model(arch: str, width: int = 64, layers: int = 2, seed: int = 0):
    """Build (model, processor) for `arch` from config classes only: random weights, real structure."""
    from transformers import (
        AutoModelForImageTextToText,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaProcessor,
        Qwen2VLConfig,
    )

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    if arch == "llava":
        from transformers import CLIPImageProcessorPil

        image_size, patch_size = 16, 4
        config = LlavaConfig(
            vision_config=CLIPVisionConfig(
                hidden_size=width,
                intermediate_size=2 * width,
                num_hidden_layers=layers,
                num_attention_heads=4,
                image_size=image_size,
                patch_size=patch_size,
            ),
            text_config=LlamaConfig(**_text_config(tokenizer, width, layers)),
            image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
            vision_feature_select_strategy="default",
            vision_feature_layer=-1,
            tie_word_embeddings=False,
        )
        image_processor = CLIPImageProcessorPil(
            size={"shortest_edge": image_size},
            crop_size={"height": image_size, "width": image_size},
        )
        processor = LlavaProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            patch_size=patch_size,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,  # the CLS token, which the "default" strategy then drops
            chat_template=LLAVA_CHAT_TEMPLATE,
        )
    elif arch == "qwen2_vl":
        from transformers import Qwen2VLImageProcessorPil, Qwen2VLProcessor

        head_dim = width // 4
        text = _text_config(tokenizer, width, layers)
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 10000.0,
            # the three M-RoPE sections (time, height, width) must add up to head_dim / 2
            "mrope_section": [head_dim // 4, head_dim // 8, head_dim // 8],
        }
        config = Qwen2VLConfig(
            text_config=text,
            vision_config=dict(
                depth=layers,
                embed_dim=width,
                hidden_size=width,
                num_heads=4,
                patch_size=4,
                spatial_merge_size=2,
                temporal_patch_size=2,
            ),
            image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
            video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
            vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
            vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
            tie_word_embeddings=False,
        )
        pixels = 16 * 16  # every digit becomes a 16x16 image: 4x4 patches, 2x2 tokens after merging
        image_processor = Qwen2VLImageProcessorPil(
            patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=pixels, max_pixels=pixels
        )
        processor = image_only_processor_class(Qwen2VLProcessor)(
            image_processor=image_processor, tokenizer=tokenizer, chat_template=QWEN2_VL_CHAT_TEMPLATE
        )
    else:
        raise ValueError(f"make-tiny-model: unknown --arch {arch!r}; choose llava or qwen2_vl")
    for cfg in (config, config.text_config):
        cfg.pad_token_id = tokenizer.pad_token_id
        cfg.eos_token_id = tokenizer.eos_token_id
        cfg.bos_token_id = tokenizer.bos_token_id
    model = AutoModelForImageTextToText.from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, processor


def make_tiny_model(out_dir: str | Path, arch: str, width: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """Write a tiny model folder that `from_pretrained` loads like a downloaded one."""
    out = Path(out_dir)
    model, processor = build_tiny_model(arch, width=width, layers=layers, seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def _png(pixels: np.ndarray) -> bytes:
    # The digits are 8x8 with values 0..16; scale to 0..255 grey and save as RGB PNG bytes.
    grey = (pixels.reshape(8, 8) * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(grey, mode="L").convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


def make_digits(out_dir: str | Path, eval_fraction: float = 0.2, seed: int = 0) -> tuple[Path, Path]:
    """Write DIR/train.parquet and DIR/eval.parquet (columns image, prompt, answer) from sklearn's digits."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))
    n_eval = int(len(order) * eval_fraction)
    splits = {"eval": order[:n_eval], "train": order[n_eval:]}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, idx in splits.items():
        table = pa.table(
            {
                "image": pa.array([_png(digits.data[i]) for i in idx], type=pa.binary()),
                "prompt": pa.array([PROMPT] * len(idx), type=pa.string()),
                "answer": pa.array([DIGIT_NAMES[digits.target[i]] for i in idx], type=pa.string()),
            }
        )
        paths[split] = out / f"{split}.parquet"
        pq.write_table(table, paths[split])
    return paths["train"], paths["eval"]
