"""Restarts: choosing what a run resumes from, refusing what it must not resume from, counting the
attempts, and clearing what a crashed attempt left behind.

- On the workers: Ray hands every rank the latest reported checkpoint. Rank 0 alone decides what is
  restored: if that checkpoint is torn or damaged (a file missing, truncated or altered per the
  manifest, state.json unreadable), it falls back to the newest intact one the run reported before
  it, with a warning that names the bad folder and file. Every rank then reads exactly the checkpoint
  rank 0 chose, and all compare the step they hold before the first step. A storage error that may
  be transient is retried with backoff, never taken for damage.
- On the driver, before Ray Train starts: a run that will resume is checked against its checkpoint
  (architecture, base model, LoRA rank and targets, what is trained, the sample order), so a mismatch
  is one clear error instead of a worker crash retried `max_failures` times.
- At the start of every attempt: the run's count of attempts goes up (`count_attempt`), and the local
  folders a crashed rank 0 was writing a checkpoint into, and the checkpoint folders of uploads that
  never completed, are removed.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import posixpath
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow.fs
import ray.train

from raylora import checkpoint, hub
from raylora.config import Config, ConfigError
from raylora.data.formats import check_source
from raylora.drills import maybe_read_error
from raylora.storage import recorded_checkpoints, run_folder

log = logging.getLogger("raylora")


ATTEMPTS_FILE = "raylora_attempts.json"


def count_attempt(storage_path: str, name: str) -> int:
    """Record that the run's worker group started once more; returns how many times it has started.

    Counted in the run folder, not in checkpoints: a worker group that dies before its first
    checkpoint leaves no trace there, but it was a restart all the same.
    """
    fs, folder = run_folder(storage_path, name)
    path = posixpath.join(folder, ATTEMPTS_FILE)
    attempts = 0
    if fs.get_file_info(path).type == pyarrow.fs.FileType.File:
        with fs.open_input_stream(path) as f:
            attempts = int(json.loads(f.read()).get("attempts", 0))
    fs.create_dir(folder, recursive=True)
    with fs.open_output_stream(path) as f:
        f.write(json.dumps({"attempts": attempts + 1}).encode())
    return attempts + 1


def _checkpoint_folders(fs: pyarrow.fs.FileSystem, run_dir: str) -> list[str]:
    """The run's checkpoint folders, oldest first (Ray names them by report time)."""
    try:
        infos = fs.get_file_info(pyarrow.fs.FileSelector(run_dir, allow_not_found=True))
    except OSError:
        return []
    names = [i.path for i in infos if i.type == pyarrow.fs.FileType.Directory]
    return sorted(p for p in names if posixpath.basename(p).startswith("checkpoint_"))


# A storage error (a network error, a timeout, a throttled request) is retried this many times, waiting
# 1, 2, 4, 8 s between tries, before the attempt fails (and Ray Train retries it with a new worker group).
READ_TRIES = 5
READ_BACKOFF_S = 1.0


def read_checkpoint(
    path: str,
    filesystem: pyarrow.fs.FileSystem,
    before_read: Callable[[str], None] | None = None,
    tries: int = READ_TRIES,
    backoff_s: float = READ_BACKOFF_S,
    hashes: bool = True,
) -> checkpoint.Ranges:
    """Open checkpoint `path` of the run's storage for ranged reads, after checking it against its
    manifest (every file's sha256 with `hashes`, else that every file is there at its size).

    Nothing is downloaded: each rank then reads only its own slices (`checkpoint.Ranges`).
    An `OSError` may be transient: it is retried with exponential backoff, and after `tries` failures
    raised as an `OSError` naming the checkpoint. Files that do not match the manifest are damage:
    `CheckpointError` at once, not retried. `before_read(path)` runs before each try (the fault drill).
    """
    for attempt in range(1, tries + 1):
        try:
            if before_read is not None:
                before_read(path)
            return checkpoint.Ranges(path, filesystem, hashes=hashes)
        except OSError as err:
            if attempt == tries:
                raise OSError(
                    f"{path}: reading the checkpoint failed {tries} times; last error: "
                    f"{type(err).__name__}: {err}"
                ) from err
            wait = backoff_s * 2 ** (attempt - 1)
            log.warning(
                "reading checkpoint %s failed (%s); try %d of %d in %.0f s",
                path,
                err,
                attempt + 1,
                tries,
                wait,
            )
            time.sleep(wait)
    raise AssertionError("unreachable")


