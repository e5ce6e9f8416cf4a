"""The data formats raylora reads, each row into one `raylora.data.sample.Sample` (docs/data.md).

- `raylora`: Parquet with columns image (encoded bytes), prompt, answer: one user turn, one answer.
- `chat`: `messages` of `{role, content}` turns (Hugging Face, TRL, OpenAI, axolotl, ms-swift, LLaMA-Factory's
  openai style), content a string with `<image>`/`<video>` tags or a list of parts, and `images` / `image` /
  `videos` (`raylora.data.turns`).
- `llava` (alias `sharegpt`): `conversations` of `{from, value}` turns with `<image>` tags, and `image` or
  `images` (LLaVA, LLaMA-Factory's sharegpt; `raylora.data.turns`).
- `alpaca` (`instruction`, `input`, `output`) and `query_response` (ms-swift's `query`, `response`), with
  `system`, `history`, `images` (`raylora.data.alpaca`).
- LLaMA-Factory's `dataset_info.json#entry`: that entry's file, read through its `columns` and `tags`
  (`raylora.data.llamafactory`).

Each may be one file, a folder of Parquet files (what Ray Data and `raylora prepare-data` write), or a folder
that `datasets.save_to_disk` wrote (its Arrow files are read here, without `datasets`); local or through any
pyarrow filesystem URI. Rows are read when a batch uses them, never at the start, so that memory and start-up
per rank stay flat however many rows there are; images are decoded only in `load_image`. An `http(s)://`
image is a `BadRow` whose reason starts "remote image URL" (`raylora.data.rows.REMOTE`), met by the driver's
preflight on the first rows. Videos are read into `Sample.videos` and decoded only in `load_video`
(`raylora.data.video`).
"""

from __future__ import annotations

import io
import json
import os
import posixpath

import pyarrow as pa
import pyarrow.fs
from PIL import Image

from raylora.config import ConfigError
from raylora.data import alpaca, llamafactory, turns, video
from raylora.data.records import ArrowRecords, JsonRecords, ParquetRecords, Records
from raylora.data.rows import BadRow, Layout, Resolve, checked, data_url, entry, media, text
from raylora.data.sample import Sample
from raylora.storage import filesystem, is_uri

__all__ = ["BadRow", "Rows", "check_source", "load_image", "load_video", "open_rows"]

# The fields that make each format, in the order detection tries them (the most specific first).
FIELDS = {
    "chat": ("messages",),
    "llava": ("conversations",),
    "alpaca": ("instruction", "output"),
    "query_response": ("query", "response"),
    "raylora": ("image", "prompt", "answer"),
}
FORMATS = ("raylora", "chat", "llava", "alpaca", "query_response")
ALIASES = {"sharegpt": "llava"}  # LLaMA-Factory's name for conversations of from/value
ACCEPTED = (
    "raylora (Parquet: image, prompt, answer), chat (messages, images), llava/sharegpt (conversations, "
    "image or images), alpaca (instruction, input, output, images), query_response (query, response, "
    "images), or a LLaMA-Factory dataset_info.json#entry; as a JSON/JSONL/Parquet file, a folder of Parquet "
    "files or a datasets.save_to_disk folder"
)
# Fields that hold media or turns: one a source has and its reader does not read is named, never dropped
# silently (`Rows.unread_fields`, for the driver's preflight).
WATCHED = (
    "images", "image", "videos", "video", "audios", "audio", "messages", "conversations", "conversation",
    "history", "system", "tools", "chosen", "rejected", "rejected_response", "rejected_messages",
    "rejected_images", "objects",
)  # fmt: skip


def load_image(entry: bytes | str) -> Image.Image:
    """The image of one `Sample.images` entry (encoded bytes, a path/URI or a `data:` URL), decoded to RGB."""
    try:
        if isinstance(entry, str) and entry[:5].lower() == "data:":
            entry = data_url(entry)
        elif isinstance(entry, str):
            fs, path = filesystem(entry)
            with fs.open_input_file(path) as f:
                entry = f.read()
        with Image.open(io.BytesIO(entry)) as img:
            return img.convert("RGB")  # decodes every pixel: a truncated file fails here, not in a batch
    except BadRow:
        raise
    except FileNotFoundError as err:
        raise BadRow(f"image not found: {err}") from err
    except Exception as err:  # PIL and the filesystems raise many types for a broken file
        raise BadRow(f"image does not decode ({type(err).__name__}: {err})") from err


