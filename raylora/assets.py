"""Offline demo assets: a tiny vision-language model folder and the handwritten digits as Parquet.

Nothing here downloads. The model folder is a real Hugging Face folder (config, safetensors weights,
tokenizer, processor with a chat template), so everything downstream loads it with `from_pretrained`
exactly as it would load llava-1.5-7b or Qwen2-VL-7B. raylora.tiny holds each architecture's config,
tokenizer and processor.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from raylora.config import ConfigError
from raylora.tiny import BUILDERS, FIX_WEIGHTS
from raylora.tiny_text import DIGIT_NAMES

PROMPT = "Which digit is this?"

# The architectures `raylora make-tiny-model --arch` can build: one builder each in raylora.tiny.
TINY_ARCHS: tuple[str, ...] = tuple(BUILDERS)


def build_tiny_model(arch: str, width: int = 64, layers: int = 2, seed: int = 0, **variant):
    """Build (model, processor) for `arch` from config classes only: random weights, real structure.
    `variant`: the builder's own options (raylora.tiny), e.g. `text_model="qwen3"` for InternVL3.5."""
    import torch
    from transformers import AutoModelForImageTextToText

    if arch not in BUILDERS:
        raise ValueError(f"make-tiny-model: unknown --arch {arch!r}; choose one of {', '.join(TINY_ARCHS)}")
    torch.manual_seed(seed)
    config, processor = BUILDERS[arch](width, layers, **variant)
    tokenizer = processor.tokenizer
    for cfg in (config, config.text_config):
        cfg.pad_token_id = tokenizer.pad_token_id
        cfg.eos_token_id = tokenizer.eos_token_id
        cfg.bos_token_id = tokenizer.bos_token_id
    model = AutoModelForImageTextToText.from_config(config)
    if arch in FIX_WEIGHTS:
        FIX_WEIGHTS[arch](model)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, processor


def make_tiny_model(
    out_dir: str | Path, arch: str, width: int = 64, layers: int = 2, seed: int = 0, **variant
) -> Path:
    """Write a tiny model folder that `from_pretrained` loads like a downloaded one."""
    out = Path(out_dir)
    model, processor = build_tiny_model(arch, width=width, layers=layers, seed=seed, **variant)
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
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise ConfigError("the digits come from scikit-learn: pip install -e '.[demo]'") from err

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
