"""What every row reader shares: `BadRow`, the parts of a turn, media entries and the final check.

The format family modules (`turns`, `alpaca`) and `formats` import this; it imports only
`raylora.data.sample`, so imports flow one way: formats -> family modules -> rows -> sample.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import unquote, urlparse

from raylora.data.sample import Sample

Resolve = Callable[[str], str]  # a path as a row holds it -> a path/URI this process can open

IMAGE = {"type": "image"}
VIDEO = {"type": "video"}
MEDIA = {"image": "images", "video": "videos"}  # part type -> the Sample field that holds its entries
# LLaVA writes "<image>\n" before the question: the tag's own line break goes with it (the chat template
# puts its own separators around a media part). ms-swift and LLaMA-Factory write `<video>` the same way.
TAG = re.compile(r"\n?<(image|video)>\n?")
# Why a row with a web URL is refused, the start of its reason (the driver's preflight matches on it).
REMOTE = "remote {kind} URL"
# Encoded images by their first bytes: a string that decodes from base64 to one of these is an image,
# not a path (a JPEG's base64 starts "/9j/", which alone would pass for an absolute path).
SIGNATURES = (b"\x89PNG", b"\xff\xd8\xff", b"GIF8", b"RIFF", b"BM", b"II*\x00", b"MM\x00*")
BASE64 = re.compile(r"[A-Za-z0-9+/\s]+={0,2}\s*")


class BadRow(Exception):
    """A row that cannot be trained on; `reason` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Layout:
    """How the rows of one source are read: the reader (`format`) and the row's field for each thing it
    reads. A peer's own names (LLaMA-Factory's `columns` and `tags`) land here, so readers never see them."""

    format: str
    fields: dict[str, str]  # what the reader reads ("messages", "images", ...) -> the row's field name
    role_key: str = "role"  # turns: the key of a turn that names its speaker
    content_key: str = "content"  # turns: the key of a turn that holds what was said
    # turns: speaker -> "system" | "user" | "assistant", or the reason a turn of that speaker is refused
    roles: dict[str, str] = field(default_factory=dict)

    def get(self, rec: dict, name: str):
        """The value of what the reader calls `name` in `rec`, or None when the source has no such field."""
        source = self.fields.get(name)
        return None if source is None else rec.get(source)


def text(value: str) -> dict:
    return {"type": "text", "text": value}


def media(kind: str, source=None) -> dict:
    """A media part; `source` (inline media, as OpenAI and axolotl parts hold it) goes in `checked`."""
    return {"type": kind} if source is None else {"type": kind, "source": source}


def split_tags(value: str) -> list[dict]:
    """A string with `<image>` / `<video>` tags as parts, a media part where each tag stood."""
    pieces = TAG.split(value)  # [text, kind, text, kind, text, ...]
    parts = [text(pieces[0])] if pieces[0] else []
    for k in range(1, len(pieces), 2):
        parts.append(media(pieces[k]))
        if pieces[k + 1]:
            parts.append(text(pieces[k + 1]))
    return parts


def entry(value, resolve: Resolve, kind: str = "image") -> bytes | str:
    """One image (or video) as a row holds it, as a `Sample` entry: encoded bytes or a path/URI.

    Takes bytes, a `{bytes, path}` struct (`datasets`' Image feature), a path (against `resolve`), a `file://`
    URL, a `data:` URL or raw base64. An `http(s)://` URL is refused: no training node should fetch the web
    at every step."""
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray)) and value:
        return bytes(value)
    if not isinstance(value, str) or not value.strip():
        raise BadRow(f"{kind} missing or empty ({type(value).__name__})")
    lower = value[:8].lower()
    if lower.startswith(("http://", "https:/")):
        raise BadRow(
            f"{REMOTE.format(kind=kind)} {value:.80}: raylora reads media from files or object storage, not "
            "the web (every training node would fetch it at every step); download it and point the row at "
            "the file"
        )
    if lower.startswith("data:"):
        return data_url(value, kind)
    if lower.startswith("file://"):
        url = urlparse(value)
        local = url.path if url.netloc in ("", "localhost") else url.netloc + url.path
        return resolve(unquote(local))
    decoded = _base64_image(value)
    return decoded if decoded is not None else resolve(value)


def data_url(value: str, kind: str = "image") -> bytes:
    """The bytes of a `data:[<type>];base64,<data>` URL."""
    head, _, payload = value.partition(",")
    if not head.lower().endswith(";base64"):
        raise BadRow(f"a {kind} data: URL that is not base64 ({head:.40})")
    try:
        return base64.b64decode(payload, validate=False)
    except (binascii.Error, ValueError) as err:
        raise BadRow(f"a {kind} data: URL whose base64 does not decode ({err})") from err


def base64_bytes(value: str, kind: str = "image") -> bytes:
    """The bytes of base64 text (a `data:` URL too), for fields that hold only base64 (axolotl's `base64`)."""
    if value[:5].lower() == "data:":
        return data_url(value, kind)
    try:
        return base64.b64decode(value, validate=False)
    except (binascii.Error, ValueError) as err:
        raise BadRow(f"{kind} base64 does not decode ({err})") from err


def _base64_image(value: str) -> bytes | None:
    if len(value) < 64 or not BASE64.fullmatch(value):
        return None
    try:
        decoded = base64.b64decode(value, validate=False)
    except (binascii.Error, ValueError):
        return None
    return decoded if decoded.startswith(SIGNATURES) else None


def entries(value, resolve: Resolve, kind: str) -> list:
    """A row's list of images (or videos; a video may be a list of frames) as `Sample` entries."""
    if value is None:
        return []
    if isinstance(value, (str, bytes, bytearray, dict)):  # ms-swift's `image`: one, not a list
        value = [value]
    out = []
    for v in value:
        if kind == "video" and isinstance(v, (list, tuple)):  # frames of one video
            out.append([entry(frame, resolve, "video frame") for frame in v])
        else:
            out.append(entry(v, resolve, kind))
    return out


def checked(messages: list[dict], images: list, videos: list | None = None) -> Sample:
    """The Sample, or `BadRow` when nothing in it can be trained on or its media do not match its parts.

    A media part with an inline `source` uses it; the others take the row's list in order. A row with no
    part of a kind but entries of it gets them at the start of its first user turn, as ms-swift, TRL and
    axolotl place untagged media."""
    answers = [t for t in messages if t["role"] == "assistant"]
    if not answers:
        raise BadRow("no assistant turn")
    if any(not "".join(p.get("text") or "" for p in t["content"]).strip() for t in answers):
        raise BadRow("empty answer")
    lists = {"image": list(images), "video": list(videos or [])}
    for kind, given in lists.items():
        parts = [p for t in messages for p in t["content"] if p["type"] == kind]
        if not parts and given:
            first = next((t for t in messages if t["role"] == "user"), None)
            if first is None:
                raise BadRow(f"{len(given)} {kind}s and no user turn to put them in")
            first["content"][:0] = [media(kind) for _ in given]
            continue
        sources = [p.pop("source", None) for p in parts]
        total = len(given) + sum(s is not None for s in sources)
        if total != len(parts):
            raise BadRow(f"{len(parts)} {kind} placeholders, {total} {kind}s")
        rest = iter(given)
        out = [s if s is not None else next(rest) for s in sources]
        lists[kind] = out
    return Sample(messages, lists["image"], lists["video"])


def turns(value, name: str) -> list[dict]:
    if not isinstance(value, list) or not value or not all(isinstance(t, dict) for t in value):
        raise BadRow(f"{name} is not a non-empty list of turns")
    return value
