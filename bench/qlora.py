"""QLoRA against LoRA on the demo's digits: held-out accuracy and CPU steps per second, both in bf16.

    python bench/qlora.py            # the demo's 400 steps per side, to bench/results/qlora.json

Each side is `raylora demo` without its fault drill (`raylora.demo.demo`): LoRA on the bf16 language model,
and QLoRA on its NF4 quantization (`model.quantization=nf4`). The QLoRA adapter is scored twice: on the
4-bit base it was trained against (`raylora eval`'s default), and merged into the base's original weights
(`raylora export --merge`), which is the model a user serves from the merged folder.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from common import parser, write_result

SIDES = {
    "lora_bf16": ["train.precision=bf16"],
    "qlora_nf4_bf16": ["train.precision=bf16", "model.quantization=nf4"],
}


def main() -> None:
    args = parser(__doc__).parse_args()
    from transformers import AutoModelForImageTextToText

    from raylora.data.processor import load_processor
    from raylora.demo import demo
    from raylora.evaluate import evaluate
    from raylora.export import export
    from raylora.progress import read_metrics

    steps = 20 if args.tiny else 400
    sides = {}
    for name, overrides in SIDES.items():
        out = Path(args.work) / "qlora" / name
        summary = demo(out, failure=False, overrides=[*overrides, f"train.max_steps={steps}"])
        rows = read_metrics(str(out / "ray"), "demo")
        batch = rows[-1].get("global_batch_size", 16)
        side = {
            "eval_accuracy": summary["eval_accuracy"],
            "eval_loss": summary["eval_loss"],
            "steps_per_s": statistics.median(r["samples_per_s"] for r in rows[1:] or rows) / batch,
            "checkpoint_bytes": summary["checkpoint_bytes"],
            "wall_s": summary["wall_s"],
        }
        if "model.quantization=nf4" in overrides:
            merged = out / "merged"
            export(summary["checkpoint_path"], merged, merge=True, device="cpu")
            model = AutoModelForImageTextToText.from_pretrained(merged)
            scores = evaluate(model, load_processor(merged), str(out / "data" / "eval.parquet"))
            side["merged_eval_accuracy"] = scores["accuracy"]
            side["merged_eval_loss"] = scores["loss"]
        sides[name] = side
    lora, qlora = sides["lora_bf16"], sides["qlora_nf4_bf16"]
    write_result(
        args,
        "qlora",
        {
            "steps": steps,
            "sides": sides,
            "qlora_over_lora_steps_per_s": qlora["steps_per_s"] / lora["steps_per_s"],
            "note": "2 Ray workers under ZeRO-3 on the CPU; bitsandbytes' CPU kernels, not its CUDA ones",
        },
    )


if __name__ == "__main__":
    main()
