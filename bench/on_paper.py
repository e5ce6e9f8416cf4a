"""Trainable parameters and checkpoint bytes of the shipped jobs' models, from their configs (meta device).

llava-1.5-7b (CLIP ViT-L/14-336 + Llama-2-7B + 2-layer MLP projector), Qwen2-VL-7B-Instruct,
Qwen3-VL-8B-Instruct and Qwen3-VL-30B-A3B-Instruct (a mixture of 128 experts in each of its 48 layers),
built from config classes with no weights (`torch.device("meta")`), LoRA r=16 on every linear layer of the
language model (and on the MoE's fused expert tensors, a rank-16 adapter per expert) exactly as raylora's
workers add it (`raylora.model.meta_model`, `mark_trained`), vision tower and aligner frozen, then trained.
Then the memory per GPU of the shipped job configs (activations, a MoE's router logits and the full-size
expert W + dW that LoRA on its experts makes, and ZeRO-3's shares as DeepSpeed 0.19 allocates them) and
what keeping the frozen base resident (`train.param_persistence_threshold`) costs in memory and saves in
all-gathers; and what packing
(train.packing) saves per step on bench/padding.py's length mixes, in FLOPs and passes. Bytes and FLOPs are
computed, not measured; the assumptions are in the JSON.
"""

from __future__ import annotations

import dataclasses
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


# Qwen3-VL's vision tower, the same in the 8B and the 30B-A3B (their config.json, vision_config): its
# output width is the language model's.
QWEN3_VL_VISION = dict(
    depth=27,
    hidden_size=1152,
    intermediate_size=4304,
    num_heads=16,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    in_channels=3,
    num_position_embeddings=2304,
    deepstack_visual_indexes=[8, 16, 24],
)
QWEN3_VL_ROPE = {
    "rope_type": "default",
    "rope_theta": 5000000.0,
    "mrope_section": [24, 20, 20],
    "mrope_interleaved": True,
}


def qwen3_vl_8b():
    """Qwen/Qwen3-VL-8B-Instruct's config.json (dense Qwen3 decoder layers, untied embeddings)."""
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config=dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=262144,
            rope_parameters=QWEN3_VL_ROPE,
        ),
        vision_config=dict(QWEN3_VL_VISION, out_hidden_size=4096),
        tie_word_embeddings=False,
    )


def qwen3_vl_30b_a3b():
    """Qwen/Qwen3-VL-30B-A3B-Instruct's config.json: 48 decoder layers, every one a mixture of 128 experts
    (8 per token) whose attention is 32 heads of 128 (4096 wide) over a 2048-wide residual stream."""
    from transformers import Qwen3VLMoeConfig

    return Qwen3VLMoeConfig(
        text_config=dict(
            hidden_size=2048,
            intermediate_size=6144,  # unused: no dense MLP layer (mlp_only_layers is empty)
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            decoder_sparse_step=1,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=262144,
            rope_parameters=QWEN3_VL_ROPE,
            router_aux_loss_coef=0.001,
        ),
        vision_config=dict(QWEN3_VL_VISION, out_hidden_size=2048),
        tie_word_embeddings=False,
    )


# name: (config builder, raylora architecture, lora.dropout). LoRA on fused experts (PEFT's
# target_parameters) takes no dropout (raylora.moe.check_expert_lora).
MODELS = {
    "llava-1.5-7b": (llava_15_7b, "llava", 0.05),
    "Qwen2-VL-7B-Instruct": (qwen2_vl_7b, "qwen2_vl", 0.05),
    "Qwen3-VL-8B-Instruct": (qwen3_vl_8b, "qwen3_vl", 0.05),
    "Qwen3-VL-30B-A3B-Instruct": (qwen3_vl_30b_a3b, "qwen3_vl_moe", 0.0),
}


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


