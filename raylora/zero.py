"""Everything that touches DeepSpeed ZeRO-3 internals, in one place.

ZeRO-3 keeps each trainable parameter's fp32 master and Adam moments as a slice of a flat partition
per parameter group (`optimizer.fp32_partitioned_groups_flat[i]`), at the offsets in
`optimizer.grad_position`. raylora reads and writes those directly:
- saving gathers whole flat partitions, one collective per group, not one per parameter
  (`safe_get_full_fp32_param` would be one all-gather per LoRA tensor: hundreds per save);
- restoring writes each rank's slice of the model's partitions, the masters and the moments from the
  full tensors every rank read from the checkpoint, with no collective at all (`GatheredParameters`
  is one all-gather and one broadcast per parameter; `safe_set_full_fp32_param` cannot write a last
  partition that holds padding).
`tests/test_zero_internals.py` checks this module against DeepSpeed's public per-parameter API, so a
DeepSpeed upgrade that moves these internals fails loudly there.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from raylora.config import Config

MOMENTS = ("exp_avg", "exp_avg_sq")


def deepspeed_config(cfg: Config, world_size: int) -> dict:
    """The ZeRO-3 DeepSpeed config for this run on `world_size` ranks (bf16 or fp32: `cfg.bf16`)."""
    t = cfg.train
    return {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum_steps(world_size),
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": t.param_persistence_threshold,
            "overlap_comm": False,
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


def partition_load(params: dict[str, torch.nn.Parameter], values: dict[str, torch.Tensor]) -> None:
    """Write saved weights into the model's ZeRO-3 partitions before `deepspeed.initialize`; no collectives.

    Every rank read the full tensors from the checkpoint, so each writes its own partition of every
    partitioned parameter (ZeRO-3's layout: the flattened parameter, padded to world * partition size,
    rank r holding slice r; the padding stays zero) and copies plain parameters (the LoRA tensors PEFT
    added after `from_pretrained`) whole. Not `GatheredParameters(modifier_rank=0)`: DeepSpeed 0.19 sends
    one all-gather per parameter entering it and one broadcast per parameter leaving it, to move values
    every rank already holds. `tests/test_zero_internals.py` reads the result back through that API.
    """
    with torch.no_grad():
        for name, param in params.items():
            if name not in values:
                continue
            value = values[name]
            if not is_partitioned(param):
                param.data.copy_(value.to(param.dtype).view(param.shape))
                continue
            if param.ds_status != ZeroParamStatus.NOT_AVAILABLE or param.ds_secondary_tensor is not None:
                # a live gathered copy, or ZeRO++'s secondary partition, would keep values this misses;
                # neither exists before `initialize` under raylora's deepspeed_config (no hpZ)
                raise RuntimeError(f"{name}: expected a released ZeRO-3 partition ({param.ds_status})")
            part = param.ds_tensor
            length = part.ds_numel
            rank = dist.get_rank(group=param.ds_process_group)
            chunk = value.reshape(-1)[rank * length : (rank + 1) * length]
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


# Elements of a rank's flat partition sent per `gather` at save: rank 0 receives world x 3 rows
# (master, exp_avg, exp_avg_sq) of this many fp32 values per message, which bounds the extra device
# memory a save needs whatever the size of a trained vision tower (8 ranks: 1.5 GiB).
GATHER_CHUNK = 1 << 24


def gather_trainable_state(
    engine, params: dict[str, torch.nn.Parameter]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None:
    """Full fp32 masters and Adam moments of `params`, on rank 0 (None elsewhere), in host memory.

    One `gather` per flat group (per `GATHER_CHUNK` of it) carries the master and both moments of
    every parameter in it. The tensors travel on the device the engine's process group serves (a CPU
    tensor on an NCCL group is an error); rank 0 moves each message to host memory as it arrives.
    Every rank must call this. Before the first optimizer step the moments are zeros.
    """
    opt = engine.optimizer
    rank, world = dist.get_rank(), dist.get_world_size()
    slots = _slots(engine, params)
    by_group: dict[int, list[str]] = defaultdict(list)
    for name, (group, _, _) in slots.items():
        by_group[group].append(name)
    weights, moments = {}, {}
    for group in sorted(by_group):
        flat = opt.fp32_partitioned_groups_flat[group]
        state = opt.optimizer.state.get(flat, {})
        rows = [flat.detach()] + [
            state[k].detach() if k in state else torch.zeros_like(flat) for k in MOMENTS
        ]
        size = flat.numel()  # the same on every rank: ZeRO-3 pads flat partitions to equal length
        parts: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for start in range(0, size, GATHER_CHUNK):
            local = torch.stack([r[start : start + GATHER_CHUNK] for r in rows]).float()
            local = local.to(engine.device).contiguous()
            gathered = [torch.empty_like(local) for _ in range(world)] if rank == 0 else None
            dist.gather(local, gathered, dst=0)
            if rank == 0:
                for r, g in enumerate(gathered):
                    parts[r].append(g.cpu())
        if rank != 0:
            continue
        per_rank = [torch.cat(p, dim=1) for p in parts]
        for name in by_group[group]:
            _, offset, length = slots[name]
            param = params[name]
            # ZeRO-3 layout: the flattened parameter, padded to world * length, rank r holds slice r.
            full = torch.cat([g[:, offset : offset + length] for g in per_rank], dim=1)[:, : param.ds_numel]
            shape = full_shape(param)
            weights[name] = full[0].reshape(shape).clone()
            for i, key in enumerate(MOMENTS, start=1):
                moments[f"{name}.{key}"] = full[i].reshape(shape).clone()
    return (weights, moments) if rank == 0 else None


def set_trainable_state(
    engine,
    params: dict[str, torch.nn.Parameter],
    weights: dict[str, torch.Tensor],
    moments: dict[str, torch.Tensor],
    step: int,
) -> None:
    """Write each rank's slice of the fp32 masters and Adam moments from full tensors; no collectives.

    The masters matter under bf16: the engine built them from bf16 parameters at `initialize`, which
    lost the fp32 precision the checkpoint kept.
    """
    opt = engine.optimizer
    ensure_optimizer_state(engine, step)
    rank = dist.get_rank(group=next(iter(params.values())).ds_process_group)
    for name, (group, offset, length) in _slots(engine, params).items():
        flat = opt.fp32_partitioned_groups_flat[group]
        targets = [(flat, weights[name])]
        targets += [(opt.optimizer.state[flat][k], moments[f"{name}.{k}"]) for k in MOMENTS]
        for dest_flat, full in targets:
            chunk = full.reshape(-1)[rank * length : (rank + 1) * length]
            dest = dest_flat.data.narrow(0, offset, length)
            dest.zero_()  # the padding past the parameter's end stays zero, as DeepSpeed keeps it
            dest[: chunk.numel()].copy_(chunk.to(dest.dtype))
