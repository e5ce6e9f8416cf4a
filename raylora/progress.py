"""The run's per-step metrics, kept beside its checkpoints in the folder `raylora_metrics/`.

Ray Train V2 keeps only the metrics reported with checkpoints. This callback runs in Ray Train's
controller, sees every report, and writes rank 0's metrics, one JSON object per line, into the run
folder through the run's pyarrow filesystem (so it works on a shared folder and on s3:// alike).
`raylora plot` (so the demo) and a resumed run's count of bad rows so far read it back in order
(`read_metrics`). A resumed run appends: steps redone after a restart appear again, each row
carrying the `restarts` count it was trained under.

The log is a folder of numbered segments, `raylora_metrics/00000000.jsonl`, `00000001.jsonl`, ...:
each holds the rows since the previous flush and is written once, in one `open_output_stream`, never
rewritten. So the bytes uploaded grow linearly with the rows (an object store has no append: a single
file would be uploaded whole at every flush, quadratic in the rows), and the controller holds only
the rows since its last flush. A resumed run's new driver lists the folder once, at its first report,
and numbers its segments after the ones there. A segment cut short by a crash mid-write (possible on a
local or NFS folder; an S3 object appears whole or not at all) ends in a partial line: readers drop it.

Runs logged by raylora before the segments have one `raylora_metrics.jsonl`, rewritten whole at each
flush. It is still read, before the segments, so such a run resumed by this raylora keeps its history.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import posixpath
import time
from concurrent.futures import ThreadPoolExecutor

import pyarrow.fs
from ray.train import UserCallback

from raylora.reporting import rows
from raylora.storage import run_folder

METRICS_DIR = "raylora_metrics"  # the log: numbered segments, each written once
METRICS_FILE = "raylora_metrics.jsonl"  # the whole-file log of runs made before the segments: read only
SEGMENT_DIGITS = 8  # zero-padded so that a listing sorts in write order (readers sort by number anyway)
READ_THREADS = 16  # segments fetched at once: on an object store each is one request of some 10 ms
log = logging.getLogger("raylora")


def never_fatal(method):
    """A metrics sink that fails must not fail training: Ray Train ends a run on any callback error."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as err:  # whatever the sink's library raises
            if not getattr(self, "_warned", False):
                log.warning("%s failed; training goes on without it: %s", type(self).__name__, err)
                self._warned = True

    return wrapper


def segment_name(index: int) -> str:
    """The file name of the log's segment number `index`."""
    return f"{index:0{SEGMENT_DIGITS}d}.jsonl"


def segments(fs: pyarrow.fs.FileSystem, folder: str) -> list[tuple[int, str]]:
    """(number, path) of every segment in run folder `folder`'s log, in write order."""
    selector = pyarrow.fs.FileSelector(posixpath.join(folder, METRICS_DIR), allow_not_found=True)
    found = []
    for info in fs.get_file_info(selector):
        stem, ext = posixpath.splitext(info.base_name)
        if info.type == pyarrow.fs.FileType.File and ext == ".jsonl" and stem.isdigit():
            found.append((int(stem), info.path))
    return sorted(found)


def parse_rows(data: bytes, where: str) -> list[dict]:
    """The rows of one log file. A last line without its newline that does not parse is a write cut
    short by a crash, and is dropped; any other line that does not parse is an error naming the file."""
    lines = data.split(b"\n")
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError as err:
            if number == len(lines):  # no newline after it: the write stopped inside this row
                log.warning("%s: its last line is cut short (a write interrupted); dropped", where)
                break
            raise ValueError(f"{where}: line {number} is not a JSON row: {err}") from err
    return out


def _read_file(fs: pyarrow.fs.FileSystem, path: str) -> list[dict]:
    with fs.open_input_stream(path) as f:
        return parse_rows(f.read(), path)


def _legacy(fs: pyarrow.fs.FileSystem, folder: str) -> str | None:
    path = posixpath.join(folder, METRICS_FILE)
    return path if fs.get_file_info(path).type == pyarrow.fs.FileType.File else None


def read_log(fs: pyarrow.fs.FileSystem, folder: str) -> list[dict]:
    """All rows of the log in run folder `folder` of `fs`, in the order they were written ([] if none)."""
    paths = [p for p in [_legacy(fs, folder)] if p] + [p for _, p in segments(fs, folder)]
    with ThreadPoolExecutor(max_workers=READ_THREADS) as pool:
        return [row for part in pool.map(lambda p: _read_file(fs, p), paths) for row in part]


