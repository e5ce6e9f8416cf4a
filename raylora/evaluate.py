"""Using a checkpoint without DeepSpeed: plain PEFT on the base model, then generation."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import PeftModel

from raylora import checkpoint, hub
from raylora.arch import auto_model_class, remote_code
from raylora.data.batches import make_batch, read, stand_in
from raylora.data.formats import BadRow, Rows, open_rows
from raylora.data.labels import end_of_turn_ids, last_answer
from raylora.data.processor import load_processor
from raylora.loss import answer_token_losses


def load_for_inference(folder: str | Path, model_path: str | None = None):
    """(model, processor) from a raylora checkpoint: `PeftModel.from_pretrained` plus trained modules."""
    folder = Path(folder)
    checkpoint.verify(folder)
    state = checkpoint.read_state(folder)
    trained_on = state.config["model"]
    model_path = model_path or hub.resolve(trained_on["path"], trained_on.get("revision"))
    trust = bool(trained_on.get("trust_remote_code"))
    base = auto_model_class(remote_code(model_path) if trust else {}).from_pretrained(
        model_path, dtype=torch.float32, trust_remote_code=trust
    )
    model = PeftModel.from_pretrained(base, str(folder))
    trained = checkpoint.read_trained_modules(folder)
    if trained:
        unexpected = model.base_model.model.load_state_dict(trained, strict=False).unexpected_keys
        if unexpected:
            raise checkpoint.CheckpointError(f"{folder}: trained modules not in the model: {unexpected[:3]}")
    model.eval()
    data = state.config.get("data", {})  # the resolution the adapter was trained at
    return model, load_processor(model_path, data.get("max_pixels"), data.get("min_pixels"), trust)


def generation_budget(tokenizer, answers: list[str]) -> int:
    """New tokens generation may take: twice the longest answer's tokens, and at least 16 more, so that a
    model that does not stop runs on past its answer (exact match fails, `stopped` counts it) instead of
    being cut off right after the answer, which would score a model that never stops as correct."""
    longest = max(len(tokenizer(a, add_special_tokens=False)["input_ids"]) for a in answers)
    return 2 * longest + 16


@torch.no_grad()
def score(
    model,
    processor,
    examples: list,
    counted: list[bool] | None = None,
    synced_gpus: bool = False,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """Exact-match hits, answers that ended with the stop token (`stopped`: the others ran into the
    generation budget), answer-token loss sum and answer tokens of one batch (only `counted` examples).

    `examples` are decoded `(messages, images)` (`data.read`): the prompt is every turn before the last
    assistant turn, the answer that turn's text; the loss covers every assistant turn, as training's does.

    `synced_gpus=True` keeps ZeRO-3 ranks in lockstep through generation (every rank must take part
    in every forward pass, however many tokens its own batch needs).
    """
    counted = counted if counted is not None else [True] * len(examples)
    tokenizer = processor.tokenizer
    batch = {k: v.to(device) for k, v in make_batch(processor, examples).items()}
    labels = batch.pop("labels")
    per_token, rows = answer_token_losses(model, batch, labels)
    mask = torch.tensor(counted, device=per_token.device)[rows]
    prompts = {k: v.to(device) for k, v in make_batch(processor, examples, with_answers=False).items()}
    answers = [last_answer(messages) for messages, _ in examples]
    stops = end_of_turn_ids(processor)  # where training taught the model to stop
    out = model.generate(
        **prompts,
        max_new_tokens=generation_budget(tokenizer, answers),
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=stops,
        synced_gpus=synced_gpus,
    )
    new = out[:, prompts["input_ids"].shape[1] :]
    stopped = torch.isin(new, torch.tensor(stops, device=new.device)).any(dim=1).tolist()
    hits = sum(
        keep and tokenizer.decode(ids, skip_special_tokens=True).strip() == answer.strip()
        for answer, ids, keep in zip(answers, new, counted, strict=True)
    )
    return {
        "correct": float(hits),
        "stopped": float(sum(keep and stop for stop, keep in zip(stopped, counted, strict=True))),
        "loss_sum": float((per_token * mask).sum()),
        "tokens": float(mask.sum()),
        "samples": float(sum(counted)),
    }


@torch.no_grad()
def evaluate(
    model,
    processor,
    data_uri: str,
    batch_size: int = 32,
    max_samples: int | None = None,
    fmt: str | None = None,
    image_root: str | None = None,
) -> dict:
    """Exact-match accuracy of generated answers and the mean answer-token loss, in one process, over the
    first `max_samples` rows; rows that cannot be scored (`BadRow`) are left out and counted."""
    data = open_rows(data_uri, fmt, image_root)
    n = len(data) if max_samples is None else min(max_samples, len(data))
    totals = {"correct": 0.0, "stopped": 0.0, "loss_sum": 0.0, "tokens": 0.0, "samples": 0.0}
    for start in range(0, n, batch_size):
        examples = []
        for i in range(start, min(n, start + batch_size)):
            try:
                examples.append(read(data, i))
            except BadRow:
                continue
        if examples:
            for key, value in score(model, processor, examples).items():
                totals[key] += value
    return {
        "accuracy": totals["correct"] / max(totals["samples"], 1),
        # answers the model ended by itself; the others ran into the generation budget
        "stopped_fraction": totals["stopped"] / max(totals["samples"], 1),
        "loss": totals["loss_sum"] / max(totals["tokens"], 1),
        "samples": int(totals["samples"]),
        "bad_rows": n - int(totals["samples"]),
    }


@torch.no_grad()
def evaluate_sharded(engine, processor, data: Rows, max_samples: int, batch_size: int) -> dict:
    """Inside ZeRO-3 training: score the first `max_samples` of `data`, sharded over the ranks.

    Every rank must call this. Every rank runs the same number of batches (short shards repeat a
    sample that is not counted; a bad row is a stand-in, not counted either) and generates with
    `synced_gpus`, because ZeRO-3 needs every rank in every forward pass. Returns the same numbers on every
    rank.
    """
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    n = min(len(data), max_samples)
    per_rank = -(-n // world)
    mine = list(range(rank * per_rank, min(n, (rank + 1) * per_rank)))
    counted = [True] * len(mine) + [False] * (per_rank - len(mine))
    mine += [0] * (per_rank - len(mine))
    totals = torch.zeros(5, dtype=torch.float64, device=engine.device)  # NCCL serves device tensors only
    model = engine.module
    model.eval()
    for i in range(0, per_rank, batch_size):
        examples, keep = [], counted[i : i + batch_size]
        for k in range(i, min(per_rank, i + batch_size)):
            try:
                examples.append(read(data, mine[k]))
            except BadRow:
                examples.append(stand_in())
                keep[k - i] = False
        if not any(images for _, images in examples):
            # ranks wait for each other in the vision tower's parameter gathers: every rank must run it
            examples.append(stand_in())
            keep.append(False)
        r = score(
            model,
            processor,
            examples,
            keep,
            synced_gpus=True,
            device=engine.device,
        )
        scores = [r["correct"], r["loss_sum"], r["tokens"], r["samples"], r["stopped"]]
        totals += torch.tensor(scores, dtype=torch.float64, device=engine.device)
    model.train()
    dist.all_reduce(totals)
    return {
        "eval_accuracy": totals[0].item() / max(totals[3].item(), 1),
        "eval_loss": totals[1].item() / max(totals[2].item(), 1),
        "eval_stopped": totals[4].item() / max(totals[3].item(), 1),
    }
