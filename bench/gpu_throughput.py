"""Tokens per second and MFU of an 8B-size LoRA step on one GPU: raylora's training step against the Hugging
Face Trainer with PEFT and DeepSpeed ZeRO-3, on the same GPU, model, data, batch and precision.

    python bench/gpu_throughput.py           # one GPU (H100/H200), under 8 minutes with the model built
    python bench/gpu_throughput.py --tiny    # CPU: a tiny Qwen3-VL, proves the script works (the smoke)

The model: Qwen3-VL-8B-Instruct's real config (bench/on_paper.py `qwen3_vl_8b`) with random weights, built
on the GPU from its config (`from_config`, transformers' own initialisation: no download) and saved once as
a folder that both sides load with `from_pretrained`, as they would load the real one; its tokenizer is
raylora's word-level stand-in (raylora.tiny_text) and its processor Qwen3-VL's (patch 16, merged 2 x 2:
one token per 32 x 32 pixels). The data: chat rows of one image each, its area log-uniform between
224 x 224 and data.max_pixels (1280 x 1024: 49 to 1280 image tokens) at a common aspect ratio, a question
of ~20 words and an answer of log-normal length (median 60 words, at most 1500): a realistic length mix.
Both sides train LoRA r=16 (alpha 32, dropout 0.05) on every linear layer of the language model, vision
tower and aligner frozen, bf16, gradient checkpointing on (non-reentrant), sdpa attention, micro batch 4,
16 samples per step (4 micro batches), on one GPU (ZeRO-3 at world size 1, as one rank of a bigger run);
8 steps, the first 2 not timed. The adapter in bf16 on both sides (raylora.model.add_lora says why).

- raylora: its step exactly as its Ray Train workers run it (`raylora.worker.setup`, `worker.train_step`),
  in a process of its own without Ray (one NCCL rank, as bench/padding.py drives it on CPUs), padded (the
  same micro batches as the Trainer's) and packed (`train.packing` with a 16384-token budget, the shipped
  jobs' setting); train.deterministic off, as the Trainer runs.
--tiny runs both sides in fp32 (the Trainer takes bf16 on a CPU only without DeepSpeed).
- the HF Trainer: `transformers.Trainer`, `TrainingArguments(deepspeed=...)` with the HF docs' ZeRO-3
  config ("auto" values), `peft.get_peft_model`, the HF-docs collate_fn (bench/hf_trainer_steps.py
  `collate`: labels on every non-padding, non-image token); its own token count.

Tokens per second: non-padding token positions (text and image tokens) per second of a step, each side's
own count, over the steps after the warm-up. MFU: model FLOPs per second over the GPU's dense bf16 peak,
the model FLOPs of a LoRA step counted the same way for both sides, per token of the data (its rows'
average): the frozen linear layers' forward and input gradient (4 FLOPs per weight and token: no weight
gradient but LoRA's own, under 1%), causal attention (forward and backward: 6 n^2 q per layer), the LM head
at answer tokens only (what the loss needs), and the frozen vision tower's forward (2 per weight and patch,
plus its attention). HFU adds the recomputation of gradient checkpointing (the forward again).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import common
import numpy as np

SEED = 0
ROWS, TINY_ROWS = 128, 64  # 8 steps of 16 samples: one epoch
MICRO, ACCUM = 4, 4  # 16 samples a step on the one rank
WARMUP, STEPS, TINY_STEPS = 2, 6, 3  # timed steps per run, after WARMUP steps (--tiny: 1) that are not
MAX_PIXELS, TINY_MAX_PIXELS = 1310720, 4096  # 1280 tokens of 32 x 32 pixels (the shipped jobs' setting)
MAX_LENGTH = 4096
PACKED_TOKENS = 16384
LORA = {"r": 16, "alpha": 32, "dropout": 0.05}
# Dense bf16 peak (no sparsity) by device name, NVIDIA's datasheets: H100 and H200 SXM 989 TFLOPS, H100 PCIe
# 756, H100 NVL 835, A100 312.
PEAK_BF16 = {"H200": 989e12, "H100 NVL": 835e12, "H100 PCIe": 756e12, "H100": 989e12, "A100": 312e12}
SIDES = ("raylora_padded", "raylora_packed", "hf_trainer")


# ---------------------------------------------------------------------------------------- model and data


def model_config(tiny: bool, tokenizer):
    """Qwen3-VL-8B-Instruct's config (bench/on_paper.py) or, --tiny, the same architecture 64 wide, with the
    special tokens of `tokenizer` (raylora's word-level stand-in for the real one)."""
    from on_paper import qwen3_vl_8b
    from transformers import Qwen3VLConfig

    if tiny:
        config = Qwen3VLConfig(
            text_config=dict(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                vocab_size=len(tokenizer),
                max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 2, 2]},
            ),
            vision_config=dict(
                depth=2,
                hidden_size=64,
                intermediate_size=128,
                num_heads=4,
                patch_size=16,
                spatial_merge_size=2,
                temporal_patch_size=2,
                out_hidden_size=64,
                num_position_embeddings=64,
                deepstack_visual_indexes=[0, 1],
            ),
            tie_word_embeddings=False,
        )
        config.text_config.rope_parameters["mrope_interleaved"] = True
    else:
        config = qwen3_vl_8b()
    ids = tokenizer.convert_tokens_to_ids
    config.image_token_id, config.video_token_id = ids("<|image_pad|>"), ids("<|video_pad|>")
    config.vision_start_token_id, config.vision_end_token_id = ids("<|vision_start|>"), ids("<|vision_end|>")
    for cfg in (config, config.text_config):
        cfg.pad_token_id, cfg.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
        cfg.bos_token_id = tokenizer.bos_token_id
    return config