def read_metrics(storage_path: str, name: str) -> list[dict]:
    """All rows of a run's metrics log, in the order they were written ([] if it has none yet)."""
    return read_log(*run_folder(storage_path, name))


def last_row(fs: pyarrow.fs.FileSystem, folder: str, found: list[tuple[int, str]]) -> dict | None:
    """The last row of the log whose segments are `found`: read from the newest segment back, so a
    resumed driver fetches one segment, not the whole log."""
    for _, path in reversed(found):
        if part := _read_file(fs, path):
            return part[-1]
    legacy = _legacy(fs, folder)
    part = _read_file(fs, legacy) if legacy else []
    return part[-1] if part else None


def bad_rows_before(storage_path: str, name: str, step: int) -> int:
    """Bad rows of a run's steps 1..`step`, as its metrics log has them: where a resumed run's count of
    bad rows so far starts. A step redone after a restart counts once (its latest row)."""
    per_step = {
        r["step"]: r.get("bad_rows", 0) for r in read_metrics(storage_path, name) if r["step"] <= step
    }
    return int(sum(per_step.values()))


class MetricsLog(UserCallback):
    """Collects rank 0's metrics from every report; writes the rows since the last flush as a new segment
    of the log every `flush_every` rows, at checkpoints, at the last step and when the run fails.

    Holds only those rows and the last one (for `steps_redone`), however long the run. While the storage
    refuses writes the rows wait here, a write is tried again every `flush_every` rows (not at every
    report), and they go out with the next segment that is written.
    """

    def __init__(self, storage_path: str, name: str, flush_every: int = 25):
        self.storage_path, self.name, self.flush_every = storage_path, name, flush_every
        self.pending: list[dict] = []  # the rows since the last segment written
        self.unflushed = 0  # rows since the last write tried
        self.last: dict | None = None  # the last row of the log (this driver's, or an earlier driver's)
        self.next_segment: int | None = None  # None until this driver's first report

    def _start(self) -> None:
        """At this driver's first report: number after the segments earlier drivers of the run wrote."""
        fs, folder = run_folder(self.storage_path, self.name)
        found = segments(fs, folder)
        self.last = last_row(fs, folder, found)
        # Once, not per segment: on an object store it is a request as slow as the segment's upload.
        fs.create_dir(posixpath.join(folder, METRICS_DIR), recursive=True)
        self.next_segment = found[-1][0] + 1 if found else 0

    def _flush(self) -> None:
        if not self.pending:
            return
        self.unflushed = 0
        fs, folder = run_folder(self.storage_path, self.name)
        data = "".join(json.dumps(r) + "\n" for r in self.pending).encode()
        # One stream per segment, never reopened: on an object store it is one upload of these rows only.
        path = posixpath.join(folder, METRICS_DIR, segment_name(self.next_segment))
        with fs.open_output_stream(path) as f:
            f.write(data)
        self.next_segment += 1
        self.pending = []

    @never_fatal
    def after_report(self, run_context, metrics, checkpoint) -> None:
        if self.next_segment is None:
            self._start()
        reported = rows(metrics[0]) if metrics else []
        for row in reported:
            self._count_redone(row)
            self.pending.append(row)
            self.last = row
        self.unflushed += len(reported)
        last = reported and reported[-1].get("step") == reported[-1].get("max_steps")
        if checkpoint is not None or last or self.unflushed >= self.flush_every:
            self._flush()

    @never_fatal
    def after_exception(self, run_context, worker_exceptions) -> None:
        if self.next_segment is not None:
            self._flush()

    def _count_redone(self, row: dict) -> None:
        """On the first row of a restarted worker group, `steps_redone`: how far past the checkpoint it
        resumed from (the step before this row's) the run had got, as the rows that reached the driver show.

        Counted here because only the driver sees every report of every worker group; the workers know
        the step they restored, not the last one the group before them reached.
        """
        before = self.last
        if before is None or row.get("restarts") == before.get("restarts"):
            return
        row["steps_redone"] = max(0, before["step"] - (row["step"] - 1))
        log.warning(
            "restart %s resumed at step %d, %d step(s) before the last step reached (%d)",
            row.get("restarts"),
            row["step"] - 1,
            row["steps_redone"],
            before["step"],
        )


def _scalars(row: dict) -> dict[str, float]:
    return {
        k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and k not in ("step", "wall_time")
    }


def _wall_time(row: dict) -> float:
    """When the row's step ended on its worker (rows of several steps reach the sinks together)."""
    return float(row.get("wall_time", time.time()))


