"""`raylora plot`: the loss curve of a run from its metrics log (`raylora_metrics/`), restarts marked.

A resumed run appends to the log, so steps redone after a restart appear twice. Each attempt (a run
of consecutive rows with the same `restarts` count) is drawn as its own segment: with an exact resume
the redone steps lie on top of the first attempt's. Drawn with matplotlib's Agg canvas directly (no
pyplot), so it needs no display and leaves the caller's matplotlib backend alone. The run folder and
the output are local paths or URIs of any pyarrow filesystem (s3://, gs://), each read or written
through its own filesystem: `raylora plot s3://bucket/runs/NAME --out loss.png` draws a cluster's run
on a laptop.
"""

from __future__ import annotations

import io
import posixpath

from raylora.config import ConfigError
from raylora.progress import METRICS_DIR, read_log
from raylora.storage import absolute, filesystem


def restart_steps(rows: list[dict]) -> list[int]:
    """The step each restart resumed from: where `restarts` increases between consecutive rows.

    A row's `step` counts the steps completed, so the first row after a resume from a checkpoint
    saved at step k has step k + 1, and the mark goes at k.
    """
    return [
        cur["step"] - 1
        for prev, cur in zip(rows, rows[1:], strict=False)
        if cur.get("restarts", 0) > prev.get("restarts", 0)
    ]


def attempts(rows: list[dict]) -> list[list[dict]]:
    """Rows split into runs of consecutive rows with the same `restarts` count."""
    segments: list[list[dict]] = []
    for row in rows:
        if not segments or row.get("restarts", 0) != segments[-1][-1].get("restarts", 0):
            segments.append([])
        segments[-1].append(row)
    return segments


def render(rows: list[dict], title: str = "") -> bytes:
    """PNG bytes: loss against step, eval accuracy on a second axis where rows have it, restarts marked."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ConfigError("raylora plot draws with matplotlib: pip install -e '.[demo]'") from err

    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, segment in enumerate(attempts([r for r in rows if "loss" in r])):
        ax.plot(
            [r["step"] for r in segment],
            [r["loss"] for r in segment],
            color="tab:blue",
            linewidth=1.2,
            label="train loss" if i == 0 else None,
        )
    for i, step in enumerate(restart_steps(rows)):
        ax.axvline(step, color="tab:red", linestyle="--", linewidth=1, label="resumed" if i == 0 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    handles, labels = ax.get_legend_handles_labels()
    evals = [r for r in rows if r.get("eval_accuracy") is not None]
    if evals:
        acc = ax.twinx()
        acc.plot(
            [r["step"] for r in evals],
            [r["eval_accuracy"] for r in evals],
            color="tab:green",
            marker="o",
            label="eval accuracy",
        )
        acc.set_ylabel("eval accuracy")
        acc.set_ylim(0, 1)
        more = acc.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.legend(handles, labels, loc="upper right")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def plot(run_dir: str, out: str | None = None) -> str:
    """Write the loss plot of run folder `run_dir` (a path or a URI) to `out` (default RUN_DIR/loss.png,
    a path or a URI too); returns `out`."""
    run_dir = run_dir.rstrip("/")
    rows = read_log(*filesystem(absolute(run_dir)))
    if not rows:
        raise ConfigError(f"no metrics in {posixpath.join(run_dir, METRICS_DIR)}: is {run_dir} a run folder?")
    png = render(rows, title=posixpath.basename(run_dir))
    out = out or posixpath.join(run_dir, "loss.png")
    fs, path = filesystem(absolute(out))
    with fs.open_output_stream(path) as f:
        f.write(png)
    return out
