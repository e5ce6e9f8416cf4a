"""What a run wrote, read back: a metrics row as the workers report it, the W&B and TensorBoard logs, the
labels a run trained on, its final checkpoint.
"""

from __future__ import annotations

import struct
from pathlib import Path

from tests import whole_checkpoint


def metrics_row(step: int, max_steps: int, restarts: int = 0, **extra) -> dict:
    """A row as the workers report it (the keys and magnitudes of a real run's row, about 330 bytes)."""
    return {
        "step": step,
        "loss": 3.5 / (1 + step) ** 0.5 + 1e-9 * step,
        "lr": 1e-4 * (1 - step / (max_steps + 1)),
        "vision_lr": 1e-5 * (1 - step / (max_steps + 1)),
        "samples_per_s": 37.85949056307141,
        "tokens_per_s": 1022.206245202928,
        "max_steps": max_steps,
        "epoch": 0,
        "restarts": restarts,
        "world_size": 2,
        "bad_rows": 0,
        "too_long": 0,
        "bad_rows_so_far": 0,
        "wall_time": 1796170227.1426444 + step,
        **extra,
    }


def wandb_history(wandb_dir: str | Path) -> list[dict[str, str]]:
    """The history rows W&B wrote in offline mode under `wandb_dir`, values as W&B's JSON strings.

    wandb 0.31 reads its own `.wandb` files only in its Go core, so this reads the format directly:
    a 7-byte header, then LevelDB-log records (32 KiB blocks; each record a 7-byte header: crc32,
    length, kind, where kind 1 is a whole record and 2-4 the first, middle and last piece of one) that
    hold `wandb_internal_pb2.Record` protobufs.
    """
    from wandb.proto import wandb_internal_pb2

    rows = []
    for path in sorted(Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, block, piece = path.read_bytes(), 7, 32768, b""
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # a block's tail too short for a header is padding
                pos += block - pos % block
                continue
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            piece += data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):
                record = wandb_internal_pb2.Record()
                record.ParseFromString(piece)
                piece = b""
                if record.WhichOneof("record_type") == "history":
                    # a key stands in `key`, or split into `nested_key` (the W&B core writes either)
                    rows.append({i.key or ".".join(i.nested_key): i.value_json for i in record.history.item})
    return rows


def tensorboard_scalars(logdir: str | Path) -> dict[str, dict[int, float]]:
    """The scalars of the TensorBoard event files under `logdir`: {tag: {step: value}}.

    Read without the tensorboard package: TFRecord framing (8-byte length, 4-byte CRC, the record, 4-byte
    CRC) around tensorboardX's `Event` protobufs.
    """
    from tensorboardX.proto import event_pb2

    scalars: dict[str, dict[int, float]] = {}
    for path in sorted(Path(logdir).glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def labelled_runs(labels) -> list[tuple[int, int]]:
    """(start, end) of each run of labelled positions in one row of labels (a list or a 1-D tensor)."""
    from raylora.data.labels import IGNORE_INDEX

    values = labels.tolist() if hasattr(labels, "tolist") else list(labels)
    runs, start = [], None
    for i, label in enumerate([*values, IGNORE_INDEX]):
        if label != IGNORE_INDEX and start is None:
            start = i
        elif label == IGNORE_INDEX and start is not None:
            runs.append((start, i))
            start = None
    return runs


def final_checkpoint(result):
    """The final checkpoint of a finished run (a `ray.train.Result`), read with raylora.checkpoint."""

    with result.checkpoint.as_directory() as folder:
        return whole_checkpoint.load(folder)