def make_model(folder: Path, tiny: bool) -> Path:
    """The model folder, built once: random weights from the config, made on the GPU (or the CPU) by
    transformers' own initialisation, saved as bf16 safetensors with Qwen3-VL's processor."""
    import torch
    from transformers import (
        AutoModelForImageTextToText,
        Qwen2VLImageProcessor,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    from raylora.tiny_text import QWEN3_VL_CHAT_TEMPLATE, build_tokenizer

    if (folder / "complete").is_file():
        return folder
    tokenizer = build_tokenizer()
    config = model_config(tiny, tokenizer)
    shape = dict(patch_size=16, merge_size=2, temporal_patch_size=2)
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(**shape, min_pixels=32 * 32, max_pixels=MAX_PIXELS),
        video_processor=Qwen3VLVideoProcessor(**shape, min_pixels=32 * 32, max_pixels=MAX_PIXELS),
        tokenizer=tokenizer,
        chat_template=QWEN3_VL_CHAT_TEMPLATE,
    )
    torch.manual_seed(SEED)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, max_shard_size="5GB")
    processor.save_pretrained(folder)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    (folder / "complete").write_text("")
    return folder


def write_mix(folder: Path, rows: int, tiny: bool) -> str:
    """Chat JSONL (`messages`, `images`) of `rows` rows, one image each beside it (module docstring); --tiny,
    images of 32 x 32 to 64 x 64 pixels (1 to 4 tokens) and a tenth of the text."""
    from PIL import Image

    from raylora.tiny_text import DIGIT_NAMES

    path = folder / "train.jsonl"
    if path.is_file():
        return str(path)
    rng = np.random.default_rng(SEED)
    folder.mkdir(parents=True, exist_ok=True)
    scale = 0.1 if tiny else 1.0
    low, high = (32 * 32, TINY_MAX_PIXELS) if tiny else (224 * 224, MAX_PIXELS)

    def words(n: float) -> str:
        return " ".join(DIGIT_NAMES[k % 10] for k in rng.integers(0, 10, max(1, int(n))))

    lines = []
    for i in range(rows):
        area = np.exp(rng.uniform(np.log(low), np.log(high)))
        aspect = [1, 4 / 3, 3 / 4, 16 / 9, 9 / 16, 2, 1 / 2][int(rng.integers(0, 7))]
        h, w = max(32, int(np.sqrt(area / aspect))), max(32, int(np.sqrt(area * aspect)))
        # noise, not one colour: the PNG's decoding costs what a photograph's does
        pixels = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{i}.png")
        question = words(rng.lognormal(np.log(20 * scale), 0.5))
        answer = words(min(rng.lognormal(np.log(60 * scale), 1.0), 1500 * scale))
        messages = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ]
        lines.append(json.dumps({"messages": messages, "images": [f"{i}.png"]}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def row_counts(model_dir: str, data: str, max_pixels: int) -> list[dict]:
    """Per row: its tokens as the HF collate_fn encodes it alone (the language model's positions), its image
    tokens and its answer tokens (the word-level tokenizer: a word a token, plus the turn's end)."""
    from hf_trainer_steps import collate

    from raylora.data import batches
    from raylora.data.formats import open_rows
    from raylora.data.processor import load_processor

    processor = load_processor(model_dir, max_pixels)
    image_token = processor.image_token_id
    rows = open_rows(data)
    out = []
    for i in range(len(rows)):
        messages, images = batches.read(rows, i)
        ids = collate(processor, [(messages, images)])["input_ids"][0]
        answer = messages[-1]["content"][0]["text"]
        out.append(
            {
                "tokens": len(ids),
                "image_tokens": int((ids == image_token).sum()),
                "answer": len(answer.split()) + 1,
            }
        )
    return out


# -------------------------------------------------------------------------------------------- FLOPs


def flops_per_token(config, counts: list[dict]) -> dict:
    """Model FLOPs of a LoRA step per token of the data (module docstring), and with checkpointing's
    recomputation (HFU); the terms, per token."""
    text, vision = config.text_config, config.vision_config
    h, layers, i = text.hidden_size, text.num_hidden_layers, text.intermediate_size
    q = text.num_attention_heads * text.head_dim
    kv = text.num_key_value_heads * text.head_dim
    linear = layers * (2 * h * q + 2 * h * kv + 3 * h * i)  # q, o; k, v; gate, up, down
    d, m, depth = vision.hidden_size, vision.intermediate_size, vision.depth
    merge = vision.spatial_merge_size**2
    vit_linear = depth * (4 * d * d + 2 * d * m)  # qkv, proj; fc1, fc2 (the aligner's mergers left out)
    tokens = sum(c["tokens"] for c in counts)
    answers = sum(c["answer"] for c in counts)
    squares = sum(c["tokens"] ** 2 for c in counts)
    patches = sum(c["image_tokens"] * merge for c in counts)
    patch_squares = sum((c["image_tokens"] * merge) ** 2 for c in counts)
    terms = {
        "frozen linear layers, forward + input gradient (4 x weights)": 4 * linear * tokens,
        "causal attention, forward + backward (6 n^2 q per layer)": 6 * layers * q * squares,
        "LM head at answer tokens, forward + input gradient": 4 * h * text.vocab_size * answers,
        "vision tower forward (2 x weights per patch, 4 p^2 d attention per block)": 2 * vit_linear * patches
        + 4 * depth * d * patch_squares,
    }
    recompute = 2 * linear * tokens + 2 * layers * q * squares  # the language model's forward, again
    model = sum(terms.values())
    return {
        "model_flops_per_token": model / tokens,
        "hardware_flops_per_token": (model + recompute) / tokens,
        "terms_per_token": {k: v / tokens for k, v in terms.items()},
        "rows": len(counts),
        "mean_tokens_per_row": tokens / len(counts),
        "mean_image_tokens_per_row": sum(c["image_tokens"] for c in counts) / len(counts),
        "linear_params_language_model": linear,
        "linear_params_vision_tower": vit_linear,
    }


def peak_flops(device_name: str | None) -> float | None:
    for key, peak in PEAK_BF16.items():
        if device_name and key in device_name:
            return peak
    return None


# ------------------------------------------------------------------------------------------- raylora


def _rank_env(port: int) -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def raylora_worker(rank: int, cfgs: list, port: int, outs: list[str]) -> None:
    """raylora's step in one process, one rank (NCCL on a GPU, gloo on the CPU), for each config in turn:
    per step its seconds and the non-padding positions train_step counted; the peak GPU memory."""
    import torch
    import torch.distributed as dist

    from raylora import worker

    _rank_env(port)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    for cfg, out in zip(cfgs, outs, strict=True):
        s = worker.setup(cfg, None)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        rows = []
        for _ in range(cfg.train.max_steps):
            start = time.perf_counter()
            metrics = worker.train_step(s)  # reads the device once, at its end: the step is done
            seconds = time.perf_counter() - start
            tokens = metrics["tokens_per_s"] * cfg.train.global_batch_size / metrics["samples_per_s"]
            rows.append({"seconds": seconds, "tokens": tokens, "loss": metrics["loss"]})
        peak = torch.cuda.max_memory_allocated() if cuda else common.peak_rss_bytes()
        Path(out).write_text(json.dumps({"steps": rows, "peak_bytes": peak}))
        del s
        if cuda:
            torch.cuda.empty_cache()
    dist.destroy_process_group()


def raylora_configs(model_dir: str, data: str, work: Path, steps: int, max_pixels: int, modes: list[str]):
    import torch

    from raylora import config

    cuda = torch.cuda.is_available()
    common_settings = [
        f"model.path={model_dir}",
        f"data.train={data}",
        f"run.storage_path={work / 'runs'}",
        f"data.max_length={MAX_LENGTH}",
        f"data.max_pixels={max_pixels}",
        f"train.max_steps={steps}",
        f"train.global_batch_size={MICRO * ACCUM}",
        f"train.micro_batch_size={MICRO}",
        "train.lr=1e-4",
        "train.warmup_steps=1",
        "train.gradient_checkpointing=true",
        f"train.precision={'bf16' if cuda else 'fp32'}",  # as the Trainer on a CPU (hf_worker)
        "train.deterministic=false",
        f"lora.r={LORA['r']}",
        f"lora.alpha={LORA['alpha']}",
        f"lora.dropout={LORA['dropout']}",
        "scaling.num_workers=1",
        f"scaling.use_gpu={str(cuda).lower()}",
    ]
    extra = {
        "raylora_padded": [],
        "raylora_packed": ["train.packing=true", f"train.max_tokens_per_micro_batch={PACKED_TOKENS}"],
    }
    return [config.load(None, [*common_settings, f"run.name={m}", *extra[m]]) for m in modes]


# ------------------------------------------------------------------------------------------ HF Trainer

# The HF docs' ZeRO-3 config (DeepSpeed integration page), "auto" values filled in by the Trainer.
HF_ZERO3 = {
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}


def hf_worker(rank: int, job: dict) -> None:
    """The Trainer's run in one process: per step its seconds and the tokens it counted; the peak memory."""
    import torch

    _rank_env(job["port"])
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ["DS_ACCELERATOR"] = "cpu"
    import accelerate
    import datasets
    import peft
    import transformers
    from hf_trainer_steps import collate

    from raylora import ds  # noqa: F401  (skips DeepSpeed's shm op build: inference only, not on the path)
    from raylora.arch import REGISTRY, lora_target_regex
    from raylora.data import batches
    from raylora.data.formats import open_rows
    from raylora.data.processor import load_processor

    transformers.set_seed(SEED)
    # as `accelerate launch` sets it for a DeepSpeed config; the state made here, as hf_trainer_steps does
    # (on CPUs accelerate would not pick gloo by itself)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    accelerate.PartialState(backend="nccl" if cuda else "gloo")
    args = transformers.TrainingArguments(
        output_dir=str(Path(job["work"]) / "trainer"),
        accelerator_config={"use_configured_state": True},
        deepspeed=HF_ZERO3,
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=ACCUM,
        max_steps=job["steps"],
        learning_rate=1e-4,
        warmup_steps=1,
        bf16=cuda,  # the Trainer refuses bf16 on a CPU unless use_cpu, which turns DeepSpeed off
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        include_num_input_tokens_seen="non_padding",
        remove_unused_columns=False,  # the collate_fn reads the row index column
        label_names=["labels"],
        logging_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_pin_memory=cuda,
        seed=SEED,
    )  # before from_pretrained: transformers then loads the model under deepspeed.zero.Init
    model = transformers.AutoModelForImageTextToText.from_pretrained(
        job["model_dir"], dtype=torch.bfloat16 if cuda else torch.float32, attn_implementation="sdpa"
    )
    model.config.use_cache = model.config.get_text_config().use_cache = False
    target = lora_target_regex(model, REGISTRY["qwen3_vl"], None)
    lora = peft.LoraConfig(
        r=LORA["r"],
        lora_alpha=LORA["alpha"],
        lora_dropout=LORA["dropout"],
        bias="none",
        target_modules=target,
    )
    # the adapter in the model's dtype, as raylora keeps it (raylora.model.add_lora): PEFT would upcast it to
    # fp32, and DeepSpeed 0.19 does not cast parameters made after zero.Init, so one engine would hold two
    # dtypes (not tried with the Trainer; raylora's own workers are built this way for that reason)
    model = peft.get_peft_model(model, lora, autocast_adapter_dtype=False)
    processor = load_processor(job["model_dir"], job["max_pixels"])
    rows = open_rows(job["data"])
    clock: list[dict] = []

    class StepClock(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            self.last, self.tokens = time.perf_counter(), state.num_input_tokens_seen

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            clock.append({"seconds": now - self.last, "tokens": state.num_input_tokens_seen - self.tokens})
            self.last, self.tokens = now, state.num_input_tokens_seen

    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_dict({"row": list(range(len(rows)))}),
        data_collator=lambda items: collate(processor, [batches.read(rows, x["row"]) for x in items]),
        callbacks=[StepClock()],
    )
    trainer.train()
    peak = torch.cuda.max_memory_allocated() if cuda else common.peak_rss_bytes()
    Path(job["out"]).write_text(json.dumps({"steps": clock, "peak_bytes": peak}))
    torch.distributed.destroy_process_group()


# ---------------------------------------------------------------------------------------------- main


def side_result(got: dict, warmup: int, flops: dict, peak: float | None) -> dict:
    timed = got["steps"][warmup:]
    per_step = [r["tokens"] / r["seconds"] for r in timed]
    tokens_per_s = sum(r["tokens"] for r in timed) / sum(r["seconds"] for r in timed)
    return {
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_step": common.summary(per_step),
        "seconds_per_step": common.summary([r["seconds"] for r in timed]),
        "tokens_per_step": common.summary([r["tokens"] for r in timed]),
        "peak_memory_gb": got["peak_bytes"] / 1e9,
        "mfu": tokens_per_s * flops["model_flops_per_token"] / peak if peak else None,
        "hfu": tokens_per_s * flops["hardware_flops_per_token"] / peak if peak else None,
        "steps": got["steps"],
    }


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {', '.join(SIDES)}")
    args = p.parse_args()
    import torch
    import torch.multiprocessing as mp

    start = time.perf_counter()
    sides = [s for s in args.sides.split(",") if s]
    work = Path(args.work) / ("gpu_throughput_tiny" if args.tiny else "gpu_throughput")
    max_pixels = TINY_MAX_PIXELS if args.tiny else MAX_PIXELS
    steps = WARMUP + (TINY_STEPS if args.tiny else STEPS)
    warmup = 1 if args.tiny else WARMUP
    seconds = {}
    model_dir = str(make_model(work / "model", args.tiny))
    data = write_mix(work / "data", TINY_ROWS if args.tiny else ROWS, args.tiny)
    seconds["model_and_data"] = time.perf_counter() - start
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    counts = row_counts(model_dir, data, max_pixels)
    flops = flops_per_token(config, counts)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    peak = peak_flops(device)

    results = {}
    modes = [s for s in sides if s.startswith("raylora")]
    if modes:
        cfgs = raylora_configs(model_dir, data, work, steps, max_pixels, modes)
        outs = [str(work / f"{m}.json") for m in modes]
        # one process per mode on a GPU (each mode's peak memory its own); --tiny, one for both
        groups = [list(range(len(modes)))] if args.tiny else [[k] for k in range(len(modes))]
        for group in groups:
            began = time.perf_counter()
            # raylora's side, as its Train workers start (its CPU workers' malloc settings; none on GPUs)
            env = contextlib.nullcontext() if torch.cuda.is_available() else common.raylora_worker_env()
            with env:
                mp.spawn(
                    raylora_worker,
                    args=([cfgs[k] for k in group], common.free_port(), [outs[k] for k in group]),
                    nprocs=1,
                )
            seconds["+".join(modes[k] for k in group)] = time.perf_counter() - began
        for mode, out in zip(modes, outs, strict=True):
            results[mode] = side_result(json.loads(Path(out).read_text()), warmup, flops, peak)
    if "hf_trainer" in sides:
        began = time.perf_counter()
        out = str(work / "hf_trainer.json")
        job = {
            "model_dir": model_dir,
            "data": data,
            "work": str(work),
            "steps": steps,
            "max_pixels": max_pixels,
            "port": common.free_port(),
            "out": out,
        }
        mp.spawn(hf_worker, args=(job,), nprocs=1)
        seconds["hf_trainer"] = time.perf_counter() - began
        results["hf_trainer"] = side_result(json.loads(Path(out).read_text()), warmup, flops, peak)
    ratios = {
        f"{mode}_over_hf_trainer": results[mode]["tokens_per_s"] / results["hf_trainer"]["tokens_per_s"]
        for mode in modes
        if "hf_trainer" in results
    }
    seconds["total"] = time.perf_counter() - start
    common.write_result(
        args,
        "gpu_throughput",
        {
            "setup": {
                "model": "tiny Qwen3-VL (64 wide, 2 + 2 layers)"
                if args.tiny
                else "Qwen3-VL-8B-Instruct's config, random weights (bench/on_paper.py qwen3_vl_8b)",
                "device": device or "cpu",
                "peak_bf16_flops": peak,
                "lora": LORA,
                "trained": "LoRA on every linear layer of the language model; vision and aligner frozen",
                "micro_batch_size": MICRO,
                "samples_per_step": MICRO * ACCUM,
                "steps": steps,
                "warmup_steps_not_timed": warmup,
                "max_length": MAX_LENGTH,
                "max_pixels": max_pixels,
                "packed_tokens_per_pass": PACKED_TOKENS,
                "precision": "bf16" if device else "fp32",
                "gradient_checkpointing": True,
                "attention": "sdpa",
            },
            "flops": flops,
            "sides": results,
            "ratios": ratios,
            "seconds": seconds,
            "assumptions": [
                "tokens: non-padding positions (text and image tokens), each side's own count",
                "MFU and HFU from the data's average FLOPs per token, not each step's own rows",
                "raylora with train.deterministic=false (its default is true), as the Trainer runs",
            ],
        },
    )
    print(json.dumps({k: {"tokens_per_s": v["tokens_per_s"], "mfu": v["mfu"]} for k, v in results.items()}))
    print(json.dumps(ratios), json.dumps(seconds))


if __name__ == "__main__":
    main()