def load_video(entry: bytes | str | list, sampling: video.Sampling) -> video.Video:
    """The video of one `Sample.videos` entry (encoded bytes, a path/URI, a `data:` URL, or a list of its
    frames as image entries), its frames decoded and sampled (`raylora.data.video`); `BadRow` naming why
    when it cannot be (not found, no video stream, no frames, does not decode, no decoder installed)."""
    if isinstance(entry, list):
        try:
            return video.from_frames([load_image(frame) for frame in entry], sampling)
        except video.Unusable as err:
            raise BadRow(f"video: {err}") from err
    try:
        if isinstance(entry, str) and entry[:5].lower() == "data:":
            entry = data_url(entry, "video")
        elif isinstance(entry, str):
            fs, path = filesystem(entry)
            with fs.open_input_file(path) as f:
                entry = f.read()
    except FileNotFoundError as err:
        raise BadRow(f"video not found: {err}") from err
    except OSError as err:
        raise BadRow(f"video does not read ({type(err).__name__}: {err})") from err
    try:
        return video.decode(entry, sampling)
    except video.Unusable as err:
        reason = str(err) if str(err) == video.NO_DECODER else f"video: {err}"
        raise BadRow(reason) from err


class Rows:
    """The rows of one source, read lazily; `sample(i)` raises `BadRow` for a row that cannot be trained on.

    Picklable (the input pipeline's processes get a copy): open files and caches are reopened after.
    """

    def __init__(self, uri: str, layout: Layout, records: Records, image_root: str, unread: list[str]):
        self.uri, self.layout, self.records, self.image_root = uri, layout, records, image_root
        # Fields of the source that hold media or turns and that its reader does not read (`WATCHED`),
        # for the driver's preflight to name: never dropped silently.
        self.unread_fields = unread

    @property
    def format(self) -> str:
        return self.layout.format

    def __len__(self) -> int:
        return len(self.records)

    def sample(self, i: int) -> Sample:
        return READERS[self.layout.format](self.records.record(i), self.layout, self.resolve)

    def resolve(self, path: str) -> str:
        """An image path as a row holds it, made a path/URI this process can open."""
        return path if is_uri(path) or os.path.isabs(path) else posixpath.join(self.image_root, path)


def open_rows(uri: str, fmt: str | None = None, image_root: str | None = None) -> Rows:
    """The rows of `uri` (a file or folder, local or a pyarrow URI) in `fmt`, or the format detected."""
    return _open(uri, "data", fmt, image_root)


def check_source(
    uri: str, key: str, fmt: str | None = None, image_root: str | None = None
) -> tuple[str, int]:
    """(format, rows) of `uri`, or a `ConfigError` naming `key`: the preflight, before Ray starts.

    Reads metadata and schemas (JSON: the record boundaries), never a row's images."""
    if image_root and not is_uri(image_root) and not os.path.isdir(image_root):
        raise ConfigError(f"data.image_root: folder not found: {image_root}")
    rows = _open(uri, key, fmt, image_root)
    if not len(rows):
        raise ConfigError(f"{key}: {uri} has no rows")
    return rows.format, len(rows)


