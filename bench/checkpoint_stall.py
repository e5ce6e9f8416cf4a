"""The training stall per checkpoint, synchronous against asynchronous upload (2 Ray workers, ZeRO-3, CPU).

Each rank runs raylora's own step and save (`worker.train_step`, `worker.save_checkpoint`) and reports
the checkpoint to Ray Train as `worker.train_loop_per_worker` does, with `run.checkpoint_upload` sync or
async. The stall of a checkpoint step is the time from the end of its training step to the return of
`ray.train.report` on rank 0 (the other ranks wait for rank 0 in the next step's collectives): the
gather and the write (the same in both modes), and in sync mode the upload into the run's storage.
The step after a checkpoint is timed too: an asynchronous upload shares the CPUs with it.

`--storage URI`: the run's storage is that folder or bucket (`s3://bucket/path`, `gs://...`), reached
as raylora reaches `run.storage_path` (pyarrow, with the endpoint and credentials of this process's
environment, which the local Ray's workers inherit), so the synchronous upload is an object-store upload
as on a cluster; written to `checkpoint_stall_s3.json`. bench/README.md says how its figure was made
against a local S3 endpoint.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import common

MODES = ("sync", "async")


def probe(cfg, mode: str, steps: int, every: int) -> list[dict]:
    import ray.train
    import torch.distributed as dist

    from raylora import worker

    s = worker.setup(cfg, None)
    rows = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        worker.train_step(s)
        trained = time.perf_counter()
        ckpt = worker.save_checkpoint(s) if s.step % every == 0 else None
        saved = time.perf_counter()
        ray.train.report(
            {"step": s.step},
            checkpoint=ckpt,
            checkpoint_upload_mode=worker.UPLOAD_MODES[mode],
            delete_local_checkpoint_after_upload=True,
        )
        rows.append(
            {
                "step": s.step,
                "checkpoint": s.step % every == 0,
                "train_s": trained - start,
                "save_s": saved - trained,
                "stall_s": time.perf_counter() - trained,
            }
        )
    return rows if s.rank == 0 else []


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument(
        "--storage", default=None, help="the run's storage: a folder or s3://... (default: under --work)"
    )
    args = p.parse_args()
    work = Path(args.work) / "checkpoint_stall"
    shutil.rmtree(work, ignore_errors=True)
    width, layers = (64, 2) if args.tiny else (256, 4)
    steps, every = (5, 3) if args.tiny else (3 * common.repeats(args, 3) + 1, 3)
    data = common.digits(args.work)
    model = common.tiny_model(args.work, width, layers)
    rows = {}
    storage = (args.storage or str(work / "ray")).rstrip("/")
    remote = "://" in storage
    with common.local_ray():
        for mode in MODES:
            cfg = common.run_config(model, data, storage, mode, f"run.checkpoint_upload={mode}")
            rows[mode] = common.on_workers(
                lambda cfg=cfg, mode=mode: probe(cfg, mode, steps, every), storage, mode
            )
    size = _last_checkpoint_bytes(storage + "/async")
    figures = {}
    for mode, r in rows.items():
        # the first step warms up; a step right after a checkpoint shares the CPUs with its upload
        plain = [
            x["train_s"] for i, x in enumerate(r) if i and not (x["checkpoint"] or r[i - 1]["checkpoint"])
        ]
        after = [x["train_s"] for i, x in enumerate(r) if i and r[i - 1]["checkpoint"]]
        stalls = [x["stall_s"] for x in r if x["checkpoint"]]
        figures[mode] = {
            "stall_per_checkpoint_s": common.summary(stalls),
            "gather_and_write_s": common.summary([x["save_s"] for x in r if x["checkpoint"]]),
            "step_s": common.summary(plain),
            "step_after_checkpoint_s": common.summary(after) if after else None,
            "stall_over_step": common.median(stalls) / common.median(plain),
        }
    saved = (
        figures["sync"]["stall_per_checkpoint_s"]["median"]
        - figures["async"]["stall_per_checkpoint_s"]["median"]
    )
    common.write_result(
        args,
        "checkpoint_stall_s3" if remote else "checkpoint_stall",
        {
            "setup": {
                "model": f"tiny llava, width {width}, {layers} layers; LoRA r=4 on every linear layer of the "
                "language model, vision tower and aligner trained",
                "workers": 2,
                "steps": steps,
                "checkpoint_every": every,
                "checkpoint_bytes": size,
                "storage": storage if remote else "local disk (under --work)",
            },
            "modes": figures,
            "raw": rows,
            "goal": {
                "text": "an asynchronous upload stalls training less per checkpoint than a synchronous one",
                "sync_minus_async_stall_s": saved,
                "met": saved > 0,
            },
            "notes": [
                "stall = end of the checkpoint step's training to the return of ray.train.report on rank 0; "
                "gather_and_write = zero.stream_trainable_state + checkpoint.Writer (both modes).",
                "On the local disk the synchronous upload is a file copy; to a bucket it is an upload "
                "that lasts checkpoint bytes / bandwidth more, which async takes off the step.",
                "step_after_checkpoint: the step that runs while the asynchronous upload is in flight.",
            ],
        },
    )
    print(json.dumps(figures, indent=1))


def _last_checkpoint_bytes(run_dir: str) -> int | None:
    """Bytes of the run's last checkpoint folder, on the local disk or in the bucket."""
    import pyarrow.fs

    from raylora.storage import filesystem

    fs, root = filesystem(run_dir)
    infos = fs.get_file_info(pyarrow.fs.FileSelector(root, recursive=True))
    files = [(i.path[len(root) :].lstrip("/"), i.size) for i in infos if i.type == pyarrow.fs.FileType.File]
    # Ray names the folders checkpoint_<date and time>: in order
    folders = sorted({rel.split("/")[0] for rel, _ in files if rel.startswith("checkpoint_") and "/" in rel})
    if not folders:
        return None
    return sum(size for rel, size in files if rel.startswith(folders[-1] + "/"))


if __name__ == "__main__":
    main()