def newest_intact(
    latest: ray.train.Checkpoint, before_read: Callable[[str], None] | None = None
) -> tuple[str, checkpoint.Ranges]:
    """(path, opened) of the newest intact checkpoint that Ray recorded, no newer than `latest`; warns
    about each damaged one it skips. A storage error that outlasts the retries is not damage: it is raised.

    Only checkpoints in Ray's record are candidates: with asynchronous uploads a folder can be in the
    run's storage, even complete, whose report Ray never recorded (the rank died after its upload).
    """
    fs, latest_path = latest.filesystem, latest.path.rstrip("/")
    run_dir = posixpath.dirname(latest_path)
    recorded = recorded_checkpoints(fs, run_dir) or set()
    folders = [
        p for p in _checkpoint_folders(fs, run_dir) if p <= latest_path and posixpath.basename(p) in recorded
    ]
    if latest_path not in folders:  # Ray handed it out, so it recorded it, whatever its snapshot says
        folders.append(latest_path)
    problems = []
    for path in reversed(folders):
        try:
            loaded = read_checkpoint(path, fs, before_read)
        except checkpoint.NewerFormatError:
            raise  # not damage: falling back past it would silently lose its steps
        except checkpoint.CheckpointError as err:
            log.warning("not resuming from damaged checkpoint %s: %s", path, err)
            problems.append(f"{path}: {err}")
            continue
        if path != latest_path:
            log.warning(
                "resuming from %s (step %d) instead of the damaged latest one", path, loaded.state.step
            )
        return path, loaded
    raise checkpoint.CheckpointError(
        f"no intact checkpoint in {run_dir}; every one is damaged:\n  " + "\n  ".join(problems)
    )


def restore_agreed(cfg: Config, latest: ray.train.Checkpoint | None) -> checkpoint.Ranges | None:
    """The checkpoint this rank restores: the one rank 0 chose, opened by every rank. Collective.

    A rank that chose for itself could fall back past a checkpoint it failed to read to an older step
    while the others restore the newest; partitions, learning rate and sampler positions would mix.
    So rank 0 alone verifies and falls back, and broadcasts the path it chose: a path of the run's
    storage, which each rank reads through its own filesystem (its own credentials). Rank 0 checked
    every byte against the manifest's hashes; the others, which read only their own slices, check that
    each file is there at the manifest's size and that its header lists every tensor at its shape. All
    ranks compare the step they hold.
    """
    import torch.distributed as dist

    rank = dist.get_rank()

    def drill(path: str) -> None:
        maybe_read_error(cfg, rank, path)

    chosen: list[str | None] = [None]
    loaded = None
    if rank == 0 and latest is not None:
        chosen[0], loaded = newest_intact(latest, drill)
    # Object collectives: they run on whatever the group serves (gloo on CPU, NCCL on the current GPU).
    dist.broadcast_object_list(chosen, src=0)
    if rank != 0 and chosen[0] is not None:
        if latest is None:
            raise checkpoint.CheckpointError(
                f"rank {rank} got no checkpoint from Ray; rank 0 restores {chosen[0]}"
            )
        loaded = read_checkpoint(chosen[0], latest.filesystem, drill, hashes=False)
    steps: list[int | None] = [None] * dist.get_world_size()
    dist.all_gather_object(steps, loaded.state.step if loaded is not None else None)
    if len(set(steps)) > 1:
        raise checkpoint.CheckpointError(
            f"ranks hold different steps after restoring {chosen[0]} (step by rank: {steps})"
        )
    if rank == 0 and chosen[0] is not None:
        log.info("every rank restores %s (step %d)", chosen[0], steps[0])
    return loaded


