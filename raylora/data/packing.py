"""Padding-free passes (train.packing): several samples concatenated in one row, none attending to another.

A padded micro batch computes every row at the length of its longest sample; on real multimodal length
mixes a quarter of the positions are padding (bench/padding.py). A packed pass is one row holding whole
samples back to back, at most `train.max_tokens_per_micro_batch` tokens, with position ids that restart at
each sample. transformers builds the block-diagonal causal mask from such position ids when the attention
mask is left out (`masking_utils.find_packed_sequence_indices`, for `sdpa` and `eager`), and
`flash_attention_2` takes its varlen path from them, so each sample sees exactly what it sees alone.

The packed row is cut from the padded batch of the same samples (`_collate`, as a padded step builds it):
every token-aligned tensor keeps the padded batch's values at the real tokens, and the vision tensors stay
as they are (one entry per image, in the order of the image tokens). Where a model's positions are not one
per token (Qwen2-VL's 3-D rotary ids: an image's tokens share a temporal id and count rows and columns)
they are computed by the model's own `get_rope_index` on the padded batch, sample by sample, and cut the same
way. Which samples a step trains on, and the loss normalisation over the global batch's answer tokens, do
not change: a sample's answer tokens are predicted from the same logits as in its padded row.
"""

from __future__ import annotations

import itertools

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from raylora.data.labels import IGNORE_INDEX, Row

# Architectures whose packed pass equals their padded micro batch (loss and gradients within 1e-5 relative,
# tests/test_packing.py); the driver refuses packing for any other before Ray starts, with `refusal`.
VERIFIED = (
    "llava",
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "glm4v",
    "glm46v",
    "idefics3",
    "internvl",
    "mistral3",
)
# Gemma 3 lets an image's tokens attend to each other both ways: transformers (5.23) ORs those image blocks
# into the mask after the packed-sequence boundaries, so in a packed row an image sample's tokens and the
# samples after it see other samples (the tiny model's logits move by 0.3-0.5). Gemma 4 does the same in its
# sliding-window layers wherever its text config says `use_bidirectional_attention: vision` (transformers'
# code leaves it unset for the smaller checkpoints only, which pack exactly): refused for the model type.
# Qwen3.5's Gated DeltaNet layers carry a recurrent state and a causal conv1d along the row: read in
# transformers 5.23, only the optional `fla` kernel takes the samples' bounds (`cu_seqlens`; the torch
# fallback raises on them, and without them the state runs from one sample into the next), and the conv1d
# is never given them (its fallback and `causal_conv1d` alike).
# Mixture-of-experts models with a load-balancing loss (raylora.moe)
MOE_AUX = (
    "its load-balancing loss is a statistic of each pass's tokens (the share routed to each expert times its "
    "mean router probability), so packing the samples into other passes than the padded micro batches "
    "changes the step"
)
REFUSED = {
    "glm4v_moe": MOE_AUX,
    "qwen3_vl_moe": MOE_AUX,
    "gemma3": (
        "transformers ORs Gemma 3's bidirectional image-token blocks into the attention mask outside the "
        "packed samples' boundaries, so a packed sample would see the samples before it"
    ),
    "gemma4": (
        "transformers ORs Gemma 4's bidirectional image-token blocks (use_bidirectional_attention: vision) "
        "into its sliding-window layers' mask outside the packed samples' boundaries, so a packed sample "
        "would see the samples before it"
    ),
    "qwen3_5": (
        "Qwen3.5's linear-attention layers (Gated DeltaNet) would carry their recurrent state and their "
        "causal conv1d from one packed sample into the next: in transformers 5.23 only the optional "
        "flash-linear-attention kernel takes the samples' bounds (the torch fallback raises on them) and "
        "the conv1d never gets them"
    ),
}
REFUSED["qwen3_5_moe"] = REFUSED["qwen3_5"] + "; and " + MOE_AUX


def refusal(model_type: str) -> str | None:
    """Why packing is refused for `model_type`, or None where it is exact."""
    if model_type in VERIFIED:
        return None
    return REFUSED.get(
        model_type,
        "no test has shown its packed pass equal to its padded one (verified: " + ", ".join(VERIFIED) + ")",
    )


