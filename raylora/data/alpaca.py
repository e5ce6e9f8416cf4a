"""Rows of one instruction and its answer: `alpaca` (`instruction`, `input`, `output`; LLaMA-Factory,
ms-swift) and `query_response` (ms-swift's `query`, `response`), each with an optional `system`, `history`
(earlier `[query, response]` pairs, trained on too) and `images` / `videos`.

As LLaMA-Factory and ms-swift build them: the user turn is `instruction` and `input` joined by a line
break (either may be empty), the `<image>` / `<video>` tags in any text become media parts where they
stand, and the history comes before it.
"""

from __future__ import annotations

from raylora.data.rows import BadRow, Layout, Resolve, checked, entries, split_tags
from raylora.data.sample import Sample


def alpaca_layout(names: list[str]) -> Layout:
    return Layout(
        "alpaca", _fields({"instruction": "instruction", "input": "input", "output": "output"}, names)
    )


def query_response_layout(names: list[str]) -> Layout:
    return Layout("query_response", _fields({"instruction": "query", "output": "response"}, names))


def _fields(fields: dict[str, str], names: list[str]) -> dict[str, str]:
    fields = {**fields, "history": "history", "system": "system"}
    for plural, single in (("images", "image"), ("videos", "video")):
        fields[plural] = plural if plural in names or single not in names else single
    return fields


def read(rec: dict, layout: Layout, resolve: Resolve) -> Sample:
    """The Sample of one instruction row."""
    messages = []
    system = layout.get(rec, "system")
    if isinstance(system, str) and system:
        messages.append({"role": "system", "content": split_tags(system)})
    history = layout.get(rec, "history") or []
    if not isinstance(history, list):
        raise BadRow(f"history is a {type(history).__name__}, not a list of [query, response] pairs")
    for k, pair in enumerate(history):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise BadRow(f"history[{k}] is not a [query, response] pair of strings")
        messages += [_turn("user", pair[0]), _turn("assistant", pair[1])]
    query = [layout.get(rec, name) for name in ("instruction", "input")]
    if any(q is not None and not isinstance(q, str) for q in query):
        raise BadRow(f"{layout.fields['instruction']} (and input) must be strings")
    query = "\n".join(q for q in query if q)
    if not query:
        raise BadRow(f"missing {layout.fields['instruction']}")
    answer = layout.get(rec, "output")
    if answer is not None and not isinstance(answer, str):
        raise BadRow(f"{layout.fields['output']} is a {type(answer).__name__}, not a string")
    messages += [_turn("user", query), _turn("assistant", answer or "")]
    images = entries(layout.get(rec, "images"), resolve, "image")
    videos = entries(layout.get(rec, "videos"), resolve, "video")
    return checked(messages, images, videos)


def _turn(role: str, value: str) -> dict:
    return {"role": role, "content": split_tags(value) or [{"type": "text", "text": ""}]}