# The sampler's fields, the config key that sets each, and what it counts: together they fix the order.
SAMPLER_KEYS = {
    "seed": ("train.seed", "seed"),
    "global_batch_size": ("train.global_batch_size", "global batch size"),
    "num_samples": ("data.train", "usable rows of data.train"),
    "group_by_length": ("train.group_by_length", "train.group_by_length"),
}


def sampler_fields(sampler) -> dict:
    """The fields of a `GlobalSampler` that its checkpoints record (`SAMPLER_KEYS`)."""
    return {
        "seed": sampler.seed,
        "global_batch_size": sampler.global_batch_size,
        "num_samples": sampler.num_samples,
        "group_by_length": sampler.lengths is not None,
    }


def check_sampler(saved: dict[str, int], now: dict[str, int], where: str) -> None:
    """Refuse to resume with another sample order: a `ConfigError` naming the config key that changed.

    The order of every step's batch follows from the sampler's fields alone, so a resume with another
    seed, global batch size or number of samples would go on with batches the run never planned.
    """
    saved = {"group_by_length": False, **saved}  # recorded since train.group_by_length exists
    for field, (key, what) in SAMPLER_KEYS.items():
        if field in now and field in saved and saved[field] != now[field]:
            raise ConfigError(
                f"{key}: {where} was trained with {what} {saved[field]}, this config gives {now[field]}; "
                f"resuming would go on in another sample order. Set {key} back, or use another run.name "
                f"to start over"
            )


def latest_state(cfg: Config) -> tuple[str, checkpoint.TrainState] | None:
    """(folder, state) of the newest checkpoint of this run whose state.json reads, if any.

    A checkpoint written in a newer format than this raylora reads is refused (`ConfigError`).
    """
    fs, run_dir = run_folder(cfg.run.storage_path, cfg.run.name)
    for path in reversed(_checkpoint_folders(fs, run_dir)):
        try:
            return path, checkpoint.read_state(path, fs)
        except checkpoint.NewerFormatError as err:
            raise ConfigError(f"run {cfg.run.name} cannot resume: {err}") from err
        except checkpoint.CheckpointError:
            continue
    return None


def staging_folder(cfg: Config) -> Path:
    """This node's folder for the checkpoints rank 0 writes before Ray uploads them, under `run.local_dir`
    (unset: the system temporary folder, resolved on this node): one per run (storage path and name), so
    that an attempt removes what a crashed one left without touching another run's."""
    key = hashlib.sha256(f"{cfg.run.storage_path}/{cfg.run.name}".encode()).hexdigest()[:12]
    local = cfg.run.local_dir or tempfile.gettempdir()
    return Path(local) / "raylora-staging" / f"{cfg.run.name}-{key}"


def new_staging_folder(cfg: Config, step: int) -> str:
    """A new empty local folder for the checkpoint of `step`."""
    parent = staging_folder(cfg)
    parent.mkdir(parents=True, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"step{step}-", dir=parent)


# Directory descriptors of this process's staging folders, each under a shared flock: Ray's asynchronous
# upload reads a folder from a thread of this process, then deletes it, so a folder is in use exactly as
# long as the process that wrote it lives and the folder exists.
_HELD: dict[str, int] = {}


