"""`raylora prepare-data`: one pass over a data source that checks every row, decodes every image and video
once, and writes the layout training reads fastest (a video's file kept as it is), with why each bad row is
bad and the data's statistics (tokens per row counting each video's tokens).

The pass runs on Ray Data, so on a cluster it spreads over every node's CPUs: the row indices are cut into
blocks and each block is one task that opens the source itself, by URI (a task may run on any node), reads
its rows with `Rows.sample` and decodes their images with `load_image`. Good rows flow on to Ray Data's
Parquet writer; each task hands its bad rows and its rows' sizes to one small actor, the ledger, which the
driver reads at the end (the written rows cannot carry them, and reading the data twice would decode every
image twice). Output and source must be paths every node sees (shared storage or a pyarrow URI).
"""

from __future__ import annotations

import functools
import json
import posixpath
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs
import ray

from raylora import hub, storage
from raylora.config import ConfigError

BAD_ROWS = "bad_rows.jsonl"
SUMMARY = "summary.json"

# A random row read (the lazy reader's access pattern: a sampler's shuffled indices) decodes the whole row
# group that holds it, since a Parquet column chunk is compressed and decoded a group at a time. Arrow's
# default groups (up to a million rows) would make every sample read a file's worth of images; 64 rows keep
# one read to 64 images (a few MB at typical sizes) while the footer every rank reads at open stays small
# (one entry per group and column).
ROW_GROUP_ROWS = 64
# Rows per Ray Data task: enough to amortise opening the source (cached per worker process) and the task's
# overhead, few enough that a big cluster has blocks for every CPU and a block of large images stays far
# below Arrow's 2 GB per binary array.
ROWS_PER_TASK = 128
# Blocks are joined into files of about this many (in-memory) bytes: a few hundred files even for a 90 GB
# set, so opening the folder reads few footers, while each write task holds at most this much.
BYTES_PER_FILE = 256 * 1024 * 1024

PART = pa.struct([("type", pa.string()), ("text", pa.string())])
SCHEMA = pa.schema(
    [
        ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.list_(PART))]))),
        ("images", pa.list_(pa.binary())),
        ("videos", pa.list_(pa.binary())),  # each video's file as it was (decoded again when trained on)
        ("source_row", pa.int64()),  # the row in the source, to trace a row back to it
    ]
)


def check_out(out: str) -> None:
    """`ConfigError` unless `out` is missing or an empty folder: prepare-data never overwrites saved data."""
    fs, path = storage.filesystem(out)
    info = fs.get_file_info(path)
    if info.type == pyarrow.fs.FileType.NotFound:
        return
    if info.type != pyarrow.fs.FileType.Directory:
        raise ConfigError(f"--out: {out} exists and is not a folder")
    if fs.get_file_info(pyarrow.fs.FileSelector(path)):
        raise ConfigError(
            f"--out: {out} exists and is not empty; prepare-data never overwrites saved data: "
            f"name a new folder"
        )


