"""What a raylora checkpoint holds, defined in one place; `Writer` and `Ranges` side by side.

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

import functools
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
from safetensors.torch import load_file

from raylora.safetensors_io import DTYPES, PieceWriter, read_elements, read_header

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
TRAINED_MODULES = "trained_modules.safetensors"
OPTIMIZER = "optimizer.safetensors"
STATE = "state.json"
MANIFEST = "manifest.json"
FORMAT_VERSION = 2
PEFT_PREFIX = "base_model.model."
MOMENTS = ("exp_avg", "exp_avg_sq")  # the AdamW moments saved per parameter, as `<name>.<moment>`


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
    """The global sampler: seed, num_samples, global_batch_size, group_by_length (recorded since it
    exists; absent means off); its position is `step`."""
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
    """The base model's fingerprint (`hub.base_model_fingerprint`): resuming on others is refused."""
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


def read_adapter_config(folder: str | Path, filesystem: Any = None) -> dict[str, Any]:
    """PEFT's adapter config of a checkpoint as plain data; `CheckpointError` if unreadable.

    `filesystem`: a pyarrow filesystem that `folder` is a path of (a run's storage); unset: local.
    """
    try:
        if filesystem is None:
            return json.loads((Path(folder) / ADAPTER_CONFIG).read_text())
        with filesystem.open_input_stream(posixpath.join(str(folder), ADAPTER_CONFIG)) as f:
            return json.loads(f.read())
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
    import peft
    import transformers

    import raylora
    from raylora.ds import deepspeed

    return {
        "raylora": raylora.__version__,
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
    }


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


class Writer:
    """Writes a checkpoint into `folder` (new or empty) as the trainable state arrives, piece by piece:
    rank 0 holds one gathered chunk at a time, not the whole trainable state. `finish` writes the small
    files and the manifest last. `trainable`: every trainable parameter's name and full shape."""

    def __init__(self, folder: str | Path, trainable: dict[str, list[int]]):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        adapter = {n: s for n, s in trainable.items() if is_adapter(n)}
        self.files = {
            ADAPTER_WEIGHTS: PieceWriter(
                self.folder / ADAPTER_WEIGHTS, {adapter_key(n): s for n, s in adapter.items()}
            ),
            TRAINED_MODULES: PieceWriter(
                self.folder / TRAINED_MODULES, {n: s for n, s in trainable.items() if not is_adapter(n)}
            ),
            OPTIMIZER: PieceWriter(
                self.folder / OPTIMIZER, {f"{n}.{k}": s for n, s in trainable.items() for k in MOMENTS}
            ),
        }

    def write(self, name: str, kind: str, start: int, values: torch.Tensor) -> None:
        """Elements `start...` (flattened) of parameter `name`'s fp32 master (`kind` "weight") or of
        its Adam moment (`kind` "exp_avg" / "exp_avg_sq")."""
        if kind != "weight":
            self.files[OPTIMIZER].write(f"{name}.{kind}", start, values)
        elif is_adapter(name):
            self.files[ADAPTER_WEIGHTS].write(adapter_key(name), start, values)
        else:
            self.files[TRAINED_MODULES].write(name, start, values)

    def finish(self, state: TrainState, adapter_config) -> None:
        """Close the tensor files, write the adapter config and state.json, then the manifest."""
        for f in self.files.values():
            f.close()
        folder = self.folder
        adapter_config.save_pretrained(str(folder))
        (folder / STATE).write_text(json.dumps(state.to_dict(), indent=1, sort_keys=True))
        files = [ADAPTER_CONFIG, ADAPTER_WEIGHTS, TRAINED_MODULES, OPTIMIZER, STATE]
        fs, path = _on(folder, None)
        manifest = {
            "format": FORMAT_VERSION,
            "files": {
                f: {"bytes": os.path.getsize(folder / f), "sha256": _sha256_on(fs, posixpath.join(path, f))}
                for f in files
            },
        }
        tmp = folder / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
        os.replace(tmp, folder / MANIFEST)


