"""Bytes uploaded for the metrics log at 1k and 10k steps on a real S3 endpoint: segments against rewrites.

1. segments (raylora now): `progress.MetricsLog`, which writes the rows since its last flush as a new
   object `raylora_metrics/NNNNNNNN.jsonl`, each written once.
2. rewrite (raylora before): the same callback as it was, which kept every row and wrote the whole
   `raylora_metrics.jsonl` again at every flush (`RewriteWholeLog` below, its logic unchanged).

Both run in this process against moto's S3 server on 127.0.0.1 (tests.support.S3Server), through
pyarrow's S3 client, fed the same reports: one step per report (steps slower than `run.report_every_s`,
as a 7B model's are), a checkpoint every 250 steps (jobs/*-7b.yaml), a flush every 25 rows (the
callback's default), rows with a real run's keys. Bytes uploaded are counted on every output stream the
callback opens (each one a PUT or multipart upload of what was written to it) and checked against what
the bucket holds afterwards. No Ray, no training: only the callback's writes are measured.
"""

from __future__ import annotations

import json
import os
import pickle
import posixpath
import time

import common
import pyarrow.fs

from tests.support import CountingFileSystem, S3Server
from tests.support import metrics_row as row

CHECKPOINT_EVERY = 250


class RewriteWholeLog:
    """raylora's MetricsLog before the segments: every row in memory, the whole file rewritten at each
    flush (checkpoints, the last step, every `flush_every` rows)."""

    def __init__(self, storage_path: str, name: str, flush_every: int = 25):
        self.storage_path, self.name, self.flush_every = storage_path, name, flush_every
        self.rows: list[dict] | None = None
        self.unflushed = 0

    def _write(self) -> None:
        from raylora import progress

        fs, folder = progress.run_folder(self.storage_path, self.name)
        fs.create_dir(folder, recursive=True)
        data = "".join(json.dumps(r) + "\n" for r in self.rows or [])
        with fs.open_output_stream(posixpath.join(folder, progress.METRICS_FILE)) as f:
            f.write(data.encode())
        self.unflushed = 0

    def after_report(self, run_context, metrics, checkpoint) -> None:
        from raylora.progress import read_metrics
        from raylora.reporting import rows

        if self.rows is None:
            self.rows = read_metrics(self.storage_path, self.name)
        reported = rows(metrics[0]) if metrics else []
        self.rows.extend(reported)
        self.unflushed += len(reported)
        last = reported and reported[-1].get("step") == reported[-1].get("max_steps")
        if checkpoint is not None or last or self.unflushed >= self.flush_every:
            self._write()


def measure(layout: str, steps: int, storage: str, fs) -> dict:
    """Feed `steps` reports to the layout's callback; what it uploaded, what it holds, how long it took."""
    from raylora import progress
    from raylora import storage as raylora_storage

    opened: list[CountingFileSystem] = []

    def counted(storage_path, name):
        got, folder = raylora_storage.run_folder(storage_path, name)
        opened.append(CountingFileSystem(got))
        return opened[-1], folder

    name = f"{layout}-{steps}"
    callback = (progress.MetricsLog if layout == "segments" else RewriteWholeLog)(storage, name)
    real, progress.run_folder = progress.run_folder, counted
    held = 0
    try:
        started = time.perf_counter()
        for step in range(1, steps + 1):
            callback.after_report(
                None, [row(step, steps)], object() if step % CHECKPOINT_EVERY == 0 else None
            )
            held = max(held, len(callback.pending) if layout == "segments" else len(callback.rows))
        seconds = time.perf_counter() - started
    finally:
        progress.run_folder = real
    _, root = raylora_storage.filesystem(storage)
    listing = fs.get_file_info(pyarrow.fs.FileSelector(posixpath.join(root, name), recursive=True))
    stored = [f for f in listing if f.type == pyarrow.fs.FileType.File]
    started = time.perf_counter()
    rows = progress.read_metrics(storage, name)
    read_seconds = time.perf_counter() - started
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), layout
    uploaded = sum(c.bytes for c in opened)
    if layout == "segments":  # each byte uploaded once: the bucket holds exactly what went up
        assert uploaded == sum(f.size for f in stored), (uploaded, [f.size for f in stored])
    return {
        "bytes_uploaded": uploaded,
        "uploads": sum(c.streams for c in opened),
        "bytes_stored": sum(f.size for f in stored),
        "objects_stored": len(stored),
        "rows_held_at_most": held,
        "callback_pickled_bytes_at_end": len(pickle.dumps(callback)),
        "seconds": seconds,
        "read_back_seconds": read_seconds,
    }


