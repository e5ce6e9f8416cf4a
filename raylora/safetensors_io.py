"""safetensors files written and read in pieces, by the format's documented layout: a little-endian u64
header length, a JSON header of each tensor's dtype, shape and byte offsets, then the data. The checkpoint
(`raylora.checkpoint`) streams its fp32 tensors out as rank 0 gathers them (`PieceWriter`) and each rank
reads back only the element ranges it owns (`read_header`, `read_elements`); tests compare both with
safetensors' own reader and writer.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}

# read(offset, length) -> exactly `length` bytes of one file from `offset`
Read = Callable[[int, int], bytes]


class PieceWriter:
    """One fp32 safetensors file written piece by piece: the header (every tensor's name, shape and byte
    range) goes first, computed from the shapes, so tensor data can arrive in any order as rank 0 gathers
    it, and no whole tensor need be in memory. The result is what `safetensors.torch.save_file` reads."""

    def __init__(self, path: Path, shapes: dict[str, list[int]]):
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        self.offsets: dict[str, int] = {}
        end = 0
        for name in sorted(shapes):
            size = 4 * math.prod(shapes[name])
            header[name] = {"dtype": "F32", "shape": list(shapes[name]), "data_offsets": [end, end + size]}
            self.offsets[name] = end
            end += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
        self.base = 8 + len(text)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self.fd, struct.pack("<Q", len(text)) + text, 0)
        os.ftruncate(self.fd, self.base + end)

    def write(self, key: str, start: int, values: torch.Tensor) -> None:
        """Elements `start...` of tensor `key`, flattened."""
        data = memoryview(values.detach().to(torch.float32).contiguous().numpy()).cast("B")
        pos = self.base + self.offsets[key] + 4 * start
        while data:
            written = os.pwrite(self.fd, data, pos)
            data, pos = data[written:], pos + written

    def close(self) -> None:
        os.close(self.fd)


def read_header(read: Read) -> tuple[int, dict[str, Any]]:
    """(the byte where the data starts, the JSON header) of a file; `ValueError` when the header does not
    parse."""
    (length,) = struct.unpack("<Q", read(0, 8))
    return 8 + length, json.loads(read(8, length))


def read_elements(read: Read, base: int, entry: dict[str, Any], start: int, stop: int) -> torch.Tensor:
    """Elements [start, stop) of the flattened tensor that header `entry` describes (`base`: where the
    file's data starts), in its own dtype."""
    dtype = DTYPES[entry["dtype"]]
    size = torch.empty((), dtype=dtype).element_size()
    stop = max(start, min(stop, math.prod(entry["shape"])))
    data = read(base + entry["data_offsets"][0] + start * size, (stop - start) * size)
    return torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)