class TensorBoardLog(UserCallback):
    """Rank 0's metrics as TensorBoard scalars, written with tensorboardX (as Ray's own TB logger does)."""

    def __init__(self, logdir: str):
        self.logdir = logdir
        self.writer = None

    @never_fatal
    def after_report(self, run_context, metrics, checkpoint) -> None:
        from tensorboardX import SummaryWriter

        reported = rows(metrics[0]) if metrics else []
        if not reported:
            return
        if self.writer is None:
            self.writer = SummaryWriter(self.logdir)
        for row in reported:
            for key, value in _scalars(row).items():
                self.writer.add_scalar(key, value, global_step=row["step"], walltime=_wall_time(row))
        if reported[-1].get("step") == reported[-1].get("max_steps"):
            self._close()  # flush() leaves queued events behind, lost when Ray ends the controller
        else:
            self.writer.flush()

    def _close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    @never_fatal
    def after_exception(self, run_context, worker_exceptions) -> None:
        self._close()


class MlflowLog(UserCallback):
    """Rank 0's metrics to an MLflow tracking server through MLflow's own client.

    One MLflow run per raylora run: a resumed raylora run finds its MLflow run by tag and goes on
    logging into it.
    """

    def __init__(self, tracking_uri: str, run_name: str, params: dict):
        self.tracking_uri, self.run_name, self.params = tracking_uri, run_name, params
        self.run_id: str | None = None

    def _client(self):
        from mlflow import MlflowClient

        return MlflowClient(self.tracking_uri)

    def _ensure_run(self) -> str:
        if self.run_id is None:
            client = self._client()
            experiment = client.get_experiment_by_name("raylora")
            experiment_id = experiment.experiment_id if experiment else client.create_experiment("raylora")
            found = client.search_runs([experiment_id], filter_string=f"tags.raylora_run = '{self.run_name}'")
            if found:
                self.run_id = found[0].info.run_id
            else:
                run = client.create_run(
                    experiment_id, run_name=self.run_name, tags={"raylora_run": self.run_name}
                )
                self.run_id = run.info.run_id
                for key, value in self.params.items():
                    client.log_param(self.run_id, key, str(value)[:500])
        return self.run_id

    @never_fatal
    def after_report(self, run_context, metrics, checkpoint) -> None:
        from mlflow.entities import Metric

        reported = rows(metrics[0]) if metrics else []
        if not reported:
            return
        batch = [
            Metric(k, v, int(_wall_time(row) * 1000), int(row["step"]))
            for row in reported
            for k, v in _scalars(row).items()
        ]
        for i in range(0, len(batch), 1000):  # MLflow refuses more than 1000 metrics per batch
            self._client().log_batch(self._ensure_run(), metrics=batch[i : i + 1000])


class WandbLog(UserCallback):
    """Rank 0's metrics to Weights & Biases through its own client.

    One W&B run per raylora run, its id derived from the run name, so a resumed raylora run goes on
    logging into the same W&B run. raylora's `step` is the x axis (`define_metric`), not W&B's own
    step counter, which must only grow: after a restart the redone steps are logged again, as in
    the run folder's metrics log. The driver's `WANDB_*` settings (mode, API key, folder) travel with the
    callback, because it runs in Ray Train's controller, another process.
    """

    def __init__(self, project: str, run_name: str, params: dict):
        self.project, self.run_name, self.params = project, run_name, params
        self.env = {k: v for k, v in os.environ.items() if k.startswith("WANDB_")}
        self.run = None

    def _ensure_run(self):
        if self.run is None:
            import wandb

            os.environ.update(self.env)
            run_id = hashlib.sha256(f"raylora:{self.project}:{self.run_name}".encode()).hexdigest()[:16]
            self.run = wandb.init(
                project=self.project, name=self.run_name, id=run_id, resume="allow", config=self.params
            )
            self.run.define_metric("step")
            self.run.define_metric("*", step_metric="step")
        return self.run

    @never_fatal
    def after_report(self, run_context, metrics, checkpoint) -> None:
        reported = rows(metrics[0]) if metrics else []
        if not reported:
            return
        for row in reported:
            self._ensure_run().log({"step": int(row["step"]), **_scalars(row)})
        if reported[-1].get("step") == reported[-1].get("max_steps"):
            self.run.finish()
            self.run = None

    @never_fatal
    def after_exception(self, run_context, worker_exceptions) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1)
            self.run = None
