"""The tool a user would pick instead of raylora: the Hugging Face Trainer with PEFT LoRA under DeepSpeed
ZeRO-3, on the tiny vision-language models and chat mixes that bench/padding.py's `measure` trains raylora
on, 2 processes on CPU (gloo): its useful (non-padding) tokens per second and each rank's peak memory.

What the HF side is, and why:
- `transformers.Trainer` and `TrainingArguments(deepspeed=ZERO3)`, set up as the HF docs set it up:
  TrainingArguments first, so `from_pretrained` (`AutoModelForImageTextToText`, fp32) loads under
  `deepspeed.zero.Init`; then `peft.get_peft_model` with raylora's LoRA (r=4, alpha 8, dropout 0.1 on
  the language model's linear layers, `lora_target_regex`), and the vision tower and aligner made
  trainable with `requires_grad_` (raylora's `arch.REGISTRY` prefixes). Trainer's own torch AdamW.
- Micro batch 4, 2 micro batches per step per rank: 16 samples a step over the 2 ranks, as raylora's
  global batch 16 at micro batch 4. `torch.set_num_threads(1)` in each rank, as raylora's side.
- CPU: not `use_cpu=True`, which turns DeepSpeed off (accelerate takes its DeepSpeed path only `and not
  cpu`). Left to itself on a machine without a GPU, accelerate picks no backend and counts 1 process
  while DeepSpeed's CPU accelerator (`DS_ACCELERATOR=cpu`, gloo) joins both: each rank would read the
  same batches, and the Trainer's token gather fails on gloo ("invalid output tensor list at index 0
  (expected length 2, got 1)"). So each rank makes the state itself, `PartialState(backend="gloo")` under
  ACCELERATE_USE_DEEPSPEED=true (what `accelerate launch` with a DeepSpeed config sets), handed to the
  Trainer by `accelerator_config={"use_configured_state": True}`. `raylora.ds` is imported only to skip
  DeepSpeed's shared-memory op build (a minute of ninja at start-up, for inference's all-reduce only).
- ZeRO-3 config: HF's "auto" values, plus `stage3_param_persistence_threshold` 0 and `overlap_comm` off,
  as raylora's tiny runs (`bench/run.yaml`, `raylora.zero.deepspeed_config` on CPU), so
  the two sides differ in how they batch and step, not in a ZeRO knob.
- Batching as the HF docs write a VLM collate_fn: each sample rendered with
  `processor.apply_chat_template(messages, tokenize=False)`, the micro batch through
  `processor(text=..., images=..., padding=True)`, labels = input_ids with padding and image tokens set to
  -100 (so prompts are trained on too: the loss differs from raylora's, the compute does not). Samples
  longer than data.max_length (384) are filtered out beforehand and counted, as raylora skips them.
- `group_by_length`: transformers 5 names it `train_sampling_strategy="group_by_length"`
  (`LengthGroupedSampler`), fed each sample's token count through the dataset's `length` column.
- Tokens: the Trainer's own count (`include_num_input_tokens_seen="non_padding"`: attention-mask sums
  of every micro batch, gathered over the ranks). Time: a `TrainerCallback` on rank 0; a step is from the
  previous step's end to its own end, since the Trainer collates a step's micro batches before
  `on_step_begin` (raylora's timed step makes its batches too). Peak memory: VmHWM, reset at train begin.
  Padding share: the positions of the micro batches the collate_fn made (the first steps x 2 per rank).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import common

WORLD, MICRO, ACCUM, MAX_LENGTH = 2, 4, 2, 384
ZERO3 = {
    "train_micro_batch_size_per_gpu": "auto",
    # no "train_batch_size": "auto": transformers 5.23 fills it in at TrainingArguments time, when its
    # world size is still 1 (the distributed state is set up lazily), and zero.Init then asserts 8 != 4*2*2
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "overlap_comm": False,
        "contiguous_gradients": True,
    },
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
}


def collate(processor, samples: list[tuple[list, list]]) -> dict:
    """An HF-docs VLM collate_fn: chat template, the processor pads, labels -100 on padding and images."""
    texts = [processor.apply_chat_template(messages, tokenize=False) for messages, _ in samples]
    images = [image for _, row_images in samples for image in row_images]
    batch = processor(text=texts, images=images or None, padding=True, return_tensors="pt")
    labels = batch["input_ids"].clone()
    labels[batch["attention_mask"] == 0] = -100
    image_token = getattr(processor, "image_token_id", None)
    if image_token is not None:
        labels[labels == image_token] = -100
    batch["labels"] = labels
    return batch


def token_lengths(processor, data: str) -> list[tuple[int, int]]:
    """Each row's token count, as `collate` encodes it alone (no padding), and its number of images."""
    from raylora.data import batches
    from raylora.data.formats import open_rows

    rows = open_rows(data)
    out = []
    for i in range(len(rows)):
        sample = batches.read(rows, i)
        out.append((int(collate(processor, [sample])["input_ids"].shape[1]), len(sample[1])))
    return out


