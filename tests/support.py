"""Helpers the tests share that are not fixtures."""

from __future__ import annotations

import struct
from pathlib import Path


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
                    rows.append({i.key: i.value_json for i in record.history.item})
    return rows
