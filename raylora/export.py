"""`raylora export`: a checkpoint as a PEFT adapter folder, or merged into a full Hugging Face model.

A checkpoint's LoRA weights are already in PEFT's format, so the adapter export copies them with the
adapter config, plus the trained vision tower / aligner weights when there are any (PEFT does not
load those: apply them with `load_state_dict(..., strict=False)` on `model.base_model.model`).
The merged export folds LoRA into the base weights (PEFT's `merge_and_unload`) in fp32, puts the
trained vision tower / aligner weights in place, and saves the model in the base model's dtype with
its processor: a plain model folder for `AutoModelForImageTextToText.from_pretrained`.

Either way the output is written into a temporary sibling folder and renamed into place at the end,
so a failed export never leaves a folder that looks complete.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from raylora import checkpoint, hub
from raylora.config import ConfigError


def verified_state(folder: str | Path) -> checkpoint.TrainState:
    """The TrainState of a checkpoint that passes its manifest check; `ConfigError` (exit 2) otherwise."""
    folder = Path(folder)
    try:
        checkpoint.verify(folder)
        return checkpoint.read_state(folder)
    except (checkpoint.CheckpointError, OSError) as err:
        raise ConfigError(f"not a usable raylora checkpoint: {err}") from err


def base_model_path(state: checkpoint.TrainState, model_path: str | None = None) -> str:
    """The base model folder: `model_path` (a folder or Hub id), else the run's own (state.json)."""
    trained_on = state.config["model"]
    path, revision = (model_path, None) if model_path else (trained_on["path"], trained_on.get("revision"))
    try:
        folder = hub.resolve(path, revision)
    except ConfigError as err:
        raise ConfigError(f"base model not found ({err}); pass --model PATH") from err
    if not (Path(folder) / "config.json").is_file():
        raise ConfigError(f"base model folder {folder} has no config.json; pass --model PATH")
    return folder


def _write_merged(folder: Path, out: Path, model_path: str) -> None:
    from transformers import AutoConfig

    from raylora.data.labels import end_of_turn_ids
    from raylora.evaluate import load_for_inference

    # Merge in fp32 so that W + BA is exact up to fp32 rounding, then save in the base model's dtype
    # (a bf16 7B model stays 14 GB on disk).
    trust = bool(checkpoint.read_state(folder).config["model"].get("trust_remote_code"))
    base_dtype = AutoConfig.from_pretrained(model_path, trust_remote_code=trust).dtype
    model, processor = load_for_inference(folder, model_path)
    merged = model.merge_and_unload()
    if isinstance(base_dtype, torch.dtype) and base_dtype.is_floating_point:
        merged = merged.to(base_dtype)
    # generate() stops at generation_config.eos_token_id: it must hold the stop token training labelled
    # (llava-1.5's base config names </s>, Qwen's <|im_end|>; raylora.data.labels.end_of_turn_ids)
    gen = merged.generation_config
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    gen.eos_token_id = list(dict.fromkeys([t for t in eos if t is not None] + end_of_turn_ids(processor)))
    merged.save_pretrained(out)
    processor.save_pretrained(out)


def export(folder: str | Path, out: str | Path, merge: bool = False, model_path: str | None = None) -> Path:
    """Write checkpoint `folder` to `out` as a PEFT adapter folder, or with `merge` as a full model.

    Refuses (`ConfigError`) a checkpoint that fails its manifest check and an `out` that exists and is
    not an empty folder, before loading anything.
    """
    folder, out = Path(folder), Path(out)
    state = verified_state(folder)
    if merge:  # the adapter alone is copied as it is: no base model needed
        model_path = base_model_path(state, model_path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} exists and is not an empty folder; choose a new one")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    partial.mkdir()
    try:
        if merge:
            _write_merged(folder, partial, model_path)
        else:
            checkpoint.copy_adapter(folder, partial)
        if out.exists():
            out.rmdir()  # empty, checked above; rename cannot replace a folder portably
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out
