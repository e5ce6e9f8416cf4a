"""LLaMA-Factory's `dataset_info.json`: `data.train=data/dataset_info.json#mllm_demo` reads that entry.

An entry names its data (`file_name`, against the json's folder, which is also where its media paths are
resolved: LLaMA-Factory's `media_dir` defaults to its `dataset_dir`), its `formatting` (`alpaca`, the
default, `sharegpt` or `openai`), its `columns` (our reader's name -> the data's field) and, for sharegpt,
its `tags` (the keys and speaker names of its turns). Only the columns an entry maps are read, as there:
an unmapped `images` field is not read (and is named in `Rows.unread_fields`).
"""

from __future__ import annotations

import json
import posixpath

from raylora.config import ConfigError
from raylora.data.rows import Layout
from raylora.data.turns import TOOLS
from raylora.storage import filesystem

# LLaMA-Factory's defaults (src/llamafactory/data/parser.py, DatasetAttr).
SHAREGPT_COLUMNS = {"messages": "conversations"}
ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output"}
TAGS = {
    "role_tag": "from",
    "content_tag": "value",
    "user_tag": "human",
    "assistant_tag": "gpt",
    "observation_tag": "observation",
    "function_tag": "function_call",
    "system_tag": "system",
}
# Its alpaca column names -> ours (raylora.data.alpaca reads instruction, input, output).
ALPACA_NAMES = {"prompt": "instruction", "query": "input", "response": "output"}
READ = {"messages", "system", "images", "videos", "prompt", "query", "response", "history"}
HUB = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")


def split(uri: str) -> tuple[str, str] | None:
    """(json uri, entry name) of `path/dataset_info.json#name`, or None for any other uri."""
    base, sep, name = uri.rpartition("#")
    return (base, name) if sep and base.lower().endswith(".json") and name else None


def entry(uri: str, name: str, key: str) -> tuple[str, str, Layout, list[str]]:
    """(data uri, media root, layout, mapped fields not read) of entry `name` of the json at `uri`."""
    fs, path = filesystem(uri)
    try:
        with fs.open_input_file(path) as f:
            info = json.loads(f.read())
    except FileNotFoundError as err:
        raise ConfigError(f"{key}: {uri} not found") from err
    except (OSError, ValueError) as err:
        raise ConfigError(f"{key}: {uri} is not readable JSON ({type(err).__name__}: {err})") from err
    if not isinstance(info, dict) or name not in info or not isinstance(info[name], dict):
        names = ", ".join(sorted(info)[:20]) if isinstance(info, dict) else "none"
        raise ConfigError(f"{key}: {uri} has no entry {name!r} (its entries: {names})")
    attr = info[name]
    where = f"{key}: {uri}#{name}"
    if "file_name" not in attr:
        hub = next((f"{k}={attr[k]}" for k in HUB if k in attr), "no file_name")
        raise ConfigError(
            f"{where} is not a local file ({hub}): download it and set file_name, or point {key} at it"
        )
    if attr.get("ranking"):
        raise ConfigError(f"{where} is a preference (ranking) data set: raylora trains on answers, not pairs")
    formatting = attr.get("formatting", "alpaca")
    columns = attr.get("columns") or {}
    if formatting in ("sharegpt", "openai"):
        layout = _turns({**SHAREGPT_COLUMNS, **columns}, {**TAGS, **(attr.get("tags") or {})})
    elif formatting == "alpaca":
        mapped = {**ALPACA_COLUMNS, **columns}
        fields = {ALPACA_NAMES.get(k, k): v for k, v in mapped.items() if k in READ and v}
        layout = Layout("alpaca", fields)
    else:
        raise ConfigError(f"{where}: formatting must be alpaca, sharegpt or openai, got {formatting!r}")
    unread = [v for k, v in columns.items() if k not in READ and isinstance(v, str)]
    folder = posixpath.dirname(uri.rstrip("/"))
    return posixpath.join(folder, attr["file_name"]), folder, layout, unread


def _turns(columns: dict, tags: dict) -> Layout:
    roles = {
        tags["system_tag"]: "system",
        tags["user_tag"]: "user",
        tags["assistant_tag"]: "assistant",
        tags["observation_tag"]: f"a {tags['observation_tag']!r} turn (observation_tag): {TOOLS}",
        tags["function_tag"]: f"a {tags['function_tag']!r} turn (function_tag): {TOOLS}",
    }
    fields = {k: v for k, v in columns.items() if k in ("messages", "system", "images", "videos") and v}
    fmt = "chat" if tags["role_tag"] == "role" else "llava"
    return Layout(fmt, fields, tags["role_tag"], tags["content_tag"], {k: v for k, v in roles.items() if k})
