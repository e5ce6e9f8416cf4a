"""Step time with the input pipeline in the background (`data.workers`) against inline, where input
processing is heavy.

One Ray Train worker (so that a core is left for the pipeline on a 2-core machine: with every core
training, a background process only takes turns with it), a tiny llava and large noise images (PNG, which
decode slowly, then resized by the processor): building a step's batches costs about as much as the step's
compute. The same run with `data.workers=0` (inline) and `data.workers=1`, alternately; seconds per step
from each step's `wall_time`, the first steps left out.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import common

VARIANTS = {"inline": "data.workers=0", "background": "data.workers=1"}


def heavy_images(work: Path, rows: int, edge: int) -> str:
    """A raylora Parquet file of `rows` noise images, `edge` pixels a side, built once."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    path = work / f"noise-{rows}x{edge}.parquet"
    if not path.is_file():
        rng = np.random.default_rng(0)
        images = []
        for _ in range(rows):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (edge, edge, 3), dtype=np.uint8)).save(buf, "PNG")
            images.append(buf.getvalue())
        answers = [str(i % 10) for i in range(rows)]
        prompts = ["Which digit is this?"] * rows
        pq.write_table(pa.table({"image": images, "prompt": prompts, "answer": answers}), path)
    return str(path)


def seconds_per_step(rows: list[dict], warmup: int) -> float:
    times = [r["t"] for r in rows][warmup:]
    return (times[-1] - times[0]) / (len(times) - 1)


def main() -> None:
    p = common.parser(__doc__)
    args = p.parse_args()
    reps = common.repeats(args, 3)
    steps, warmup, edge = (5, 2, 256) if args.tiny else (16, 4, 1024)
    work = Path(args.work) / "pipeline"
    shutil.rmtree(work / "ray", ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    model = common.tiny_model(args.work)
    data = heavy_images(work, 64, edge)
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with common.local_ray():
        from raylora.driver import make_trainer, preflight

        for rep in range(reps):
            for variant, setting in VARIANTS.items():
                cfg = common.run_config(
                    model,
                    data,
                    work / "ray",
                    f"pipeline-{variant}-{rep}",
                    "scaling.num_workers=1",
                    f"train.max_steps={steps}",
                    common.NO_CHECKPOINTS,
                    "run.report_every_s=0",
                    setting,
                )
                preflight(cfg)
                clock = work / f"clock-{variant}-{rep}.jsonl"
                clock.unlink(missing_ok=True)
                result = make_trainer(cfg, [common.step_clock(clock)]).fit()
                assert result.error is None, result.error
                rows = common.read_clock(clock)
                assert [r["step"] for r in rows] == list(range(1, steps + 1)), "a step's row is missing"
                samples[variant].append(seconds_per_step(rows, warmup))
    med = {k: common.median(v) for k, v in samples.items()}
    ratio = med["inline"] / med["background"]
    common.write_result(
        args,
        "pipeline",
        {
            "setup": {
                "workers": 1,
                "image_edge_px": edge,
                "image_format": "PNG of uniform noise",
                "steps_per_run": steps,
                "warmup_steps_left_out": warmup,
                "run": "bench/run.yaml, 1 worker, data.workers 0 against 1",
                "repeats": reps,
            },
            "figures": {f"{k}_seconds_per_step": common.summary(v) for k, v in samples.items()},
            "ratios": {"inline_over_background_step_time": ratio},
            "goal": {
                "text": "steps take less time with the input pipeline in the background than inline",
                "value": ratio,
                "met": ratio > 1.0,
            },
            "notes": [
                "Seconds per step from each step's wall_time (when it ended on the worker), every step "
                "reported (run.report_every_s=0); the first steps (engine warm-up, the pipeline's start) "
                "are left out.",
                "A ratio above 1 is the share of input processing the background hid behind compute.",
            ],
        },
    )
    print(json.dumps({"inline_over_background_step_time": ratio}))


if __name__ == "__main__":
    main()
