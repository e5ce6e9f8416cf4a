"""Fault drills: a worker that kills its own process at a chosen step, for demos and tests.

`fault.kill_at_steps` kills before those steps, `fault.kill_checkpoint_steps` while writing those
steps' checkpoints (after the files are written, before Ray has them). A marker file in the run
folder remembers each drill that fired, so the resumed run, which trains that step again, goes on.
"""

from __future__ import annotations

import logging
import os
import posixpath
import signal

import pyarrow.fs

from raylora.config import Config, storage_path
from raylora.progress import run_folder

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
    fs, folder = run_folder(storage_path(cfg), cfg.run.name)
    kind = "checkpoint" if while_checkpointing else "step"
    marker = posixpath.join(folder, f".raylora-drill-{kind}{step}")
    if fs.get_file_info(marker).type != pyarrow.fs.FileType.NotFound:
        return
    fs.create_dir(folder, recursive=True)
    with fs.open_output_stream(marker) as out:
        out.write(b"fired\n")
    where = "while writing the checkpoint of" if while_checkpointing else "before"
    log.warning("fault drill: rank %d kills itself %s step %d", rank, where, step)
    os.kill(os.getpid(), signal.SIGKILL)
