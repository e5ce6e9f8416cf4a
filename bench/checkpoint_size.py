"""Checkpoint bytes and save time, three ways, on the same trained ZeRO-3 state (2 Ray workers, CPU).

1. raylora: `worker.save_checkpoint` (zero.gather_trainable_state + checkpoint.save on rank 0).
2. Ray's DeepSpeed example: every rank calls `engine.save_checkpoint(dir)`.
3. Hugging Face Trainer with PEFT under ZeRO-3: `engine.save_checkpoint(dir, exclude_frozen_parameters=True)`
   plus the 16-bit consolidated export (`engine._zero3_consolidated_16bit_state_dict()`, what accelerate's
   `get_state_dict` calls; the adapter and trained modules kept, as bf16 safetensors).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import common


def probe(cfg, out_dir: str, steps: int, reps: int) -> dict:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from raylora import checkpoint, worker
    from raylora.model import base_name, is_lora

    s = worker.setup(cfg, None)
    for _ in range(steps):
        worker.train_step(s)
    out = Path(out_dir)
    rank = s.rank
    trainable = sum(int(p.ds_numel) for p in s.params.values())
    frozen = sum(int(p.ds_numel) for p in s.engine.module.parameters() if not p.requires_grad)

    def raylora_save():
        ckpt = worker.save_checkpoint(s)
        return ckpt.path if ckpt is not None else None

    def deepspeed_save(folder: Path):
        s.engine.save_checkpoint(str(folder), tag="ckpt")

    def hf_save(folder: Path):
        s.engine.save_checkpoint(str(folder), tag="ckpt", exclude_frozen_parameters=True)
        state = s.engine._zero3_consolidated_16bit_state_dict()  # every rank gathers; rank 0 holds it
        if rank == 0:
            adapter = {}
            for key, tensor in state.items():
                name = base_name(key)
                if name in s.params:
                    adapter[checkpoint.adapter_key(name) if is_lora(name) else name] = tensor.to(
                        torch.bfloat16
                    )
            folder.mkdir(parents=True, exist_ok=True)
            save_file(adapter, folder / "adapter_model.safetensors", metadata={"format": "pt"})
            s.engine.module.peft_config["default"].save_pretrained(str(folder))

    samples: dict[str, dict[str, list]] = {k: {"seconds": [], "bytes": []} for k in WAYS}
    files: dict[str, dict[str, int]] = {}
    for rep in range(reps):
        for way in WAYS:
            folder = out / f"{way}-{rep}"
            if way == "raylora":
                seconds, path = common.barrier_time(raylora_save)
                if rank == 0:
                    shutil.move(path, folder)
            else:
                fn = deepspeed_save if way == "deepspeed_full" else hf_save
                seconds, _ = common.barrier_time(lambda fn=fn, folder=folder: fn(folder))
            dist.barrier()
            if rank == 0:
                samples[way]["seconds"].append(seconds)
                samples[way]["bytes"].append(common.folder_bytes(folder))
                files[way] = {
                    str(p.relative_to(folder)): p.stat().st_size
                    for p in sorted(folder.rglob("*"))
                    if p.is_file()
                }
            dist.barrier()
            if rank == 0 and rep < reps - 1:
                shutil.rmtree(folder)
            dist.barrier()
    if rank != 0:
        return {}
    return {
        "trainable_params": trainable,
        "frozen_params": frozen,
        "num_trainable_tensors": len(s.params),
        "samples": samples,
        "files": files,
    }


WAYS = ("raylora", "deepspeed_full", "hf_trainer_peft")
SMALL_FILES = ("adapter_config.json", "state.json", "manifest.json")


# (label, width, layers, LoRA rank): bench/run.yaml's tiny model, and one whose tensors have the sizes of a
# real LoRA run's (rank 16, 256 wide), where the safetensors headers (about 130 bytes a tensor a file) weigh
# what they weigh at 7B. --tiny measures the first at width 32 only.
SIZES = [("tiny", 64, 2, 4), ("rank 16, width 256", 256, 2, 16)]


def measure(args, work: Path, label: str, width: int, layers: int, rank: int, steps: int, reps: int) -> dict:
    model = common.tiny_model(args.work, width, layers)
    lora = [f"lora.r={rank}", f"lora.alpha={2 * rank}"]
    cfg = common.run_config(
        model, common.digits(args.work), work / "ray", "checkpoint-size", common.NO_CHECKPOINTS, *lora
    )
    out = str(work / "out" / label.replace(" ", "-").replace(",", ""))
    r = common.on_workers(lambda: probe(cfg, out, steps, reps), work / "ray", "ckpt-size")

    s = r["samples"]
    med = {w: {k: common.median(v) for k, v in s[w].items()} for w in WAYS}
    raylora_files = r["files"]["raylora"]
    small = sum(raylora_files.get(f, 0) for f in SMALL_FILES)
    tensor_bytes = med["raylora"]["bytes"] - small
    ideal = 12 * r["trainable_params"]
    figures = {
        "raylora_bytes": common.summary(s["raylora"]["bytes"]),
        "raylora_save_seconds": common.summary(s["raylora"]["seconds"]),
        "deepspeed_full_bytes": common.summary(s["deepspeed_full"]["bytes"]),
        "deepspeed_full_save_seconds": common.summary(s["deepspeed_full"]["seconds"]),
        "hf_trainer_peft_bytes": common.summary(s["hf_trainer_peft"]["bytes"]),
        "hf_trainer_peft_save_seconds": common.summary(s["hf_trainer_peft"]["seconds"]),
        "raylora_small_files_bytes": small,
        "raylora_tensor_file_bytes": tensor_bytes,
        "raylora_bytes_per_trainable_param_tensor_files": tensor_bytes / r["trainable_params"],
        "raylora_bytes_per_trainable_param_all_files": med["raylora"]["bytes"] / r["trainable_params"],
        "raylora_vs_12_bytes_per_param_plus_small_files": med["raylora"]["bytes"] / (ideal + small),
    }
    ratios = {
        "deepspeed_full_over_raylora_bytes": med["deepspeed_full"]["bytes"] / med["raylora"]["bytes"],
        "hf_trainer_peft_over_raylora_bytes": med["hf_trainer_peft"]["bytes"] / med["raylora"]["bytes"],
        "deepspeed_full_over_raylora_save_seconds": med["deepspeed_full"]["seconds"]
        / med["raylora"]["seconds"],
        "hf_trainer_peft_over_raylora_save_seconds": med["hf_trainer_peft"]["seconds"]
        / med["raylora"]["seconds"],
    }
    return {
        "size": label,
        "setup": {
            "model": f"tiny llava width {width}, {layers}+{layers} layers",
            "trained": f"LoRA r={rank} on every linear layer of the language model, vision tower and "
            "aligner fully",
            "trainable_params": r["trainable_params"],
            "frozen_params": r["frozen_params"],
            "trainable_tensors": r["num_trainable_tensors"],
        },
        "figures": figures,
        "ratios": ratios,
        "files_of_last_repeat": r["files"],
    }


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--steps", type=int, default=None, help="training steps before saving (default 3)")
    args = p.parse_args()
    reps = common.repeats(args, 5)
    steps = args.steps or (1 if args.tiny else 3)
    work = Path(args.work) / "checkpoint_size"
    shutil.rmtree(work, ignore_errors=True)
    sizes = [("tiny", 32, 1, 4)] if args.tiny else SIZES
    with common.local_ray():
        results = [measure(args, work, *size, steps=steps, reps=reps) for size in sizes]
    values = {r["size"]: r["figures"]["raylora_vs_12_bytes_per_param_plus_small_files"] for r in results}
    common.write_result(
        args,
        "checkpoint_size",
        {
            "setup": {
                "workers": 2,
                "zero_stage": 3,
                "training_steps_before_saving": steps,
                "repeats": reps,
            },
            "sizes": results,
            "goal": {
                "text": (
                    "raylora checkpoint within 2% of 12 bytes per trainable parameter plus its small files"
                ),
                "value_by_size": values,
                "judged_at": results[-1]["size"],
                "met": values[results[-1]["size"]] <= 1.02,
            },
            "notes": [
                "Bytes are every file each way writes (all ranks' files for the DeepSpeed ways); seconds "
                "are wall time over both ranks (barriers before and after), medians of the repeats.",
                "What raylora stores beyond 12 bytes per parameter is the safetensors header: about 130 "
                "bytes per tensor in each of the three tensor files, which is a few percent of a 64-wide "
                "rank-4 model's kilobyte-sized tensors and a fraction of a percent at realistic sizes "
                "(bench/on_paper.py: 1.0001-1.0005x at 7B). The goal is judged at the larger size; the "
                "tiny one is reported beside it.",
                "The runs are fp32 on CPU; the Hugging Face export is cast to bf16 as it would be with bf16 "
                "on GPU.",
                "The Hugging Face way gathers the whole model to rank 0 (accelerate's get_state_dict under "
                "ZeRO-3) and keeps the trainable tensors, as PEFT's save_pretrained would.",
                "Under ZeRO-3, engine.save_checkpoint writes, per rank, that rank's fragment of every "
                "frozen parameter (frozen_param_fragments in the model states file, in the model's dtype) "
                "plus the fp32 partitions and Adam moments of the trainable ones; "
                "exclude_frozen_parameters=True leaves the frozen fragments out. See files_of_last_repeat.",
            ],
        },
    )
    print(
        json.dumps({r["size"]: {"figures": r["figures"], "ratios": r["ratios"]} for r in results}, indent=1)
    )


if __name__ == "__main__":
    main()