def hold_until_uploaded(folder: str) -> None:
    """Mark staging `folder` as in use while this process lives: `remove_leftovers` leaves it alone (an
    asynchronous upload may still be reading it). Releases the folders Ray has deleted since."""
    for path, fd in list(_HELD.items()):
        if not os.path.isdir(path):
            os.close(fd)
            del _HELD[path]
    fd = os.open(folder, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    _HELD[folder] = fd


def _in_use(folder: Path) -> bool:
    """Whether a live process holds `folder` (`hold_until_uploaded`); the lock dies with its process."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the probe's lock


def remove_partial_uploads(fs: pyarrow.fs.FileSystem, run_dir: str) -> list[str]:
    """Remove the checkpoint folders that have no manifest and that Ray's snapshot does not list: uploads
    cut short by a crash. Ray never hands them out, but they hold storage and look like checkpoints.
    Returns the removed paths; removes nothing while the snapshot does not read."""
    recorded = recorded_checkpoints(fs, run_dir)
    if recorded is None:
        return []
    removed = []
    for path in _checkpoint_folders(fs, run_dir):
        if posixpath.basename(path) not in recorded and not checkpoint.is_complete(path, fs):
            fs.delete_dir(path)
            removed.append(path)
    return removed


def remove_leftovers(cfg: Config, rank: int) -> None:
    """What crashed attempts left: this node's staging folders of this run and, on rank 0, partial
    uploads in the run folder. Runs before any rank writes a checkpoint; never fails the attempt."""
    staging = staging_folder(cfg)
    if staging.is_dir():
        # a folder that a live process holds may still be uploading (a rank of this node that has not
        # yet exited): never pull it from under the upload
        stale = sorted(p for p in staging.iterdir() if not _in_use(p))
        for path in stale:
            shutil.rmtree(path, ignore_errors=True)
        if stale:
            names = [p.name for p in stale]
            log.warning("removed local checkpoint folders of a crashed attempt in %s: %s", staging, names)
    if rank != 0:
        return
    try:
        removed = remove_partial_uploads(*run_folder(cfg.run.storage_path, cfg.run.name))
    except OSError as err:  # storage unreachable now: the next attempt cleans up
        log.warning("could not clear partial checkpoint uploads: %s", err)
        return
    if removed:
        log.warning("removed checkpoint folders whose upload never completed: %s", removed)


def expected_trainable(cfg: Config) -> dict[str, list[int]]:
    """Trainable names and shapes this config gives, from the model's config on the meta device."""
    from transformers import AutoConfig

    from raylora.arch import for_model
    from raylora.model import trainable_shapes

    model_dir = hub.resolve(cfg.model.path, cfg.model.revision, config_only=True)
    model_config = AutoConfig.from_pretrained(model_dir, trust_remote_code=cfg.model.trust_remote_code)
    return trainable_shapes(cfg, for_model(model_dir, cfg.model), model_config)


def check_resume(cfg: Config) -> checkpoint.TrainState | None:
    """If this run will resume, refuse a checkpoint made for another model, adapter or architecture."""
    found = latest_state(cfg)
    if found is None:
        return None
    folder, state = found
    sampler = {
        "seed": cfg.train.seed,
        "global_batch_size": cfg.train.global_batch_size,
        "group_by_length": cfg.train.group_by_length,
    }
    check_sampler(state.sampler, sampler, folder)
    # The row count from the source's metadata, which a changed data set almost always changes.
    _, rows = check_source(cfg.data.train, "data.train", cfg.data.format, cfg.data.image_root)
    if state.data_rows is not None and rows != state.data_rows:
        raise ConfigError(
            f"data.train: {folder} was trained on {state.data_rows} rows, {cfg.data.train} has {rows}; "
            f"resuming would go on in another sample order. Point data.train at the data it was trained on, "
            f"or use another run.name to start over"
        )
    arch = state.arch
    from raylora.arch import for_model

    model_dir = hub.resolve(cfg.model.path, cfg.model.revision, config_only=True)
    here = for_model(model_dir, cfg.model).model_type
    if arch and arch != here:
        raise ConfigError(
            f"run {cfg.run.name} resumes from {folder}, made for architecture {arch}; "
            f"model.path is a {here} model"
        )
    # A Hub model's weights are fetched to the driver here, and only here: a resume must be refused on
    # this side of Ray when the base model changed, and the fingerprint is made from the files.
    if state.base_model:
        weights = hub.resolve(cfg.model.path, cfg.model.revision)
        if state.base_model != hub.base_model_fingerprint(weights):
            raise ConfigError(
                f"run {cfg.run.name} resumes from {folder}, made on another base model than "
                f"{cfg.model.path} (config.json or weights differ); use another run.name to start over"
            )
    try:
        checkpoint.check_compatible(state, expected_trainable(cfg), folder)
    except checkpoint.CheckpointError as err:
        raise ConfigError(f"run {cfg.run.name} cannot resume: {err}") from err
    return state
