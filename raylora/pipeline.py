"""The input pipeline beside training: the next steps' micro batches are built in worker processes while
the current step computes.

What a step trains on is a function of the step number alone (the global sampler), so the pipeline is a
torch `DataLoader` over step numbers: worker processes call the same `build(step)` the inline path calls,
in step order, and an exact resume is unchanged (it starts the loader at the restored step). Collectives
(the step's skipped-sample and token counts) stay in the training process: a loader worker has no
process group.

The workers are forked: a forked worker shares the processor, the data reader and its caches with the
training process instead of pickling them, and builds batches on the CPU only (it never touches CUDA,
which a forked child must not). An exception in a worker is re-raised in the training process by
the DataLoader with its original type (a bad row with `data.on_bad_row: error` stays a permanent
error); a worker that dies (killed, out of memory) raises instead of leaving the step waiting.
"""

from __future__ import annotations

import multiprocessing
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
    )
    return iter(loader)
