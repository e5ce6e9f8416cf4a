"""Peak memory per rank of a long-sequence tiny model, with each memory control off and on.

A tiny Qwen2-VL (2 workers, ZeRO-3 on CPU, LoRA plus a trained vision tower) given what makes a real one
run out of memory: a 32k vocabulary, a processor that keeps images as large as they come, like
Qwen2-VL-7B's (up to 16384 image tokens), 256x256 images (1024 image tokens each) and every other
prompt 1500 words long. Each configuration runs in its own Ray worker group: the model and engine are
built, freed heap is returned to the system (malloc_trim), the peak resident set size is reset
(/proc/self/clear_refs), and the peak (VmHWM) of the steps that follow is read on each rank.
"step_peak" is that peak above the rank's resident size before the steps: what training needs beyond
the model, engine and data it holds (ZeRO-3's optimizer state, created at the first step, included).

Controls, the settings a user turns: `train.gradient_checkpointing`, `data.max_pixels` and
`data.max_length`. raylora's loss computes the logits of answer positions only, always (`raylora.loss`);
what the logits of every position would add is arithmetic, in bench/on_paper.py.
"""

from __future__ import annotations

import gc
import io
import json
import shutil
import time
from pathlib import Path

import common

VOCAB = 32064  # llava-1.5-7b's; Qwen2-VL-7B's is 152064
WIDTH, LAYERS = 256, 4
IMAGE_EDGE = 256  # pixels a side: 1024 image tokens at 8 px per merged token
LONG_PROMPT_WORDS = 1500
MAX_PIXELS = 128 * 128  # 256 image tokens
MAX_LENGTH = 1500  # between the short rows (about 1040 tokens) and the long ones (about 2500)
# The processor's own limits, as Qwen2-VL-7B's (min_pixels 56*56, max_pixels 16384 tokens) scaled to the
# tiny model's 8 px per merged token.
PROCESSOR_MIN_PIXELS, PROCESSOR_MAX_PIXELS = 4 * 64, 16384 * 64

CONTROLS = ("gradient_checkpointing", "max_pixels", "max_length")


def long_sequence_model(work: str | Path, tiny: bool) -> str:
    """The tiny Qwen2-VL with a 32k vocabulary and Qwen2-VL-7B's image size limits, built once."""
    from transformers.image_utils import SizeDict

    from raylora.assets import build_tiny_model

    width, layers = (64, 2) if tiny else (WIDTH, LAYERS)
    folder = Path(work) / "models" / f"qwen2_vl-long-w{width}-l{layers}-v{VOCAB}"
    if not (folder / "config.json").is_file():
        model, processor = build_tiny_model("qwen2_vl", width=width, layers=layers)
        model.resize_token_embeddings(VOCAB)  # rows no word uses, as in a real vocabulary
        processor.image_processor.size = SizeDict(
            shortest_edge=PROCESSOR_MIN_PIXELS, longest_edge=PROCESSOR_MAX_PIXELS
        )
        model.save_pretrained(folder)
        processor.save_pretrained(folder)
    return str(folder)


def long_sequence_data(work: str | Path, tiny: bool) -> str:
    """16 digits, upscaled; every other prompt LONG_PROMPT_WORDS words long."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    from raylora.assets import PROMPT

    edge, words = (64, 200) if tiny else (IMAGE_EDGE, LONG_PROMPT_WORDS)
    path = Path(work) / "digits" / f"long-e{edge}-w{words}.parquet"
    if not path.is_file():
        rows = pq.read_table(common.digits(work)).slice(0, 16).to_pylist()
        long_prompt = " ".join((PROMPT.split() * words)[:words])
        for i, row in enumerate(rows):
            image = Image.open(io.BytesIO(row["image"])).resize((edge, edge), Image.NEAREST)
            buf = io.BytesIO()
            image.save(buf, format="PNG")
            row["image"], row["prompt"] = buf.getvalue(), long_prompt if i % 2 else row["prompt"]
        pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def sample_lengths(model_dir: str, train_file: str, max_pixels: int | None) -> dict:
    """Tokens of a short and a long sample and image tokens per image, as the processor makes them."""
    from raylora.data.batches import make_batch, read
    from raylora.data.formats import open_rows
    from raylora.data.processor import load_processor

    processor = load_processor(model_dir, max_pixels)
    data = open_rows(train_file)
    short, long = (make_batch(processor, [read(data, i)]) for i in (0, 1))
    return {
        "short_sample_tokens": int(short["attention_mask"].sum()),
        "long_sample_tokens": int(long["attention_mask"].sum()),
        "image_tokens": int((short["input_ids"] == processor.image_token_id).sum()),
    }


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure_on_rank(cfg, steps: int) -> list[dict]:
    """On each rank: build, reset the peak, train `steps` steps; every rank's figures (on rank 0)."""
    import ctypes

    import torch.distributed as dist

    from raylora.worker import setup, train_step

    s = setup(cfg, None)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand what building freed back, so it does not hide the steps'
    dist.barrier()
    before = _rss_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    rows = [train_step(s) for _ in range(steps)]
    mine = {
        "rank": s.rank,
        "rss_before_mb": before / 1024,
        "peak_rss_mb": _rss_kb("VmHWM") / 1024,
        "too_long": sum(r["too_long"] for r in rows),
        "loss": [r["loss"] for r in rows],
    }
    everyone = [None] * s.world_size
    dist.all_gather_object(everyone, mine)
    return everyone


