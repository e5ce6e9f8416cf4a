"""The background input pipeline: the same items in the same order as inline, errors surface."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from raylora.config import ConfigError
from raylora.data import pipeline
from raylora.data.pipeline import step_inputs


def build(step: int) -> dict:
    return {"step": step, "x": torch.full((2, 3), float(step)), "pid": os.getpid()}


def test_background_equals_inline_in_step_order():
    inline = list(step_inputs(build, range(5, 12), workers=0))
    background = list(step_inputs(build, range(5, 12), workers=2))
    assert [b["step"] for b in background] == list(range(5, 12))
    for a, b in zip(inline, background, strict=True):
        assert torch.equal(a["x"], b["x"])
    assert {b["pid"] for b in background}.isdisjoint({os.getpid()})  # built in other processes


def failing(step: int) -> dict:
    if step == 3:
        raise ConfigError("data.train: row 17: image does not decode")
    return build(step)


def test_error_in_a_worker_keeps_its_type_and_message():
    got = []
    with pytest.raises(ConfigError, match="row 17: image does not decode"):
        for item in step_inputs(failing, range(6), workers=2):
            got.append(item["step"])
    assert got == [0, 1, 2]


def dying(step: int) -> dict:
    if step == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return build(step)


def test_a_worker_that_dies_raises_instead_of_hanging():
    with pytest.raises(RuntimeError, match="DataLoader worker"):
        list(step_inputs(dying, range(6), workers=1))


def stuck(step: int) -> dict:
    if step == 1:
        threading.Event().wait()  # a decoder that never returns
    return build(step)


def test_a_stuck_worker_raises_and_prints_where_it_is_stuck(monkeypatch, capfd):
    """A worker that produces nothing for WORKER_TIMEOUT_S: the training process raises, and the worker's
    stacks, down to the line it waits in, are in its stderr (a Ray worker's log)."""
    monkeypatch.setattr(pipeline, "WORKER_TIMEOUT_S", 3)
    got = []
    with pytest.raises(RuntimeError, match="input pipeline: no batch for 3 s"):
        for item in step_inputs(stuck, range(4), workers=1):
            got.append(item["step"])
    assert got == [0]
    err = capfd.readouterr().err
    assert "Current thread" in err and "in stuck" in err, err[-2000:]


class _Trainer:
    """A Ray actor that trains as a Ray Train worker does, with the pipeline's processes beside it."""

    def start(self) -> tuple[int, int]:
        self.batches = step_inputs(build, range(100), workers=1)
        return next(self.batches)["pid"], os.getpid()

    def crash(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.distributed
def test_workers_die_with_the_training_process(ray_cluster):
    """A Ray worker that crashes takes its loader worker with it at once. A loader worker that lived on
    would hold the crashed process's connection to Ray open (Ray would see the crash, and restart the
    run, only when torch's own check of the parent ends the loader worker, ~5 s later)."""
    import time

    import psutil

    trainer = ray_cluster.remote(num_cpus=1)(_Trainer).remote()
    loader_worker, actor = ray_cluster.get(trainer.start.remote())
    assert loader_worker != actor
    trainer.crash.remote()
    deadline = time.monotonic() + 2.0

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    while alive(actor) or alive(loader_worker):
        assert time.monotonic() < deadline, "the loader worker outlived the crashed training process"
        time.sleep(0.02)
