"""Choosing what a run resumes from, and refusing what it must not resume from.

- On a worker: Ray hands over the latest reported checkpoint. If it is torn or damaged (a file
  missing, truncated or altered per the manifest, state.json unreadable), fall back to the newest
  intact checkpoint the run reported before it, with a warning that names the bad folder and file.
- On the driver, before Ray Train starts: a run that will resume is checked against its checkpoint
  (architecture, base model, LoRA rank and targets, what is trained), so a mismatch is one clear
  error instead of a worker crash retried `max_failures` times.
"""

from __future__ import annotations

import hashlib
import json
import logging
import posixpath
from pathlib import Path

import pyarrow.fs
import ray.train

from raylora import checkpoint, hub
from raylora.config import Config, ConfigError, storage_path
from raylora.progress import run_folder

log = logging.getLogger("raylora")


def base_model_fingerprint(model_path: str | Path, sample: int = 1 << 20) -> dict[str, str | int]:
    """What identifies a base model folder cheaply: config.json, and the weight files' sizes and the
    first and last MiB of each (hashing every byte of a 15 GB model on each start would be slow)."""
    folder = Path(model_path)
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    weight_bytes = 0
    for path in sorted(folder.glob("*.safetensors")):
        size = path.stat().st_size
        weight_bytes += size
        with open(path, "rb") as f:
            digest.update(f"{path.name}:{size}".encode())
            digest.update(f.read(sample))
            f.seek(max(0, size - sample))
            digest.update(f.read(sample))
    return {"sha256": digest.hexdigest(), "weight_bytes": weight_bytes}


def _checkpoint_folders(fs: pyarrow.fs.FileSystem, run_dir: str) -> list[str]:
    """The run's checkpoint folders, oldest first (Ray names them by report time)."""
    try:
        infos = fs.get_file_info(pyarrow.fs.FileSelector(run_dir, allow_not_found=True))
    except OSError:
        return []
    names = [i.path for i in infos if i.type == pyarrow.fs.FileType.Directory]
    return sorted(p for p in names if posixpath.basename(p).startswith("checkpoint_"))


def load_intact(latest: ray.train.Checkpoint) -> checkpoint.Loaded:
    """The newest intact checkpoint no newer than `latest`; warns about each damaged one it skips."""
    fs, latest_path = latest.filesystem, latest.path.rstrip("/")
    run_dir = posixpath.dirname(latest_path)
    folders = [p for p in _checkpoint_folders(fs, run_dir) if p <= latest_path] or [latest_path]
    problems = []
    for path in reversed(folders):
        try:
            with ray.train.Checkpoint(path, filesystem=fs).as_directory() as local:
                loaded = checkpoint.load(local)
        except (checkpoint.CheckpointError, OSError) as err:
            log.warning("not resuming from damaged checkpoint %s: %s", path, err)
            problems.append(f"{path}: {err}")
            continue
        if path != latest_path:
            log.warning(
                "resuming from %s (step %d) instead of the damaged latest one", path, loaded.state.step
            )
        return loaded
    raise checkpoint.CheckpointError(
        f"no intact checkpoint in {run_dir}; every one is damaged:\n  " + "\n  ".join(problems)
    )


def latest_state(cfg: Config) -> tuple[str, checkpoint.TrainState] | None:
    """(folder, state) of the newest checkpoint of this run whose state.json reads, if any."""
    fs, run_dir = run_folder(storage_path(cfg), cfg.run.name)
    for path in reversed(_checkpoint_folders(fs, run_dir)):
        try:
            with fs.open_input_stream(posixpath.join(path, checkpoint.STATE)) as f:
                return path, checkpoint.TrainState.from_dict(json.loads(f.read()))
        except (OSError, ValueError, TypeError):
            continue
    return None


def expected_trainable(cfg: Config) -> dict[str, list[int]]:
    """Trainable names and shapes this config gives, from the model's config on the meta device."""
    from transformers import AutoConfig

    from raylora.arch import detect
    from raylora.model import trainable_shapes

    model_dir = hub.resolve(cfg.model.path, cfg.model.revision, config_only=True)
    return trainable_shapes(cfg, detect(model_dir, cfg.model.arch), AutoConfig.from_pretrained(model_dir))


def check_resume(cfg: Config) -> checkpoint.TrainState | None:
    """If this run will resume, refuse a checkpoint made for another model, adapter or architecture."""
    found = latest_state(cfg)
    if found is None:
        return None
    folder, state = found
    arch = state.extra.get("arch")
    from raylora.arch import detect

    model_dir = hub.resolve(cfg.model.path, cfg.model.revision, config_only=True)
    here = detect(model_dir, cfg.model.arch).model_type
    if arch and arch != here:
        raise ConfigError(
            f"run {cfg.run.name} resumes from {folder}, made for architecture {arch}; "
            f"model.path is a {here} model"
        )
    fingerprint = state.extra.get("base_model")
    # A Hub model's weights are fetched to the driver here, and only here: a resume must be refused on
    # this side of Ray when the base model changed, and the fingerprint is made from the files.
    if fingerprint and fingerprint != base_model_fingerprint(hub.resolve(cfg.model.path, cfg.model.revision)):
        raise ConfigError(
            f"run {cfg.run.name} resumes from {folder}, made on another base model than {cfg.model.path} "
            f"(config.json or weights differ); use another run.name to start over"
        )
    try:
        checkpoint.check_compatible(state, expected_trainable(cfg), folder)
    except checkpoint.CheckpointError as err:
        raise ConfigError(f"run {cfg.run.name} cannot resume: {err}") from err
    return state
