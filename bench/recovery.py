"""Seconds from a worker's death to the first step after the resume, against a cold start of the run.

One raylora run on 2 Ray workers per repeat, checkpoints every 2 steps, with the fault drill
`fault.kill_at_steps=[K]` (K odd): rank 1 kills itself before step K+1, one step after the step-(K-1)
checkpoint, so the restarted group resumes from step K-1. In the same run:
- cold start: from the trainer's `fit()` to the controller receiving step 1;
- recovery: from the kill (the drill's marker file, written just before SIGKILL) to the controller
  receiving the first step of the restarted worker group.
Both include starting a worker group, importing, building the ZeRO-3 model and one training step;
recovery adds Ray noticing the death, tearing the old group down, and restoring the checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import common


def main() -> None:
    from raylora.driver import make_trainer, preflight

    p = common.parser(__doc__)
    p.add_argument("--kill-at", type=int, default=None, help="step K of the drill, odd (default 5, --tiny 3)")
    args = p.parse_args()
    reps = common.repeats(args, 3)
    kill_at = args.kill_at or (3 if args.tiny else 5)
    every = 2
    expected_resume = kill_at // every * every
    work = Path(args.work) / "recovery"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    width, layers = (32, 1) if args.tiny else (64, 2)
    model, data = common.tiny_model(args.work, width, layers), common.digits(args.work)

    samples: dict[str, list[float]] = {"cold_start_s": [], "recovery_s": [], "ratio": []}
    resumed_from, load = [], []
    with common.local_ray():
        for rep in range(reps):
            cfg = common.run_config(
                model,
                data,
                work / "ray",
                f"recovery-{rep}",
                f"train.max_steps={kill_at + 2}",
                f"train.checkpoint_every={every}",
                f"fault.kill_at_steps=[{kill_at}]",
                "fault.kill_rank=1",
            )
            preflight(cfg)
            load.append(os.getloadavg()[0])
            clock = work / f"clock-{rep}.jsonl"
            trainer = make_trainer(cfg, [common.step_clock(clock)])
            started = time.time()
            result = trainer.fit()
            assert result.error is None, result.error
            rows = common.read_clock(clock)
            first = next(r for r in rows if r["restarts"] == 0)
            after = next(r for r in rows if r["restarts"] >= 1)
            marker = Path(cfg.run.storage_path) / cfg.run.name / f".raylora-drill-step{kill_at}"
            died = marker.stat().st_mtime
            cold, recovery = first["t"] - started, after["t"] - died
            samples["cold_start_s"].append(cold)
            samples["recovery_s"].append(recovery)
            samples["ratio"].append(recovery / cold)
            resumed_from.append(after["step"] - 1)

    ratio = common.median(samples["recovery_s"]) / common.median(samples["cold_start_s"])
    common.write_result(
        args,
        "recovery",
        {
            "setup": {
                "model": f"tiny llava width {width}, {layers}+{layers} layers",
                "workers": 2,
                "zero_stage": 3,
                "kill": f"rank 1 kills itself (SIGKILL) before step {kill_at + 1}",
                "checkpoint_every": every,
                "expected_resume_step": expected_resume,
                "resumed_from_step": resumed_from,
                "resumed_from_expected_step": all(s == expected_resume for s in resumed_from),
                "load_average_1min_before_each_run": load,
                "repeats": reps,
            },
            "figures": {
                "cold_start_s": common.summary(samples["cold_start_s"]),
                "recovery_s": common.summary(samples["recovery_s"]),
            },
            "ratios": {"recovery_over_cold_start": ratio, "per_run": samples["ratio"]},
            "goal": {"text": "recovery at most 1.2x a cold start", "value": ratio, "met": ratio <= 1.2},
            "notes": [
                "Times are wall clock on the driver's machine: fit() start, the drill's marker file mtime, "
                "and when Ray Train's controller received a step's report (a callback). Cold start and "
                "recovery come from the same run.",
                "Cold start does not include starting Ray itself (the cluster is up before the first run).",
                "The kill comes one step after a checkpoint, not right after one: a worker that dies right "
                "after ray.train.report(checkpoint=...) can die before Ray Train's controller takes that "
                "report, and the run then resumes from the checkpoint before it (seen with K=4, every 4: "
                "each run restarted from step 0).",
            ],
        },
    )
    print(json.dumps(samples, indent=1))


if __name__ == "__main__":
    main()