def _open(uri: str, key: str, fmt: str | None, image_root: str | None) -> Rows:
    fmt = ALIASES.get(fmt, fmt)
    if fmt is not None and fmt not in FORMATS:
        raise ConfigError(f"data.format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    layout, unread, data_uri = None, [], uri
    if (entry_of := llamafactory.split(uri)) is not None:
        data_uri, root, layout, unread = llamafactory.entry(*entry_of, key)
        image_root = image_root or root
        if fmt is not None and fmt != layout.format:
            raise ConfigError(
                f"{key}: {uri} is in the {layout.format} format by its entry; data.format is {fmt}"
            )
    records, root = _records(data_uri, key)
    names = records.names
    if layout is None:
        layout = _detect(uri, key, fmt, names)
    read = set(layout.fields.values())
    unread += [n for n in names if n in WATCHED and n not in read and n not in unread]
    # Parquet and Arrow read only the columns the reader uses (a missing one reads as absent)
    records.columns = [n for n in names if n in read]
    return Rows(uri, layout, records, image_root or root, unread)


def _records(uri: str, key: str) -> tuple[Records, str]:
    """The records of the file or folder at `uri`, and the folder its relative paths are against."""
    if posixpath.basename(uri.rstrip("/")) == "dataset_info.json":
        raise ConfigError(f"{key}: {uri} is LLaMA-Factory's list of data sets: name one, as {uri}#name")
    fs, path = filesystem(uri)
    try:
        info = fs.get_file_info(path)
    except (OSError, pa.ArrowException) as err:
        raise ConfigError(f"{key}: cannot reach {uri}: {err}") from err
    if info.type == pyarrow.fs.FileType.NotFound:
        raise ConfigError(f"{key}: data file or folder not found: {uri}")
    try:
        if info.type == pyarrow.fs.FileType.Directory:
            return _folder(fs, path, key, uri), uri
        return _file(fs, path, key, uri), posixpath.dirname(uri.rstrip("/"))
    except (OSError, ValueError, BadRow, pa.ArrowException) as err:  # ValueError: json's errors
        raise ConfigError(f"{key}: {uri} is not readable as data ({type(err).__name__}: {err})") from err


def _detect(uri: str, key: str, fmt: str | None, names: list[str]) -> Layout:
    if fmt is None:
        fmt = next((f for f, needs in FIELDS.items() if set(needs) <= set(names)), None)
    if fmt is None or not set(FIELDS[fmt]) <= set(names):
        what = (
            f"is not in the {fmt} format (data.format), which needs {', '.join(FIELDS[fmt])}"
            if fmt
            else ("is in no known format")
        )
        raise ConfigError(
            f"{key}: {uri} {what}; its fields: {', '.join(names) or 'none'}. Formats accepted: {ACCEPTED}"
        )
    return LAYOUTS[fmt](names)


def _file(fs, path: str, key: str, uri: str) -> Records:
    ext = posixpath.splitext(path)[1].lower()
    if ext in (".parquet", ".pq"):
        return ParquetRecords(fs, [path])
    if ext in (".json", ".jsonl", ".ndjson"):
        return JsonRecords(fs, path)
    with fs.open_input_file(path) as f:
        head = f.read(4)
    if head == b"PAR1":
        return ParquetRecords(fs, [path])
    if head.lstrip()[:1] in (b"[", b"{"):
        return JsonRecords(fs, path)
    raise ConfigError(f"{key}: {uri} is neither Parquet nor JSON/JSONL. Formats accepted: {ACCEPTED}")


def _folder(fs, path: str, key: str, uri: str) -> Records:
    entries = fs.get_file_info(pyarrow.fs.FileSelector(path, recursive=True))
    names = {posixpath.relpath(e.path, path): e for e in entries if e.type == pyarrow.fs.FileType.File}
    if "state.json" in names:  # datasets.save_to_disk
        with fs.open_input_file(posixpath.join(path, "state.json")) as f:
            state = json.loads(f.read())
        return ArrowRecords(fs, [posixpath.join(path, d["filename"]) for d in state["_data_files"]])
    if "dataset_dict.json" in names:
        splits = sorted({n.split("/")[0] for n in names if "/" in n})
        raise ConfigError(
            f"{key}: {uri} holds a datasets DatasetDict; point {key} at one split's folder "
            f"({', '.join(posixpath.join(uri, s) for s in splits)})"
        )
    parquet = sorted(posixpath.join(path, n) for n in names if n.endswith((".parquet", ".pq")))
    if not parquet:
        raise ConfigError(
            f"{key}: {uri} is a folder with neither Parquet files nor a datasets.save_to_disk state.json "
            f"(files: {', '.join(sorted(names)[:5]) or 'none'}). Formats accepted: {ACCEPTED}"
        )
    return ParquetRecords(fs, parquet)


def _raylora(rec: dict, layout: Layout, resolve: Resolve) -> Sample:
    if rec.get("prompt") is None:
        raise BadRow("missing prompt")
    has_image = rec.get("image") is not None  # no image at all: a text-only sample
    images = [entry(rec["image"], resolve)] if has_image else []
    user = [media("image"), text(rec["prompt"])] if has_image else [text(rec["prompt"])]
    answer = rec.get("answer") or ""
    return checked(
        [{"role": "user", "content": user}, {"role": "assistant", "content": [text(answer)]}], images
    )


LAYOUTS = {
    "raylora": lambda names: Layout("raylora", {n: n for n in FIELDS["raylora"]}),
    "chat": turns.chat_layout,
    "llava": turns.llava_layout,
    "alpaca": alpaca.alpaca_layout,
    "query_response": alpaca.query_response_layout,
}
READERS = {
    "raylora": _raylora,
    "chat": turns.read,
    "llava": turns.read,
    "alpaca": alpaca.read,
    "query_response": alpaca.read,
}