def prepare(
    source: str,
    out: str,
    fmt: str | None = None,
    image_root: str | None = None,
    model: str | None = None,
    template_kwargs: dict | None = None,
) -> dict[str, Any]:
    """Check, decode and rewrite every row of `source` into `out` on Ray Data; returns the summary.
    `template_kwargs`: for the model's chat template, as data.chat_template_kwargs.

    Everything that can be checked without Ray is checked first (the source's format, `out`, the model).
    """
    from raylora.data.formats import check_source

    source, out = storage.absolute(source), storage.absolute(out)
    image_root = storage.absolute(image_root) if image_root else None
    fmt, num_rows = check_source(source, "SOURCE", fmt, image_root)
    check_out(out)
    if model is not None and not (Path(hub.resolve(model, config_only=True)) / "config.json").is_file():
        raise ConfigError(f"--model: {model} has no config.json (not a Hugging Face model folder)")

    from raylora.ray_runtime import init_ray

    init_ray()
    start = time.perf_counter()
    ledger = Ledger.remote()
    context = ray.data.DataContext.get_current()
    keep_order = context.execution_options.preserve_order
    context.execution_options.preserve_order = True  # output files in source order
    try:
        rows = ray.data.range(num_rows, override_num_blocks=max(1, -(-num_rows // ROWS_PER_TASK)))
        checked = rows.map_batches(
            check_rows,
            batch_size=ROWS_PER_TASK,
            batch_format="numpy",
            fn_kwargs={
                "uri": source,
                "fmt": fmt,
                "image_root": image_root,
                "model": model,
                "ledger": ledger,
                "template_kwargs": json.dumps(template_kwargs or {}),
            },
        )
        checked.write_parquet(out, row_group_size=ROW_GROUP_ROWS, min_bytes_per_file=BYTES_PER_FILE)
        bad, sizes = ray.get(ledger.collect.remote())
    finally:
        context.execution_options.preserve_order = keep_order
        ray.kill(ledger)

    fs, root = storage.filesystem(out)
    fs.create_dir(root, recursive=True)  # Ray Data writes no folder when no row is good
    files = sorted(
        posixpath.basename(f.path)
        for f in fs.get_file_info(pyarrow.fs.FileSelector(root))
        if f.path.endswith(".parquet")
    )
    with fs.open_output_stream(posixpath.join(root, BAD_ROWS)) as f:
        f.write("".join(json.dumps({"row": r, "reason": why}) + "\n" for r, why in bad).encode())
    summary = {
        "source": source,
        "format": fmt,
        "out": out,
        "rows": num_rows,
        "good_rows": num_rows - len(bad),
        "bad_rows": len(bad),
        "files": files,
        "row_group_rows": ROW_GROUP_ROWS,
        "model": model,
        "statistics": statistics(sizes, with_tokens=model is not None),
        "seconds": round(time.perf_counter() - start, 2),
    }
    with fs.open_output_stream(posixpath.join(root, SUMMARY)) as f:
        f.write((json.dumps(summary, indent=1) + "\n").encode())
    return summary


def describe(values: np.ndarray) -> dict[str, float] | None:
    """min, median, 95th percentile (linear interpolation) and max; None for no values."""
    if not len(values):
        return None
    v = np.asarray(values, dtype=np.float64)
    return {
        "min": float(v.min()),
        "median": float(np.median(v)),
        "p95": float(np.percentile(v, 95)),
        "max": float(v.max()),
    }


def statistics(sizes: dict[str, np.ndarray], with_tokens: bool) -> dict[str, dict[str, float] | None]:
    """Image width and height (over all images of the good rows), images per row and tokens per row."""
    names = ["width", "height", "images_per_row", *(["tokens"] if with_tokens else [])]
    return {name: describe(sizes[name]) for name in names}


def format_report(summary: dict[str, Any]) -> str:
    """The summary as the lines `raylora prepare-data` prints."""
    lines = [
        f"{summary['rows']} rows of {summary['format']} data: {summary['good_rows']} good, "
        f"{summary['bad_rows']} bad (reasons in {posixpath.join(summary['out'], BAD_ROWS)})",
        f"wrote {len(summary['files'])} Parquet file(s) to {summary['out']} in {summary['seconds']} s",
        f"{'':16}{'min':>10}{'median':>10}{'p95':>10}{'max':>10}",
    ]
    for name, row in summary["statistics"].items():
        cells = "".join(f"{row[k]:>10.6g}" for k in ("min", "median", "p95", "max")) if row else "  (none)"
        lines.append(f"{name:16}{cells}")
    return "\n".join(lines)


# Exit codes of `raylora prepare-data` beside 0 (and 2, a ConfigError before Ray starts).
NO_GOOD_ROWS, TOO_MANY_BAD_ROWS = 1, 3


def verdict(summary: dict[str, Any], max_bad_fraction: float) -> tuple[int, str | None]:
    """The exit code of a finished pass and why it is not 0: no good row at all (1), or more than
    `max_bad_fraction` of the rows bad (3). `bad_rows.jsonl` is written either way, to say why."""
    rows, bad = summary["rows"], summary["bad_rows"]
    reasons = posixpath.join(summary["out"], BAD_ROWS)
    if bad == rows:
        return NO_GOOD_ROWS, f"no row of {summary['source']} is good ({rows} bad; why in {reasons})"
    if bad > max_bad_fraction * rows:
        return TOO_MANY_BAD_ROWS, (
            f"{bad} of {rows} rows of {summary['source']} are bad, more than --max-bad-fraction "
            f"({max_bad_fraction}); why in {reasons}"
        )
    return 0, None


# ------------------------------------------------------------------------------------- in the tasks


@functools.cache
def _open(uri: str, fmt: str, image_root: str | None):
    """The source, opened once per worker process: Ray reuses a process for many tasks."""
    from raylora.data.formats import open_rows

    return open_rows(uri, fmt, image_root)


@functools.cache
def _processor(model: str, template_kwargs: str = "{}"):
    from raylora.data.processor import load_processor

    return load_processor(hub.resolve(model), template_kwargs=json.loads(template_kwargs))


def _read(entry: bytes | str) -> bytes:
    """An image's encoded bytes: the entry itself, or the file a path or URI names."""
    if isinstance(entry, bytes):
        return entry
    fs, path = storage.filesystem(entry)
    with fs.open_input_file(path) as f:
        return f.read()


def _tokens(processor, messages: list[dict], images: list, videos: list | None = None) -> int:
    """Tokens of the sample as training makes them and `data.max_length` counts them: every turn through
    the model's chat template and processor, image and video tokens expanded (frames sampled as
    data.video_fps and its siblings default)."""
    from raylora.data.labels import encode

    return len(encode(processor, (messages, images, videos) if videos else (messages, images)).labels)


def check_rows(
    batch: dict[str, np.ndarray],
    uri: str,
    fmt: str,
    image_root: str | None,
    model: str | None,
    ledger,
    template_kwargs: str = "{}",
) -> pa.Table:
    """One Ray Data task: the good rows of `batch["id"]` in the training layout; bad rows and every good
    row's sizes go to `ledger`."""
    from jinja2 import TemplateError

    from raylora.data import video
    from raylora.data.formats import BadRow, load_image, load_video

    rows = _open(uri, fmt, image_root)
    processor = _processor(model, template_kwargs) if model else None
    good: list[dict] = []
    bad: list[tuple[int, str]] = []
    sizes: dict[str, list] = {"width": [], "height": [], "images_per_row": [], "tokens": []}
    for row in batch["id"].tolist():
        try:
            sample = rows.sample(row)
            images = [load_image(entry) for entry in sample.images]
            if any(isinstance(entry, list) for entry in sample.videos):
                raise BadRow("a video given as a list of frames: prepare-data keeps video files only")
            # every video decoded once here too: one that does not decode is a bad row before training
            videos = [load_video(entry, video.Sampling()) for entry in sample.videos]
            tokens = _tokens(processor, sample.messages, images, videos) if processor is not None else None
        except BadRow as err:
            bad.append((row, err.reason))
            continue
        except (ValueError, TemplateError) as err:  # the processor rejects it: a bad row in training too
            bad.append(
                (row, f"the processor rejects it ({type(err).__name__}: {' '.join(str(err).split())})")
            )
            continue
        sizes["width"] += [im.width for im in images]
        sizes["height"] += [im.height for im in images]
        sizes["images_per_row"].append(len(images))
        if tokens is not None:
            sizes["tokens"].append(tokens)
        messages = [
            {"role": t["role"], "content": [{"type": p["type"], "text": p.get("text")} for p in t["content"]]}
            for t in sample.messages
        ]
        good.append(
            {
                "messages": messages,
                "images": [_read(e) for e in sample.images],
                "videos": [_read(e) for e in sample.videos],
                "source_row": row,
            }
        )
    first = int(batch["id"][0]) if len(batch["id"]) else -1
    # keyed by the block's first row, so a retried task does not count its rows twice; int32 arrays keep
    # the ledger at 4 bytes a number, for data sets of many millions of rows
    ray.get(ledger.add.remote(first, bad, {k: np.asarray(v, dtype=np.int32) for k, v in sizes.items()}))
    return pa.Table.from_pylist(good, schema=SCHEMA)


@ray.remote(num_cpus=0)
class Ledger:
    """Bad rows and sizes from every task, by the first row of its block."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[list, dict[str, np.ndarray]]] = {}

    def add(self, first: int, bad: list, sizes: dict[str, np.ndarray]) -> None:
        self.blocks[first] = (bad, sizes)

    def collect(self) -> tuple[list[tuple[int, str]], dict[str, np.ndarray]]:
        blocks = [self.blocks[first] for first in sorted(self.blocks)]
        bad = [row for block_bad, _ in blocks for row in block_bad]
        names = ("width", "height", "images_per_row", "tokens")
        sizes = {n: np.concatenate([np.zeros(0, np.int32), *(b[1][n] for b in blocks)]) for n in names}
        return bad, sizes
