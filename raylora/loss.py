"""The answer-token loss, with logits computed only where the next token is an answer token.

A 7B model's vocabulary has 32k-152k entries: fp32 logits of every prompt and image token of a
4k-token sample would take 0.5-2.5 GB per sample before the cross-entropy even starts, for positions
whose labels are IGNORE_INDEX anyway. transformers' `logits_to_keep` (every architecture raylora
supports accepts it) slices the hidden states before `lm_head`; a boolean (batch, length) mask keeps
exactly the positions that predict an answer token, flattened in row-major order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from raylora.data.labels import IGNORE_INDEX

FULL_LOGITS = False
"""Benchmark switch (bench/memory.py): compute the logits of every position, as a plain forward does."""


def predicts_answer(labels: torch.Tensor) -> torch.Tensor:
    """Boolean (batch, length): position p predicts token p + 1, an answer token (the last predicts none)."""
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    return keep


def answer_token_losses(model, batch: dict, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 cross-entropy of each answer token, the batch row it belongs to), row by row in order."""
    keep = predicts_answer(labels)
    if FULL_LOGITS:
        logits = model(**batch).logits.float()
        every = F.cross_entropy(
            logits[:, :-1].transpose(1, 2), labels[:, 1:], ignore_index=IGNORE_INDEX, reduction="none"
        )
        losses = every[keep[:, :-1]]
    else:
        logits = model(**batch, logits_to_keep=keep).logits  # (answer tokens, vocabulary)
        losses = F.cross_entropy(logits.float(), labels[:, 1:][keep[:, :-1]], reduction="none")
    return losses, keep.nonzero()[:, 0]
