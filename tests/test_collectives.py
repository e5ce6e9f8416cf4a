"""The collectives a save and a restore cost under ZeRO-3, as counts that do not move.

A save gathers the trainable state in a fixed number of collectives whatever the number of trainable
tensors (`zero.gather_trainable_state`: a gather per flat fp32 group carries masters and moments), and a
restore adds none to a fresh start (each rank writes its own slices of the partitions, masters and
moments). Counted on 2 Ray workers with `bench/common.py`'s `CollectiveCounter` (every torch.distributed
and deepspeed.comm collective, each call once), on the same tiny runs with LoRA on one and on every
linear layer. bench/save_collectives.py and bench/restore_collectives.py report the same counts beside
the other ways' and the seconds.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from tests.support import tiny_run_config

BENCH = str(Path(__file__).resolve().parent.parent / "bench")


def _count(cfgs: dict, folder: str) -> dict:
    """On every rank: for each config, the collectives of a save's gather, and of a start from scratch
    and a start restored from that save; rank 0's counts (the other rank makes the same calls)."""
    import torch.distributed as dist

    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    import common

    from raylora import checkpoint, worker, zero

    def ranges(path: str):  # as a resumed run opens its checkpoint: rank 0 checks the files' hashes
        return checkpoint.Ranges(path, hashes=dist.get_rank() == 0)

    counter, installed = common.CollectiveCounter(), False
    out = {}
    try:
        for name, cfg in cfgs.items():
            s = worker.setup(cfg, None)
            worker.train_step(s)
            if not installed:  # after DeepSpeed's comm backend exists, so that its captured calls count
                counter.install()
                installed = True
            with counter.counting():
                zero.gather_trainable_state(s.engine, s.params)
            save = counter.total
            ckpt = worker.save_checkpoint(s)
            path = f"{folder}/{name}"
            if s.rank == 0:
                shutil.move(ckpt.path, path)
            dist.barrier()
            tensors = len(s.params)
            s.engine.destroy()
            del s
            starts = {}
            for start, source in (("fresh", lambda: None), ("restored", lambda path=path: ranges(path))):
                with counter.counting():
                    s = worker.setup(cfg, source())
                starts[start] = counter.total
                s.engine.destroy()
                del s
            out[name] = {"trainable_tensors": tensors, "save": save, **starts}
    finally:
        counter.uninstall()  # the worker group serves other tests' probes next
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_save_and_restore_collectives_do_not_grow_with_the_tensors(
    ray_cluster, probes, tiny_models, digits, tmp_path
):
    model = tiny_models("llava")

    def cfg(name: str, *overrides: str):
        return tiny_run_config(
            model, digits[0], tmp_path / "ray", name, "train.checkpoint_every=1000", *overrides
        )

    cfgs = {"q_proj": cfg("q_proj", "lora.target_modules=[q_proj]"), "every_linear": cfg("every_linear")}
    folder = str(tmp_path / "checkpoints")
    Path(folder).mkdir()
    counts = probes(lambda: _count(cfgs, folder))
    few, many = counts["q_proj"], counts["every_linear"]
    assert few["trainable_tensors"] < many["trainable_tensors"], counts
    # a save: the same few gathers whatever the number of tensors
    assert few["save"] == many["save"] == 2, counts
    # a restore: no collective beyond those of a start from scratch (which makes some: the counter sees it)
    for name, c in counts.items():
        assert c["restored"] == c["fresh"] > 0, (name, c)
