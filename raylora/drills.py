"""Fault drills: a worker that kills its own process at a chosen step, or whose checkpoint reads fail,
for demos and tests.

`fault.kill_at_steps` kills before those steps, `fault.kill_checkpoint_steps` while writing those
steps' checkpoints (after the files are written, before Ray has them). A kill one or more steps after a
checkpoint first waits until Ray Train has recorded that checkpoint, so the resume point is known: on a
cluster, seconds pass between a checkpoint and a crash later on, while here the next step takes a tenth of
a second and the controller takes reports only at its next poll. A kill at a checkpoint step itself does
not wait, and races the report as a real crash would. A marker file in the run
folder remembers each drill that fired, so the resumed run, which trains that step again, goes on.
`fault.read_errors` makes the first reads of a checkpoint by `fault.read_error_rank` fail as a storage
network error would (a transient `OSError`), counted in a marker file too.
"""

from __future__ import annotations

import logging
import os
import posixpath
import signal
import time

import pyarrow.fs

from raylora.config import Config
from raylora.storage import recorded_steps, run_folder

log = logging.getLogger("raylora")


def maybe_kill(cfg: Config, step: int, rank: int, while_checkpointing: bool = False) -> None:
    """Fault drill: the configured rank kills its own process at each configured step, once.

    A marker file in the run folder remembers each drill that fired, so the resumed run, which trains
    that step again, goes on.
    """
    f = cfg.fault
    steps = f.kill_checkpoint_steps if while_checkpointing else f.kill_at_steps
    if step not in steps or rank != f.kill_rank:
        return
    fs, folder = run_folder(cfg.run.storage_path, cfg.run.name)
    kind = "checkpoint" if while_checkpointing else "step"
    marker = posixpath.join(folder, f".raylora-drill-{kind}{step}")
    if fs.get_file_info(marker).type != pyarrow.fs.FileType.NotFound:
        return
    every = cfg.train.checkpoint_every
    if not while_checkpointing and step % every:
        _wait_until_recorded(fs, folder, step - step % every)
    fs.create_dir(folder, recursive=True)
    with fs.open_output_stream(marker) as out:
        out.write(b"fired\n")
    where = "while writing the checkpoint of" if while_checkpointing else "before"
    log.warning("fault drill: rank %d kills itself %s step %d", rank, where, step)
    os.kill(os.getpid(), signal.SIGKILL)


def _wait_until_recorded(fs: pyarrow.fs.FileSystem, folder: str, step: int, timeout_s: float = 120) -> None:
    """Wait until Ray's snapshot in the run folder lists a checkpoint of `step` or later (none for 0)."""
    deadline = time.monotonic() + timeout_s
    while step > 0 and max(recorded_steps(fs, folder), default=-1) < step:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fault drill: Ray recorded no checkpoint of step {step} in {timeout_s} s")
        time.sleep(0.1)


def maybe_read_error(cfg: Config, rank: int, path: str) -> None:
    """Fault drill: the first `fault.read_errors` checkpoint reads of `fault.read_error_rank` in the run
    raise a transient `OSError` (read before each try, so a retry counts as another read)."""
    f = cfg.fault
    if not f.read_errors or rank != f.read_error_rank:
        return
    fs, folder = run_folder(cfg.run.storage_path, cfg.run.name)
    marker = posixpath.join(folder, ".raylora-drill-read-errors")
    fired = 0
    if fs.get_file_info(marker).type == pyarrow.fs.FileType.File:
        with fs.open_input_stream(marker) as inp:
            fired = int(inp.read().decode() or 0)
    if fired >= f.read_errors:
        return
    with fs.open_output_stream(marker) as out:
        out.write(f"{fired + 1}".encode())
    log.warning("fault drill: rank %d fails to read %s (%d of %d)", rank, path, fired + 1, f.read_errors)
    raise OSError(f"fault drill: transient read error on {path} ({fired + 1} of {f.read_errors})")
