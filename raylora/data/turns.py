"""Rows that hold a list of turns: `chat` (`messages` of role/content) and `llava` (`conversations` of
from/value, also called sharegpt), as LLaVA, LLaMA-Factory, ms-swift, TRL, axolotl and OpenAI-style tools
write them.

A turn's content is a string, whose `<image>` / `<video>` tags become media parts where they stand, or a
list of parts: `{"type": "text"}`, `{"type": "image"}` (TRL; axolotl's with `path`, `url` or `base64`),
OpenAI's `{"type": "image_url", "image_url": {"url": ...}}`, Anthropic's `{"type": "image", "source": ...}`,
and the `video` / `video_url` counterparts. Media without an inline source come from the row's `images` /
`videos` (or ms-swift's single `image` / `video`), in order.
"""

from __future__ import annotations

from raylora.data.rows import (
    BadRow,
    Layout,
    Resolve,
    base64_bytes,
    checked,
    entries,
    entry,
    media,
    split_tags,
)
from raylora.data.rows import text as text_part
from raylora.data.rows import turns as turn_list
from raylora.data.sample import Sample

TOOLS = "tool-call turns are not supported: raylora trains on system, user and assistant turns"
CHAT_ROLES = {
    "system": "system",
    "user": "user",
    "assistant": "assistant",
    **{r: f"a {r!r} turn: {TOOLS}" for r in ("tool", "tool_call", "tool_response", "function", "ipython")},
}
# LLaVA's human/gpt, and the user/assistant that LLaMA-Factory's sharegpt users also write.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    **{r: f"a {r!r} turn (LLaMA-Factory's tool turns): {TOOLS}" for r in ("observation", "function_call")},
}
ROLE_NAMES = ("system", "user", "assistant")
# Part keys that may hold an inline image/video besides its own type's key (axolotl's).
INLINE = ("path", "url", "base64")


def chat_layout(names: list[str]) -> Layout:
    return Layout("chat", _fields("messages", names), roles=CHAT_ROLES)


def llava_layout(names: list[str]) -> Layout:
    return Layout("llava", _fields("conversations", names), "from", "value", SHAREGPT_ROLES)


def _fields(messages: str, names: list[str]) -> dict[str, str]:
    fields = {"messages": messages, "system": "system"}
    for plural, single in (("images", "image"), ("videos", "video")):
        # `images` when the source has it (an `image` beside it is then named in `Rows.unread_fields`)
        fields[plural] = plural if plural in names or single not in names else single
    return fields


def read(rec: dict, layout: Layout, resolve: Resolve) -> Sample:
    """The Sample of a row of turns."""
    field = layout.fields["messages"]
    messages = []
    for turn in turn_list(layout.get(rec, "messages"), field):
        speaker = turn.get(layout.role_key)
        role = layout.roles.get(speaker) if isinstance(speaker, str) else None
        if role is None:
            known = ", ".join(k for k, v in layout.roles.items() if v in ROLE_NAMES)
            what = "role" if layout.role_key == "role" else "speaker"
            raise BadRow(f"unknown {what} {speaker!r} ({known})")
        if role not in ROLE_NAMES:
            raise BadRow(role)
        if turn.get("tool_calls"):
            raise BadRow(f"an {speaker} turn with tool_calls: {TOOLS}")
        messages.append({"role": role, "content": content(turn.get(layout.content_key), speaker, resolve)})
    system = layout.get(rec, "system")
    if isinstance(system, str) and system and not any(t["role"] == "system" for t in messages):
        messages.insert(0, {"role": "system", "content": [text_part(system)]})
    images = entries(layout.get(rec, "images"), resolve, "image")
    videos = entries(layout.get(rec, "videos"), resolve, "video")
    return checked(messages, images, videos)


def content(value, speaker, resolve: Resolve) -> list[dict]:
    """The parts of one turn's content: a string (tags split where they stand) or a list of parts."""
    if isinstance(value, str):
        return split_tags(value) if "<image>" in value or "<video>" in value else [text_part(value)]
    if not isinstance(value, list):
        raise BadRow(f"a {speaker} turn without content")
    parts = []
    for part in value:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            parts.append(text_part(part.get("text") or ""))
        elif kind in ("image", "video"):
            parts.append(media(kind, _inline(part, kind, resolve)))
        elif kind in ("image_url", "video_url"):  # OpenAI: {"url": ...} or the URL itself
            url = part.get(kind)
            url = url.get("url") if isinstance(url, dict) else url
            parts.append(media(kind[:-4], entry(url, resolve, kind[:-4])))
        else:
            raise BadRow(f"unknown content part {part!r:.60} (type text, image, image_url, video)")
    return parts


def _inline(part: dict, kind: str, resolve: Resolve) -> bytes | str | list | None:
    """The image/video a part carries itself, or None when it takes the row's next one."""
    source = part.get("source")
    if isinstance(source, dict):  # Anthropic: {"type": "base64", "data": ...} | {"type": "url", "url": ...}
        if source.get("type") == "base64":
            return base64_bytes(source.get("data") or "", kind)
        return entry(source.get("url"), resolve, kind)
    for key in (*INLINE, kind):
        value = part.get(key)
        if value is None or (isinstance(value, dict) and not any(value.values())):
            continue  # Arrow gives every part every key of its struct, None where unused
        if kind == "video" and isinstance(value, list):  # Qwen's video as its frames: a list of images
            return [entry(frame, resolve, "video frame") for frame in value]
        return base64_bytes(value, kind) if key == "base64" else entry(value, resolve, kind)
    return None
