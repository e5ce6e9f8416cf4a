"""Memory per rank and seconds to the first step against the number of rows: 1k, 10k and 100k.

Synthetic rows (a small random-noise PNG each, unique so that Parquet cannot fold them together, a prompt
and a one-word answer), in two layouts: `raylora` Parquet as `pyarrow.parquet.write_table` writes it (one
file, Arrow's default row groups) and the folder `raylora prepare-data` writes from it. Every (layout, rows)
pair starts its own 2-worker group of the tiny Llava (ZeRO-3 on CPU), side by side in one run, repeats
interleaved, after one unmeasured warm-up group. On each rank: `worker.setup` (model, engine, data opened)
and one training step; then the rank's resident set size (VmRSS) and its peak (VmHWM). Seconds to the first
step = the driver's preflight (`driver.preflight`: model folder, data source, ...) + the slower rank's setup
and first step; the worker group's own start (Ray's, the same for any data) is left out.
"""

from __future__ import annotations

import io
import json
import shutil
import time
from pathlib import Path

import common

SIZES = (1_000, 10_000, 100_000)
TINY_SIZES = (64, 640)
LAYOUTS = ("raylora", "prepared")
EDGE = 8  # pixels a side of the synthetic images
ANSWERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def synthetic(work: Path, rows: int) -> str:
    """`rows` raylora Parquet rows of random 8x8 PNGs, built once."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    path = work / "data" / f"rows-{rows}.parquet"
    if path.is_file():
        return str(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(rows)
    pixels = rng.integers(0, 256, size=(rows, EDGE, EDGE, 3), dtype=np.uint8)
    images = []
    for p in pixels:
        buf = io.BytesIO()
        Image.fromarray(p).save(buf, format="PNG")
        images.append(buf.getvalue())
    table = pa.table(
        {
            "image": pa.array(images, type=pa.binary()),
            "prompt": ["Which digit is this?"] * rows,
            "answer": [ANSWERS[int(k)] for k in rng.integers(0, 10, size=rows)],
        }
    )
    tmp = path.with_suffix(".tmp")
    pq.write_table(table, tmp)
    tmp.rename(path)
    return str(path)


def prepared(work: Path, source: str, rows: int) -> tuple[str, float | None]:
    """The prepare-data folder of `source` (built once) and the seconds its pass took (None: reused)."""
    from raylora.prepare import prepare

    out = work / "data" / f"prepared-{rows}"
    if (out / "summary.json").is_file():
        return str(out), None
    shutil.rmtree(out, ignore_errors=True)  # a pass that did not finish
    start = time.perf_counter()
    summary = prepare(source, str(out))
    assert summary["bad_rows"] == 0, summary
    return str(out), time.perf_counter() - start


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def first_step_on_rank(cfg) -> list[dict]:
    """On each rank: set up and train one step; every rank's figures (on rank 0)."""
    import torch.distributed as dist

    from raylora.worker import setup, train_step

    start = time.perf_counter()
    s = setup(cfg, None)
    set_up = time.perf_counter() - start
    train_step(s)
    mine = {
        "rank": s.rank,
        "setup_s": set_up,
        "to_first_step_s": time.perf_counter() - start,
        "rss_mb": _status_mb("VmRSS"),
        "peak_rss_mb": _status_mb("VmHWM"),
        "rows": len(s.data),
    }
    everyone = [None] * s.world_size
    dist.all_gather_object(everyone, mine)
    return everyone


