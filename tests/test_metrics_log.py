"""The metrics log: numbered segments written once each, read back in order; upload bytes linear in
the rows, the callback's memory flat; a resumed driver numbers after the segments there; a segment cut
short by a crash, and the single-file log of older runs, still read."""

from __future__ import annotations

import json
import pickle

import pyarrow.fs
import pytest

from raylora import progress, storage
from raylora.progress import (
    METRICS_DIR,
    METRICS_FILE,
    MetricsLog,
    bad_rows_before,
    read_metrics,
    segment_name,
)
from raylora.reporting import EARLIER_ROWS
from tests.run_logs import metrics_row as row
from tests.s3_server import CountingFileSystem


def counting(monkeypatch) -> list[CountingFileSystem]:
    """Every filesystem MetricsLog gets from `run_folder` from now on, wrapped in a counter."""
    made: list[CountingFileSystem] = []

    def wrapped(storage_path, name):
        fs, folder = storage.run_folder(storage_path, name)
        made.append(CountingFileSystem(fs))
        return made[-1], folder

    monkeypatch.setattr(progress, "run_folder", wrapped)
    return made


def report(log: MetricsLog, reported: list[dict], checkpoint: bool = False) -> None:
    """One `ray.train.report` as Ray Train hands it to the callback: rank 0's metrics (its last row,
    the earlier ones packed under EARLIER_ROWS), and a checkpoint or None."""
    *earlier, last = reported
    metrics = {**last, EARLIER_ROWS: earlier} if earlier else dict(last)
    log.after_report(None, [metrics, {}], object() if checkpoint else None)


def train(log: MetricsLog, steps: range, max_steps: int, restarts: int = 0, every: int = 250) -> int:
    """Report each step alone (steps slower than run.report_every_s), a checkpoint every `every` steps;
    returns the most rows the callback held at once."""
    held = 0
    for step in steps:
        report(log, [row(step, max_steps, restarts)], checkpoint=step % every == 0)
        held = max(held, len(log.pending))
    return held


def test_bytes_written_grow_linearly_and_memory_stays_flat(tmp_path, monkeypatch):
    written, held, size = {}, {}, {}
    for n in (1000, 10000):
        made = counting(monkeypatch)
        log = MetricsLog(str(tmp_path), f"run{n}")
        held[n] = train(log, range(1, n + 1), n)
        written[n] = (sum(fs.bytes for fs in made), sum(fs.streams for fs in made))
        size[n] = len(pickle.dumps(log))  # everything the callback holds
        rows = read_metrics(str(tmp_path), f"run{n}")
        assert [r["step"] for r in rows] == list(range(1, n + 1))
        files = sorted((tmp_path / f"run{n}" / METRICS_DIR).iterdir())
        assert [f.name for f in files] == [segment_name(i) for i in range(len(files))]
        # each byte written once: what was written is what the folder holds
        assert written[n] == (sum(f.stat().st_size for f in files), len(files))
    bytes_ratio, writes_ratio = written[10000][0] / written[1000][0], written[10000][1] / written[1000][1]
    # The rewrite-the-whole-file layout wrote about 100x the bytes for 10x the rows.
    assert 9.5 < bytes_ratio < 10.5, written
    assert writes_ratio == 10, written
    assert held[1000] <= 25 and held[10000] <= 25, held
    assert size[10000] < size[1000] * 1.05, size


def test_a_report_of_many_rows_is_one_segment(tmp_path):
    log = MetricsLog(str(tmp_path), "run")
    report(log, [row(s, 100) for s in range(1, 41)])  # a report of 40 steps' rows (fast steps)
    report(log, [row(s, 100) for s in range(41, 43)])
    assert len(log.pending) == 2
    assert [f.name for f in (tmp_path / "run" / METRICS_DIR).iterdir()] == [segment_name(0)]


def test_a_new_driver_numbers_after_the_segments_and_counts_redone_steps(tmp_path):
    first = MetricsLog(str(tmp_path), "run")
    train(first, range(1, 31), 40, every=20)  # segments at steps 20 (checkpoint) and 30 (failure)
    first.after_exception(None, {})
    # The driver dies; a new one resumes the run from the checkpoint at step 20.
    second = MetricsLog(str(tmp_path), "run")
    train(second, range(21, 41), 40, restarts=1, every=10)
    names = sorted(f.name for f in (tmp_path / "run" / METRICS_DIR).iterdir())
    assert names == [segment_name(i) for i in range(4)]  # 0-1 from the first driver, 2-3 from the second
    rows = read_metrics(str(tmp_path), "run")
    assert [r["step"] for r in rows] == [*range(1, 31), *range(21, 41)]
    assert rows[30]["steps_redone"] == 10  # reached step 30, resumed from 20
    assert sum("steps_redone" in r for r in rows) == 1