class Ranges:
    """A checkpoint opened for reading element ranges of its tensors, so that a rank reads only the
    slices of the partitions it owns: restore bytes and memory per rank shrink with the world.

    Reads go through the run storage's pyarrow filesystem, one ranged read per slice, rather than
    `safe_open(...).get_slice` on a downloaded copy: safetensors needs a local file, and a download once
    per node would still move every byte to every node and need the node's ranks to agree on who fetches;
    a ranged read moves each byte to the one rank that needs it, on local disk and object storage alike.
    The files' layout is safetensors' documented one (`raylora.safetensors_io`).
    """

    def __init__(self, folder: str | Path, filesystem: Any = None, hashes: bool = True):
        """Check the manifest (every file's sha256 with `hashes`, else only that each is there at its
        size), read state.json and the tensor files' headers; no tensor data yet."""
        self.folder = folder
        self.fs, self.path = _on(folder, filesystem)
        verify(folder, filesystem, hashes=hashes)
        with self.fs.open_input_stream(posixpath.join(self.path, STATE)) as f:
            self.state = _parse_state(f.read(), folder)
        self.bytes_read = 0
        self._open: dict[str, Any] = {}
        self._headers = {name: self._header(name) for name in (ADAPTER_WEIGHTS, TRAINED_MODULES, OPTIMIZER)}
        self._where: dict[tuple[str, str], tuple[str, str]] = {}
        for name, shape in self.state.trainable.items():
            weights = ADAPTER_WEIGHTS if is_adapter(name) else TRAINED_MODULES
            keys = [("weight", weights, adapter_key(name) if is_adapter(name) else name)]
            keys += [(kind, OPTIMIZER, f"{name}.{kind}") for kind in MOMENTS]
            for kind, file, key in keys:
                entry = self._headers[file][1].get(key)
                if entry is None or list(entry["shape"]) != list(shape) or entry["dtype"] not in DTYPES:
                    found = "nothing" if entry is None else f"{entry['dtype']} of shape {entry['shape']}"
                    raise CheckpointError(
                        f"{folder}: {file} entry {key}: state.json says shape {shape}, the file has {found}"
                    )
                self._where[(name, kind)] = (file, key)

    def _file(self, name: str) -> Any:
        if name not in self._open:
            self._open[name] = self.fs.open_input_file(posixpath.join(self.path, name))
        return self._open[name]

    def _read(self, name: str, offset: int, length: int) -> bytes:
        data = self._file(name).read_at(length, offset)
        if len(data) != length:
            raise CheckpointError(f"{self.folder}: {name} ends before byte {offset + length}")
        self.bytes_read += length
        return data

    def _header(self, name: str) -> tuple[int, dict[str, Any]]:
        try:
            return read_header(functools.partial(self._read, name))
        except ValueError as err:
            raise CheckpointError(
                f"{self.folder}: {name} has no readable safetensors header ({err})"
            ) from err

    def _range(self, name: str, kind: str, start: int, stop: int) -> torch.Tensor:
        file, key = self._where[(name, kind)]
        base, header = self._headers[file]
        return read_elements(functools.partial(self._read, file), base, header[key], start, stop)

    def weight_range(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of parameter `name`'s flattened fp32 master, read from storage."""
        return self._range(name, "weight", start, stop)

    def moment_range(self, name: str, kind: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of parameter `name`'s flattened Adam moment `kind`, read from storage."""
        return self._range(name, kind, start, stop)

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()


def is_complete(folder: str, filesystem: Any) -> bool:
    """Whether a checkpoint folder of a run's storage has its manifest (written last, so an upload cut
    short has none); says nothing about whether the files match it."""
    import pyarrow.fs

    path = posixpath.join(folder, MANIFEST)
    return filesystem.get_file_info(path).type == pyarrow.fs.FileType.File


def _on(folder: str | Path, filesystem: Any) -> tuple[Any, str]:
    """(pyarrow filesystem, path in it) of a checkpoint folder; unset `filesystem`: the local disk."""
    import pyarrow.fs

    if filesystem is None:
        return pyarrow.fs.LocalFileSystem(), os.path.abspath(folder)
    return filesystem, str(folder).rstrip("/")


def _read_manifest(fs: Any, folder: str, where: str | Path) -> dict[str, Any]:
    import pyarrow.fs

    path = posixpath.join(folder, MANIFEST)
    try:
        if fs.get_file_info(path).type != pyarrow.fs.FileType.File:
            raise FileNotFoundError(path)
        with fs.open_input_stream(path) as f:
            manifest = json.loads(f.read())
        manifest["files"].items()
    except (FileNotFoundError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(
            f"{where}: {MANIFEST} missing or unreadable ({err}); checkpoint incomplete"
        ) from err
    check_format(manifest.get("format"), where)
    return manifest


def verify(folder: str | Path, filesystem: Any = None, hashes: bool = True) -> dict[str, Any]:
    """Check every file against the manifest; raise `CheckpointError` naming the folder and file.

    `filesystem`: a pyarrow filesystem that `folder` is a path of (a run's storage); unset: local.
    `hashes=False` checks that every file is there at the manifest's size, without reading it.
    Any other `OSError` (an I/O error, a timeout on network storage) is raised as it is: it says nothing
    about the checkpoint, and a reader may retry it.
    """
    import pyarrow.fs

    fs, path = _on(folder, filesystem)
    manifest = _read_manifest(fs, path, folder)
    for name, entry in manifest["files"].items():
        info = fs.get_file_info(posixpath.join(path, name))
        if info.type != pyarrow.fs.FileType.File:
            raise CheckpointError(f"{folder}: file {name} listed in the manifest is missing")
        if info.size != entry["bytes"]:
            raise CheckpointError(
                f"{folder}: file {name} has {info.size} bytes, manifest says "
                f"{entry['bytes']} (truncated or altered)"
            )
        if hashes and _sha256_on(fs, posixpath.join(path, name)) != entry["sha256"]:
            raise CheckpointError(
                f"{folder}: file {name} does not match its sha256 in the manifest (altered)"
            )
    return manifest


def _sha256_on(fs: Any, path: str) -> str:
    digest = hashlib.sha256()
    with fs.open_input_stream(path) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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
