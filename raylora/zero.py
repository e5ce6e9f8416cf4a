"""Everything that touches DeepSpeed ZeRO-3 internals, in one place.

ZeRO-3 keeps each trainable parameter's fp32 master and Adam moments as a slice of a flat partition
per parameter group (`optimizer.fp32_partitioned_groups_flat[i]`), at the offsets in
`optimizer.grad_position`. raylora reads and writes those directly:
- saving gathers whole flat partitions, one collective per group, not one per parameter
  (`safe_get_full_fp32_param` would be one all-gather per LoRA tensor: hundreds per save);
- saving hands rank 0 one gathered chunk at a time, which it writes into the checkpoint files before
  the next arrives: rank 0 never holds the whole trainable state;
- restoring writes each rank's slice of the model's partitions, the masters and the moments, reading
  only that slice from the checkpoint, with no collective at all (`GatheredParameters` is one
  all-gather and one broadcast per parameter; `safe_set_full_fp32_param` cannot write a last
  partition that holds padding).
`tests/test_zero_internals.py` checks this module against DeepSpeed's public per-parameter API, so a
DeepSpeed upgrade that moves these internals fails loudly there.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from raylora.config import Config
from raylora.ds import ZeroParamStatus

MOMENTS = ("exp_avg", "exp_avg_sq")


def deepspeed_config(cfg: Config, world_size: int) -> dict:
    """The ZeRO-3 DeepSpeed config for this run on `world_size` ranks (bf16 or fp32: `cfg.bf16`)."""
    t = cfg.train
    return {
        # no train_batch_size: DeepSpeed would require micro x accumulation x world to equal it, which a
        # global batch that does not split evenly over the ranks does not; it derives one instead
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum_steps(world_size),
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": t.param_persistence_threshold,
            # On CUDA, each gradient bucket's reduce-scatter runs on a stream of its own, overlapped with
            # the backward pass of the layers before it (DeepSpeed's own stage-3 default); off, it waits in
            # line on the compute stream. Stage 3 keeps one bucket either way (no second buffer, unlike
            # stages 1 and 2). DeepSpeed's CPU accelerator has no streams: off there, as the CPU runs are
            # tested.
            "overlap_comm": cfg.scaling.use_gpu,
            "contiguous_gradients": True,
        },
        # torch's AdamW: no fused_adam JIT build on CPU, and its state is plain tensors.
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": t.lr,
                "weight_decay": t.weight_decay,
                "betas": [0.9, 0.999],
                "eps": 1e-8,
                "torch_adam": True,
            },
        },
        "bf16": {"enabled": cfg.bf16},
        # Under bf16, DeepSpeed would accumulate gradients over micro batches and reduce-scatter them in
        # bf16 (the model dtype): 8 bits of mantissa summed over ranks and micro batches. Keep both in
        # fp32, as the masters and Adam moments are.
        **(
            {"data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "fp32"}
            if cfg.bf16
            else {}
        ),
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def is_partitioned(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_id")


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The unpartitioned shape (a ZeRO-3 partitioned parameter's own `.shape` is empty)."""
    return tuple(param.ds_shape) if is_partitioned(param) else tuple(param.shape)


class Source(Protocol):
    """What a restore reads from: `checkpoint.Ranges` (a rank's slices, from storage), or a reader of whole
    tensors in memory (the tests' `whole_checkpoint.Loaded`)."""

    def weight_range(self, name: str, start: int, stop: int) -> torch.Tensor: ...

    def moment_range(self, name: str, kind: str, start: int, stop: int) -> torch.Tensor: ...


def _own_range(param: torch.Tensor, length: int) -> tuple[int, int]:
    """The flat elements of a parameter that this rank's partition of `length` holds (ZeRO-3's layout:
    the flattened parameter, padded to world * length, rank r holding slice r; the padding stays zero)."""
    rank = dist.get_rank(group=param.ds_process_group)
    return min(rank * length, param.ds_numel), min((rank + 1) * length, param.ds_numel)


