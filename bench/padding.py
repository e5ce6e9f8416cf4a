"""How much of each step computes on padding: the token positions of a step's micro batches that are
padding, on length mixes like the data raylora's 7B configs are shipped for, at their micro batch sizes.

Every micro batch is padded to its longest sample. Two synthetic mixes, each a stated model of its data
(the assumptions are written into the JSON):
- LLaVA-Instruct-like (`jobs/llava-1.5-7b.yaml`): multi-turn conversations (1 + a geometric number of
  further question/answer pairs), question and answer lengths log-normal (answers long-tailed), one
  336x336 image (576 tokens) in most rows and none in the text-only rest;
- Qwen2-VL-like (`jobs/qwen2-vl-7b.yaml`): one image per row at a log-uniform pixel area and a common
  aspect ratio, its tokens by Qwen2-VL's own resolution rule (transformers' `smart_resize`, 28-pixel
  patches merged 2x2, under the config's `data.max_pixels`), and a shorter text.
Samples longer than `data.max_length` are skipped as training skips them (a stand-in takes the slot).
Steps are cut as raylora cuts them (`GlobalSampler.micro_batches` over the config's world size), and
once more with each rank's share sorted by length before it is cut (the same samples per step).

The figure is the fraction of positions that are padding, and 1 / (1 - p), the most that removing the
padding can speed a step up by. Arithmetic only: no model runs here (the useful tokens per second of real
steps are issue 22's next part).
"""

from __future__ import annotations

import json

import common
import numpy as np

from raylora import config
from raylora.data.sampler import GlobalSampler

SAMPLES = 20_000
STEPS = 100
SEED = 0


def llava_instruct_lengths(rng: np.random.Generator, n: int) -> tuple[np.ndarray, dict]:
    """Token lengths of `n` LLaVA-Instruct-like conversations (llava-1.5's template and 576-token image)."""
    model = {
        "turns": "1 + geometric(p=0.45), at most 10 question/answer pairs",
        "question_tokens": "lognormal(median 18, sigma 0.8)",
        "answer_tokens": "lognormal(median 55, sigma 1.1), at most 1500",
        "template_tokens": "12 per pair, 30 for the system line",
        "image": "576 tokens (336/14 squared) in 93% of rows, none in the rest (text-only rows)",
    }
    turns = 1 + np.minimum(rng.geometric(0.45, n) - 1, 9)
    lengths = np.full(n, 30)
    for i, t in enumerate(turns):
        questions = rng.lognormal(np.log(18), 0.8, t)
        answers = np.minimum(rng.lognormal(np.log(55), 1.1, t), 1500)
        lengths[i] += int(questions.sum() + answers.sum()) + 12 * t
    lengths += np.where(rng.random(n) < 0.93, 576, 0)
    return lengths, model


def qwen2_vl_lengths(rng: np.random.Generator, n: int, max_pixels: int) -> tuple[np.ndarray, dict]:
    """Token lengths of `n` Qwen2-VL-like rows: one image of mixed size under `max_pixels`, a short text."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize  # no torchvision

    model = {
        "image_area": "log-uniform between 224x224 and 2048x2048 pixels",
        "aspect": "one of 1, 4/3, 3/4, 16/9, 9/16, 2, 1/2",
        "image_tokens": f"(h/28)*(w/28) after smart_resize(factor 28, max_pixels {max_pixels}), +2",
        "text_tokens": "lognormal(median 60, sigma 1.0), at most 2000, +25 for the template",
    }
    aspects = np.array([1, 4 / 3, 3 / 4, 16 / 9, 9 / 16, 2, 1 / 2])
    area = np.exp(rng.uniform(np.log(224 * 224), np.log(2048 * 2048), n))
    aspect = aspects[rng.integers(0, len(aspects), n)]
    text = np.minimum(rng.lognormal(np.log(60), 1.0, n), 2000).astype(int) + 25
    lengths = np.empty(n, dtype=int)
    for i in range(n):
        h, w = int(np.sqrt(area[i] / aspect[i])), int(np.sqrt(area[i] * aspect[i]))
        rh, rw = smart_resize(h, w, factor=28, max_pixels=max_pixels)
        lengths[i] = (rh // 28) * (rw // 28) + 2 + text[i]
    return lengths, model


def padding(lengths: np.ndarray, cfg, stand_in: int, sort: bool, steps: int) -> dict:
    """Padding fraction of each of `steps` steps, as the workers of `cfg` would cut them."""
    workers = cfg.scaling.num_workers
    world = workers if isinstance(workers, int) else max(workers)
    sampler = GlobalSampler(len(lengths), cfg.train.global_batch_size, SEED)
    micro = cfg.train.micro_batch_size
    limit = cfg.data.max_length or np.inf
    fractions, skipped = [], 0
    for step in range(steps):
        useful = positions = 0
        for rank in range(world):
            batches = sampler.micro_batches(step, rank, world, micro)
            if sort:  # the same samples, ordered by length before they are cut
                share = sorted((i for b in batches for i in b if i is not None), key=lambda i: lengths[i])
                batches = [share[k : k + micro] for k in range(0, len(share), micro)] + [
                    [None] for b in batches if b == [None]
                ]
            for batch in batches:
                kept = [int(lengths[i]) if i is not None and lengths[i] <= limit else stand_in for i in batch]
                skipped += sum(i is not None and lengths[i] > limit for i in batch)
                useful += sum(
                    k for k, i in zip(kept, batch, strict=True) if i is not None and lengths[i] <= limit
                )
                positions += max(kept) * len(batch)
        fractions.append(1 - useful / positions)
    return {
        "padding_fraction": common.summary(fractions),
        "speedup_bound": 1 / (1 - common.median(fractions)),
        "skipped_too_long": int(skipped),
    }


def main() -> None:
    args = common.parser(__doc__).parse_args()
    steps, n = (10, 2_000) if args.tiny else (STEPS, SAMPLES)
    rng = np.random.default_rng(SEED)
    llava = config.load("jobs/llava-1.5-7b.yaml", [])
    qwen = config.load("jobs/qwen2-vl-7b.yaml", [])
    mixes = {}
    for name, cfg, (lengths, model), stand_in in (
        ("llava_instruct", llava, llava_instruct_lengths(rng, n), 576 + 20),
        ("qwen2_vl", qwen, qwen2_vl_lengths(rng, n, qwen.data.max_pixels), 4 + 2 + 25),
    ):
        mixes[name] = {
            "config": {
                "global_batch_size": cfg.train.global_batch_size,
                "micro_batch_size": cfg.train.micro_batch_size,
                "num_workers": cfg.scaling.num_workers,
                "max_length": cfg.data.max_length,
            },
            "length_model": model,
            "lengths": {q: int(np.percentile(lengths, q)) for q in (0, 5, 50, 95, 100)},
            "as_cut_today": padding(lengths, cfg, stand_in, False, steps),
            "sorted_within_rank": padding(lengths, cfg, stand_in, True, steps),
        }
    common.write_result(
        args,
        "padding",
        {
            "setup": {"samples": n, "steps": steps, "seed": SEED},
            "mixes": mixes,
            "goal": {
                "text": "measure the padding share first (issue 22, part 1); packing is to remove it",
                "met": None,
            },
            "notes": [
                "Synthetic lengths from the stated models, not a data set: the shares move with them.",
                "A skipped (too long) sample's slot holds the stand-in, as in training.",
            ],
        },
    )
    print(json.dumps({k: (v["as_cut_today"], v["sorted_within_rank"]) for k, v in mixes.items()}, indent=1))


if __name__ == "__main__":
    main()
