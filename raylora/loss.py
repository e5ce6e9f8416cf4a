"""The answer-token loss, with logits computed only where the next token is an answer token.

A 7B model's vocabulary has 32k-152k entries: fp32 logits of every prompt and image token of a
4k-token sample would take 0.5-2.5 GB per sample before the cross-entropy even starts, for positions
whose labels are IGNORE_INDEX anyway. transformers' `logits_to_keep` (every architecture raylora
supports accepts it) slices the hidden states before `lm_head`; here a hook on `lm_head` keeps exactly the
positions that predict an answer token (flattened in row-major order), found on the CPU before the batch
is copied (`answer_positions`), so that no step waits on the GPU to count them.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from raylora.data.labels import IGNORE_INDEX


def predicts_answer(labels: torch.Tensor) -> torch.Tensor:
    """Boolean (batch, length): position p predicts token p + 1, an answer token (the last predicts none)."""
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    return keep


def answer_positions(labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Where the answer tokens of `labels` are, as index tensors built on the labels' device (the CPU in
    training, before the batch is copied to the GPU), so that the loss selects them without a host sync:
    `flat`, the positions that predict an answer token in the (batch * length) flattening, row-major;
    `targets`, the token each predicts; `rows`, its batch row.

    A boolean mask would select the same rows, but indexing a GPU tensor with one needs the count of its
    True values on the host (a `nonzero`, which waits for every kernel queued before it).
    """
    keep = predicts_answer(labels)
    return {
        "flat": keep.flatten().nonzero()[:, 0],
        "targets": labels[:, 1:][keep[:, :-1]],
        "rows": keep.nonzero()[:, 0],
    }


@contextlib.contextmanager
def _only_rows(model, flat: torch.Tensor):
    """`model`'s output projection (lm_head) computes the logits of the hidden states at `flat` only.

    transformers' `logits_to_keep` takes an int, positions shared by every row, or a boolean mask (whose
    indexing syncs with the host, above); none selects precomputed flat indices, so a forward pre-hook
    on the projection does: it sees the whole (batch, length, hidden) states, as a view, and passes on
    the selected (answer tokens, hidden) rows. Installed for one forward, removed after it.
    """
    head = getattr(model, "module", model).get_output_embeddings()
    handle = head.register_forward_pre_hook(lambda _, args: (args[0].flatten(0, -2).index_select(0, flat),))
    try:
        yield
    finally:
        handle.remove()


def answer_token_losses(
    model,
    batch: dict,
    labels: torch.Tensor,
    positions: dict[str, torch.Tensor] | None = None,
    aux: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 cross-entropy of each answer token, the batch row it belongs to), row by row in order.

    `positions`: `answer_positions(labels)` computed beforehand (on the CPU, then copied with the batch);
    computed here from `labels` when not given. `aux`: a list that receives the forward's load-balancing
    loss (mixture-of-experts models, raylora.moe.aux_loss_coef), which the model then computes.
    """
    extra = {"output_router_logits": True} if aux is not None else {}
    pos = positions if positions is not None else answer_positions(labels)
    with _only_rows(model, pos["flat"]):
        out = model(**batch, logits_to_keep=0, **extra)  # logits: (answer tokens, vocabulary)
    if aux is not None:
        aux.append(out.aux_loss)
    return F.cross_entropy(out.logits.float(), pos["targets"], reduction="none"), pos["rows"]