def partition_load(params: dict[str, torch.nn.Parameter], source: Source) -> None:
    """Write saved weights into the model's ZeRO-3 partitions before `deepspeed.initialize`; no collectives.

    Each rank reads and writes only its own partition of every partitioned parameter. The plain
    parameters (the LoRA tensors PEFT added after `from_pretrained`) are read whole on rank 0 only:
    `deepspeed.initialize` makes them ZeRO-3 parameters by broadcasting rank 0's values
    (`Init._zero_init_param`), so what other ranks held would be overwritten. Not
    `GatheredParameters(modifier_rank=0)`: DeepSpeed 0.19 sends one all-gather per parameter entering it
    and one broadcast per parameter leaving it. `tests/test_zero_internals.py` reads the result back
    through that API.
    """
    rank = dist.get_rank()
    with torch.no_grad():
        for name, param in params.items():
            if not is_partitioned(param):
                if rank == 0:
                    param.data.copy_(
                        source.weight_range(name, 0, param.numel()).to(param.dtype).view(param.shape)
                    )
                continue
            if param.ds_status != ZeroParamStatus.NOT_AVAILABLE or param.ds_secondary_tensor is not None:
                # a live gathered copy, or ZeRO++'s secondary partition, would keep values this misses;
                # neither exists before `initialize` under raylora's deepspeed_config (no hpZ)
                raise RuntimeError(f"{name}: expected a released ZeRO-3 partition ({param.ds_status})")
            part = param.ds_tensor
            chunk = source.weight_range(name, *_own_range(param, part.ds_numel))
            part.data.zero_()
            part.data[: chunk.numel()].copy_(chunk.to(part.dtype))


def _slots(engine, params: dict[str, torch.nn.Parameter]) -> dict[str, tuple[int, int, int]]:
    """name -> (flat group index, offset in the rank's flat partition, partition length)."""
    opt = engine.optimizer
    return {n: tuple(opt.grad_position[opt.get_param_id(p)]) for n, p in params.items()}


def ensure_optimizer_state(engine, step: int) -> None:
    """Create the AdamW state that ZeRO-3 only builds lazily at the first step, so it can be written."""
    opt = engine.optimizer
    for flat in opt.fp32_partitioned_groups_flat:
        state = opt.optimizer.state[flat]
        state["step"] = torch.tensor(float(step))
        for key in MOMENTS:
            state.setdefault(key, torch.zeros_like(flat))


# Bytes rank 0 receives per `gather` at save, all ranks together: every rank sends GATHER_ROWS rows
# (master, exp_avg, exp_avg_sq) of `gather_chunk(world)` fp32 values, and rank 0 holds the world's rows on
# the device and once more in host memory until it has handed each piece to the checkpoint writer. A
# budget over all ranks, not a count per rank, so rank 0's memory at save does not grow with the world
# size, whatever the size of a trained vision tower (1 GiB: 44.7M values per rank at 2 ranks, 11.2M at
# 8, 1.4M at 64, still megabytes per rank per message).
GATHER_BYTES = 1 << 30
GATHER_ROWS = 1 + len(MOMENTS)


