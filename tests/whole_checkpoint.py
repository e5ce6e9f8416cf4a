"""A checkpoint written and read as whole tensors, for tests: `save` writes through raylora's own
`checkpoint.Writer`, `load` reads every file back after `checkpoint.verify`. Training writes piece by piece
(`checkpoint.Writer`) and restores only each rank's slices (`checkpoint.Ranges`); `Loaded` serves
`zero.partition_load` in the same way as a `Ranges`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from raylora import checkpoint


def save(
    folder: str | Path,
    weights: dict[str, torch.Tensor],
    moments: dict[str, torch.Tensor],
    state: checkpoint.TrainState,
    adapter_config,
) -> None:
    """Write a checkpoint of whole tensors into `folder` (which must be new or empty); the manifest goes
    last: the same writer as training's (`checkpoint.Writer`), fed whole tensors."""
    writer = checkpoint.Writer(folder, {n: list(t.shape) for n, t in weights.items()})
    for name, tensor in weights.items():
        writer.write(name, "weight", 0, tensor)
        for kind in checkpoint.MOMENTS:
            writer.write(name, kind, 0, moments[f"{name}.{kind}"])
    writer.finish(state, adapter_config)


@dataclass
class Loaded:
    """A checkpoint read whole (export, evaluation, tests); `Ranges` reads only the parts a rank needs."""

    weights: dict[str, torch.Tensor]
    """fp32 masters by base parameter name (LoRA and trained modules together)."""
    moments: dict[str, torch.Tensor]
    """Adam moments keyed `<name>.exp_avg` / `<name>.exp_avg_sq`."""
    state: checkpoint.TrainState

    def weight_range(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of parameter `name`'s flattened fp32 master."""
        return self.weights[name].reshape(-1)[start:stop]

    def moment_range(self, name: str, kind: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of parameter `name`'s flattened Adam moment `kind`."""
        return self.moments[f"{name}.{kind}"].reshape(-1)[start:stop]


def load(folder: str | Path) -> Loaded:
    """Verify and read a checkpoint written by `save` (safetensors and JSON only)."""
    folder = Path(folder)
    checkpoint.verify(folder)
    state = checkpoint._parse_state((folder / checkpoint.STATE).read_bytes(), folder)
    lora_by_key = {checkpoint.adapter_key(n): n for n in state.trainable if checkpoint.is_adapter(n)}
    weights = {}
    for key, tensor in load_file(folder / checkpoint.ADAPTER_WEIGHTS).items():
        if key not in lora_by_key:
            raise checkpoint.CheckpointError(
                f"{folder}: {checkpoint.ADAPTER_WEIGHTS} holds {key}, which state.json does not list"
            )
        weights[lora_by_key[key]] = tensor
    weights.update(load_file(folder / checkpoint.TRAINED_MODULES))
    moments = load_file(folder / checkpoint.OPTIMIZER)
    return Loaded(weights=weights, moments=moments, state=state)
