"""The run's per-step metrics, kept beside its checkpoints as `raylora_metrics.jsonl`.

Ray Train V2 keeps only the metrics reported with checkpoints. This callback runs in Ray Train's
controller, sees every report, and writes rank 0's metrics, one JSON object per line, into the run
folder through the run's pyarrow filesystem (so it works on a shared folder and on s3:// alike).
`raylora plot` and the demo read it. A resumed run appends: steps redone after a restart appear
again, each row carrying the `restarts` count it was trained under.
"""

from __future__ import annotations

import json
import posixpath

import pyarrow.fs
from ray.train import UserCallback

METRICS_FILE = "raylora_metrics.jsonl"


def run_folder(storage_path: str, name: str) -> tuple[pyarrow.fs.FileSystem, str]:
    """The filesystem and path of a run's folder, for a local path or a URI."""
    if "://" in storage_path:
        fs, root = pyarrow.fs.FileSystem.from_uri(storage_path)
    else:
        fs, root = pyarrow.fs.LocalFileSystem(), storage_path
    return fs, posixpath.join(root, name)


def read_metrics(storage_path: str, name: str) -> list[dict]:
    """All rows of a run's metrics log ([] if it has none yet)."""
    fs, folder = run_folder(storage_path, name)
    path = posixpath.join(folder, METRICS_FILE)
    if fs.get_file_info(path).type != pyarrow.fs.FileType.File:
        return []
    with fs.open_input_stream(path) as f:
        return [json.loads(line) for line in f.read().decode().splitlines() if line.strip()]


class MetricsLog(UserCallback):
    """Collects rank 0's metrics from every report and rewrites the log at checkpoints and at the end."""

    def __init__(self, storage_path: str, name: str, flush_every: int = 25):
        self.storage_path, self.name, self.flush_every = storage_path, name, flush_every
        self.rows: list[dict] | None = None
        self.unflushed = 0

    def _write(self) -> None:
        fs, folder = run_folder(self.storage_path, self.name)
        fs.create_dir(folder, recursive=True)
        data = "".join(json.dumps(r) + "\n" for r in self.rows or [])
        with fs.open_output_stream(posixpath.join(folder, METRICS_FILE)) as f:
            f.write(data.encode())
        self.unflushed = 0

    def after_report(self, run_context, metrics, checkpoint) -> None:
        if self.rows is None:  # first report of this driver: keep what earlier drivers of the run wrote
            self.rows = read_metrics(self.storage_path, self.name)
        if metrics and metrics[0]:
            self.rows.append(dict(metrics[0]))
            self.unflushed += 1
        last = metrics and metrics[0] and metrics[0].get("step") == metrics[0].get("max_steps")
        if checkpoint is not None or last or self.unflushed >= self.flush_every:
            self._write()

    def after_exception(self, run_context, worker_exceptions) -> None:
        if self.rows is not None:
            self._write()


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