def test_a_segment_cut_short_is_read_without_its_partial_line(tmp_path):
    log = MetricsLog(str(tmp_path), "run", flush_every=5)
    train(log, range(1, 11), 100)
    segment = tmp_path / "run" / METRICS_DIR / segment_name(1)
    data = segment.read_bytes()
    segment.write_bytes(data[: len(data) - 40])  # the driver died inside the segment's last row
    assert [r["step"] for r in read_metrics(str(tmp_path), "run")] == [*range(1, 10)]
    # A new driver resumes: it writes after the cut segment, and its rows follow.
    resumed = MetricsLog(str(tmp_path), "run", flush_every=5)
    train(resumed, range(9, 14), 100, restarts=1)
    rows = read_metrics(str(tmp_path), "run")
    assert [r["step"] for r in rows] == [*range(1, 10), *range(9, 14)]
    assert rows[9]["steps_redone"] == 1  # the last row that reached the log is step 9's
    # A line that is whole (it has its newline) and does not parse is damage, not a cut write.
    segment.write_bytes(b'{"step": 1}\n{"step"\n')
    with pytest.raises(ValueError, match=f"{segment_name(1)}: line 2 is not a JSON row"):
        read_metrics(str(tmp_path), "run")


def test_the_single_file_log_of_older_runs_is_read_first(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    old = [row(s, 8, bad_rows=1) for s in range(1, 5)]
    (folder / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in old))
    log = MetricsLog(str(tmp_path), "run")  # the run resumed by this raylora, from step 2
    train(log, range(3, 9), 8, restarts=1)
    rows = read_metrics(str(tmp_path), "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, *range(3, 9)]
    assert rows[4]["steps_redone"] == 2 and (folder / METRICS_FILE).read_text().count("\n") == 4
    assert bad_rows_before(str(tmp_path), "run", 4) == 2  # steps 3-4 redone: their latest rows count


def test_rows_wait_while_the_storage_refuses_writes(tmp_path, monkeypatch):
    log = MetricsLog(str(tmp_path), "run", flush_every=10)
    train(log, range(1, 6), 100)  # the first report lists the folder
    tried = []

    def refused(storage_path, name):
        tried.append(len(log.pending))
        raise OSError("storage unreachable")

    monkeypatch.setattr(progress, "run_folder", refused)
    train(log, range(6, 46), 100)
    assert len(log.pending) == 45 and tried == [10, 20, 30, 40]  # tried every 10 rows, not every report
    monkeypatch.undo()
    train(log, range(46, 51), 100)  # the storage is back: the next try writes all 50 rows, once
    assert log.pending == [] and log.next_segment == 1
    assert [r["step"] for r in read_metrics(str(tmp_path), "run")] == list(range(1, 51))


def test_no_rows_no_log(tmp_path):
    log = MetricsLog(str(tmp_path), "run")
    log.after_report(None, [{}, {}], None)
    log.after_exception(None, {})
    assert read_metrics(str(tmp_path), "run") == [] and not list((tmp_path / "run" / METRICS_DIR).iterdir())


def test_segments_on_s3(s3):
    storage = s3.uri("metrics")
    log = MetricsLog(storage, "run", flush_every=10)
    train(log, range(1, 36), 35)
    resumed = MetricsLog(storage, "run", flush_every=10)
    train(resumed, range(31, 36), 35, restarts=1)
    listing = s3.fs().get_file_info(pyarrow.fs.FileSelector(f"{s3.bucket}/metrics/run/{METRICS_DIR}"))
    keys = sorted(info.base_name for info in listing)
    assert keys == [segment_name(i) for i in range(5)]  # 10, 10, 10, 5 rows; then the resumed 5
    rows = read_metrics(storage, "run")
    assert [r["step"] for r in rows] == [*range(1, 36), *range(31, 36)]
    assert rows[35]["steps_redone"] == 5
