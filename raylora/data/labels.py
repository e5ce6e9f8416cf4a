"""What a sample trains on: the conversation rendered once with the model's own chat template and
tokenised once by its processor, labels on every assistant turn and its stop token (docs/data.md: Labels and
stop tokens).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

import torch
from PIL import Image

from raylora.data.video import Video, processor_inputs

IGNORE_INDEX = -100  # labels PyTorch's cross-entropy skips: prompt, image and padding tokens


Decoded = tuple[list[dict], list[Image.Image]] | tuple[list[dict], list[Image.Image], list[Video]]
"""A sample ready to batch: `Sample.messages` and its images decoded, one per image part, in order; and
for a sample with videos, its videos decoded (`raylora.data.video.Video`), one per video part, in order."""


def last_answer(messages: list[dict]) -> str:
    """The text of the last assistant turn: what generation from the turns before it should produce."""
    turn = next(m for m in reversed(messages) if m["role"] == "assistant")
    return "".join(part.get("text", "") for part in turn["content"])


def final_answer(text: str) -> str:
    """`text` after its reasoning block, stripped: what a reasoning model's answer says once its template
    opened `<think>` (Qwen3.5's generation prompt does, so generation starts inside the block)."""
    return text.rsplit("</think>", 1)[-1].strip()


def _image_parts(messages: list[dict], kind: str = "image") -> int:
    return sum(part["type"] == kind for turn in messages for part in turn["content"])


def numbered_image_text(messages: list[dict], tag: str) -> list[dict]:
    """`messages` with each turn's content as one string, for a template that concatenates content as text
    and a processor that finds image N by its own numbered tag (Phi-3-vision's `<|image_1|>`): each image
    part becomes `tag.format(N)`, counted over the conversation, and a line break, as the model card writes
    `<|image_1|>\nWhat is shown?`, unless the text after it starts with one (an `<image>\n` tag's)."""
    out, n = [], 0
    for turn in messages:
        text = ""
        for k, part in enumerate(turn["content"]):
            if part["type"] == "image":
                n += 1
                following = turn["content"][k + 1].get("text", "") if k + 1 < len(turn["content"]) else ""
                text += tag.format(n) + ("" if following.startswith("\n") else "\n")
            else:
                text += part.get("text", "")
        out.append({**turn, "content": text})
    return out


def _render(processor, messages: list[dict], generation_prompt: bool) -> str:
    tag = getattr(processor, "numbered_image_tag", None)  # set by raylora.remote_compat's bridges
    if tag:
        messages = numbered_image_text(messages, tag)
    return processor.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=generation_prompt,
        **getattr(processor, "chat_template_kwargs", {}),
    )


@dataclass(frozen=True)
class _Span:
    start: int  # characters of the rendering
    end: int
    closed: bool  # whether the template ends the turn with a token of its own after the answer


def _continues(text: str, start: str, turns: int) -> None:
    """`ValueError` where the chat template renders `start` (turns 1-`turns`) differently in `text`."""
    if not text.startswith(start):
        raise ValueError(
            f"the model's chat template renders turns 1-{turns} differently once later turns follow them, "
            f"so the assistant's tokens cannot be told apart from the rest; raylora needs a template that "
            f"renders a conversation as its rendering of every earlier part plus what follows"
        )


def _answer_spans(processor, messages: list[dict], generation_prompt: bool) -> tuple[str, list[_Span]]:
    """The conversation rendered once by the chat template, and the character span of each assistant turn.

    Turn k's span is what rendering turns 0..k adds to rendering turns 0..k-1 with the generation prompt:
    its answer and its end-of-turn token as the template writes them; whitespace after it belongs to what
    follows. Rendering prefixes (LLaMA-Factory's approach) rather than looking for the answers in the text
    works with any template that renders a conversation as an extension of its beginning, and needs no
    generation markers in the template (most have none). With `generation_prompt` the text ends with the
    generation prompt of the turn after `messages`.
    """
    whole = _render(processor, messages, generation_prompt)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(processor, messages[:k], generation_prompt=True)
        through = _render(processor, messages[: k + 1], generation_prompt=False)
        _continues(through, prompt, k)
        answer = through[len(prompt) :].rstrip()
        # closed: the template wrote something after the answer's text (<|im_end|>, </s>, ...)
        text = "".join(part.get("text", "") for part in message["content"]).strip()
        closed = not answer.endswith(text) if text else bool(answer.strip())
        if whole.startswith(prompt + answer):
            spans.append(_Span(len(prompt), len(prompt) + len(answer), closed))
            continue
        # A reasoning model's template (Qwen3.5, Qwen3's thinking ones) writes an assistant turn one way while
        # it is the last and another once a user turn follows (its reasoning dropped): the turn trains as the
        # conversation shows it, its text and the template's end of turn.
        close = answer[answer.rfind(text) + len(text) :] if text and text in answer else None
        span = _history_span(processor, messages, k, whole, generation_prompt, close)
        if span is None:
            _continues(whole, prompt + answer, k + 1)  # raises, naming the turns
        spans.append(span)
    return whole, spans