def gather_chunk(world_size: int) -> int:
    """Elements of each rank's flat partition per save `gather`: GATHER_BYTES over world x 3 rows x 4 B."""
    return max(1, GATHER_BYTES // (world_size * GATHER_ROWS * 4))


# sink(name, kind, start, values): elements `start...` of parameter `name`'s flattened fp32 master
# (kind "weight") or Adam moment (kind "exp_avg" / "exp_avg_sq"); `checkpoint.Writer.write` is one.
Sink = Callable[[str, str, int, torch.Tensor], None]


def stream_trainable_state(engine, params: dict[str, torch.nn.Parameter], sink: Sink | None) -> None:
    """Hand the full fp32 masters and Adam moments of `params` to `sink` on rank 0, chunk by chunk.

    One `gather` per flat group (per `gather_chunk(world)` elements of it) carries the master and both
    moments of every parameter in it. The tensors travel on the device the engine's process group
    serves (a CPU tensor on an NCCL group is an error); rank 0 moves each message to host memory, gives
    `sink` the pieces of every parameter the chunk covers and drops it. Every rank must call this
    (`sink` is used on rank 0 only). Before the first optimizer step the moments are zeros.
    """
    opt = engine.optimizer
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = gather_chunk(world)  # the same on every rank, so every rank sends as many messages
    slots = _slots(engine, params)
    by_group: dict[int, list[str]] = defaultdict(list)
    for name, (group, _, _) in slots.items():
        by_group[group].append(name)
    kinds = ("weight", *MOMENTS)
    for group in sorted(by_group):
        flat = opt.fp32_partitioned_groups_flat[group]
        state = opt.optimizer.state.get(flat, {})
        rows = [flat.detach()] + [
            state[k].detach() if k in state else torch.zeros_like(flat) for k in MOMENTS
        ]
        size = flat.numel()  # the same on every rank: ZeRO-3 pads flat partitions to equal length
        for start in range(0, size, per_rank):
            local = torch.stack([r[start : start + per_rank] for r in rows]).float()
            local = local.to(engine.device).contiguous()
            gathered = [torch.empty_like(local) for _ in range(world)] if rank == 0 else None
            dist.gather(local, gathered, dst=0)
            if rank != 0:
                continue
            stop = start + local.shape[1]
            chunks = [g.cpu() for g in gathered]
            for name in by_group[group]:
                _, offset, length = slots[name]
                lo, hi = max(offset, start), min(offset + length, stop)
                if lo >= hi:
                    continue
                numel = params[name].ds_numel
                # ZeRO-3 layout: the flattened parameter, padded to world * length, rank r holds slice r.
                for r, chunk in enumerate(chunks):
                    first = r * length + lo - offset  # where this piece starts in the full tensor
                    count = min(hi - lo, numel - first)  # the padding past the parameter's end is dropped
                    if count <= 0:
                        continue
                    for i, kind in enumerate(kinds):
                        sink(name, kind, first, chunk[i, lo - start : lo - start + count])
            del chunks, gathered


def gather_trainable_state(
    engine, params: dict[str, torch.nn.Parameter]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None:
    """Full fp32 masters and Adam moments of `params`, on rank 0 (None elsewhere), in host memory, as
    `stream_trainable_state` hands them out. Every rank must call this."""
    rank = dist.get_rank()
    weights = {n: torch.empty(full_shape(p)) for n, p in params.items()} if rank == 0 else {}
    moments = (
        {f"{n}.{k}": torch.empty(full_shape(p)) for n, p in params.items() for k in MOMENTS}
        if rank == 0
        else {}
    )

    def sink(name: str, kind: str, start: int, values: torch.Tensor) -> None:
        full = weights[name] if kind == "weight" else moments[f"{name}.{kind}"]
        full.view(-1)[start : start + values.numel()] = values

    stream_trainable_state(engine, params, sink if rank == 0 else None)
    return (weights, moments) if rank == 0 else None


def set_trainable_state(engine, params: dict[str, torch.nn.Parameter], source: Source, step: int) -> None:
    """Write each rank's slice of the fp32 masters and Adam moments, read from `source`; no collectives.

    The masters matter under bf16: the engine built them from bf16 parameters at `initialize`, which
    lost the fp32 precision the checkpoint kept.
    """
    opt = engine.optimizer
    ensure_optimizer_state(engine, step)
    for name, (group, offset, length) in _slots(engine, params).items():
        flat = opt.fp32_partitioned_groups_flat[group]
        start, stop = _own_range(params[name], length)
        targets = [(flat, source.weight_range(name, start, stop))]
        targets += [
            (opt.optimizer.state[flat][k], source.moment_range(name, k, start, stop)) for k in MOMENTS
        ]
        for dest_flat, chunk in targets:
            dest = dest_flat.data.narrow(0, offset, length)
            dest.zero_()  # the padding past the parameter's end stays zero, as DeepSpeed keeps it
            dest[: chunk.numel()].copy_(chunk.to(dest.dtype))


@torch.no_grad()
def gather_copies(
    params: list[torch.nn.Parameter], device: torch.device, chunk: int
) -> dict[int, torch.Tensor]:
    """A whole copy of each parameter on `device`, by `id`, gathered about `chunk` elements at a time
    (`GatheredParameters` with no modifier rank: read, never written, released as they were; those already
    whole, ZeRO-3's persistent ones and any the engine kept from its last pass, are copied as they are and
    left so). Every rank must call it: the gathers are collectives."""
    from raylora.ds import deepspeed

    values: dict[int, torch.Tensor] = {}
    start, numel = 0, 0
    for i, param in enumerate(params):
        numel += param.ds_numel if is_partitioned(param) else param.numel()
        if numel < chunk and i + 1 < len(params):
            continue
        group, start, numel = params[start : i + 1], i + 1, 0
        away = [p for p in group if is_partitioned(p) and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        with deepspeed.zero.GatheredParameters(away):
            for p in group:
                values[id(p)] = p.data.to(device, copy=True)
    return values
