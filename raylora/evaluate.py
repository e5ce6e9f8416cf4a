"""Using a checkpoint without DeepSpeed: plain PEFT on the base model, then generation."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from raylora import checkpoint
from raylora.data import IGNORE_INDEX, ImageTextData, make_batch
from raylora.processor import load_processor


def load_for_inference(folder: str | Path, model_path: str | None = None):
    """(model, processor) from a raylora checkpoint: `PeftModel.from_pretrained` plus trained modules."""
    folder = Path(folder)
    checkpoint.verify(folder)
    state = json.loads((folder / checkpoint.STATE).read_text())
    model_path = model_path or state["config"]["model"]["path"]
    base = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(folder))
    trained = load_file(folder / checkpoint.TRAINED_MODULES)
    if trained:
        missing, unexpected = model.base_model.model.load_state_dict(trained, strict=False)
        if unexpected:
            raise checkpoint.CheckpointError(f"{folder}: trained modules not in the model: {unexpected[:3]}")
    model.eval()
    return model, load_processor(model_path)


@torch.no_grad()
def evaluate(model, processor, data_uri: str, batch_size: int = 32, max_samples: int | None = None) -> dict:
    """Exact-match accuracy of generated answers and the mean answer-token loss."""
    data = ImageTextData(data_uri)
    n = len(data) if max_samples is None else min(max_samples, len(data))
    correct, loss_sum, tokens = 0, 0.0, 0
    tokenizer = processor.tokenizer
    for start in range(0, n, batch_size):
        examples = [data.example(i) for i in range(start, min(n, start + batch_size))]
        batch = make_batch(processor, examples)
        labels = batch.pop("labels")
        logits = model(**batch).logits.float()
        loss_sum += torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]),
            labels[:, 1:].reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        ).item()
        tokens += int((labels != IGNORE_INDEX).sum())
        prompts = make_batch(processor, examples, with_answers=False)
        out = model.generate(
            **prompts, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
        new = out[:, prompts["input_ids"].shape[1] :]
        for (_, _, answer), ids in zip(examples, new, strict=True):
            correct += tokenizer.decode(ids, skip_special_tokens=True).strip() == answer.strip()
    return {"accuracy": correct / max(n, 1), "loss": loss_sum / max(tokens, 1), "samples": n}
