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
and JSON are read back: nothing is unpickled. This module is the only one that opens these files:
resume, export, eval, inspect and the demo read them through the functions below.

`FORMAT_VERSION` is written into state.json and the manifest. Format 2 made the architecture and the
base model's fingerprint typed fields of the state (format 1 kept them in `extra`) and added the data
set's row count; format 1 still reads. A newer format than this raylora's is refused, naming both.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
TRAINED_MODULES = "trained_modules.safetensors"
OPTIMIZER = "optimizer.safetensors"
STATE = "state.json"
MANIFEST = "manifest.json"
FORMAT_VERSION = 2
PEFT_PREFIX = "base_model.model."


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: damaged, incomplete, or made for another model."""


class NewerFormatError(CheckpointError):
    """A checkpoint written in a newer format than this raylora reads: not damage, so never skipped."""


def check_format(found: Any, where: str | Path) -> None:
    """Refuse a checkpoint whose format is newer than `FORMAT_VERSION`, naming both versions."""
    if isinstance(found, int) and found > FORMAT_VERSION:
        raise NewerFormatError(
            f"{where}: checkpoint format {found} was written by a newer raylora; this raylora reads "
            f"format {FORMAT_VERSION} and older (upgrade raylora to resume, export or inspect it)"
        )


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
    arch: str = ""
    """The architecture's registry name (config.json's model_type); empty in checkpoints that lack it."""
    base_model: dict[str, Any] = field(default_factory=dict)
    """The base model's fingerprint (`resume.base_model_fingerprint`): resuming on others is refused."""
    data_rows: int | None = None
    """Rows of data.train, bad rows included: the driver compares it with the Parquet file's metadata
    on resume, without reading the data."""
    format: int = FORMAT_VERSION
    """The checkpoint format (`FORMAT_VERSION` of the raylora that wrote it)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else, untyped."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainState:
        data = dict(data)
        if data.get("format", 1) < 2:  # format 1 kept the architecture and fingerprint in `extra`
            extra = dict(data.get("extra", {}))
            data.setdefault("arch", extra.pop("arch", "") or "")
            data.setdefault("base_model", extra.pop("base_model", {}) or {})
            data["extra"] = extra
        return cls(**data)


def _parse_state(text: str | bytes, where: str | Path) -> TrainState:
    try:
        data = json.loads(text)
        check_format(data.get("format"), where)
        return TrainState.from_dict(data)
    except (ValueError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{where}: file {STATE} does not parse: {err}") from err


def read_state(folder: str | Path, filesystem: Any = None) -> TrainState:
    """A checkpoint's TrainState, without checking the manifest (`verify` does that).

    `filesystem`: a pyarrow filesystem that `folder` is a path of (a run's storage); unset: local.
    Raises `CheckpointError` when state.json is missing or does not parse, `NewerFormatError` when
    it was written in a newer format.
    """
    try:
        if filesystem is None:
            text = (Path(folder) / STATE).read_bytes()
        else:
            with filesystem.open_input_stream(posixpath.join(str(folder), STATE)) as f:
                text = f.read()
    except OSError as err:
        raise CheckpointError(f"{folder}: {STATE} missing or unreadable ({err})") from err
    return _parse_state(text, folder)


def read_adapter_config(folder: str | Path) -> dict[str, Any]:
    """PEFT's adapter config of a checkpoint as plain data; `CheckpointError` if unreadable."""
    try:
        return json.loads((Path(folder) / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{folder}: {ADAPTER_CONFIG} unreadable: {err}") from err


def read_trained_modules(folder: str | Path) -> dict[str, torch.Tensor]:
    """The trained vision tower / aligner weights (fp32), by full parameter name; empty when none."""
    return load_file(Path(folder) / TRAINED_MODULES)


def trained_module_names(folder: str | Path) -> list[str]:
    """The names in trained_modules.safetensors, read from its header only."""
    with safe_open(Path(folder) / TRAINED_MODULES, framework="pt") as f:
        return list(f.keys())


def copy_adapter(folder: str | Path, out: str | Path) -> list[str]:
    """Copy what makes a PEFT adapter folder (config and weights, plus the trained vision tower /
    aligner weights when there are any) from checkpoint `folder` into `out`; returns the file names."""
    names = [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
    if trained_module_names(folder):
        names.append(TRAINED_MODULES)
    for name in names:
        shutil.copyfile(Path(folder) / name, Path(out) / name)
    return names


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


def is_complete(folder: str, filesystem: Any) -> bool:
    """Whether a checkpoint folder of a run's storage has its manifest (written last, so an upload cut
    short has none); says nothing about whether the files match it."""
    import pyarrow.fs

    path = posixpath.join(folder, MANIFEST)
    return filesystem.get_file_info(path).type == pyarrow.fs.FileType.File


def verify(folder: str | Path) -> dict[str, Any]:
    """Check every file against the manifest; raise `CheckpointError` naming the folder and file.

    Any other `OSError` (an I/O error, a timeout on network storage) is raised as it is: it says nothing
    about the checkpoint, and a reader may retry it.
    """
    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        entries = manifest["files"]
    except (FileNotFoundError, NotADirectoryError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"{folder}: {MANIFEST} missing or unreadable ({err}); checkpoint incomplete"
        ) from err
    check_format(manifest.get("format"), folder)
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
    state = _parse_state((folder / STATE).read_bytes(), folder)
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