def main() -> None:
    from raylora.driver import preflight

    p = common.parser(__doc__)
    p.add_argument(
        "--layouts", nargs="+", choices=LAYOUTS, default=None, help="default: both (--tiny: raylora)"
    )
    args = p.parse_args()
    sizes = TINY_SIZES if args.tiny else SIZES
    layouts = args.layouts or (["raylora"] if args.tiny else list(LAYOUTS))
    reps = common.repeats(args, 2)
    work = Path(args.work) / "data_scale"
    shutil.rmtree(
        work / "ray", ignore_errors=True
    )  # a run folder left from before would be taken for a resume
    model = common.tiny_model(args.work)

    sources: dict[tuple[str, int], str] = {}
    prepare_s: dict[int, float | None] = {}
    figures: dict[tuple[str, int], dict[str, list[float]]] = {}
    with common.local_ray():
        for rows in sizes:
            sources["raylora", rows] = synthetic(work, rows)
            if "prepared" in layouts:
                sources["prepared", rows], prepare_s[rows] = prepared(work, sources["raylora", rows], rows)
        if not args.tiny:  # the first worker group of a run pays for cold caches: keep it out of the figures
            warm = common.run_config(
                model, sources["raylora", sizes[0]], work / "ray", "warm-up", "train.max_steps=1"
            )
            common.on_workers(lambda: first_step_on_rank(warm), work / "ray", "warm-up")
        for rep in range(reps):
            for layout in layouts:
                for rows in sizes:
                    name = f"{layout}-{rows}-{rep}"
                    cfg = common.run_config(
                        model,
                        sources[layout, rows],
                        work / "ray",
                        name,
                        common.NO_CHECKPOINTS,
                        "train.max_steps=1",
                        "train.warmup_steps=0",
                    )
                    start = time.perf_counter()
                    preflight(cfg)
                    preflight_s = time.perf_counter() - start
                    ranks = common.on_workers(lambda cfg=cfg: first_step_on_rank(cfg), work / "ray", name)
                    assert all(r["rows"] == rows for r in ranks), ranks
                    slowest = max(r["to_first_step_s"] for r in ranks)
                    f = figures.setdefault((layout, rows), {})
                    f.setdefault("peak_rss_mb", []).extend(r["peak_rss_mb"] for r in ranks)
                    f.setdefault("rss_mb", []).extend(r["rss_mb"] for r in ranks)
                    f.setdefault("preflight_s", []).append(preflight_s)
                    f.setdefault("setup_s", []).append(max(r["setup_s"] for r in ranks))
                    f.setdefault("first_step_s", []).append(preflight_s + slowest)
                    print(
                        name,
                        f"peak {max(r['peak_rss_mb'] for r in ranks):.0f} MB",
                        f"first step {preflight_s + slowest:.1f} s",
                        flush=True,
                    )

    small, large = sizes[0], sizes[-1]
    label = f"{large // 1000}k_over_{small // 1000}k" if small >= 1000 else f"{large}_over_{small}"
    table, ratios = {}, {}
    for layout in layouts:
        table[layout] = {
            str(rows): {k: common.summary(v) for k, v in figures[layout, rows].items()} for rows in sizes
        }
        lo, hi = table[layout][str(small)], table[layout][str(large)]
        ratios[layout] = {
            f"memory_{label}": hi["peak_rss_mb"]["median"] / lo["peak_rss_mb"]["median"],
            f"startup_{label}": hi["first_step_s"]["median"] / lo["first_step_s"]["median"],
        }
    met = {
        layout: r[f"memory_{label}"] <= 1.2 and r[f"startup_{label}"] <= 1.5 for layout, r in ratios.items()
    }
    common.write_result(
        args,
        "data_scale",
        {
            "setup": {
                "model": "tiny Llava, width 64, 2 layers; 2 workers, ZeRO-3 on CPU (gloo), LoRA r=4 plus the "
                "vision tower and aligner trained; global batch 8, micro batch 2, one step",
                "data": f"synthetic rows: a random {EDGE}x{EDGE} RGB PNG each (unique), a prompt, a one-word "
                "answer; layout raylora = one Parquet file as pyarrow.parquet.write_table writes it "
                "(Arrow's default row groups), prepared = the folder raylora prepare-data writes from it",
                "rows": list(sizes),
                "repeats": reps,
                "figures": "peak_rss_mb / rss_mb: VmHWM / VmRSS of each rank after setup and the first step "
                "(both ranks' samples); first_step_s = driver.preflight + the slower rank's setup and first "
                "step (the worker group's start by Ray left out); setup_s: the slower rank's worker.setup",
            },
            "layouts": table,
            "prepare_data_seconds": {str(k): v for k, v in prepare_s.items()},
            "ratios": ratios,
            "goal": {
                "text": "largest over smallest number of rows: peak memory per rank <= 1.2, seconds to the "
                "first step <= 1.5",
                "met_by_layout": met,
                "met": all(met.values()),
            },
        },
    )
    print(json.dumps(ratios, indent=1))


if __name__ == "__main__":
    main()