def configurations(tiny: bool) -> dict[str, set[str]]:
    """Name -> controls on: all off, each alone, all on (--tiny: all off and all on)."""
    names = {"all off": set()}
    if not tiny:
        names.update({f"{c} only": {c} for c in CONTROLS})
    names["all on"] = set(CONTROLS)
    return names


def main() -> None:
    args = common.parser(__doc__).parse_args()
    work = Path(args.work) / "memory"
    shutil.rmtree(work, ignore_errors=True)  # a run folder left from before would be taken for a resume
    steps = 1 if args.tiny else 3
    model_dir = long_sequence_model(args.work, args.tiny)
    train_file = long_sequence_data(args.work, args.tiny)
    max_length = 150 if args.tiny else MAX_LENGTH
    rows = {}
    with common.local_ray():
        for name, on in configurations(args.tiny).items():
            overrides = [
                f"train.max_steps={steps}",
                "train.global_batch_size=4",
                "train.micro_batch_size=1",
                f"train.gradient_checkpointing={'gradient_checkpointing' in on}",
                *([f"data.max_pixels={MAX_PIXELS}"] if "max_pixels" in on else []),
                *([f"data.max_length={max_length}"] if "max_length" in on else []),
            ]
            cfg = common.run_config(
                model_dir, train_file, work, name.replace(" ", "-"), common.NO_CHECKPOINTS, *overrides
            )
            start = time.perf_counter()
            ranks = common.on_workers(lambda cfg=cfg: measure_on_rank(cfg, steps), work, cfg.run.name)
            step_peaks = [r["peak_rss_mb"] - r["rss_before_mb"] for r in ranks]
            rows[name] = {
                "controls_on": sorted(on),
                "peak_rss_mb": common.summary([r["peak_rss_mb"] for r in ranks]),
                "step_peak_mb": common.summary(step_peaks),
                # the ranks train on different samples: the one with the longest ones sets what must fit
                "largest_rank_step_peak_mb": max(step_peaks),
                "rss_before_mb": common.summary([r["rss_before_mb"] for r in ranks]),
                "too_long_samples": ranks[0]["too_long"],
                "loss": ranks[0]["loss"],
                "seconds": time.perf_counter() - start,
                **sample_lengths(model_dir, train_file, MAX_PIXELS if "max_pixels" in on else None),
            }
            print(name, json.dumps(rows[name]["step_peak_mb"]))
    off = rows["all off"]["largest_rank_step_peak_mb"]
    lowered = {n: row["largest_rank_step_peak_mb"] < off for n, row in rows.items() if n != "all off"}
    common.write_result(
        args,
        "memory",
        {
            "setup": {
                "model": f"tiny Qwen2-VL, width {64 if args.tiny else WIDTH}, {2 if args.tiny else LAYERS} "
                f"layers (language model and vision tower), vocabulary {VOCAB}, processor pixel limits "
                f"[{PROCESSOR_MIN_PIXELS}, {PROCESSOR_MAX_PIXELS}] (Qwen2-VL-7B's, scaled to 8 px per token)",
                "data": "16 digits upscaled, every other prompt long; "
                "global batch 4, micro batch 1, 2 workers (2 micro batches per rank per step)",
                "training": "ZeRO-3 on CPU (gloo), fp32, LoRA r=4 plus the vision tower and aligner trained",
                "measured_steps": steps,
                "max_pixels_when_on": MAX_PIXELS,
                "max_length_when_on": max_length,
                "figures": "MB per rank (both ranks' samples, their median, and the largest); step_peak = "
                "VmHWM during the measured steps minus VmRSS before them",
            },
            "configurations": rows,
            "goal": {
                "text": "each control, and all of them together, lowers the largest rank's step peak below "
                "all off",
                "lowered": lowered,
                "met": all(lowered.values()),
            },
        },
    )


if __name__ == "__main__":
    main()
