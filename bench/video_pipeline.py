"""Steps per second with video rows (decoded by PyAV in the input pipeline) against the same rows with their
frames pre-decoded, the same `data.workers` on both sides: whether the pipeline hides decoding.

One Ray Train worker (a core left for the pipeline's process on a 2-core machine), a tiny Qwen2-VL and
chat rows of H.264 MP4 clips written here with PyAV (`--edge` pixels a side, 3 s at 30 fps, sampled at
data.video_fps 2: 6 frames a clip). The pre-decoded side gives each row the same 6 frames as a list of BMP
images (a copy, not a decode), so the model's inputs are the same size. Seconds per step from each step's
`wall_time`, the first steps left out. The runs come in pairs, one of each side, the side that runs first
taking turns from pair to pair; the figure is the median of the pairs' ratios (video over pre-decoded
steps per second), so that a load that comes and goes on a shared machine falls on both sides of a pair.
The goal is at least 0.95. Writes bench/results/video_pipeline.json.

`--rss`: a worker's resident memory over a run of video rows instead (bench/results/video_pipeline_rss.json):
one run of 110 steps, the Train worker's RSS and its children's (the input pipeline's process, which
decodes the frames) read at the reports of steps 10 and 100; the goal is at most 5% growth between them
(no frame or batch kept from step to step).
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import common

VARIANTS = ("video", "predecoded")
SECONDS, FPS = 3, 30


def write_rows(work: Path, rows: int, edge: int) -> dict[str, str]:
    """{variant: chat JSONL path}: the clips (MP4) and the same sampled frames as BMP files, built once."""
    import av
    import numpy as np
    from PIL import Image

    from raylora.data import video

    out = {v: work / f"{v}-{rows}x{edge}.jsonl" for v in VARIANTS}
    if all(p.is_file() for p in out.values()):
        return {k: str(v) for k, v in out.items()}
    rng = np.random.default_rng(0)
    lines: dict[str, list[str]] = {v: [] for v in VARIANTS}
    for i in range(rows):
        clip = work / f"clip-{i}-{edge}.mp4"
        with av.open(str(clip), "w") as container:
            stream = container.add_stream("libx264", rate=FPS)
            stream.width = stream.height = edge
            stream.pix_fmt = "yuv420p"
            base = rng.integers(0, 256, (edge, edge, 3), dtype=np.uint8)
            for t in range(SECONDS * FPS):  # a moving noise texture: real motion for the codec to encode
                picture = np.roll(base, 3 * t, axis=1)
                for packet in stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
        frames = video.decode(clip.read_bytes(), video.Sampling()).frames
        names = []
        for k, frame in enumerate(frames):
            name = work / f"clip-{i}-{edge}-{k}.bmp"
            buf = io.BytesIO()
            Image.fromarray(frame).save(buf, "BMP")
            name.write_bytes(buf.getvalue())
            names.append(str(name))
        messages = [
            {"role": "user", "content": "<video>Which digit?"},
            {"role": "assistant", "content": ["zero", "one", "two", "three"][i % 4]},
        ]
        lines["video"].append(json.dumps({"messages": messages, "videos": [str(clip)]}))
        lines["predecoded"].append(json.dumps({"messages": messages, "videos": [names]}))
    for v in VARIANTS:
        out[v].write_text("\n".join(lines[v]) + "\n")
    return {k: str(v) for k, v in out.items()}


def seconds_per_step(rows: list[dict], warmup: int) -> float:
    times = [r["t"] for r in rows][warmup:]
    return (times[-1] - times[0]) / (len(times) - 1)


RSS_STEPS = (10, 100)  # the steps whose reports read the worker's memory
RSS_RUN_STEPS = 110  # past the last read: the input pipeline is still running at step 100's report


def worker_rss(path: str | Path):
    """A Ray Train callback (it runs in the controller) that appends, for each report whose step is one of
    RSS_STEPS, `{step, worker, children}`: the resident bytes of the run's Train worker process and of its
    child processes (the input pipeline's, which decode the frames), read through psutil. The worker is
    found among the controller's sibling processes (both are started by the node's raylet), so another
    Ray on the machine is not mistaken for this one; a run of one worker only."""
    from ray.train import UserCallback

    from raylora.reporting import rows

    class WorkerRss(UserCallback):
        def __init__(self, path: str):
            self.path, self.pid = path, None

        def _worker(self):
            import psutil

            if self.pid is None:
                siblings = psutil.Process().parent().children()
                found = [p.pid for p in siblings if "RayTrainWorker" in " ".join(p.cmdline())]
                assert len(found) == 1, f"expected one Train worker, found {found}"
                self.pid = found[0]
            return psutil.Process(self.pid)

        def after_report(self, run_context, metrics, checkpoint) -> None:
            steps = [row.get("step") for row in rows(metrics[0])] if metrics else []
            if not set(steps) & set(RSS_STEPS):
                return
            worker = self._worker()
            children = worker.children(recursive=True)
            record = {
                "step": max(s for s in steps if s in RSS_STEPS),
                "worker": worker.memory_info().rss,
                "children": sum(c.memory_info().rss for c in children),
                "child_processes": len(children),
            }
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    return WorkerRss(str(path))


def video_run(model: Path, data: str, work: Path, name: str, steps: int):
    """bench/run.yaml on one worker, a global batch of 4 and `steps` steps, reporting every step."""
    return common.run_config(
        str(model),
        data,
        work / "ray",
        name,
        "scaling.num_workers=1",
        "train.global_batch_size=4",
        f"train.max_steps={steps}",
        common.NO_CHECKPOINTS,
        "run.report_every_s=0",  # a report, and so a row of the clock, at every step
        "data.workers=1",
    )


def measure_rss(args, model: Path, data: dict[str, str], work: Path, edge: int) -> None:
    from raylora.driver import make_trainer, preflight

    cfg = video_run(model, data["video"], work, "video-rss", RSS_RUN_STEPS)
    preflight(cfg)
    out = work / "rss.jsonl"
    out.unlink(missing_ok=True)
    result = make_trainer(cfg, [worker_rss(out)]).fit()
    assert result.error is None, result.error
    read = {r["step"]: r for r in common.read_clock(out)}
    assert sorted(read) == list(RSS_STEPS), f"reads at steps {sorted(read)}"
    first, last = (read[s] for s in RSS_STEPS)
    total = {s: read[s]["worker"] + read[s]["children"] for s in RSS_STEPS}
    growth = total[RSS_STEPS[1]] / total[RSS_STEPS[0]] - 1
    mib = 1 << 20
    common.write_result(
        args,
        "video_pipeline_rss",
        {
            "setup": {
                "workers": 1,
                "data_workers": 1,
                "clip": f"H.264 MP4, {edge} px a side, {SECONDS} s at {FPS} fps, 6 frames taken",
                "steps_per_run": RSS_RUN_STEPS,
                "run": "bench/run.yaml on a tiny qwen2_vl, 1 worker, global batch 4, 16 rows",
                "read": "psutil RSS of the Train worker process and of its children (the input pipeline), "
                "from the controller when the report of the step arrives (a report every step)",
            },
            **({"note": args.note} if args.note else {}),
            "figures": {
                f"step_{s}": {
                    "worker_mib": read[s]["worker"] / mib,
                    "children_mib": read[s]["children"] / mib,
                    "child_processes": read[s]["child_processes"],
                    "total_mib": total[s] / mib,
                }
                for s in RSS_STEPS
            },
            "ratios": {
                "total_growth": growth,
                "worker_growth": last["worker"] / first["worker"] - 1,
            },
            "goal": {
                "text": "a worker's RSS (its input pipeline's included) grows by at most 5% from step 10 "
                "to step 100",
                "value": growth,
                "met": growth <= 0.05,
            },
        },
    )
    print(json.dumps({"rss_growth_step_10_to_100": growth}))


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--edge", type=int, default=None, help="clip width and height in pixels")
    p.add_argument("--rss", action="store_true", help="the worker's memory over 110 steps instead")
    p.add_argument("--note", default=None, help="a note kept with the result (the machine's load, ...)")
    args = p.parse_args()
    reps = common.repeats(args, 3)
    steps, warmup, edge = (5, 2, 128) if args.tiny else (20, 4, args.edge or 512)
    work = Path(args.work) / "video_pipeline"
    shutil.rmtree(work / "ray", ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    from raylora.assets import make_tiny_model

    model = work / "qwen2_vl"  # built here: a folder from before the video template would not serve
    if not (model / "config.json").is_file():
        make_tiny_model(model, "qwen2_vl")
    data = write_rows(work, 16, edge)
    if args.rss:
        with common.local_ray():
            measure_rss(args, model, data, work, edge)
        return
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    pairs: list[float] = []
    with common.local_ray():
        from raylora.driver import make_trainer, preflight

        for rep in range(reps):
            for variant in VARIANTS if rep % 2 == 0 else VARIANTS[::-1]:  # who goes first takes turns
                cfg = video_run(model, data[variant], work, f"video-{variant}-{rep}", steps)
                preflight(cfg)
                clock = work / f"clock-{variant}-{rep}.jsonl"
                clock.unlink(missing_ok=True)
                result = make_trainer(cfg, [common.step_clock(clock)]).fit()
                assert result.error is None, result.error
                rows = common.read_clock(clock)
                assert [r["step"] for r in rows] == list(range(1, steps + 1)), "a step's row is missing"
                samples[variant].append(seconds_per_step(rows, warmup))
            pairs.append(samples["predecoded"][-1] / samples["video"][-1])  # steps/s, video over pre-decoded
    ratio = common.median(pairs)
    common.write_result(
        args,
        "video_pipeline",
        {
            "setup": {
                "workers": 1,
                "data_workers": 1,
                "clip": f"H.264 MP4, {edge} px a side, {SECONDS} s at {FPS} fps, 6 frames taken",
                "predecoded": "the same 6 frames a row as BMP images, taken as they are",
                "steps_per_run": steps,
                "warmup_steps_left_out": warmup,
                "run": "bench/run.yaml on a tiny qwen2_vl, 1 worker, global batch 4",
                "pairs": reps,
                "order": "video first in even pairs, pre-decoded first in odd ones",
            },
            **({"note": args.note} if args.note else {}),
            "figures": {f"{k}_seconds_per_step": common.summary(v) for k, v in samples.items()},
            "ratios": {"video_over_predecoded_steps_per_s": common.summary(pairs)},
            "goal": {
                "text": "the input pipeline hides decoding: at least 0.95 of pre-decoded steps per second "
                "(the median of the pairs' ratios)",
                "value": ratio,
                "met": ratio >= 0.95,
            },
        },
    )
    print(json.dumps({"video_over_predecoded_steps_per_s": ratio, "pairs": pairs}))


if __name__ == "__main__":
    main()
