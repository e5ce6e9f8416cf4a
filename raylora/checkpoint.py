"""What a raylora checkpoint holds, defined in one place; `save` and `load` side by side.

A checkpoint holds only what training changed, as full (unpartitioned) fp32 tensors keyed by name,
so it restores on any number of workers:

    adapter_config.json         PEFT's adapter config
    adapter_model.safetensors   LoRA weights (DoRA magnitudes, modules_to_save copies) under PEFT's keys
    trained_modules.safetensors trained vision tower / aligner weights (fp32 masters), full names
    optimizer.safetensors       AdamW moments `<name>.exp_avg`, `<name>.exp_avg_sq`
    state.json                  TrainState: step, sampler, scheduler, names and shapes, config, versions
    manifest.json               size and sha256 of every file above; written last

That is 12 bytes per trainable parameter (weight + two moments) plus small files. Only safetensors
and JSON are read back: nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
TRAINED_MODULES = "trained_modules.safetensors"
OPTIMIZER = "optimizer.safetensors"
STATE = "state.json"
MANIFEST = "manifest.json"
FORMAT_VERSION = 1
PEFT_PREFIX = "base_model.model."


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: damaged, incomplete, or made for another model."""


@dataclass
class TrainState:
    """Training progress, saved as state.json."""

    step: int
    """Optimizer steps completed; training resumes with step `step` (0-based)."""
    epoch: int
    """Epoch of the next step's batch."""
    sampler: dict[str, int]
    """The global sampler: seed, num_samples, global_batch_size; its position is `step`."""
    scheduler: dict[str, Any]
    """The LR scheduler's `state_dict()`."""
    world_size: int
    """Workers the checkpoint was saved from (informational: restores work on any number)."""
    trainable: dict[str, list[int]]
    """Every trainable parameter's name and full shape."""
    config: dict[str, Any]
    """The run's Config as plain data."""
    versions: dict[str, str]
    """raylora, torch, deepspeed, transformers and peft versions that wrote it."""
    restarts: int = 0
    """How many times the run's worker group had restarted when this was saved."""
    format: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainState:
        return cls(**data)


def versions() -> dict[str, str]:
    import deepspeed
    import peft
    import transformers

    import raylora

    return {
        "raylora": raylora.__version__,
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
    }


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_adapter(name: str) -> bool:
    """Whether a parameter is PEFT's (LoRA, DoRA magnitude, modules_to_save copy): saved in the adapter."""
    return ".lora_" in name or ".modules_to_save." in name


def adapter_key(name: str) -> str:
    """PEFT's on-disk key for an adapter parameter, as `get_peft_model_state_dict` writes it.

    The adapter name (`default`) is dropped, a modules_to_save copy is saved under the original module's
    name, and DoRA's magnitude keeps the key it had before PEFT made it a module (no `.weight`).
    tests/test_peft_options.py checks these rules against PEFT's own.
    """
    key = PEFT_PREFIX + name.replace(".modules_to_save.default.", ".", 1).replace(".default.", ".", 1)
    return key.removesuffix(".weight") if key.endswith(".lora_magnitude_vector.weight") else key


def save(
    folder: str | Path,
    weights: dict[str, torch.Tensor],
    moments: dict[str, torch.Tensor],
    state: TrainState,
    adapter_config,
) -> None:
    """Write a checkpoint into `folder` (which must be new or empty); the manifest goes last."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lora = {adapter_key(n): t.contiguous() for n, t in weights.items() if is_adapter(n)}
    trained = {n: t.contiguous() for n, t in weights.items() if not is_adapter(n)}
    adapter_config.save_pretrained(str(folder))
    save_file(lora, folder / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    save_file(trained, folder / TRAINED_MODULES, metadata={"format": "pt"})
    save_file({n: t.contiguous() for n, t in moments.items()}, folder / OPTIMIZER, metadata={"format": "pt"})
    (folder / STATE).write_text(json.dumps(state.to_dict(), indent=1, sort_keys=True))
    files = [ADAPTER_CONFIG, ADAPTER_WEIGHTS, TRAINED_MODULES, OPTIMIZER, STATE]
    manifest = {
        "format": FORMAT_VERSION,
        "files": {f: {"bytes": os.path.getsize(folder / f), "sha256": _sha256(folder / f)} for f in files},
    }
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, folder / MANIFEST)


def verify(folder: str | Path) -> dict[str, Any]:
    """Check every file against the manifest; raise `CheckpointError` naming the folder and file."""
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        entries = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"{folder}: {MANIFEST} missing or unreadable ({err}); checkpoint incomplete"
        ) from err
    for name, entry in entries.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{folder}: file {name} listed in the manifest is missing")
        if path.stat().st_size != entry["bytes"]:
            raise CheckpointError(
                f"{folder}: file {name} has {path.stat().st_size} bytes, manifest says "
                f"{entry['bytes']} (truncated or altered)"
            )
        if _sha256(path) != entry["sha256"]:
            raise CheckpointError(
                f"{folder}: file {name} does not match its sha256 in the manifest (altered)"
            )
    return manifest


@dataclass
class Loaded:
    weights: dict[str, torch.Tensor]
    """fp32 masters by base parameter name (LoRA and trained modules together)."""
    moments: dict[str, torch.Tensor]
    """Adam moments keyed `<name>.exp_avg` / `<name>.exp_avg_sq`."""
    state: TrainState


def load(folder: str | Path) -> Loaded:
    """Verify and read a checkpoint written by `save` (safetensors and JSON only)."""
    folder = Path(folder)
    verify(folder)
    try:
        state = TrainState.from_dict(json.loads((folder / STATE).read_text()))
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"{folder}: file {STATE} does not parse: {err}") from err
    lora_by_key = {adapter_key(n): n for n in state.trainable if is_adapter(n)}
    weights = {}
    for key, tensor in load_file(folder / ADAPTER_WEIGHTS).items():
        if key not in lora_by_key:
            raise CheckpointError(f"{folder}: {ADAPTER_WEIGHTS} holds {key}, which state.json does not list")
        weights[lora_by_key[key]] = tensor
    weights.update(load_file(folder / TRAINED_MODULES))
    moments = load_file(folder / OPTIMIZER)
    return Loaded(weights=weights, moments=moments, state=state)


def check_compatible(state: TrainState, expected: dict[str, list[int]], folder: str | Path = "") -> None:
    """Refuse a checkpoint whose trainable names or shapes differ; name the first difference."""
    where = f"{folder}: " if folder else ""
    for name, shape in expected.items():
        if name not in state.trainable:
            raise CheckpointError(
                f"{where}checkpoint lacks trainable parameter {name} (expected shape {shape}); "
                f"was it made with another LoRA target set, freeze setting or model?"
            )
        if list(state.trainable[name]) != list(shape):
            raise CheckpointError(
                f"{where}parameter {name}: expected shape {shape}, checkpoint has "
                f"{state.trainable[name]} (another LoRA rank or base model?)"
            )
    for name, shape in state.trainable.items():
        if name not in expected:
            raise CheckpointError(
                f"{where}checkpoint has trainable parameter {name} (shape {shape}) that this "
                f"model does not train (another architecture, LoRA target set or freeze setting?)"
            )