def count(model_config, arch_name: str, trained_vision: bool, lora_dropout: float = 0.05) -> dict:
    """Parameters and checkpoint bytes of LoRA r=LORA_R as raylora adds it (on a mixture-of-experts model
    also on the fused expert tensors, a rank-r adapter per expert: `lora_dropout` must then be 0)."""
    from raylora import config as cfgmod
    from raylora.arch import REGISTRY
    from raylora.checkpoint import adapter_key
    from raylora.model import base_name, is_lora, mark_trained, meta_model, shapes

    arch = REGISTRY[arch_name]
    cfg = cfgmod.from_dict(
        {
            "lora": {"r": LORA_R, "alpha": 2 * LORA_R, "dropout": lora_dropout},
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
        # PEFT's ParamWrapper: lora_A [r x experts, in], lora_B [out, r x experts] per fused expert tensor
        "expert_lora_params": sum(_numel(s) for n, s in lora.items() if ".experts." in n),
        "raylora_checkpoint_bytes": raylora_bytes,
        "raylora_checkpoint_gb": raylora_bytes / 1e9,
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


# ------------------------------------------------------------------------------ memory per GPU

GB = 1e9
CARDS_GB = (40, 80)
JOBS = {
    "llava-1.5-7b": "llava-1.5-7b.yaml",
    "Qwen2-VL-7B-Instruct": "qwen2-vl-7b.yaml",
    "Qwen3-VL-8B-Instruct": "qwen3-vl-8b.yaml",
    "Qwen3-VL-30B-A3B-Instruct": "qwen3-vl-30b-a3b.yaml",
}
ANSWER_TOKENS = 256  # assumed answer length per sample, for the logits raylora computes
RUNTIME_OVERHEAD_GB = 3.0  # CUDA context, NCCL buffers, allocator fragmentation: not computed, allowed for
QWEN2_VL_7B_MAX_PIXELS = 12845056  # Qwen2-VL-7B-Instruct's preprocessor_config.json: 16384 image tokens
# Qwen3-VL's preprocessor_config.json (size.longest_edge, 4096 x 4096): 16384 image tokens of 32 x 32 pixels
MODEL_MAX_PIXELS = {"qwen2_vl": QWEN2_VL_7B_MAX_PIXELS, "qwen3_vl": 16777216, "qwen3_vl_moe": 16777216}


def decoder_layer_bytes(h: int, i: int, kv: int) -> dict:
    """Activation bytes one decoder layer (RMSNorm, attention, SwiGLU MLP: Llama, Qwen2) keeps per token
    for the backward pass: bf16, frozen base weights (a frozen linear keeps nothing for its own backward),
    LoRA with dropout on all seven linear layers, fused attention (sdpa or flash: no seq x seq scores)."""
    terms = {
        "attention RMSNorm: its fp32 input copy (4h)": 4 * h,
        "q, k, v LoRA dropout: output (2h) + 1-byte mask (h), each (3 x 3h)": 9 * h,
        "attention kernel inputs q, k, v after RoPE (2h + 2kv + 2kv)": 2 * h + 4 * kv,
        "attention output (2h)": 2 * h,
        "o_proj LoRA dropout (3h)": 3 * h,
        "MLP RMSNorm: fp32 input copy (4h)": 4 * h,
        "gate, up LoRA dropout (2 x 3h)": 6 * h,
        "gate output, SiLU(gate), up output (3 x 2i)": 6 * i,
        "down_proj LoRA dropout (3i)": 3 * i,
    }
    return {
        "formula": "30h + 4kv + 9i",
        "h": h,
        "i": i,
        "kv": kv,
        "terms": terms,
        "bytes": sum(terms.values()),
    }


def qwen3_layer_bytes(h: int, q: int, kv: int, dropout: bool, mlp: dict) -> dict:
    """Activation bytes one Qwen3 decoder layer keeps per token for the backward pass, as
    `decoder_layer_bytes` counts a Llama layer (bf16, frozen base, LoRA on every linear layer, fused
    attention), with what Qwen3 adds: attention `q` wide (heads x head_dim, which need not be h) with
    RMSNorms on q and k, and, in a mixture-of-experts layer, the router and each token's top-k experts.

    `mlp`: {"i": intermediate} for a dense SwiGLU MLP, or {"experts": E, "top_k": k, "i": expert
    intermediate} for a MoE block (transformers' grouped_mm experts: each routed copy of a token keeps its
    gathered input for the expert weights' gradient, the gate_up output, SiLU(gate), the product and
    the expert's output before the routing weight). Without LoRA dropout (required on experts) each LoRA
    input is the base layer's input, kept once; with it, each LoRA layer keeps its dropout's output and
    1-byte mask."""
    drop = 3 if dropout else 0  # per element of a LoRA layer's input: dropout output (2) + mask (1)
    terms = {
        "attention RMSNorm: its fp32 input copy (4h)": 4 * h,
        "q, k, v LoRA input: the normed hidden state (2h)"
        + (" + each one's dropout (3 x 3h)" if dropout else ""): 2 * h + 3 * drop * h,
        "q and k RMSNorms: fp32 input copies (4q + 4kv)": 4 * q + 4 * kv,
        "attention kernel inputs q, k, v after RoPE (2q + 4kv)": 2 * q + 4 * kv,
        "attention output = o_proj input (2q)" + (" + its dropout (3q)" if dropout else ""): (2 + drop) * q,
        "MLP RMSNorm: fp32 input copy (4h)": 4 * h,
    }
    if "experts" in mlp:
        e, k, i = mlp["experts"], mlp["top_k"], mlp["i"]
        terms |= {
            "router: fp32 softmax over the experts (4E)": 4 * e,
            "top-k copies of the token, one per routed expert: the experts' input (k x 2h)": 2 * k * h,
            "gate_up output, SiLU(gate), gate x up = down input (k x (4i + 2i + 2i))": 8 * k * i,
            "expert output before the routing weight (k x 2h)": 2 * k * h,
        }
    else:
        i = mlp["i"]
        terms |= {
            "gate, up LoRA input: the normed hidden state (2h)"
            + (" + dropout (2 x 3h)" if dropout else ""): (2 + 2 * drop) * h,
            "gate output, SiLU(gate), up output (3 x 2i)": 6 * i,
            "gate x up = down_proj input (2i)" + (" + its dropout (3i)" if dropout else ""): (2 + drop) * i,
        }
    return {
        "h": h,
        "q": q,
        "kv": kv,
        **mlp,
        "lora_dropout": dropout,
        "terms": terms,
        "bytes": sum(terms.values()),
    }


def expert_weights_bytes(text, target_modules: list[str] | None, gc: bool) -> dict:
    """Bytes of the full-size expert tensors that LoRA on the experts makes in each MoE layer: PEFT's
    ParamWrapper folds the adapter into the weight (`torch.baddbmm(W, lhs, rhs)`, peft 0.21
    `_LoraFactorsProxy`), a bf16 tensor as large as the layer's whole expert stack, cached for the layer's
    forward; the experts' backward makes its gradient, as large again (the gradient flows to the two
    low-rank factors through it). Autograd keeps W + dW for the backward of every MoE layer; with
    gradient checkpointing only the layer being recomputed has it (the checkpointed forward keeps none),
    so at most one layer's W + dW and its gradient are alive at once. 0 when LoRA leaves the experts out."""
    e, h, i = text.num_experts, text.hidden_size, text.moe_intermediate_size
    shapes = {"gate_up_proj": e * 2 * i * h, "down_proj": e * h * i}
    adapted = {n: v for n, v in shapes.items() if not target_modules or n in target_modules}
    per_layer = 2 * sum(adapted.values())  # bf16
    sparse = [
        k
        for k in range(text.num_hidden_layers)
        if k not in (text.mlp_only_layers or []) and (k + 1) % text.decoder_sparse_step == 0
    ]
    kept_layers = 1 if gc else len(sparse)
    return {
        "adapted_tensors": sorted(adapted),
        "moe_layers": len(sparse),
        "w_plus_dw_bytes_per_layer": per_layer,
        "layers_holding_w_plus_dw": kept_layers if adapted else 0,
        "gradient_bytes": per_layer,  # one layer's at a time: the backward goes layer by layer
        "bytes": kept_layers * per_layer + per_layer if adapted else 0,
    }


def vit_block_bytes(d: int, m: int, trained: bool) -> dict:
    """Activation bytes one vision transformer block (LayerNorm, attention, GELU MLP) keeps per patch, bf16.

    Trained: every linear keeps its input for its weight's gradient. Frozen: only what the input's
    gradient needs, which PEFT's `enable_input_require_grads` (on with gradient checkpointing) asks for.
    """
    if trained:
        terms = {
            "LayerNorm 1 input + output = qkv input (2d + 2d)": 4 * d,
            "q, k, v for the attention kernel (6d)": 6 * d,
            "attention output = proj input (2d)": 2 * d,
            "LayerNorm 2 input + output = fc1 input (2d + 2d)": 4 * d,
            "fc1 output = GELU input, GELU output = fc2 input (2m + 2m)": 4 * m,
        }
        formula = "16d + 4m"
    else:
        terms = {
            "LayerNorm 1 and 2 inputs (2d + 2d)": 4 * d,
            "q, k, v and attention output (6d + 2d)": 8 * d,
            "GELU input (2m)": 2 * m,
        }
        formula = "12d + 2m"
    return {"formula": formula, "d": d, "m": m, "terms": terms, "bytes": sum(terms.values())}


# DeepSpeed 0.19's stage3_max_live_parameters and reduce_bucket_size defaults (raylora sets neither)
MAX_LIVE, REDUCE_BUCKET = 10**9, 5 * 10**8


def zero3_shares(model_config, arch_name: str, cfg) -> dict:
    """Bytes per GPU of ZeRO-3's parameter, gradient and optimizer partitions for run config `cfg`.

    As DeepSpeed 0.19 allocates them (runtime/zero/stage3.py, partition_parameters.py): a parameter of
    at most stage3_param_persistence_threshold elements stays whole on every rank beside its partition;
    with contiguous_gradients (raylora's config) the gradient bucket is one buffer of the whole
    reduce_bucket_size, allocated at start in the communication dtype (fp32: raylora reduces in fp32
    under bf16, and an fp32 model is fp32), however few parameters are trained.
    """
    from raylora.arch import REGISTRY
    from raylora.model import mark_trained, meta_model

    arch, world = REGISTRY[arch_name], cfg.world_size
    model = meta_model(cfg, arch, model_config)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in mark_trained(model, arch, cfg).values())
    threshold = cfg.train.param_persistence_threshold
    persistent = sum(p.numel() for p in model.parameters() if p.numel() <= threshold)
    gathered = min(MAX_LIVE, total - persistent)  # the persistent ones are never gathered on demand
    shares = {
        f"bf16 parameters, 1/{world} partition (2 x {total:,} / {world})": 2 * total / world,
        f"persistent parameters (at most the threshold's elements), whole (2 x {persistent:,})": 2
        * persistent,
        f"gathered parameters, at most stage3_max_live_parameters (2 x {gathered:,})": 2 * gathered,
        f"fp32 masters + Adam moments, 1/{world} (12 x {trainable:,} / {world})": 12 * trainable / world,
        f"fp32 gradient partition (4 x {trainable:,} / {world})": 4 * trainable / world,
        f"fp32 gradient bucket, the whole reduce_bucket_size at start (4 x {REDUCE_BUCKET:,})": 4
        * REDUCE_BUCKET,
    }
    return {
        "params": total,
        "trainable_params": trainable,
        "persistent_params": persistent,
        "param_persistence_threshold": threshold,
        "largest_param": max(p.numel() for p in model.parameters()),
        "world_size": world,
        "bytes": shares,
    }


def base_all_gathers(shares: dict, accumulation: int) -> dict:
    """Bytes each rank receives per optimizer step to gather the base parameters, on paper.

    Not persistent: gathered for every use, at least twice per micro batch (the forward pass, then the
    backward pass with its recomputation: DeepSpeed keeps a layer gathered between the two when its next
    use comes within stage3_max_reuse_distance, 1e9 elements; three times if it does not). Persistent:
    gathered once per optimizer step (stage3.py releases every parameter before the step,
    `_partition_all_parameters`, and gathers the persistent ones again after it, `_post_step`).
    """
    world = shares["world_size"]
    received = (world - 1) / world * 2  # bf16: each rank receives the other ranks' partitions
    on_demand = shares["params"] - shares["persistent_params"]
    return {
        "micro_batches_per_step": accumulation,
        "gathers_per_step_on_demand": 2 * accumulation,
        "on_demand_gb": 2 * accumulation * received * on_demand / GB,
        "persistent_gb": received * shares["persistent_params"] / GB,
        "total_gb": (2 * accumulation * received * on_demand + received * shares["persistent_params"]) / GB,
    }


def stack_bytes(per_item: int, width: int, layers: int, items: int, gc: bool) -> int:
    """Bytes a stack of `layers` layers keeps for `items` tokens (or patches): every layer's activations,
    or with checkpointing each layer's bf16 input (2 x width) plus one layer's activations at a time,
    recomputed in the backward pass."""
    return (layers * 2 * width + per_item) * items if gc else layers * per_item * items


def memory_per_gpu(name: str, model_config, arch_name: str) -> dict:
    """Activation memory and ZeRO-3 shares per GPU of the shipped job config, against 40 and 80 GB cards.

    A micro batch of train.micro_batch_size samples, each data.max_length tokens long (the worst case) with
    one image; Llava's image is 576 tokens (577 patches with CLS), Qwen2-VL's data.max_pixels / 28^2 tokens
    and Qwen3-VL's data.max_pixels / 32^2 (4 patches each). A mixture-of-experts model also keeps, per
    layer and token, its router logits for the load-balancing loss, and the full-size expert weights
    that LoRA on the experts makes (`expert_weights_bytes`).
    """
    from raylora import config as cfgmod

    cfg = cfgmod.load(common.ROOT / "jobs" / JOBS[name])
    text, vision = model_config.text_config, model_config.vision_config
    h, layers, vocab = text.hidden_size, text.num_hidden_layers, text.vocab_size
    head_dim = getattr(text, "head_dim", None) or h // text.num_attention_heads
    kv = text.num_key_value_heads * head_dim
    moe = getattr(text, "num_experts", 0) > 0
    if arch_name.startswith("qwen3"):
        mlp = (
            {"experts": text.num_experts, "top_k": text.num_experts_per_tok, "i": text.moe_intermediate_size}
            if moe
            else {"i": text.intermediate_size}
        )
        q = text.num_attention_heads * head_dim
        lm = qwen3_layer_bytes(h, q, kv, cfg.lora.dropout > 0, mlp)
    else:
        lm = decoder_layer_bytes(h, text.intermediate_size, kv)
    if arch_name == "llava":
        d, m, depth = vision.hidden_size, vision.intermediate_size, vision.num_hidden_layers
        tokens_per_image = {"shipped": (vision.image_size // vision.patch_size) ** 2}
        patches_per_token, extra_patches = 1, 1  # CLS
    else:
        # Qwen2-VL's vision config names its width embed_dim (its hidden_size is the output width) and its
        # MLP by mlp_ratio; Qwen3-VL's names them hidden_size and intermediate_size
        d = getattr(vision, "embed_dim", None) or vision.hidden_size
        m = vision.intermediate_size if hasattr(vision, "intermediate_size") else d * vision.mlp_ratio
        depth = vision.depth
        pixels_per_token = (vision.patch_size * vision.spatial_merge_size) ** 2
        tokens_per_image = {
            "shipped": cfg.data.max_pixels // pixels_per_token,
            "unset": MODEL_MAX_PIXELS[arch_name] // pixels_per_token,
        }
        patches_per_token, extra_patches = vision.spatial_merge_size**2, 0
    vit = vit_block_bytes(d, m, trained=not cfg.train.freeze_vision)
    shares = zero3_shares(model_config, arch_name, cfg)
    # train.param_persistence_threshold at the largest parameter (the embedding or lm_head): every
    # parameter persistent, the whole frozen base resident on every GPU
    largest = shares["largest_param"]
    resident_cfg = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, param_persistence_threshold=largest)
    )
    resident = zero3_shares(model_config, arch_name, resident_cfg)
    accumulation = cfg.grad_accum_steps(cfg.world_size)
    b, s = cfg.train.micro_batch_size, cfg.data.max_length
    scenarios = {  # name: (gradient checkpointing, image tokens, sample tokens)
        "shipped": (cfg.gradient_checkpointing, tokens_per_image["shipped"], s),
        "gradient_checkpointing off": (False, tokens_per_image["shipped"], s),
    }
    if "unset" in tokens_per_image:  # the model's own cap: one 16384-token image plus 512 tokens of text
        unset = tokens_per_image["unset"]
        scenarios["max_pixels and max_length unset"] = (cfg.gradient_checkpointing, unset, unset + 512)
    rows = {}
    for label, (gc, image_tokens, sample_tokens) in scenarios.items():
        tokens, patches = b * sample_tokens, b * (image_tokens * patches_per_token + extra_patches)
        # a frozen vision tower keeps activations only when PEFT asks for input gradients (checkpointing)
        vision_kept = gc or not cfg.train.freeze_vision
        lm_bytes = stack_bytes(lm["bytes"], h, layers, tokens, gc)
        vision_bytes = stack_bytes(vit["bytes"], d, depth, patches, gc) if vision_kept else 0
        # bf16 logits (2) + their fp32 copy (4) + the fp32 cross-entropy gradient (4)
        logits_bytes = b * ANSWER_TOKENS * vocab * 10
        act = {
            f"language model: {layers} layers, {tokens:,} tokens": lm_bytes,
            f"vision tower: {depth} blocks, {patches:,} patches": vision_bytes,
            f"answer logits: {b} x {ANSWER_TOKENS} answer tokens x {vocab:,} x 10 B": logits_bytes,
        }
        if moe:
            e = text.num_experts
            # each layer's router logits (bf16), kept to the end of the forward for the load-balancing loss,
            # and the loss's own softmax of them (bf16), kept for its backward: checkpointing keeps both
            act[
                f"router logits and their softmax for the load-balancing loss: {layers} x {tokens:,} x 4E"
            ] = layers * tokens * 4 * e
            experts = expert_weights_bytes(text, cfg.lora.target_modules, gc)
            act[
                f"experts' W + dW at full size (bf16, {experts['w_plus_dw_bytes_per_layer'] / GB:.2f} GB a "
                f"layer) in {experts['layers_holding_w_plus_dw']} layer(s), and one layer's gradient of it"
            ] = experts["bytes"]
        total = sum(act.values()) + sum(shares["bytes"].values()) + RUNTIME_OVERHEAD_GB * GB
        total_resident = sum(act.values()) + sum(resident["bytes"].values()) + RUNTIME_OVERHEAD_GB * GB
        rows[label] = {
            "gradient_checkpointing": gc,
            "micro_batch": b,
            "sample_tokens": sample_tokens,
            "image_tokens": image_tokens,
            "activation_bytes": act,
            "activations_gb": sum(act.values()) / GB,
            "logits_of_every_position_would_be_gb": tokens * vocab * 10 / GB,
            **({"expert_weights": experts} if moe else {}),
            "total_gb": total / GB,
            "fits": {f"{c} GB": total <= c * GB for c in CARDS_GB},
            "total_gb_base_resident": total_resident / GB,
            "fits_base_resident": {f"{c} GB": total_resident <= c * GB for c in CARDS_GB},
        }
    return {
        "model": name,
        "job": f"jobs/{JOBS[name]}",
        "decoder_layer_bytes_per_token": lm,
        "vision_block_bytes_per_patch": vit,
        "zero3_shares": shares,
        "zero3_shares_gb": sum(shares["bytes"].values()) / GB,
        # what this job trains (its lora, freeze and router settings), 12 bytes each in a checkpoint
        "checkpoint_gb_of_this_job": 12 * shares["trainable_params"] / GB,
        "base_all_gathers_per_step": base_all_gathers(shares, accumulation),
        "base_resident": {
            "setting": f"train.param_persistence_threshold={largest}",
            "why": "the largest parameter's element count: every parameter persistent, so the frozen bf16 "
            "base stays whole on every GPU beside its partition, and is gathered once per optimizer step "
            "instead of at every use",
            "zero3_shares": resident,
            "zero3_shares_gb": sum(resident["bytes"].values()) / GB,
            "extra_gb_per_gpu": (sum(resident["bytes"].values()) - sum(shares["bytes"].values())) / GB,
            "base_all_gathers_per_step": base_all_gathers(resident, accumulation),
        },
        "runtime_overhead_gb_allowed": RUNTIME_OVERHEAD_GB,
        "scenarios": rows,
        "assumptions": [
            "every sample data.max_length tokens long with one image (the worst case the config allows)",
            f"{ANSWER_TOKENS} answer tokens per sample for the logits raylora computes (answer positions)",
            "left out: the aligner's activations (under 1% here), attention kernel workspaces, the CUDA "
            f"context and allocator fragmentation (the {RUNTIME_OVERHEAD_GB:g} GB allowance)",
            "gathered parameters are DeepSpeed's upper bound, not typical use; the gradient bucket is "
            "allocated whole at start",
        ],
    }


QLORA_CARDS_GB = (24, 40, 48, 80)
QLORA_WORLDS = (1, 2, 8)


def qlora_on_paper(name: str, model_config, arch_name: str, memory: dict) -> dict:
    """Memory per GPU of the shipped job config with and without model.quantization=nf4, at load and in
    training, on 1, 2 and 8 GPUs, and the smallest card (24, 40, 48, 80 GB) each fits.

    At load, raylora without 4 bits loads under zero.Init (a 1/world share of the bf16 model per GPU);
    with 4 bits every rank holds the whole model (transformers skips zero.Init for a quantized model):
    the language model's linear layers at half a byte per parameter plus one fp32 scale per 64
    (bitsandbytes' blocksize, no double quantization), everything else in bf16. In training ZeRO-3
    partitions the packed weights like any parameter; the scales are no parameters and stay whole on
    every rank. Activations, gradients and optimizer state are the shipped scenario's
    (`memory_per_gpu`), which the 4-bit base does not change; the gathered-parameter bound is kept at
    its bf16 size (an upper bound).
    """
    import torch

    from raylora import config as cfgmod
    from raylora.arch import REGISTRY, base_on_meta

    cfg = cfgmod.load(common.ROOT / "jobs" / JOBS[name])
    arch = REGISTRY[arch_name]
    model = base_on_meta(model_config)  # the linear layers bitsandbytes quantizes (raylora.quant)
    linear = sum(
        m.weight.numel()
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and arch.part_of(n + ".weight") == "language_model"
    )
    total = sum(p.numel() for p in model.parameters())
    packed, scales, rest = linear / 2, 4 * linear / 64, 2 * (total - linear)
    shipped = memory["scenarios"]["shipped"]
    activations = shipped["activations_gb"] * GB
    rows = {}
    for world in QLORA_WORLDS:
        sized = dataclasses.replace(cfg, scaling=dataclasses.replace(cfg.scaling, num_workers=world))
        shares = zero3_shares(model_config, arch_name, sized)
        bf16_train = sum(shares["bytes"].values()) + activations + RUNTIME_OVERHEAD_GB * GB
        four_train = bf16_train - 2 * total / world + (packed + rest) / world + scales
        sides = {
            "bf16": {"load_gb": 2 * total / world / GB, "train_gb": bf16_train / GB},
            "nf4": {"load_gb": (packed + scales + rest) / GB, "train_gb": four_train / GB},
        }
        for side in sides.values():
            peak = max(side["load_gb"], side["train_gb"])
            side["smallest_card_gb"] = next((c for c in QLORA_CARDS_GB if peak <= c), None)
        rows[f"{world} GPU"] = sides
    return {
        "model": name,
        "job": f"jobs/{JOBS[name]}",
        "language_model_linear_params": linear,
        "params": total,
        "nf4_weights_gb": (packed + scales) / GB,
        "activations_gb_shipped": shipped["activations_gb"],
        "per_gpu": rows,
    }


def packing_on_paper(name: str, model_config, steps: int, samples: int) -> dict:
    """A step of the shipped job config padded against packed, in the language model's FLOPs, on the length
    mix bench/padding.py models for it; and the activation memory of a packed pass at the config's token
    budget (against the padded micro batch's worst case, micro_batch_size x data.max_length tokens).

    FLOPs per step, gradient checkpointing on (the shipped configs): 6 N per token position for the
    frozen linear layers (forward, recomputed forward, the input gradient; LoRA's own are under 1%) and
    4 x the attention's forward (forward, recomputation, backward at twice the forward), whose forward is
    4 h L^2 per layer for a row attended whole (sdpa under a mask) and 2 h L^2 for a causal block that a
    kernel skips the upper half of (flash_attention_2's varlen path, which also unpads a padded batch, and
    raylora's packed sdpa, `packing.PACKED_SDPA`: each sample's attention on its own, causal, no mask).
    Logits: only at answer positions in both (raylora.loss), so left out. The vision tower sees the same
    images either way, so it is left out too.
    """
    import numpy as np
    import padding

    from raylora import config as cfgmod

    cfg = cfgmod.load(common.ROOT / "jobs" / JOBS[name])
    text = model_config.text_config
    h, layers, i = text.hidden_size, text.num_hidden_layers, text.intermediate_size
    kv = text.num_key_value_heads * (h // text.num_attention_heads)
    n_linear = layers * (2 * h * h + 2 * h * kv + 3 * h * i)
    rng = np.random.default_rng(padding.SEED)
    if name == "llava-1.5-7b":
        lengths, has_image, _ = padding.llava_instruct_lengths(rng, samples)
        stand_in = 576 + 20
    else:
        lengths, has_image, _ = padding.qwen2_vl_lengths(rng, samples, cfg.data.max_pixels)
        stand_in = 4 + 2 + 25
    budget = cfg.train.max_tokens_per_micro_batch or cfg.train.micro_batch_size * cfg.data.max_length
    padded = padding.padding(lengths, cfg, stand_in, False, steps)
    packed = padding.packed_cut(lengths, has_image, cfg, budget, stand_in, steps)

    def flops(positions: float, squares: float, causal_skip: bool) -> float:
        return 6 * n_linear * positions + 4 * layers * (2 if causal_skip else 4) * h * squares

    padded_sdpa = flops(padded["positions_per_step"], padded["attention_squares_per_step"], False)
    # a padded batch under flash_attention_2 is unpadded for the attention: each sample's own causal block
    padded_flash = flops(padded["positions_per_step"], packed["attention_squares_per_step"]["varlen"], True)
    # raylora's packed passes under sdpa: each sample on its own, as the varlen path
    packed_sdpa = flops(packed["positions_per_step"], packed["attention_squares_per_step"]["varlen"], True)
    # transformers' own sdpa would attend each packed row whole, the other samples masked out
    packed_masked = flops(packed["positions_per_step"], packed["attention_squares_per_step"]["masked"], False)
    packed_flash = flops(packed["positions_per_step"], packed["attention_squares_per_step"]["varlen"], True)
    memory = memory_per_gpu(name, model_config, "llava" if name == "llava-1.5-7b" else "qwen2_vl")
    worst = memory["scenarios"]["shipped"]
    return {
        "job": f"jobs/{JOBS[name]}",
        "max_tokens_per_micro_batch": budget,
        "padded_micro_batch_tokens": cfg.train.micro_batch_size * cfg.data.max_length,
        "linear_flops_per_token": 6 * n_linear,
        "padded": padded,
        "packed": packed,
        "tflops_per_step": {
            "padded_sdpa": padded_sdpa / 1e12,
            "padded_flash_attention_2": padded_flash / 1e12,
            "packed_sdpa": packed_sdpa / 1e12,
            "packed_sdpa_masked_row": packed_masked / 1e12,
            "packed_flash_attention_2": packed_flash / 1e12,
        },
        "speedup_on_paper": {
            "flash_attention_2": padded_flash / packed_flash,
            "sdpa": padded_sdpa / packed_sdpa,
            "sdpa_masked_row": padded_sdpa / packed_masked,
            "bound_1_over_1_minus_padding": padded["speedup_bound"],
        },
        "passes_per_rank_per_step": {
            "padded": cfg.grad_accum_steps(cfg.world_size),
            "packed_median": packed["passes_per_rank_per_step"]["median"],
            "why_it_matters": "ZeRO-3 gathers the frozen base at least twice per pass "
            "(base_all_gathers_per_step)",
        },
        "memory": {
            "packed_pass_tokens": budget,
            "same_as_padded_worst_case": budget == cfg.train.micro_batch_size * cfg.data.max_length,
            "total_gb_per_gpu": worst["total_gb"],
            "fits": worst["fits"],
        },
    }


def padding_steps() -> int:
    import padding

    return padding.STEPS


def main() -> None:
    args = common.parser(__doc__).parse_args()
    start = time.perf_counter()
    models = MODELS
    if args.tiny:  # the CI smoke: llava's counts and memory, and the MoE arithmetic's once (a few seconds)
        models = {n: MODELS[n] for n in ("llava-1.5-7b", "Qwen3-VL-30B-A3B-Instruct")}
    rows = []
    for name, (build, arch, dropout) in models.items():
        for trained in (False,) if args.tiny and arch != "llava" else (False, True):
            rows.append({"model": name, **count(build(), arch, trained, dropout)})
    memory = [memory_per_gpu(name, build(), arch) for name, (build, arch, _) in models.items()]
    qlora = [
        qlora_on_paper(name, build(), arch, mem)
        for (name, (build, arch, _)), mem in zip(models.items(), memory, strict=True)
        if arch in ("llava", "qwen2_vl", "qwen3_vl")  # dense: model.quantization refuses fused experts
    ]
    steps, samples = (10, 2_000) if args.tiny else (padding_steps(), 20_000)
    # packing on the length mixes bench/padding.py models, which are the 7B jobs'
    packed = [
        packing_on_paper(name, build(), steps, samples)
        for name, (build, arch, _) in models.items()
        if arch in ("llava", "qwen2_vl")
    ]
    common.write_result(
        args,
        "on_paper",
        {
            "setup": {
                "lora": f"r={LORA_R}, alpha={2 * LORA_R}, every linear layer of the language model "
                "(q, k, v, o, gate, up, down) and, in a mixture-of-experts model, its fused expert tensors "
                "(gate_up_proj, down_proj: a rank-r adapter per expert, no dropout), as "
                "raylora.model.add_lora builds it",
                "built_on": "meta device from transformers config classes: no weights",
                "seconds": time.perf_counter() - start,
            },
            "models": rows,
            "memory_per_gpu": memory,
            "qlora_memory_per_gpu": qlora,
            "packing": packed,
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
