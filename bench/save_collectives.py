"""Collective calls and wall time of gathering the trainable state for a save (2 Ray workers, ZeRO-3, CPU).

1. raylora: `zero.gather_trainable_state` (one gather per flat fp32 group carries masters and moments).
2. DeepSpeed's public per-parameter API: `safe_get_full_fp32_param` and `safe_get_full_optimizer_state`
   (exp_avg, exp_avg_sq) for every trainable parameter.

The LoRA target set and the number of layers vary, so the counts show what the collectives depend on.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import common
from restore_collectives import variants


def probe(runs: list, reps: int) -> list[dict]:
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from raylora import worker, zero
    from raylora.model import is_lora

    counter = None
    report = []
    for label, cfg in runs:
        s = worker.setup(cfg, None)
        worker.train_step(s)
        if counter is None:
            counter = common.CollectiveCounter().install()

        def per_parameter(s=s):
            return {
                n: (
                    safe_get_full_fp32_param(p),
                    safe_get_full_optimizer_state(p, "exp_avg"),
                    safe_get_full_optimizer_state(p, "exp_avg_sq"),
                )
                for n, p in s.params.items()
            }

        rows: dict[str, list] = {"batched": [], "per_param": []}
        for _ in range(reps):
            t, c, ours = common.counted_time(
                counter, lambda s=s: zero.gather_trainable_state(s.engine, s.params)
            )
            rows["batched"].append((t, c))
            t, c, public = common.counted_time(counter, per_parameter)
            rows["per_param"].append((t, c))
        same = None
        if s.rank == 0:
            weights, moments = ours
            same = all(
                torch.equal(weights[n], w)
                and torch.equal(moments[f"{n}.exp_avg"], m)
                and torch.equal(moments[f"{n}.exp_avg_sq"], v)
                for n, (w, m, v) in public.items()
            )
        report.append(
            {
                "label": label,
                "trainable_tensors": len(s.params),
                "lora_tensors": sum(is_lora(n) for n in s.params),
                "flat_groups": len(s.engine.optimizer.fp32_partitioned_groups_flat),
                "same_values": same,
                "rows": rows,
            }
        )
        del s
    return report if dist.get_rank() == 0 else []


def main() -> None:
    args = common.parser(__doc__).parse_args()
    reps = common.repeats(args, 3)
    work = Path(args.work) / "save_collectives"
    shutil.rmtree(work, ignore_errors=True)
    runs = variants(args, work)
    with common.local_ray():
        report = common.on_workers(lambda: probe(runs, reps), work / "ray", "save")

    rows = []
    for v in report:
        r = v["rows"]

        batched, per_param = (
            common.collective_figures(r["batched"]),
            common.collective_figures(r["per_param"]),
        )
        rows.append(
            {
                "variant": v["label"],
                "trainable_tensors": v["trainable_tensors"],
                "lora_tensors": v["lora_tensors"],
                "flat_groups": v["flat_groups"],
                "same_values": v["same_values"],
                "raylora_gather_trainable_state": batched,
                "per_parameter_safe_get_full": per_param,
                "ratios": {
                    "per_parameter_over_raylora_collectives": per_param["collectives"]["median"]
                    / max(1, batched["collectives"]["median"]),
                    "per_parameter_over_raylora_seconds": per_param["seconds"]["median"]
                    / batched["seconds"]["median"],
                },
            }
        )
    counts = {
        r["trainable_tensors"]: r["raylora_gather_trainable_state"]["collectives"]["median"] for r in rows
    }
    independent = len(set(counts.values())) == 1 and len(counts) > 1
    common.write_result(
        args,
        "save_collectives",
        {
            "setup": {
                "workers": 2,
                "zero_stage": 3,
                "trained": "LoRA r=4, vision tower and aligner fully (two flat fp32 groups: LoRA, modules)",
                "repeats": reps,
            },
            "variants": rows,
            "goal": {
                "text": "gather collectives independent of the number of trainable tensors",
                "raylora_collectives_by_trainable_tensors": counts,
                "met": independent,
            },
            "notes": [
                "Counts are collective calls made by rank 0, counted where they enter torch.distributed or "
                "deepspeed.comm, whichever comes first; barriers are not counted.",
                "same_values: raylora's gathered masters and moments equal DeepSpeed's per-parameter ones, "
                "bit for bit (last repeat).",
            ],
        },
    )
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