_MARK = "RAYLORATURNMARK"  # stands in for an answer's text, to find where the template puts it


def _history_span(processor, messages, k: int, whole: str, generation_prompt: bool, close: str | None):
    """The span of assistant turn `k` in `whole`, found by rendering the conversation again with that
    turn's text replaced by a mark: the text around the mark is the same in both renderings. None where
    that does not hold, or the turn holds more than text."""
    if close is None or any(part["type"] != "text" for part in messages[k]["content"]):
        return None
    marked = [
        *messages[:k],
        {**messages[k], "content": [{"type": "text", "text": _MARK}]},
        *messages[k + 1 :],
    ]
    text = _render(processor, marked, generation_prompt)
    if text.count(_MARK) != 1:
        return None
    before, after = text.split(_MARK)
    end = len(whole) - len(after)
    if not (whole.startswith(before) and whole.endswith(after) and end > len(before)):
        return None
    if not after.startswith(close):
        return None
    return _Span(len(before), end + len(close), bool(close))


@dataclass
class Row:
    tokens: dict[str, list[int]]  # token-aligned: input_ids, attention_mask, mm_token_type_ids, ...
    labels: list[int]
    vision: dict[str, list[torch.Tensor]]  # pixel_values, image_grid_thw, ...: one entry per sample


# Processor outputs that are not token-aligned although they can have the shape (1, tokens).
VISION_KEYS = ("image_grid_thw", "image_sizes", "video_grid_thw")


def _labelled_tokens(tokenizer, text: str, spans: list[_Span], special: bool):
    """(ids, labelled, stops) of `text` tokenised once: whether each token lies in an assistant span, and
    after which token a stop token must be added because the template closed that turn with none.

    The tokenizer's offset mapping says which characters each token covers; a token overlapping an
    answer's span is the answer's (a SentencePiece '▁seven' covers the space before the word). Tokenising
    the whole rendering, instead of each turn alone, is what makes the trained sequence the one inference
    sees: a SentencePiece tokenizer prefixes '▁' to every text it is given, so pieces tokenised one by one
    gain tokens that the whole never has.
    """
    enc = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    labelled, stops = [False] * len(ids), []
    for span in spans:
        inside = [j for j, (a, b) in enumerate(offsets) if b > a and a < span.end and b > span.start]
        if not inside and span.end > span.start:
            raise ValueError(f"an assistant turn ({text[span.start : span.end]!r:.40}) has no tokens")
        if not inside:  # an empty answer (the stand-in's): its stop goes after the prompt's last token
            inside = [max((j for j, (a, b) in enumerate(offsets) if b > a and b <= span.start), default=0)]
            stops.append(inside[0])
            continue
        first = offsets[inside[0]]
        if first[0] < span.start:
            # inference tokenises the prompt alone: that token is never what generation continues from
            raise ValueError(
                f"the generation prompt ends inside a token ({text[first[0] : first[1]]!r}) that runs into "
                f"the answer, so the trained tokens are not those inference continues into; with a reasoning "
                f"template (Qwen3.5, Qwen3) and answers without reasoning, set "
                f"data.chat_template_kwargs: {{enable_thinking: false}}"
            )
        for j in inside:
            labelled[j] = True
        # Where the template ends the turn with a token of its own (<|im_end|>, <end_of_turn>, </s>), that
        # token is trained as the stop; where it writes none (llava-1.5: the answer and a space), EOS is
        # added after the answer and trained, as LLaVA's own training and LLaMA-Factory's template do.
        if not span.closed:
            stops.append(inside[-1])
    return ids, labelled, stops


