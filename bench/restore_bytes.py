"""Bytes read and peak memory per rank while restoring a checkpoint, at 1, 2 and 4 workers (ZeRO-3, CPU).

Each rank opens the checkpoint for ranged reads (`checkpoint.Ranges`; rank 0 also hashes every file
against the manifest, streamed) and reads only its own slices of the partitioned tensors' masters and
Adam moments (`zero.partition_load`, `zero.set_trainable_state`), as a resumed run does. The checkpoint
is a real run's (`raylora.driver.run`, one step).

The restore goes into an engine built once per rank before the measurement, so the model's memory is
not counted: the figures are what the restore itself reads and allocates. Bytes read come from
the kernel (`/proc/self/io` rchar: every byte read by the process, page cache included); peak memory is
the highest resident set size sampled every millisecond during the restore, less the size before it.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import common

WORKERS = (1, 2, 4)
# Large allocations always mmapped, so memory a restore frees goes back to the OS and the next measurement
# starts from where the engine alone stands (glibc reads it as the worker process starts).
MMAPPED = {"MALLOC_MMAP_THRESHOLD_": str(1 << 16)}


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def _rss(sampled: list[int] | None = None) -> int:
    text = Path("/proc/self/status").read_text()
    if sampled is not None:
        sampled[0] += len(text.encode())  # the sampler's own reads, taken out of rchar
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _measured(fn) -> dict:
    """Bytes read (by read calls), peak RSS above the start, and seconds of `fn()` on this rank."""
    import gc

    gc.collect()
    base, peak, done, sampled = _rss(), [0], threading.Event(), [0]

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss(sampled))
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    read, start = _rchar(), time.perf_counter()
    sampler.start()
    try:
        extra = fn()
    finally:
        done.set()
        sampler.join()
    seconds = time.perf_counter() - start
    return {
        "read_call_bytes": _rchar() - read - sampled[0],
        "peak_rss_above_start": max(peak[0], _rss()) - base,
        "seconds": seconds,
        **(extra or {}),
    }


def probe(cfg, folder: str, reps: int) -> list[dict]:
    """Each rank restores `folder` into one engine `reps` times; every rank's figures."""
    import torch.distributed as dist

    from raylora import checkpoint, worker, zero

    s = worker.setup(cfg, None)
    rank = s.rank
    files = sum(p.stat().st_size for p in Path(folder).iterdir())
    rows = []
    for _ in range(reps):
        dist.barrier()

        def restore():
            source = checkpoint.Ranges(folder, hashes=rank == 0)  # as resume.restore_agreed opens it
            zero.partition_load(s.params, source)
            zero.set_trainable_state(s.engine, s.params, source, source.state.step)
            source.close()  # hashed every file on rank 0 only, then read its slices
            return {"bytes_read": source.bytes_read + (files if rank == 0 else 0)}

        rows.append({"rank": rank, **_measured(restore)})
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"rows": rows})
    return everyone if rank == 0 else []


def main() -> None:
    args = common.parser(__doc__).parse_args()
    reps = common.repeats(args, 3)
    work = Path(args.work) / "restore_bytes"
    shutil.rmtree(work, ignore_errors=True)
    width, layers = (64, 2) if args.tiny else (256, 4)
    data = common.digits(args.work)
    model = common.tiny_model(args.work, width, layers)
    folder = str(work / "checkpoint")
    with common.local_ray():
        from raylora.driver import run

        made = run(common.run_config(model, data, work / "ray", "make", "train.max_steps=1"))
        assert made.error is None, made.error
        shutil.copytree(made.checkpoint.path, folder)
        sizes = {p.name: p.stat().st_size for p in Path(folder).iterdir()}
        figures = {}
        for n in WORKERS:
            cfg_n = common.run_config(
                model, data, work / "ray", f"w{n}", common.NO_CHECKPOINTS, f"scaling.num_workers={n}"
            )
            measure = lambda cfg_n=cfg_n: probe(cfg_n, folder, reps)  # noqa: E731
            figures[n] = common.on_workers(measure, work / "ray", f"w{n}", num_workers=n, env=MMAPPED)

    total = sum(sizes.values())
    rows = []
    for n, ranks in figures.items():
        per_rank = []
        for r in ranks:
            mine = r["rows"]
            per_rank.append(
                {
                    "rank": mine[0]["rank"],
                    "bytes_read": common.summary([x["bytes_read"] for x in mine]),
                    "read_call_bytes": common.summary([x["read_call_bytes"] for x in mine]),
                    "peak_rss_above_start": common.summary([x["peak_rss_above_start"] for x in mine]),
                    "seconds": common.summary([x["seconds"] for x in mine]),
                }
            )
        rows.append(
            {
                "workers": n,
                "per_rank": per_rank,
                "rank0_bytes_read_mib": per_rank[0]["bytes_read"]["median"] / 2**20,
                "other_ranks_max_bytes_read_mib": max(
                    [p["bytes_read"]["median"] for p in per_rank[1:]], default=0
                )
                / 2**20,
                "max_peak_rss_above_start_mib": max(p["peak_rss_above_start"]["median"] for p in per_rank)
                / 2**20,
            }
        )
    table = {r["workers"]: r for r in rows}
    others = [table[n]["other_ranks_max_bytes_read_mib"] for n in (2, 4)]
    met = others[1] < others[0] < table[1]["rank0_bytes_read_mib"]
    common.write_result(
        args,
        "restore_bytes",
        {
            "setup": {
                "model": f"tiny llava, width {width}, {layers} layers; LoRA r=4 on every linear layer of the "
                "language model, vision tower and aligner trained and partitioned (persistence threshold 0)",
                "checkpoint_bytes": total,
                "checkpoint_files": sizes,
                "workers": list(WORKERS),
                "repeats": reps,
            },
            "rows": rows,
            "goal": {
                "text": "bytes read per rank (other than rank 0, which also hashes every file) shrink "
                "with the number of workers",
                "met": met,
            },
            "notes": [
                "bytes_read: bytes of the checkpoint the rank reads: Ranges counts its ranged reads (headers "
                "included), plus every file for the hash on rank 0. read_call_bytes cross-checks from the "
                "kernel (/proc/self/io rchar less the memory sampler's own reads).",
                "Rank 0's ranged figure includes hashing every file against the manifest (streamed, 1 MiB "
                "at a time): the bytes, not the memory. The other ranks check sizes and headers only.",
                "The probe restores into an engine already built, where LoRA tensors are partitioned too. In "
                "training they are plain tensors before deepspeed.initialize: rank 0 alone reads them whole "
                "(initialize broadcasts rank 0's values), 4 bytes per LoRA parameter more for rank 0.",
                "peak_rss_above_start: VmRSS sampled every ms during the restore, less VmRSS before it, with "
                "MALLOC_MMAP_THRESHOLD_=64 KiB so freed tensors leave the resident set.",
            ],
        },
    )
    print(json.dumps([{k: v for k, v in r.items() if k != "per_rank"} for r in rows], indent=1))


if __name__ == "__main__":
    main()
