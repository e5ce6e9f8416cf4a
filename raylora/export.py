"""`raylora export`: a checkpoint as a PEFT adapter folder, or merged into a full Hugging Face model.

A checkpoint's LoRA weights are already in PEFT's format, so the adapter export copies them with the
adapter config, plus the trained vision tower / aligner weights when there are any (PEFT does not
load those: apply them with `load_state_dict(..., strict=False)` on `model.base_model.model`).
The merged export folds LoRA into the base weights (PEFT's `merge_and_unload`) in fp32, on a GPU when
the node has one (`--device`), puts the trained vision tower / aligner weights in place, and saves the
model in the base model's dtype with its processor: a plain model folder for
`AutoModelForImageTextToText.from_pretrained`.

The checkpoint and the output may each be a local path or a URI of any pyarrow filesystem (s3://,
gs://). A checkpoint in object storage is downloaded into a temporary folder first (`local_checkpoint`:
its adapter, trained modules, optimizer state and JSON files, never the base model); an output there is
written locally, then uploaded file by file, its config last.

A local output is written into a temporary sibling folder and renamed into place at the end, so a
failed export never leaves a folder that looks complete; an upload cut short lacks its config file
(`config.json` or `adapter_config.json`), without which neither transformers nor PEFT loads it.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pyarrow.fs
import torch

from raylora import checkpoint, hub, storage
from raylora.config import ConfigError


@contextlib.contextmanager
def local_checkpoint(where: str | Path) -> Iterator[Path]:
    """A checkpoint folder on this machine: a local path as it is; a URI (s3://, gs://) copied whole into
    a temporary folder, removed when the block ends. `ConfigError` when the URI names no folder."""
    where = str(where)
    if not storage.is_uri(where):
        yield Path(where)
        return
    fs, path = storage.filesystem(where.rstrip("/"))
    if fs.get_file_info(path).type != pyarrow.fs.FileType.Directory:
        raise ConfigError(f"not a usable raylora checkpoint: {where}: no such folder")
    with tempfile.TemporaryDirectory(prefix="raylora-checkpoint-") as tmp:
        local = Path(tmp) / posixpath.basename(path)
        local.mkdir()  # copy_files writes into a folder, it does not make it
        pyarrow.fs.copy_files(
            path, str(local), source_filesystem=fs, destination_filesystem=pyarrow.fs.LocalFileSystem()
        )
        yield local


def verified_state(folder: str | Path, shown: str | None = None) -> checkpoint.TrainState:
    """The TrainState of a local checkpoint that passes its manifest check; `ConfigError` (exit 2)
    otherwise, naming the checkpoint as `shown` (the URI it was downloaded from) when given."""
    folder = Path(folder)
    try:
        checkpoint.verify(folder)
        return checkpoint.read_state(folder)
    except (checkpoint.CheckpointError, OSError) as err:
        message = str(err).replace(str(folder), shown) if shown else str(err)
        raise ConfigError(f"not a usable raylora checkpoint: {message}") from err


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


def _write_merged(folder: Path, out: Path, model_path: str, device: str) -> None:
    from transformers import AutoConfig

    from raylora.data.labels import end_of_turn_ids
    from raylora.evaluate import load_for_inference

    # Merge in fp32 on either device, so that W + BA is exact up to fp32 rounding, then save in the base
    # model's dtype (a bf16 7B model stays 14 GB on disk). In bf16, DoRA's norms and the embeddings'
    # deltas would be rounded twice. On a GPU that takes 4 bytes a parameter: 28 GB for 7B.
    trust = bool(checkpoint.read_state(folder).config["model"].get("trust_remote_code"))
    base_dtype = AutoConfig.from_pretrained(model_path, trust_remote_code=trust).dtype
    # a QLoRA adapter is merged into the base's original weights, not their 4-bit rounding: the merged
    # model is the base as published plus the update trained against its quantized copy
    model, processor = load_for_inference(
        folder, model_path, device=device, dtype=torch.float32, quantized=False
    )
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


# The file a reader of each kind of output looks for first: uploaded last.
LOADED_FIRST = ("config.json", checkpoint.ADAPTER_CONFIG)


def _check_new(out: str) -> None:
    """`ConfigError` when `out` (a path or a URI) exists and is not an empty folder."""
    fs, path = storage.filesystem(out)
    info = fs.get_file_info(path)
    taken = info.type == pyarrow.fs.FileType.File or (
        info.type == pyarrow.fs.FileType.Directory
        and fs.get_file_info(pyarrow.fs.FileSelector(path, allow_not_found=True))
    )
    if taken:
        raise ConfigError(f"--out {out} exists and is not an empty folder; choose a new one")


def _upload(local: Path, out: str) -> None:
    """Copy the files of folder `local` to `out` (a URI), the config files last; on failure, remove what
    was uploaded."""
    fs, path = storage.filesystem(out)
    files = sorted((p for p in local.rglob("*") if p.is_file()), key=lambda p: (p.name in LOADED_FIRST, p))
    done: list[str] = []
    try:
        for file in files:
            target = posixpath.join(path, file.relative_to(local).as_posix())
            pyarrow.fs.copy_files(
                str(file), target, source_filesystem=pyarrow.fs.LocalFileSystem(), destination_filesystem=fs
            )
            done.append(target)
    except BaseException:
        for target in done:
            with contextlib.suppress(OSError):
                fs.delete_file(target)
        raise


def export(
    folder: str | Path,
    out: str | Path,
    merge: bool = False,
    model_path: str | None = None,
    device: str = "auto",
) -> str:
    """Write checkpoint `folder` to `out` as a PEFT adapter folder, or with `merge` as a full model
    (computed on `device`: `auto`, `cpu` or `cuda`). Either may be a local path or a URI.

    Refuses (`ConfigError`) an `out` that exists and is not an empty folder and a checkpoint that fails its
    manifest check, before loading anything.
    """
    folder, out = str(folder), str(out)
    remote = storage.is_uri(out)
    _check_new(out if remote else os.path.abspath(out))
    with local_checkpoint(folder) as local:
        state = verified_state(local, folder)
        if merge:  # the adapter alone is copied as it is: no base model needed
            model_path = base_model_path(state, model_path)
        target = Path(tempfile.mkdtemp(prefix="raylora-export-")) / "out" if remote else Path(out)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.parent / f".{target.name}.partial-{os.getpid()}"
        partial.mkdir()
        try:
            if merge:
                _write_merged(local, partial, model_path, device)
            else:
                checkpoint.copy_adapter(local, partial)
            if remote:
                _upload(partial, out)
            else:
                if target.exists():
                    target.rmdir()  # empty, checked above; rename cannot replace a folder portably
                partial.rename(target)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        finally:
            if remote:
                shutil.rmtree(target.parent, ignore_errors=True)
    return out