def pack(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins of at most `budget` tokens each: first-fit decreasing, the
    longest first (ties by index, so that every rank and a resumed run pack alike). A length over the
    budget gets a bin of its own (the caller has already skipped what is over data.max_length)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return bins


# Under `sdpa`, transformers computes a packed row's attention over the whole row, the other samples'
# positions masked out: work that grows with the square of the row where each sample needs only its own
# square (on a CPU, which has no flash_attention_2, a 1536-token row of 10 samples ran its forward and
# backward 1.7x slower so). The language model of a packed run therefore attends through PACKED_SDPA:
# torch's sdpa, as transformers calls it, over each sample on its own (causal, no mask, so each gives
# what it gives alone), the boundaries from the pass's `cu_seq_lens_q`. That is transformers' own name for
# them: its models pass it down to the attention function with the forward's other keyword arguments
# (flash_attention_2 ignores it without max_length_q/k and finds the samples from the position ids). A
# call without it (the vision tower, evaluation, generation) is plain sdpa with its mask.
PACKED_SDPA = "raylora_packed_sdpa"


def packed_sdpa(module, query, key, value, attention_mask, cu_seq_lens_q=None, **kwargs):
    """transformers' sdpa attention, one sample at a time where the call carries a packed pass's sample
    boundaries (`cu_seq_lens_q`, on the host: `data.steps.to_device` leaves it there, so reading it does not
    wait on a GPU); `query` is (1, heads, tokens, dim) then, and the mask built for the row is not used."""
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("cu_seq_lens_k", None)
    bounds = cu_seq_lens_q.tolist()
    out = [
        sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, **kwargs)[0]
        for a, b in itertools.pairwise(bounds)
    ]
    return torch.cat(out, dim=1), None  # (1, tokens, heads, dim), as sdpa_attention_forward returns it


def use_packed_attention(model) -> None:
    """Make `model`'s language model attend through `PACKED_SDPA` (its vision tower keeps sdpa)."""
    AttentionInterface.register(PACKED_SDPA, packed_sdpa)
    AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)  # the masks of calls without boundaries
    text = model.config.get_text_config()
    key = next(k for k in model.config.sub_configs if getattr(model.config, k, None) is text)
    model.set_attn_implementation({key: PACKED_SDPA})


def rope_index_of(model) -> object | None:
    """The model's multimodal position function (Qwen2-VL's and Qwen2.5-VL's `get_rope_index`), or None
    for models whose positions are one per token. `model` may be wrapped (DeepSpeed, PEFT)."""
    for module in model.modules():
        if callable(getattr(module, "get_rope_index", None)):
            return module.get_rope_index
    return None


def packed(padded: dict, rope_index=None) -> dict:
    """One packed row (batch size 1) from a right-padded batch (`batches._collate` with labels): the real
    tokens of each row in turn, position ids restarting at each row, no attention mask.

    With `rope_index` (`rope_index_of`), position_ids is (4, 1, tokens): the text positions, from which
    transformers finds the samples' boundaries, then the model's three rotary rows, computed per sample
    exactly as the padded batch's forward computes them.
    """
    mask = padded["attention_mask"].bool()
    if (padded["labels"][:, 0] != IGNORE_INDEX).any():
        # the last token of one sample must not be trained to predict the first of the next
        raise ValueError("a packed sample starts with an answer token")
    out = {}
    for key, value in padded.items():
        if key == "attention_mask":
            continue
        token_aligned = value.dim() == 2 and value.shape == mask.shape
        out[key] = value[mask][None] if token_aligned else value
    text = (mask.cumsum(-1) - 1)[mask][None]  # 0, 1, ... within each sample
    # where each sample starts and the row ends (PACKED_SDPA), int32 as flash-attn's cu_seqlens are
    out["cu_seq_lens_q"] = torch.cat([torch.zeros(1, dtype=torch.int32), mask.sum(-1).cumsum(0).int()])
    if rope_index is None:
        out["position_ids"] = text
        return out
    # a video's positions take its grid, and Qwen2.5-VL's its seconds per temporal patch (where the batch has
    # them: not every model's get_rope_index takes these names)
    videos = {k: padded[k] for k in ("video_grid_thw", "second_per_grid_ts") if k in padded}
    rope, _ = rope_index(
        padded["input_ids"],
        mm_token_type_ids=padded.get("mm_token_type_ids"),
        image_grid_thw=padded.get("image_grid_thw"),
        attention_mask=padded["attention_mask"],
        **videos,
    )
    out["position_ids"] = torch.cat([text[None], rope[:, mask][:, None]], dim=0)
    return out


def length(row: Row) -> int:
    """Tokens `row` takes in a packed pass."""
    return len(row.labels)