def main() -> None:
    from raylora import progress

    args = common.parser(__doc__).parse_args()
    reps = common.repeats(args, 1)  # bytes are exact; the seconds are noted, not the goal
    sizes = (100, 1000) if args.tiny else (1000, 10000)
    server = S3Server()
    saved = {k: os.environ.get(k) for k in server.env}
    os.environ.update(server.env)  # pyarrow's S3 client (FileSystem.from_uri) reads the endpoint from it
    try:
        fs = server.fs()
        figures: dict = {}
        for layout in ("segments", "rewrite"):
            for steps in sizes:
                samples = [measure(layout, steps, server.uri(f"rep{rep}"), fs) for rep in range(reps)]
                figures.setdefault(layout, {})[str(steps)] = {
                    key: common.summary([s[key] for s in samples]) for key in samples[0]
                }
                got = figures[layout][str(steps)]
                print(
                    f"{layout:>8} {steps:>6} steps: {got['bytes_uploaded']['median']:>13,.0f} bytes in "
                    f"{got['uploads']['median']:.0f} uploads, {got['seconds']['median']:.1f} s",
                    flush=True,
                )
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    small, large = (str(s) for s in sizes)

    def ratio(layout: str, key: str) -> float:
        return figures[layout][large][key]["median"] / figures[layout][small][key]["median"]

    ratios = {
        layout: {
            f"bytes_uploaded_{large}_over_{small}": ratio(layout, "bytes_uploaded"),
            f"uploads_{large}_over_{small}": ratio(layout, "uploads"),
            f"rows_held_{large}_over_{small}": ratio(layout, "rows_held_at_most"),
        }
        for layout in figures
    }
    row_bytes = figures["segments"][large]["bytes_uploaded"]["median"] / int(large)
    flushes = 100_000 // 25
    on_paper = {
        "steps": 100_000,
        "row_bytes": row_bytes,
        "segments_bytes": 100_000 * row_bytes,
        "segments_objects": flushes,
        # flush k (every 25 rows) rewrites the first 25 k rows: 25 x row x (1 + ... + 4000)
        "rewrite_bytes": 25 * row_bytes * flushes * (flushes + 1) / 2,
    }
    grow = ratio("segments", "bytes_uploaded")
    met = 0.9 * int(large) / int(small) < grow < 1.1 * int(large) / int(small)
    met = met and figures["segments"][large]["rows_held_at_most"]["median"] <= 25
    common.write_result(
        args,
        "metrics_log",
        {
            "goal": {
                "text": f"bytes uploaded for the metrics grow linearly in the steps ({large}/{small} steps: "
                "about the same ratio in bytes), and the callback holds at most flush_every (25) rows",
                "met": bool(met),
            },
            "layouts": figures,
            "ratios": ratios,
            "on_paper_100k_steps": on_paper,
            "notes": [
                "bytes_uploaded: bytes written to every output stream the callback opened on the S3 "
                "filesystem (one upload each); bytes_stored: what the bucket holds at the end",
                f"one step per report, a checkpoint every {CHECKPOINT_EVERY} steps, a flush every 25 rows; "
                "rows as tests.test_metrics_log.row makes them (a real run's keys, about 330 bytes)",
                "rewrite is the callback before the segments (RewriteWholeLog), run against the same server",
                "read_back_seconds: progress.read_metrics of the whole log (the segments: one GET each, "
                f"{progress.READ_THREADS} at a time) from moto on 127.0.0.1: no real network latency",
                "on_paper_100k_steps: the same arithmetic at 100k steps, from the measured bytes per row",
            ],
        },
    )


if __name__ == "__main__":
    main()
