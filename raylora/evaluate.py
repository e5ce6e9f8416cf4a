"""Scoring a model on held-out data: a checkpoint without DeepSpeed (plain PEFT on the base model, for
`raylora eval` and `export --merge`), and the evaluation inside ZeRO-3 training (`evaluate_sharded`).

Where a checkpoint is scored: `inference_device` (a GPU when the node has one, `--device` forces it) in
`inference_dtype` (bf16 on a GPU that has it: llava-1.5-7b takes 14 GB there instead of 28 in fp32; fp32
on the CPU, whose bf16 kernels are slow on most CPUs).
"""

from __future__ import annotations

import copy
import gc
import logging
import math
import os
from pathlib import Path

import torch
from peft import PeftModel, get_peft_model

from raylora import checkpoint, hub, quant
from raylora.arch import auto_model_class, remote_code
from raylora.config import ConfigError
from raylora.data import video
from raylora.data.batches import (
    VIDEO_STAND_IN,
    make_batch,
    read,
    stand_in,
    stand_in_video,
    use_video_stand_in,
    video_sampling,
)
from raylora.data.formats import BadRow, Rows, open_rows
from raylora.data.labels import end_of_turn_ids, final_answer, last_answer
from raylora.data.processor import load_processor
from raylora.loss import answer_token_losses

log = logging.getLogger("raylora")
DEVICES = ("auto", "cpu", "cuda")


def inference_device(choice: str = "auto") -> torch.device:
    """Where a checkpoint is scored or merged: `auto` is a GPU when this node has one, else the CPU."""
    if choice not in DEVICES:
        raise ConfigError(f"--device must be one of {', '.join(DEVICES)}, got {choice!r}")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: this node has no CUDA GPU (torch.cuda.is_available() is false)")
    return torch.device(choice)