def _align(plain: list[int], expanded: list[int]) -> list[int | None]:
    """For each token of `expanded` (the processor's ids, image tokens expanded), its index in `plain`
    (the same text tokenised without images), or None for a token the expansion added.

    The processors expand images by rewriting the text around each image token, in ways of their own
    (Llava repeats <image>, Gemma3 adds line breaks and <start_of_image>...<end_of_image>, Idefics3 adds
    tiles and row markers), so the two are aligned by their longest common runs (difflib) instead of
    by each architecture's rule."""
    if plain == expanded:
        return list(range(len(plain)))
    where: list[int | None] = [None] * len(expanded)
    for i, j, n in difflib.SequenceMatcher(None, plain, expanded, autojunk=False).get_matching_blocks():
        where[j : j + n] = range(i, i + n)
    return where


def encode(processor, sample: Decoded, with_answers: bool = True) -> Row:
    """One sample's tokens and labels: every assistant turn and its stop token labelled, nothing else.
    Without answers: the turns before the last assistant turn, then the generation prompt.

    The conversation is rendered once and tokenised once, by the processor with all its images (which
    expands their image tokens), as at inference. The labels come from the assistant turns' character
    spans (`_answer_spans`) through the tokenizer's offsets (`_labelled_tokens`), carried over to the
    processor's tokens (`_align`). `ValueError` when the template or the processor cannot serve this
    sample (a bad row).
    """
    messages, images, *rest = sample
    videos = rest[0] if rest else []  # a sample with videos: raylora.data.video decoded their frames
    if videos and getattr(processor, "video_processor", None) is None:  # it would drop them silently
        raise ValueError(
            f"a video row, and the model's processor ({type(processor).__name__}) takes no videos"
        )
    if not with_answers:
        last = max(k for k, m in enumerate(messages) if m["role"] == "assistant")
        videos = videos[: _image_parts(messages[:last], "video")]
        messages, images = messages[:last], images[: _image_parts(messages[:last])]
    text, spans = _answer_spans(processor, messages, generation_prompt=not with_answers)
    tokenizer = processor.tokenizer
    # transformers' own rule for chat-template text: special tokens only where the template wrote none
    special = not (tokenizer.bos_token and text.startswith(tokenizer.bos_token))
    plain, labelled, stops = _labelled_tokens(tokenizer, text, spans, special)
    enc = processor(
        text=[text],
        images=images or None,
        return_tensors="pt",
        add_special_tokens=special,
        **processor_inputs(videos),
    )
    ids = enc["input_ids"][0].tolist()
    where = _align(plain, ids)
    carried = {i for i in where if i is not None}
    if any(labelled[i] and i not in carried for i in range(len(plain))):
        raise ValueError("the processor tokenises an assistant turn differently once its images are expanded")
    row = Row({}, [], {})
    aligned = {}
    for key, value in enc.items():
        if value.dim() == 2 and value.shape == (1, len(ids)) and key not in VISION_KEYS:
            aligned[key] = value[0].tolist()
        else:
            row.vision[key] = [value]
    # the added stop tokens: EOS itself, attended to, and 0 in every other token-aligned input
    added = {"input_ids": tokenizer.eos_token_id, "attention_mask": 1}
    after = set(stops)
    row.tokens = {key: [] for key in aligned}
    for j, i in enumerate(where):
        for key, values in aligned.items():
            row.tokens[key].append(values[j])
        row.labels.append(ids[j] if i is not None and labelled[i] else IGNORE_INDEX)
        if i in after:
            for key in aligned:
                row.tokens[key].append(added.get(key, 0))
            row.labels.append(tokenizer.eos_token_id)
    return row


def end_of_turn_ids(processor) -> list[int]:
    """The token that ends generation: exactly the stop token training labels after every answer (the
    template's own end of turn, Qwen's <|im_end|> or Gemma's <end_of_turn>, else the EOS `encode` adds)."""
    probe = [
        {"role": "user", "content": [{"type": "text", "text": "?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "0"}]},
    ]
    labels = encode(processor, (probe, [])).labels
    return [[t for t in labels if t != IGNORE_INDEX][-1]]


def check_chat_template(processor) -> None:
    """`ValueError` (before the first step) when the chat template cannot be cut into turns
    (`_answer_spans`)."""
    text = {"type": "text", "text": "?"}
    turns = [{"role": role, "content": [text]} for role in ("user", "assistant") * 2]
    encode(processor, (turns, []))
