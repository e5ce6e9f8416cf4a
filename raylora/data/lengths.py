"""Every training sample's token count, for train.group_by_length (`raylora.data.sampler`).

The count is the one a step makes: the row read and its images decoded, rendered with the model's chat
template and tokenised by its processor, image tokens expanded (`labels.encode`); no estimate from the
text's length, which would miss Qwen2-VL's image tokens (4 to 16,384 of them, by the image's size). A
row that does not read or encode counts 0 tokens (its step skips it as it skips it today).

Counted once per run: each rank counts every world-th row and one all_reduce sums the counts, so the
work spreads over the workers; rank 0 then keeps them in the run's folder (`LENGTHS`) with what they were
counted from, and a restarted worker group, on any number of workers, reads them back instead of
counting again. Counted from other data or another processor, the kept counts are counted again.
"""

from __future__ import annotations

import json
import logging
import posixpath
import time

import numpy as np
import torch
import torch.distributed as dist
from jinja2 import TemplateError

from raylora import storage
from raylora.config import Config
from raylora.data.batches import read, video_sampling
from raylora.data.formats import BadRow, Rows
from raylora.data.labels import encode

log = logging.getLogger("raylora")

LENGTHS = "raylora_lengths.json"


def count(processor, rows: Rows, indices: range) -> list[int]:
    """Tokens of each row of `indices` as a training step encodes it; 0 for a row that is bad."""
    counts = []
    for i in indices:
        try:
            counts.append(len(encode(processor, read(rows, i, video_sampling(processor))).labels))
        except (BadRow, ValueError, TemplateError):
            counts.append(0)
    return counts


def source_key(cfg: Config, rows: Rows) -> dict:
    """What the counts follow from: the data, the model's processor, its image size limits and the video
    settings (frames sampled, pixel caps)."""
    d, m = cfg.data, cfg.model
    return {
        "data.train": d.train,
        "data.format": d.format,
        "data.image_root": d.image_root,
        "rows": len(rows),
        "model.path": m.path,
        "model.revision": m.revision,
        "data.max_pixels": d.max_pixels,
        "data.min_pixels": d.min_pixels,
        **{
            f"data.{k}": getattr(d, k)
            for k in (
                "video_fps",
                "video_num_frames",
                "video_max_frames",
                "video_max_pixels",
                "video_min_pixels",
                "video_total_pixels",
            )
        },
    }


def _kept(cfg: Config, key: dict) -> np.ndarray | None:
    fs, run_dir = storage.run_folder(cfg.run.storage_path, cfg.run.name)
    path = posixpath.join(run_dir, LENGTHS)
    try:
        with fs.open_input_stream(path) as f:
            kept = json.loads(f.read())
    except (FileNotFoundError, OSError, ValueError):
        return None
    if kept.get("key") != key or len(kept.get("lengths", ())) != key["rows"]:
        return None
    return np.asarray(kept["lengths"], dtype=np.int64)


def _keep(cfg: Config, key: dict, lengths: np.ndarray) -> None:
    fs, run_dir = storage.run_folder(cfg.run.storage_path, cfg.run.name)
    fs.create_dir(run_dir, recursive=True)
    path = posixpath.join(run_dir, LENGTHS)
    # written whole and then moved into place: a reader never sees half a file
    with fs.open_output_stream(path + ".partial") as f:
        f.write(json.dumps({"key": key, "lengths": lengths.tolist()}).encode())
    fs.move(path + ".partial", path)  # replaces counts kept for other data


def token_lengths(cfg: Config, processor, rows: Rows, device: torch.device) -> np.ndarray:
    """Every row's token count, the same on every rank: read from the run's folder where rank 0 kept
    them for this data and processor, else counted (a share per rank) and kept. Collective."""
    rank, world = dist.get_rank(), dist.get_world_size()
    key = source_key(cfg, rows)
    kept = _kept(cfg, key) if rank == 0 else None
    # rank 0 decides for all, so that every rank takes part in the same collectives
    hit = torch.tensor([kept is not None], dtype=torch.int64, device=device)
    dist.broadcast(hit, src=0)
    lengths = torch.zeros(len(rows), dtype=torch.int64)
    if hit.item():
        if rank == 0:
            lengths = torch.from_numpy(kept)
        lengths = lengths.to(device)
        dist.broadcast(lengths, src=0)
        return lengths.cpu().numpy()
    started = time.perf_counter()
    mine = range(rank, len(rows), world)
    lengths[rank::world] = torch.tensor(count(processor, rows, mine), dtype=torch.int64)
    lengths = lengths.to(device)
    dist.all_reduce(lengths)
    lengths = lengths.cpu().numpy()
    if rank == 0:
        _keep(cfg, key, lengths)
        log.info(
            "train.group_by_length: counted the tokens of %d rows in %.1f s on %d workers (kept in the "
            "run's %s)",
            len(rows),
            time.perf_counter() - started,
            world,
            LENGTHS,
        )
    return lengths


def grouping_keys(cfg: Config, processor, rows: Rows, device: torch.device) -> np.ndarray:
    """`token_lengths` for the sampler (train.group_by_length), -1 for a row that its step will skip (a
    bad row, or one longer than data.max_length or than a pass's token budget), which the sampler leaves
    in its shuffled place. Collective."""
    keys = token_lengths(cfg, processor, rows, device).copy()
    limit = cfg.length_limit
    skipped = keys == 0
    if limit is not None:
        skipped |= keys > limit[1]
    keys[skipped] = -1
    return keys