def inference_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 on a GPU that computes in it, fp32 elsewhere (the CPU, and GPUs older than Ampere, where fp16
    would be the only half precision and overflows on weights trained in bf16)."""
    if torch.device(device).type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def place(model: torch.nn.Module, device: torch.device, forced: bool) -> torch.nn.Module:
    """`model` on `device`. A GPU too small for it leaves it on the CPU in fp32 with a warning, as on a
    node without a GPU, unless the GPU was asked for (`forced`: the out-of-memory error is raised)."""
    try:
        return model.to(device)
    except torch.OutOfMemoryError:
        if forced:
            raise
        model.to("cpu", torch.float32)
        torch.cuda.empty_cache()
        log.warning(
            "the model does not fit on %s: running on the CPU in fp32 (--device cuda to insist)", device
        )
        return model


def load_for_inference(
    folder: str | Path,
    model_path: str | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    quantized: bool = True,
):
    """(model, processor) from a local raylora checkpoint folder: `PeftModel.from_pretrained` plus the
    trained modules, on `device` (`auto`, `cpu`, `cuda`: `inference_device`) in `dtype` (default:
    `inference_dtype` of the device). The base is loaded in 4 bits where it was trained so (QLoRA), unless
    `quantized` is false (`export --merge` folds the adapter into the base's original weights)."""
    folder = Path(folder)
    forced = str(device) != "auto"
    device = inference_device(device) if str(device) in DEVICES else torch.device(device)
    checkpoint.verify(folder)
    state = checkpoint.read_state(folder)
    trained_on = state.config["model"]
    model_path = model_path or hub.resolve(trained_on["path"], trained_on.get("revision"))
    trust = bool(trained_on.get("trust_remote_code"))
    dtype = dtype or inference_dtype(device)
    four_bit = quant.inference_kwargs(state.config, model_path, dtype, device) if quantized else {}
    base = auto_model_class(remote_code(model_path) if trust else {}).from_pretrained(
        model_path, dtype=dtype, trust_remote_code=trust, **four_bit
    )
    quant.no_cpu_repack(base)  # scored with training's numerics (raylora.quant)
    model = PeftModel.from_pretrained(base, str(folder))
    trained = checkpoint.read_trained_modules(folder)
    if trained:
        unexpected = model.base_model.model.load_state_dict(trained, strict=False).unexpected_keys
        if unexpected:
            raise checkpoint.CheckpointError(f"{folder}: trained modules not in the model: {unexpected[:3]}")
    model.eval()
    data = state.config.get("data", {})  # the resolution the adapter was trained at
    processor = load_processor(
        model_path,
        data.get("max_pixels"),
        data.get("min_pixels"),
        trust,
        video.PixelCaps.of(data),
        data.get("chat_template_kwargs"),
    )
    # frames sampled as in training (one process: no ranks to keep in step, so no video stand-in)
    sampling = video.Sampling(
        data.get("video_fps"), data.get("video_num_frames"), data.get("video_max_frames", 128)
    )
    use_video_stand_in(processor, False, sampling)
    return place(model, device, forced), processor


def generation_budget(tokenizer, answers: list[str]) -> int:
    """New tokens generation may take: twice the longest answer's tokens, and at least 16 more, so that a
    model that does not stop runs on past its answer (exact match fails, `stopped` counts it) instead of
    being cut off right after the answer, which would score a model that never stops as correct."""
    longest = max(len(tokenizer(a, add_special_tokens=False)["input_ids"]) for a in answers)
    return 2 * longest + 16


@torch.no_grad()
def score(
    model,
    processor,
    examples: list,
    counted: list[bool] | None = None,
    synced_gpus: bool = False,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """Exact-match hits, answers that ended with the stop token (`stopped`: the others ran into the
    generation budget), answer-token loss sum and answer tokens of one batch (only `counted` examples).

    `examples` are decoded `(messages, images)` (`data.read`): the prompt is every turn before the last
    assistant turn, the answer that turn's text; the loss covers every assistant turn, as training's does.

    `synced_gpus=True` keeps ZeRO-3 ranks in lockstep through generation (every rank must take part
    in every forward pass, however many tokens its own batch needs).
    """
    counted = counted if counted is not None else [True] * len(examples)
    tokenizer = processor.tokenizer
    batch = {k: v.to(device) for k, v in make_batch(processor, examples).items()}
    labels = batch.pop("labels")
    per_token, rows = answer_token_losses(model, batch, labels)
    mask = torch.tensor(counted, device=per_token.device)[rows]
    prompts = {k: v.to(device) for k, v in make_batch(processor, examples, with_answers=False).items()}
    answers = [last_answer(example[0]) for example in examples]
    stops = end_of_turn_ids(processor)  # where training taught the model to stop
    out = model.generate(
        **prompts,
        max_new_tokens=generation_budget(tokenizer, answers),
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=stops,
        synced_gpus=synced_gpus,
    )
    new = out[:, prompts["input_ids"].shape[1] :]
    stopped = torch.isin(new, torch.tensor(stops, device=new.device)).any(dim=1).tolist()
    hits = sum(
        keep and final_answer(tokenizer.decode(ids, skip_special_tokens=True)) == final_answer(answer)
        for answer, ids, keep in zip(answers, new, counted, strict=True)
    )
    return {
        "correct": float(hits),
        "stopped": float(sum(keep and stop for stop, keep in zip(stopped, counted, strict=True))),
        "loss_sum": float((per_token * mask).sum()),
        "tokens": float(mask.sum()),
        "samples": float(sum(counted)),
    }


KEYS = ("correct", "stopped", "loss_sum", "tokens", "samples")


def _score_rows(model, processor, data: Rows, rows, batch_size: int, device) -> dict[str, float]:
    """`score` totals over `rows` of `data`, `batch_size` rows at a time; a bad row is left out."""
    totals = dict.fromkeys(KEYS, 0.0)
    rows = list(rows)
    for start in range(0, len(rows), batch_size):
        examples = []
        for i in rows[start : start + batch_size]:
            try:
                examples.append(read(data, i, video_sampling(processor)))
            except BadRow:
                continue
        if examples:
            for key, value in score(model, processor, examples, device=device).items():
                totals[key] += value
    return totals


@torch.no_grad()
def evaluate(
    model,
    processor,
    data_uri: str,
    batch_size: int = 32,
    max_samples: int | None = None,
    fmt: str | None = None,
    image_root: str | None = None,
) -> dict:
    """Exact-match accuracy of generated answers and the mean answer-token loss, in one process on the
    model's device, over the first `max_samples` rows; rows that cannot be scored (`BadRow`) are left out
    and counted."""
    data = open_rows(data_uri, fmt, image_root)
    n = len(data) if max_samples is None else min(max_samples, len(data))
    device = next(model.parameters()).device
    totals = _score_rows(model, processor, data, range(n), batch_size, device)
    return {
        "accuracy": totals["correct"] / max(totals["samples"], 1),
        # answers the model ended by itself; the others ran into the generation budget
        "stopped_fraction": totals["stopped"] / max(totals["samples"], 1),
        "loss": totals["loss_sum"] / max(totals["tokens"], 1),
        "samples": int(totals["samples"]),
        "bad_rows": n - int(totals["samples"]),
    }


# ------------------------------------------------------------------------- inside ZeRO-3 training

COPY_CHUNK = 1 << 28
"""Elements of the ZeRO-3 model gathered at once while `gathered_copy` copies it (512 MiB in bf16): what
a rank holds beside the copy while it is built."""
COPY_HEADROOM = 1.25
"""The copy fits when this many times its bytes are free: the rest is for generation's activations and KV
cache (llava-1.5-7b, 4 samples of 650 tokens: a KV cache of 1.4 GB beside the copy's 14 GB)."""


def copy_bytes(model: torch.nn.Module) -> int:
    """Bytes of a whole copy of the (ZeRO-3 partitioned) model's parameters and buffers."""
    from raylora.zero import full_shape

    params = sum(math.prod(full_shape(p)) * p.element_size() for p in model.parameters())
    return params + sum(b.numel() * b.element_size() for b in model.buffers())


def free_bytes(device: torch.device) -> int:
    """Memory this rank may still take on `device`: the GPU's free memory plus what torch's caching
    allocator holds unused; on the CPU, the host's available memory shared by the node's ranks."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/meminfo") as f:  # free memory plus the page cache the kernel can drop
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        pass
    return available // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


@torch.no_grad()
def gathered_copy(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A plain copy of the ZeRO-3 PeftModel `model` on this rank, on `device`: the same modules, dtypes
    and values, with no ZeRO-3 hooks, so it runs forward passes without any collective.

    Built on the meta device from the model's own config and adapter config (no weights, no memory),
    then filled with the parameters gathered `COPY_CHUNK` elements at a time (`zero.gather_copies`) and
    the buffers. Every rank must call this (the gathers are collectives). The engine, its fp32 masters
    and optimizer state are only read.
    """
    from transformers.integrations import is_deepspeed_zero3_enabled

    from raylora.zero import gather_copies

    if is_deepspeed_zero3_enabled():  # from_config would partition the copy under zero.Init
        raise RuntimeError("gathered_copy: an HfDeepSpeedConfig is still alive; drop it after initialize")
    source = model.base_model.model
    adapter = copy.deepcopy(model.peft_config["default"])
    adapter.init_lora_weights = True  # the values are overwritten: skip PiSSA's SVD and the like
    config = copy.deepcopy(source.config)  # from_config writes into the config it is given
    auto_map = getattr(config, "auto_map", None) or {}
    # the meta device draws no random numbers, but forking keeps training's generator out of it for sure
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        skeleton = auto_model_class(auto_map).from_config(config, trust_remote_code=bool(auto_map))
        quant.quantize_like(skeleton, source)  # a 4-bit base gets 4-bit layers in the copy too
        plain = get_peft_model(skeleton, adapter, autocast_adapter_dtype=False)
    values = gather_copies(list(model.parameters()), device, COPY_CHUNK)  # each tied parameter once
    made: dict[int, torch.nn.Parameter] = {}  # a tied parameter stays one parameter in the copy
    for name, param in model.named_parameters(remove_duplicate=False):
        owner, _, leaf = name.rpartition(".")
        if id(param) not in made:
            made[id(param)] = quant.copy_weight(param, values[id(param)], device)
        plain.get_submodule(owner)._parameters[leaf] = made[id(param)]
    for name, buffer in model.named_buffers(remove_duplicate=False):
        owner, _, leaf = name.rpartition(".")
        plain.get_submodule(owner)._buffers[leaf] = buffer.detach().to(device, copy=True)
    quant.no_cpu_repack(plain)
    left = [n for n, t in [*plain.named_parameters(), *plain.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"gathered_copy: the copy's {left[:3]} have no counterpart in the model")
    plain.base_model.model.generation_config = copy.deepcopy(source.generation_config)
    return plain.eval()


def copy_fits(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether a `gathered_copy` of `model` fits on every rank (a collective: every rank must call it,
    and all get the same answer, so that all take the same path)."""
    import torch.distributed as dist

    size = copy_bytes(model)
    fits = torch.tensor([int(free_bytes(device) >= COPY_HEADROOM * size)], device=device)
    dist.all_reduce(fits, op=dist.ReduceOp.MIN)
    if not fits.item() and dist.get_rank() == 0:
        log.warning(
            "evaluation: a copy of the model (%.1f GB) does not fit beside training on some rank; "
            "generating under ZeRO-3, which gathers the model for every generated token",
            size / 1e9,
        )
    return bool(fits.item())


@torch.no_grad()
def evaluate_sharded(
    engine, processor, data: Rows, max_samples: int, batch_size: int, gather: bool | None = None
) -> dict:
    """Inside ZeRO-3 training: score the first `max_samples` of `data`, sharded over the ranks. Every rank
    must call this; it returns the same numbers on every rank.

    Each rank scores its shard on a copy of the model gathered once per evaluation (`gathered_copy`),
    then drops it. Generating under ZeRO-3 instead gathers the model again for every forward pass, that
    is for every generated token: llava-1.5-7b (14 GB in bf16) at jobs/llava-1.5-7b.yaml's scale (16
    ranks, micro batch 4, 256 samples, 10-token answers) runs 148 passes per rank per evaluation and
    gathers 2 TB per rank, against 14 GB once (bench/eval_gather.py, which measures 41 times the bytes
    and 7 times the seconds at the tiny size). `GatheredParameters` around `generate` would not keep the
    parameters whole: DeepSpeed 0.19.8's post-forward hook (`PartitionedParameterCoordinator.
    release_sub_module`) re-partitions every parameter that is not persistent or external as soon as its
    module's forward ends, gathered by the context or not, and the next pass gathers it again (without
    `synced_gpus`, the rank that finishes first then leaves the others waiting in those gathers). The
    copy has no hooks: each rank generates its own shard at its own length, with no collective until
    the totals' all-reduce.

    The copy costs its whole size on each rank beside the ZeRO-3 partitions: for llava-1.5-7b in bf16,
    14 GB + 14/world GB, which fits an 80 GB (or 40 GB) card next to the LoRA masters and Adam moments.
    Where it does not fit on some rank (`copy_fits`: a 70B model), or with `gather=False`, the ranks
    generate under ZeRO-3 in lockstep (`synced_gpus`), as before. Neither path writes the engine's
    parameters, fp32 masters or optimizer state, nor draws from the random generators, so the training
    that follows is the same with or without evaluation (tests/test_eval_sharded.py).
    """
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    device = engine.device
    n = min(len(data), max_samples)
    per_rank = -(-n // world)
    mine = list(range(rank * per_rank, min(n, (rank + 1) * per_rank)))
    if gather if gather is not None else copy_fits(engine.module, device):
        model = gathered_copy(engine.module, device)
        totals = _score_rows(model, processor, data, mine, batch_size, device)
        del model
        gc.collect()  # PEFT's modules refer to each other: free the copy now, not at some later collection
        if device.type == "cuda":
            torch.cuda.empty_cache()
    else:
        totals = _score_in_lockstep(engine, processor, data, mine, per_rank, batch_size)
    summed = torch.tensor([totals[k] for k in KEYS], dtype=torch.float64, device=device)
    dist.all_reduce(summed)  # NCCL serves device tensors only
    correct, stopped, loss_sum, tokens, samples = summed.tolist()
    return {
        "eval_accuracy": correct / max(samples, 1),
        "eval_loss": loss_sum / max(tokens, 1),
        "eval_stopped": stopped / max(samples, 1),
    }


def _score_in_lockstep(
    engine, processor, data: Rows, mine: list[int], per_rank: int, batch_size: int
) -> dict:
    """`score` totals of this rank's rows under ZeRO-3: every rank runs the same number of batches (a
    short shard repeats a sample that is not counted; a bad row is a stand-in, not counted either) and
    generates with `synced_gpus`, because ZeRO-3 needs every rank in every forward pass."""
    counted = [True] * len(mine) + [False] * (per_rank - len(mine))
    mine = mine + [0] * (per_rank - len(mine))
    totals = dict.fromkeys(KEYS, 0.0)
    model = engine.module
    model.eval()
    for i in range(0, per_rank, batch_size):
        examples, keep = [], counted[i : i + batch_size]
        for k in range(i, min(per_rank, i + batch_size)):
            try:
                examples.append(read(data, mine[k], video_sampling(processor)))
            except BadRow:
                examples.append(stand_in())
                keep[k - i] = False
        if not any(example[1] for example in examples):
            # ranks wait for each other in the vision tower's parameter gathers: every rank must run it
            examples.append(stand_in())
            keep.append(False)
        if getattr(processor, VIDEO_STAND_IN, False) and not any(len(example) > 2 for example in examples):
            examples.append(stand_in_video())  # and its video pass, where the model has one
            keep.append(False)
        for key, value in score(
            model, processor, examples, keep, synced_gpus=True, device=engine.device
        ).items():
            totals[key] += value
    model.train()
    return totals
