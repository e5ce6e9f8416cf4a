"""The run's per-step metrics, kept beside its checkpoints as `raylora_metrics.jsonl`.

Ray Train V2 keeps only the metrics reported with checkpoints. This callback runs in Ray Train's
controller, sees every report, and writes rank 0's metrics, one JSON object per line, into the run
folder through the run's pyarrow filesystem (so it works on a shared folder and on s3:// alike).
`raylora plot` and the demo read it. A resumed run appends: steps redone after a restart appear
again, each row carrying the `restarts` count it was trained under.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import posixpath
import time

import pyarrow.fs
from ray.train import UserCallback

from raylora.reporting import rows
from raylora.storage import run_folder

METRICS_FILE = "raylora_metrics.jsonl"
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


def read_metrics(storage_path: str, name: str) -> list[dict]:
    """All rows of a run's metrics log ([] if it has none yet)."""
    fs, folder = run_folder(storage_path, name)
    path = posixpath.join(folder, METRICS_FILE)
    if fs.get_file_info(path).type != pyarrow.fs.FileType.File:
        return []
    with fs.open_input_stream(path) as f:
        return [json.loads(line) for line in f.read().decode().splitlines() if line.strip()]


def bad_rows_before(storage_path: str, name: str, step: int) -> int:
    """Bad rows of a run's steps 1..`step`, as its metrics log has them: where a resumed run's count of
    bad rows so far starts. A step redone after a restart counts once (its latest row)."""
    per_step = {
        r["step"]: r.get("bad_rows", 0) for r in read_metrics(storage_path, name) if r["step"] <= step
    }
    return int(sum(per_step.values()))


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

    @never_fatal
    def after_report(self, run_context, metrics, checkpoint) -> None:
        if self.rows is None:  # first report of this driver: keep what earlier drivers of the run wrote
            self.rows = read_metrics(self.storage_path, self.name)
        reported = rows(metrics[0]) if metrics else []
        for row in reported:
            self._count_redone(row)
            self.rows.append(row)
        self.unflushed += len(reported)
        last = reported and reported[-1].get("step") == reported[-1].get("max_steps")
        if checkpoint is not None or last or self.unflushed >= self.flush_every:
            self._write()

    @never_fatal
    def after_exception(self, run_context, worker_exceptions) -> None:
        if self.rows is not None:
            self._write()

    def _count_redone(self, row: dict) -> None:
        """On the first row of a restarted worker group, `steps_redone`: how far past the checkpoint it
        resumed from (the step before this row's) the run had got, as the rows that reached the driver show.

        Counted here because only the driver sees every report of every worker group; the workers know
        the step they restored, not the last one the group before them reached.
        """
        before = self.rows[-1] if self.rows else None
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
    `raylora_metrics.jsonl`. The driver's `WANDB_*` settings (mode, API key, folder) travel with the
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
