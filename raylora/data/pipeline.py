"""The input pipeline beside training: the next steps' micro batches are built in worker processes while
the current step computes.

What a step trains on is a function of the step number alone (the global sampler), so the pipeline is a
torch `DataLoader` over step numbers: worker processes call the same `build(step)` the inline path calls,
in step order, and an exact resume is unchanged (it starts the loader at the restored step). Collectives
(the step's skipped-sample and token counts) stay in the training process: a loader worker has no
process group.

The workers are forked: a forked worker shares the processor, the data reader and its caches with the
training process instead of pickling them, and builds batches on the CPU only (it never touches CUDA,
which a forked child must not). raylora runs FFmpeg without threads of its own (`raylora.data.video`):
a worker forked from a process that had run FFmpeg's thread pools was seen to hang inside FFmpeg.

An exception in a worker is re-raised in the training process by the DataLoader with its original type
(a bad row with `data.on_bad_row: error` stays a permanent error); a worker that dies (killed, out of
memory) raises instead of leaving the step waiting, and one that produces nothing for WORKER_TIMEOUT_S
prints its stacks and raises. A worker dies with the training process (Linux): otherwise it would hold
the dead process's connection to Ray open until torch's own check notices, and Ray would see the crash,
and restart, ~5 s late.
"""

from __future__ import annotations

import ctypes
import faulthandler
import functools
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch.utils.data

T = TypeVar("T")

# A worker that has produced nothing for this long is reported rather than waited on forever.
WORKER_TIMEOUT_S = 600


class _Steps(torch.utils.data.Dataset):
    def __init__(self, build: Callable[[int], T], steps: range):
        self.build, self.steps = build, steps

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, k: int) -> T:
        return self.build(self.steps[k])


def _as_is(item):
    return item  # the step's batches are already tensors: no collation


PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
STACKS_SIGNAL = signal.SIGUSR1


def _worker_init(parent: int, _worker_id: int) -> None:
    """A loader worker's first act: be ready to print its stacks, and ask Linux to kill it when the
    training process dies.

    A forked worker inherits the training process's connection to Ray's raylet, and Ray sees a worker
    die only when that connection closes: while the child lives, a crashed training process looks alive.
    torch's workers notice a dead parent only at their next status check (every 5 s). Linux sends the
    signal when the thread that forked the worker ends: the training function's thread, which iterates
    the loader to its end. prctl has no Python binding in the standard library, hence ctypes.
    """
    # a worker that stops producing prints its threads' Python stacks to its stderr when the training
    # process gives up on it (`_report_stuck`), so a hang names the line it hangs in
    faulthandler.register(STACKS_SIGNAL, all_threads=True)
    if sys.platform != "linux":
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def step_inputs(build: Callable[[int], T], steps: range, workers: int, ahead: int = 2) -> Iterator[T]:
    """`build(step)` for each step of `steps`, in order: inline with `workers=0`, else prepared by
    `workers` processes, up to `ahead` steps per worker in advance."""
    if workers == 0:
        return (build(step) for step in steps)
    loader = torch.utils.data.DataLoader(
        _Steps(build, steps),
        batch_size=None,
        shuffle=False,
        num_workers=workers,
        prefetch_factor=ahead,
        collate_fn=_as_is,
        multiprocessing_context=multiprocessing.get_context("fork"),
        timeout=WORKER_TIMEOUT_S,
        worker_init_fn=functools.partial(_worker_init, os.getpid()),
        # on a GPU node, the batches arrive in page-locked memory (the loader's thread in this process
        # pins them, through the item's own `pin_memory`), so their copies to the GPU are asynchronous
        pin_memory=torch.cuda.is_available(),
    )
    # Started here, not at the first step: starting draws the workers' base seed from torch's global
    # generator, which each training step seeds for its dropout noise just before it takes its batches
    # (drawn there, the first step after a resume would differ from the uninterrupted run's).
    return _closing(iter(loader))


def _closing(batches) -> Iterator:
    try:
        yield from batches
    except (EOFError, ConnectionError) as err:
        # A worker that dies while the training process receives a batch from it (tensors travel as
        # file descriptors over a connection to the worker) ends the transfer with one of these instead
        # of torch's own "exited unexpectedly" error; say which process died, as torch does otherwise.
        dead = _dead_workers(batches)
        if not dead:
            raise
        raise RuntimeError(f"input pipeline: DataLoader worker {dead} exited unexpectedly") from err
    except RuntimeError as err:
        if "timed out" not in str(err):
            raise
        _report_stuck(batches)
        raise RuntimeError(
            f"input pipeline: no batch for {WORKER_TIMEOUT_S} s; the workers' stacks are in their stderr "
            "(the worker's log on a Ray node)"
        ) from err
    finally:
        # The worker processes are stopped here, when an error leaves the loader, and not by the
        # iterator's __del__: the error's traceback holds the iterator in a reference cycle, so __del__
        # would run at some later garbage collection, wherever that happens to start, and torch's
        # shutdown from there was seen to block forever on one of its queue locks (a test hung).
        # torch has no public close for a loader's iterator; a second call does nothing.
        batches._shutdown_workers()


def _report_stuck(batches) -> None:
    """Ask each live loader worker to print its threads' stacks, and give them a moment to."""
    for w in batches._workers:  # torch's list of the iterator's processes (no public accessor)
        if w.exitcode is None:
            os.kill(w.pid, STACKS_SIGNAL)
    time.sleep(1.0)


def _dead_workers(batches) -> str:
    """'(pid N, exit code C), ...' for each of the loader's worker processes that has ended."""
    dead = []
    for w in batches._workers:  # torch's list of the iterator's processes (no public accessor)
        w.join(timeout=1.0)  # the connection closes a moment before the process can be reaped
        if w.exitcode is not None:
            dead.append(f"(pid {w.pid}, exit code {w.exitcode})")
    return ", ".join(dead)