def trainer_rows(counted: list[tuple[int, int]]) -> list[int]:
    """The rows the Trainer trains on, of `token_lengths`' counts: those up to MAX_LENGTH tokens (filtered
    beforehand, as the HF docs do) with an image. Rows without one are left out: under ZeRO-3 a rank whose
    micro batch has no image skips the vision tower's forward, and with it the all-gathers of its
    parameters that the other ranks wait in (seen here: both ranks blocked for good at a step of the
    LLaVA-like mix, 7% of whose rows are text only). raylora adds a label-less stand-in image row to such
    a micro batch instead."""
    return [i for i, (n, images) in enumerate(counted) if n <= MAX_LENGTH and images > 0]


def _worker(rank: int, port: int, job: dict) -> None:
    """One rank: the Trainer run, its step clock and peak memory written to job["out"]-RANK.json."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD), DS_ACCELERATOR="cpu")
    import accelerate
    import datasets
    import peft
    import torch
    import transformers

    from raylora import ds  # noqa: F401  (skips DeepSpeed's shm op build: inference only, not on the path)
    from raylora.arch import REGISTRY, lora_target_regex
    from raylora.data import batches
    from raylora.data.formats import open_rows
    from raylora.data.processor import load_processor

    torch.set_num_threads(1)
    transformers.set_seed(0)
    # as `accelerate launch` sets it for a DeepSpeed config; the gloo state made here (module docstring)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    accelerate.PartialState(backend="gloo")
    args = transformers.TrainingArguments(
        output_dir=str(Path(job["work"]) / "trainer"),
        accelerator_config={"use_configured_state": True},  # the PartialState above
        deepspeed=ZERO3,
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=ACCUM,
        max_steps=job["steps"],
        learning_rate=1e-3,
        warmup_steps=2,
        train_sampling_strategy="group_by_length" if job["group_by_length"] else "random",
        length_column_name="length",
        include_num_input_tokens_seen="non_padding",
        remove_unused_columns=False,  # the collate_fn reads the row index column
        label_names=["labels"],
        logging_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_pin_memory=False,
        seed=0,
    )  # before from_pretrained: transformers then loads the model under deepspeed.zero.Init
    arch = REGISTRY[job["arch"]]
    model = transformers.AutoModelForImageTextToText.from_pretrained(job["model_dir"], dtype=torch.float32)
    model.config.use_cache = model.config.get_text_config().use_cache = False
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.1, bias="none", target_modules=lora_target_regex(model, arch, None)
    )
    model = peft.get_peft_model(model, lora)
    for prefix in (*arch.vision_tower, *arch.aligner):  # trained fully, as raylora trains them
        model.get_submodule("base_model.model." + prefix).requires_grad_(True)

    processor = load_processor(job["model_dir"], job["max_pixels"])
    rows = open_rows(job["data"])
    kept = datasets.Dataset.from_dict({"row": job["rows"], "length": job["lengths"]})
    clock: list[dict] = []
    passes: list[list[int]] = []  # per micro batch collated here: [non-padding, positions]

    def collate_rows(items: list[dict]) -> dict:
        batch = collate(processor, [batches.read(rows, x["row"]) for x in items])
        passes.append([int(batch["attention_mask"].sum()), batch["attention_mask"].numel()])
        return batch

    class StepClock(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            common.peak_rss_reset()
            self.last, self.tokens = time.perf_counter(), state.num_input_tokens_seen

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            clock.append(
                {
                    "seconds": now - self.last,  # previous step's end to this one's: its batches included
                    "compute_seconds": now - self.begin,  # on_step_begin to on_step_end
                    "tokens": state.num_input_tokens_seen - self.tokens,  # all ranks (gathered)
                }
            )
            self.last, self.tokens = now, state.num_input_tokens_seen

        def on_train_end(self, args, state, control, **kwargs):
            self.peak = common.peak_rss_bytes()

    clock_cb = StepClock()
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=kept, data_collator=collate_rows, callbacks=[clock_cb]
    )
    trainer.train()
    # the micro batches the steps trained on: the first ones collated (the loader collates one ahead)
    used = passes[: job["steps"] * ACCUM]
    result = {"steps": clock, "peak_rss_bytes": clock_cb.peak, "passes": used}
    Path(f"{job['out']}-{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def hf_trainer_run(
    model_dir: str,
    data: str,
    work: Path,
    arch: str,
    steps: int,
    warmup: int,
    group_by_length: bool,
    max_pixels: int | None,
    counted: list[tuple[int, int]] | None = None,
) -> dict:
    """Useful tokens per second of `steps` Trainer steps after `warmup` (2 CPU processes, ZeRO-3), the
    largest peak resident memory of a rank, the padding share of the timed steps' positions, the rows
    filtered out as too long, and the per-step figures (seconds, compute_seconds, tokens, positions,
    padding_share; collated_tokens, the tokens counted in the collate_fn, checks the Trainer's count)."""
    import torch.multiprocessing as mp

    from raylora.data.processor import load_processor

    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    if counted is None:  # `token_lengths` of `data`, when the caller has them already
        counted = token_lengths(load_processor(model_dir, max_pixels), data)
    lengths = [n for n, _ in counted]
    kept = trainer_rows(counted)
    out = work / f"hf-{arch}-{'grouped' if group_by_length else 'random'}"
    job = {
        "model_dir": model_dir,
        "data": data,
        "work": str(work),
        "arch": arch,
        "steps": steps,
        "group_by_length": group_by_length,
        "max_pixels": max_pixels,
        "rows": kept,
        "lengths": [lengths[i] for i in kept],
        "out": str(out),
    }
    mp.spawn(_worker, args=(common.free_port(), job), nprocs=WORLD)
    ranks = [json.loads(Path(f"{out}-{r}.json").read_text()) for r in range(WORLD)]
    rows = ranks[0]["steps"]
    for k, row in enumerate(rows):  # the step's padding share, its micro batches on every rank
        useful, positions = (
            sum(p[i] for r in ranks for p in r["passes"][k * ACCUM : (k + 1) * ACCUM]) for i in (0, 1)
        )
        row.update(positions=positions, padding_share=1 - useful / positions, collated_tokens=useful)
    timed = rows[warmup:]
    return {
        "useful_tokens_per_s": sum(r["tokens"] for r in timed) / sum(r["seconds"] for r in timed),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
        "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in ranks],
        "padding_share": 1 - sum(r["tokens"] for r in timed) / sum(r["positions"] for r in timed),
        "skipped_too_long": sum(n > MAX_LENGTH for n in lengths),
        "left_out_without_image": sum(n <= MAX_LENGTH and images == 0 for n, images in counted),
        "steps": rows,
    }
