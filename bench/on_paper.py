"""Trainable parameters and checkpoint bytes of the real 7B models, from their configs on the meta device.

llava-1.5-7b (CLIP ViT-L/14-336 + Llama-2-7B + 2-layer MLP projector) and Qwen2-VL-7B-Instruct, built
from config classes with no weights (`torch.device("meta")`), LoRA r=16 on every linear layer of the
language model exactly as raylora's workers add it (`raylora.model.meta_model`, `mark_trained`), vision
tower and aligner frozen, then trained. Bytes are computed, not measured; the assumptions are in the JSON.
"""

from __future__ import annotations

import json
import time

import common

LORA_R = 16


def llava_15_7b():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision = CLIPVisionConfig(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        image_size=336,
        patch_size=14,
        projection_dim=768,
        hidden_act="quick_gelu",
    )
    text = LlamaConfig(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32064,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=32000,
        projector_hidden_act="gelu",
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )


def qwen2_vl_7b():
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(
        text_config=dict(
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
            max_position_embeddings=32768,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        ),
        vision_config=dict(
            depth=32,
            embed_dim=1280,
            hidden_size=3584,
            num_heads=16,
            mlp_ratio=4,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
        ),
        tie_word_embeddings=False,
    )


def safetensors_header(shapes: dict[str, list[int]], bytes_per_value: int) -> int:
    """Bytes of a safetensors header for these tensors (8-byte length + JSON, padded to 8)."""
    entries, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        n = bytes_per_value
        for d in shape:
            n *= d
        entries[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(entries, separators=(",", ":"))
    return 8 + len(text) + (-len(text)) % 8


def count(model_config, arch_name: str, trained_vision: bool) -> dict:
    from raylora import config as cfgmod
    from raylora.arch import REGISTRY
    from raylora.checkpoint import adapter_key
    from raylora.model import base_name, is_lora, mark_trained, meta_model, shapes

    arch = REGISTRY[arch_name]
    cfg = cfgmod.from_dict(
        {
            "lora": {"r": LORA_R, "alpha": 2 * LORA_R},
            "train": {"freeze_vision": not trained_vision, "freeze_aligner": not trained_vision},
        }
    )
    model = meta_model(cfg, arch, model_config)  # the same model and marking the workers use
    trainable = shapes(mark_trained(model, arch, cfg))
    parts: dict[str, int] = {}
    total = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if not is_lora(name):
            part = arch.part_of(base_name(name)) or "other (lm_head)"
            parts[part] = parts.get(part, 0) + p.numel()
    n_trainable = sum(_numel(s) for s in trainable.values())
    lora = {adapter_key(n): s for n, s in trainable.items() if is_lora(n)}
    trained = {n: s for n, s in trainable.items() if not is_lora(n)}
    moments = {f"{n}.{k}": s for n, s in trainable.items() for k in ("exp_avg", "exp_avg_sq")}
    headers = sum(safetensors_header(d, 4) for d in (lora, trained, moments))
    # state.json lists every trainable name and shape, plus config, scheduler, versions (~5 KB measured)
    small = len(json.dumps({n: list(s) for n, s in trainable.items()}, indent=1)) + 8_000
    base = total - sum(_numel(s) for n, s in trainable.items() if is_lora(n))
    frozen = total - n_trainable
    raylora_bytes = 12 * n_trainable + headers + small
    full_ft = 14 * base
    ds_lora_run = 2 * frozen + 12 * n_trainable
    return {
        "trained_vision_and_aligner": trained_vision,
        "base_params": base,
        "base_params_by_part": parts,
        "lora_params": n_trainable - sum(_numel(s) for s in trained.values()),
        "trainable_params": n_trainable,
        "trainable_tensors": len(trainable),
        "lora_tensors": len(lora),
        "trainable_fraction_of_base": n_trainable / base,
        "raylora_checkpoint_bytes": raylora_bytes,
        "raylora_tensor_bytes_12_per_param": 12 * n_trainable,
        "raylora_headers_and_small_files_bytes": headers + small,
        "full_finetune_zero3_checkpoint_bytes": full_ft,
        "deepspeed_save_checkpoint_of_this_lora_run_bytes": ds_lora_run,
        "base_model_bf16_bytes": 2 * base,
        "ratios": {
            "full_finetune_over_raylora": full_ft / raylora_bytes,
            "deepspeed_lora_run_over_raylora": ds_lora_run / raylora_bytes,
            "raylora_over_base_model_bf16": raylora_bytes / (2 * base),
        },
    }


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main() -> None:
    args = common.parser(__doc__).parse_args()
    start = time.perf_counter()
    models = {"llava-1.5-7b": (llava_15_7b, "llava"), "Qwen2-VL-7B-Instruct": (qwen2_vl_7b, "qwen2_vl")}
    if args.tiny:
        models = {"llava-1.5-7b": models["llava-1.5-7b"]}
    rows = []
    for name, (build, arch) in models.items():
        for trained in (False, True):
            rows.append({"model": name, **count(build(), arch, trained)})
    common.write_result(
        args,
        "on_paper",
        {
            "setup": {
                "lora": f"r={LORA_R}, alpha={2 * LORA_R}, every linear layer of the language model "
                "(q, k, v, o, gate, up, down), as raylora.model.add_lora builds it",
                "built_on": "meta device from transformers config classes: no weights",
                "seconds": time.perf_counter() - start,
            },
            "models": rows,
            "assumptions": [
                "raylora: 12 bytes per trainable parameter (fp32 master + Adam exp_avg + exp_avg_sq) plus "
                "the safetensors headers (computed exactly from the names and shapes) and about 8 KB + the "
                "trainable name/shape list for adapter_config.json, state.json and manifest.json.",
                "full_finetune_zero3_checkpoint: every base parameter trained, 14 bytes each: bf16 weights "
                "(2) + fp32 master (4) + Adam exp_avg and exp_avg_sq (8). Pickle overhead and DeepSpeed's "
                "placeholder module states are left out.",
                "deepspeed_save_checkpoint_of_this_lora_run: what engine.save_checkpoint writes for the "
                "same LoRA run under ZeRO-3 with bf16: each rank's fragment of every frozen parameter in "
                "bf16 (frozen_param_fragments, 2 bytes) plus fp32 flat partitions and Adam moments of the "
                "trainable ones (12 bytes); the layout was read from the tiny checkpoints of "
                "checkpoint_size.py.",
            ],
        },
    )
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
