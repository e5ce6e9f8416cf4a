"""`raylora demo`: the whole path on one machine, offline, in a few minutes.

Tiny Llava from config classes, the handwritten digits from scikit-learn, 2 Ray workers under
ZeRO-3, one worker killed mid-run, Ray restarts and raylora resumes, then held-out accuracy.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

from raylora import checkpoint, config
from raylora.assets import make_digits, make_tiny_model

# Tuned on this tiny model: LoRA at 1e-3, the fully trained vision tower and projector at 1e-4.
DEMO_WIDTH = 96
DEMO_SETTINGS = [
    "train.max_steps=400",
    "train.global_batch_size=16",
    "train.micro_batch_size=8",
    "train.lr=1e-3",
    "train.vision_lr=1e-4",
    "train.warmup_steps=20",
    "train.checkpoint_every=100",
    "train.eval_every=100",
    "train.eval_samples=128",
    "train.freeze_vision=false",
    "train.freeze_aligner=false",
    "lora.r=16",
    "lora.alpha=64",
    "lora.dropout=0.0",
    "scaling.num_workers=2",
    "run.max_failures=2",
    "run.num_to_keep=2",
    # The digits are 8x8 images: a step's batches take less to build inline than to hand over from a
    # pipeline process, which competes with the workers for the machine's cores (dev/LOG.md).
    "data.workers=0",
]


def demo(
    out: str | Path = "runs/demo",
    failure: bool = True,
    arch: str = "llava",
    overrides: list[str] | None = None,
) -> dict:
    """Run the demo under `out` and return (and write) its summary."""
    from raylora.driver import run
    from raylora.evaluate import evaluate, load_for_inference
    from raylora.plot import plot
    from raylora.ray_runtime import init_ray
    from raylora.tiny import TEMPLATE_KWARGS

    started = time.perf_counter()
    out = Path(out).absolute()
    model_dir, data_dir = out / "model", out / "data"
    make_tiny_model(model_dir, arch, width=DEMO_WIDTH)
    train_file, eval_file = make_digits(data_dir)
    run_name = "demo"
    # The demo always starts over: its run folder is its own scratch space, never a user's run.
    shutil.rmtree(out / "ray" / run_name, ignore_errors=True)
    settings = DEMO_SETTINGS + [
        f"model.path={model_dir}",
        f"data.train={train_file}",
        f"data.eval={eval_file}",
        f"run.storage_path={out / 'ray'}",
        f"run.name={run_name}",
    ]
    if arch in TEMPLATE_KWARGS:  # the digits' answers hold no reasoning (docs/data.md: Reasoning templates)
        settings.append(f"data.chat_template_kwargs={json.dumps(TEMPLATE_KWARGS[arch])}")
    if failure:
        settings.append("fault.kill_at_steps=250")
    cfg = config.load(None, settings + list(overrides or []))
    init_ray(num_cpus=max(os.cpu_count() or 2, cfg.world_size))
    result = run(cfg)
    if result.error:
        raise result.error
    with result.checkpoint.as_directory() as folder:
        state = checkpoint.read_state(folder)
        ckpt_bytes = sum(f.stat().st_size for f in Path(folder).iterdir() if f.is_file())
        model, processor = load_for_inference(folder, str(model_dir))
    scores = evaluate(model, processor, str(eval_file))
    trainable = sum(math.prod(shape) for shape in state.trainable.values())
    base_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    summary = {
        "arch": arch,
        "steps": state.step,
        "restarts": state.restarts,
        "final_loss": result.metrics.get("loss"),
        "eval_accuracy": scores["accuracy"],
        # answers the model ended with its stop token, within a budget well past the answer's length
        "eval_stopped": scores["stopped_fraction"],
        "eval_loss": scores["loss"],
        "eval_samples": scores["samples"],
        "trainable_params": trainable,
        "checkpoint_bytes": ckpt_bytes,
        "checkpoint_bytes_per_trainable_param": ckpt_bytes / trainable,
        "base_model_bytes": base_bytes,
        "checkpoint_path": result.checkpoint.path,
        "plot": plot(str(out / "ray" / run_name), str(out / "loss.png")),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
