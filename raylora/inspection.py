"""`raylora inspect`: what a checkpoint holds and whether it is intact, without loading any tensor.

Everything comes from state.json (step, trainable names and shapes, config, versions), the adapter
config and the folder listing, so a checkpoint can be inspected on a machine without its base model.
The folder is a local path or a URI of any pyarrow filesystem (s3://, gs://), read where it lies:
nothing is downloaded but those JSON files, and the manifest check streams each file through sha256.
"""

from __future__ import annotations

import json
import math
import posixpath
from pathlib import Path
from typing import Any

import pyarrow.fs

from raylora import checkpoint
from raylora.arch import REGISTRY
from raylora.config import ConfigError
from raylora.storage import absolute, filesystem

GROUPS = {
    "language_model": "LoRA on the language model",
    "vision_tower": "vision tower",
    "aligner": "aligner",
    "other": "other",
}


def part_of(name: str, arch: str | None) -> str:
    """`language_model`, `vision_tower`, `aligner` or `other` for a trainable parameter name (a LoRA
    tensor belongs to the part of the layer it adapts).

    The configured architecture decides when set; otherwise the first registry entry that knows the
    name. Only the language model prefixes are shared between entries, so the order does not matter.
    """
    entries = [REGISTRY[arch]] if arch in REGISTRY else list(REGISTRY.values())
    return next((p for a in entries if (p := a.part_of(name)) is not None), "other")


def module_name(name: str) -> str:
    """The module a trainable parameter belongs to: the adapted layer for LoRA, the owner otherwise."""
    for marker in (".lora_A.", ".lora_B.", ".lora_magnitude_vector."):
        if marker in name:
            return name.split(marker, 1)[0]
    return name.rsplit(".", 1)[0]


def trainable_groups(trainable: dict[str, list[int]], arch: str | None) -> dict[str, dict[str, Any]]:
    """Trainable modules grouped by model part, with tensor and parameter counts."""
    groups: dict[str, dict[str, Any]] = {}
    for name, shape in trainable.items():
        g = groups.setdefault(part_of(name, arch), {"modules": [], "tensors": 0, "parameters": 0})
        if (module := module_name(name)) not in g["modules"]:
            g["modules"].append(module)
        g["tensors"] += 1
        g["parameters"] += math.prod(shape)
    return {part: groups[part] for part in GROUPS if part in groups}


def inspect_checkpoint(folder: str | Path) -> dict[str, Any]:
    """A report on checkpoint `folder` (a path or a URI); `report["manifest"]["ok"]` says whether every
    file matches.

    Raises `ConfigError` only when `folder` is not a checkpoint at all (no state.json, no manifest).
    """
    where = str(folder).rstrip("/") or "/"  # a URI stays a string: pathlib folds `s3://b/k` to `s3:/b/k`
    fs, path = filesystem(absolute(where))

    def error(err: Exception) -> str:  # the folder as the user named it, not as its filesystem does
        return str(err).replace(path, where)

    found = fs.get_file_info(
        [posixpath.join(path, checkpoint.STATE), posixpath.join(path, checkpoint.MANIFEST)]
    )
    if all(f.type != pyarrow.fs.FileType.File for f in found):
        raise ConfigError(
            f"{where} is not a raylora checkpoint (no {checkpoint.STATE}, no {checkpoint.MANIFEST})"
        )
    report: dict[str, Any] = {"folder": where}
    listing = sorted(fs.get_file_info(pyarrow.fs.FileSelector(path)), key=lambda f: f.base_name)
    report["files"] = {f.base_name: f.size for f in listing if f.type == pyarrow.fs.FileType.File}
    try:
        checkpoint.verify(path, filesystem=fs)
        report["manifest"] = {"ok": True, "error": None}
    except checkpoint.CheckpointError as err:
        report["manifest"] = {"ok": False, "error": error(err)}
    try:
        state = checkpoint.read_state(path, filesystem=fs)
    except checkpoint.CheckpointError as err:
        report["state_error"] = f"{checkpoint.STATE} unreadable: {error(err)}"
        return report
    try:
        lora = checkpoint.read_adapter_config(path, filesystem=fs)
        report["lora"] = {k: lora.get(k) for k in ("r", "lora_alpha", "lora_dropout", "target_modules")}
    except checkpoint.CheckpointError as err:
        report["lora"] = {"error": error(err)}
    arch = state.arch or state.config.get("model", {}).get("arch")
    report.update(
        step=state.step,
        epoch=state.epoch,
        restarts=state.restarts,
        world_size=state.world_size,
        format=state.format,
        trainable=trainable_groups(state.trainable, arch),
        config=state.config,
        versions=state.versions,
    )
    return report


def _flat(data: dict[str, Any], prefix: str = "") -> list[str]:
    """Nested config as the dotted `key=value` lines that `raylora train` takes as overrides."""
    lines = []
    for key, value in data.items():
        if isinstance(value, dict):
            lines += _flat(value, f"{prefix}{key}.")
        else:
            lines.append(f"{prefix}{key}={json.dumps(value) if not isinstance(value, str) else value}")
    return lines


def format_report(report: dict[str, Any]) -> str:
    """The report as text for a terminal."""
    lines = [f"checkpoint {report['folder']}"]
    m = report["manifest"]
    lines.append("manifest   ok: every file matches" if m["ok"] else f"manifest   FAILED: {m['error']}")
    if "step" in report:
        lines.append(
            f"step       {report['step']} (epoch {report['epoch']}, restarts {report['restarts']}, "
            f"world size {report['world_size']}, format {report['format']})"
        )
    lines.append("files")
    for name, size in report["files"].items():
        lines.append(f"  {name:<30} {size:>14,} bytes")
    lines.append(f"  {'total':<30} {sum(report['files'].values()):>14,} bytes")
    if "state_error" in report:
        lines.append(report["state_error"])
        return "\n".join(lines)
    lines.append("trainable")
    for part, g in report["trainable"].items():
        lines.append(
            f"  {GROUPS[part]:<28} {len(g['modules']):>5} modules {g['tensors']:>6} tensors "
            f"{g['parameters']:>14,} parameters"
        )
    total = sum(g["parameters"] for g in report["trainable"].values())
    lines.append(f"  {'total':<28} {total:>42,} parameters")
    lora = report["lora"]
    if "error" in lora:
        lines.append(f"lora       {lora['error']}")
    else:
        lines.append(
            f"lora       r={lora['r']} alpha={lora['lora_alpha']} dropout={lora['lora_dropout']} "
            f"targets={lora['target_modules']}"
        )
    lines.append("versions   " + " ".join(f"{k}={v}" for k, v in report["versions"].items()))
    lines.append("config")
    lines += [f"  {line}" for line in _flat(report["config"])]
    return "\n".join(lines)
