"""The lazy row readers: a source's rows as plain dicts, read when a batch uses them, never at the start.

Parquet is read one row group at a time (a few decoded row groups kept), a `datasets.save_to_disk` folder
is memory-mapped, and JSON/JSONL keep a byte-offset index of their records (16 bytes a row) and parse a
record when it is used, so memory and start-up per rank stay flat however many rows there are. What a
record means is for the format readers (`raylora.data.formats` and the family modules beside it).
"""

from __future__ import annotations

import bisect
import json
import re
from collections import OrderedDict

import numpy as np
import pyarrow as pa
import pyarrow.fs
import pyarrow.parquet as pq

from raylora.data.rows import BadRow

# Decoded Parquet row groups kept per process. The sampler visits rows in a random order, so a cache only
# pays where the whole data set is a few row groups (it then stays decoded); a big one has small row groups
# (prepare-data writes them) that are cheap to read again, and a bound keeps memory flat in the rows.
ROW_GROUP_CACHE = 4
CHUNK = 1 << 24  # bytes a JSONL file is scanned by: the index never holds the file
JSON_NAMES = 32  # JSON records whose keys make a source's field names (rows of JSONL vary in their keys)


class Records:
    """Rows of a source as plain dicts: `names` (its fields), `columns` (those read), `record(i)`."""

    names: list[str]
    columns: list[str] | None = None

    def __len__(self) -> int:
        raise NotImplementedError

    def record(self, i: int) -> dict:
        raise NotImplementedError

    def __getstate__(self) -> dict:  # open files and caches stay in the process that opened them
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


class ParquetRecords(Records):
    """Parquet files, one row group read (and cached) when a row in it is used; the footers say the rest."""

    def __init__(self, fs, files: list[str]):
        self.fs, self.files, self.groups, starts = fs, files, [], [0]
        for k, path in enumerate(files):
            meta = pq.read_metadata(path, filesystem=fs)
            if k == 0:
                self.names = meta.schema.to_arrow_schema().names
            for g in range(meta.num_row_groups):
                self.groups.append((k, g))
                starts.append(starts[-1] + meta.row_group(g).num_rows)
        self.starts = np.asarray(starts, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def record(self, i: int) -> dict:
        g = bisect.bisect_right(self.starts, i) - 1
        cache = self.__dict__.setdefault("_cache", OrderedDict())
        if g not in cache:
            k, group = self.groups[g]
            # A file's footer is parsed once per process: with many small row groups it is large (about
            # 1 KB a group), and parsing it at every read cost ten times the row group's own read.
            footers = self.__dict__.setdefault("_footers", {})
            if k not in footers:
                footers[k] = pq.read_metadata(self.files[k], filesystem=self.fs)
            with self.fs.open_input_file(self.files[k]) as f:
                cache[g] = pq.ParquetFile(f, metadata=footers[k]).read_row_group(group, columns=self.columns)
            if len(cache) > ROW_GROUP_CACHE:
                cache.popitem(last=False)
        cache.move_to_end(g)
        return cache[g].slice(i - int(self.starts[g]), 1).to_pylist()[0]


class ArrowRecords(Records):
    """A `datasets.save_to_disk` folder: its Arrow stream files, memory-mapped, so rows cost no memory of
    their own and the OS pages in what is read (zero copy). Not through `datasets`, which pulls in much more
    at every start. A remote (URI) folder has no memory map: its files are read whole, once."""

    def __init__(self, fs, files: list[str]):
        self.fs, self.files = fs, files
        table = self._table()
        self.names, self.rows = table.schema.names, table.num_rows

    def _table(self) -> pa.Table:
        if "_tables" not in self.__dict__:
            local = isinstance(self.fs, pyarrow.fs.LocalFileSystem)
            sources = [pa.memory_map(p) if local else self.fs.open_input_stream(p) for p in self.files]
            self._tables = pa.concat_tables(pa.ipc.open_stream(s).read_all() for s in sources)
        return self._tables

    def __len__(self) -> int:
        return self.rows

    def record(self, i: int) -> dict:
        table = self._table()
        return table.select(self.columns or table.schema.names).slice(i, 1).to_pylist()[0]


class JsonRecords(Records):
    """A JSON array or JSONL file, by a byte-offset index of its records (16 bytes a row): a record is read
    and parsed when used, so a rank holds neither the file nor its parsed objects. Building the index is
    one pass over the file at the start, which a JSON array (no line boundaries) needs in full."""

    def __init__(self, fs, path: str):
        self.fs, self.path = fs, path
        with fs.open_input_stream(path) as f:
            head = f.read(CHUNK)
            if head.lstrip()[:1] == b"[":
                self.spans = _array_spans(head + f.read())
            else:
                self.spans = _line_spans(head, f)
        names: dict[str, None] = {}  # in order of first appearance
        for i in range(min(len(self.spans), JSON_NAMES)):
            try:
                names.update(dict.fromkeys(self.record(i)))
            except BadRow:
                if i == 0:
                    raise
        self.names = list(names)

    def __len__(self) -> int:
        return len(self.spans)

    def record(self, i: int) -> dict:
        if "_file" not in self.__dict__:
            self._file = self.fs.open_input_file(self.path)
        start, end = (int(x) for x in self.spans[i])
        try:
            rec = json.loads(self._file.read_at(end - start, start))
        except ValueError as err:
            raise BadRow(f"not valid JSON ({err})") from err
        if not isinstance(rec, dict):
            raise BadRow(f"a JSON {type(rec).__name__}, not an object")
        return rec


def _line_spans(chunk: bytes, stream) -> np.ndarray:
    """(start, end) byte offsets of JSONL's lines that hold a record, read chunk by chunk."""
    breaks, offset = [], 0
    while chunk:
        breaks.append(np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == ord("\n")) + offset)
        offset += len(chunk)
        chunk = stream.read(CHUNK)
    ends = np.concatenate([*breaks, [offset]]).astype(np.int64)
    starts = np.concatenate([[0], ends[:-1] + 1])
    # A line of a few bytes ("", "\r", " ") holds no JSON object: `{"a":1}` alone takes 7.
    spans = np.stack([starts, ends], axis=1)
    return spans[ends - starts > 2]


def _array_spans(data: bytes) -> np.ndarray:
    """(start, end) byte offsets of a JSON array's elements, each decoded once and dropped."""
    text, decoder, spans = data.decode("utf-8"), json.JSONDecoder(), []
    space = re.compile(r"[\s,]*")
    pos = space.match(text, text.index("[") + 1).end()
    while pos < len(text) and text[pos] != "]":
        _, end = decoder.raw_decode(text, pos)
        spans.append((pos, end))
        pos = space.match(text, end).end()
    if not text.isascii():  # character offsets to byte offsets, piece by piece
        byte, last, out = 0, 0, []
        for start, end in spans:
            byte += len(text[last:start].encode())
            size = len(text[start:end].encode())
            out.append((byte, byte + size))
            byte, last = byte + size, end
        spans = out
    return np.asarray(spans, dtype=np.int64).reshape(-1, 2)
