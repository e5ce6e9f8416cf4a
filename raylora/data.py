"""The global sampler, and batches of conversations rendered with the model's own chat template.

Rows come from `raylora.formats` and are decoded only when a batch uses them (`read`). The sampler is
global: which samples form step `s`'s batch depends only on (seed, epoch) and the global batch size, never
on the number of workers. Ray Data's iterators have no state to save, so an exact mid-epoch resume needs
this sampler of our own; its position is just the step.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from raylora.config import ConfigError
from raylora.formats import BadRow, Rows, load_image

IGNORE_INDEX = -100  # labels PyTorch's cross-entropy skips: prompt, image and padding tokens


@dataclass(frozen=True)
class GlobalSampler:
    """Sample order from (seed, epoch) only; one global batch per step, drop-last within an epoch."""

    num_samples: int
    global_batch_size: int
    seed: int

    def __post_init__(self):
        if self.num_samples < self.global_batch_size:
            raise ConfigError(
                f"train.global_batch_size ({self.global_batch_size}) exceeds the {self.num_samples} "
                f"training samples"
            )

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size

    def epoch(self, step: int) -> int:
        return step // self.steps_per_epoch

    def global_batch(self, step: int) -> list[int]:
        """Sample indices of the global batch that optimizer step `step` (0-based) trains on."""
        epoch, pos = divmod(step, self.steps_per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        start = pos * self.global_batch_size
        return order[start : start + self.global_batch_size].tolist()

    def shares(self, world_size: int) -> list[int]:
        """Samples each rank trains on per step: the global batch split as evenly as it goes, so that
        shares differ by at most one sample (the first ranks take the remainder)."""
        base, extra = divmod(self.global_batch_size, world_size)
        return [base + (rank < extra) for rank in range(world_size)]

    def micro_batches(
        self, step: int, rank: int, world_size: int, micro_batch_size: int
    ) -> list[list[int | None]]:
        """This rank's contiguous share of the global batch, cut into micro batches.

        Every rank gets as many micro batches as the largest share needs (`Config.grad_accum_steps`):
        under ZeRO-3 all ranks run each forward and backward pass together. A rank one sample short of
        that ends with `[None]`: a slot for a label-less stand-in, which trains on nothing.
        """
        shares = self.shares(world_size)
        start = sum(shares[:rank])
        mine: list[int | None] = self.global_batch(step)[start : start + shares[rank]]
        micro = [mine[i : i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]
        count = -(-shares[0] // micro_batch_size)
        return micro + [[None] for _ in range(count - len(micro))]


Decoded = tuple[list[dict], list[Image.Image]]
"""A sample ready to batch: `Sample.messages` and its images decoded, one per image part, in order."""


# Why a row with videos is not trained (the driver refuses a source with video rows before Ray starts).
NO_VIDEO = (
    "a video row: raylora trains on images only. The Qwen2-VL family's video processor needs torchvision, "
    "and the registry's torchvision (a CUDA build) does not import beside the CPU torch raylora pins; a "
    "<video> tag is never trained on as text, so the row is not used"
)


def read(rows: Rows, i: int) -> Decoded:
    """Row `i` of `rows`, its images decoded; `BadRow` when the row or one of its images is unusable, and
    for a row with videos (`NO_VIDEO`)."""
    sample = rows.sample(i)
    if sample.video_count or sample.videos:
        raise BadRow(NO_VIDEO)
    return sample.messages, [load_image(entry) for entry in sample.images]


def last_answer(messages: list[dict]) -> str:
    """The text of the last assistant turn: what generation from the turns before it should produce."""
    turn = next(m for m in reversed(messages) if m["role"] == "assistant")
    return "".join(part.get("text", "") for part in turn["content"])


def _image_parts(messages: list[dict]) -> int:
    return sum(part["type"] == "image" for turn in messages for part in turn["content"])


def _render(processor, messages: list[dict], generation_prompt: bool) -> str:
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


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
        _continues(whole, prompt + answer, k + 1)
        # closed: the template wrote something after the answer's text (<|im_end|>, </s>, ...)
        text = "".join(part.get("text", "") for part in message["content"]).strip()
        closed = not answer.endswith(text) if text else bool(answer.strip())
        spans.append(_Span(len(prompt), len(prompt) + len(answer), closed))
    return whole, spans


@dataclass
class _Row:
    tokens: dict[str, list[int]]  # token-aligned: input_ids, attention_mask, mm_token_type_ids, ...
    labels: list[int]
    vision: dict[str, list[torch.Tensor]]  # pixel_values, image_grid_thw, ...: one entry per sample


# Processor outputs that are not token-aligned although they can have the shape (1, tokens).
VISION_KEYS = ("image_grid_thw", "image_sizes")


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


def encode(processor, sample: Decoded, with_answers: bool = True) -> _Row:
    """One sample's tokens and labels: every assistant turn and its stop token labelled, nothing else.
    Without answers: the turns before the last assistant turn, then the generation prompt.

    The conversation is rendered once and tokenised once, by the processor with all its images (which
    expands their image tokens), as at inference. The labels come from the assistant turns' character
    spans (`_answer_spans`) through the tokenizer's offsets (`_labelled_tokens`), carried over to the
    processor's tokens (`_align`). `ValueError` when the template or the processor cannot serve this
    sample (a bad row).
    """
    messages, images = sample
    if not with_answers:
        last = max(k for k, m in enumerate(messages) if m["role"] == "assistant")
        messages, images = messages[:last], images[: _image_parts(messages[:last])]
    text, spans = _answer_spans(processor, messages, generation_prompt=not with_answers)
    tokenizer = processor.tokenizer
    # transformers' own rule for chat-template text: special tokens only where the template wrote none
    special = not (tokenizer.bos_token and text.startswith(tokenizer.bos_token))
    plain, labelled, stops = _labelled_tokens(tokenizer, text, spans, special)
    enc = processor(text=[text], images=images or None, return_tensors="pt", add_special_tokens=special)
    ids = enc["input_ids"][0].tolist()
    where = _align(plain, ids)
    carried = {i for i in where if i is not None}
    if any(labelled[i] and i not in carried for i in range(len(plain))):
        raise ValueError("the processor tokenises an assistant turn differently once its images are expanded")
    row = _Row({}, [], {})
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


def _cat(values: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along the first dimension, zero-padding the others where they differ: Idefics3's
    images per sample, Pixtral's image height and width (the zeros are what their processors pad with)."""
    shape = [max(v.shape[d] for v in values) for d in range(1, values[0].dim())]
    padded = []
    for v in values:
        pad = [p for d in reversed(range(1, v.dim())) for p in (0, shape[d - 1] - v.shape[d])]
        padded.append(F.pad(v, pad) if any(pad) else v)
    return torch.cat(padded, dim=0)


def _collate(processor, rows: list[_Row], with_answers: bool) -> dict:
    """Right-padded training rows, or left-padded generation prompts (no labels)."""
    pad_id = processor.tokenizer.pad_token_id
    width = max(len(r.labels) for r in rows)
    keys = list(dict.fromkeys(k for r in rows for k in r.tokens))
    if with_answers:
        keys.append("labels")
    batch = {}
    for key in keys:
        fill = {"input_ids": pad_id, "labels": IGNORE_INDEX}.get(key, 0)
        padded = []
        for r in rows:
            values = r.labels if key == "labels" else r.tokens.get(key, [0] * len(r.labels))
            pad = [fill] * (width - len(values))
            padded.append(values + pad if with_answers else pad + values)
        batch[key] = torch.tensor(padded, dtype=torch.long)
    for key in dict.fromkeys(k for r in rows for k in r.vision):
        batch[key] = _cat([v for r in rows for v in r.vision.get(key, [])])
    return batch


def make_batch(processor, samples: list[Decoded], with_answers: bool = True) -> dict:
    """Tensors for the model from decoded samples, rendered with the model's own chat template: labels
    on every assistant turn and its end-of-turn token, IGNORE_INDEX elsewhere (`encode`).

    With `with_answers=False` (generation) each sample's last assistant turn is left out, the generation
    prompt ends it, and padding goes on the left. Token-aligned tensors (input_ids, attention_mask,
    mm_token_type_ids, ...) are padded together; vision tensors are concatenated along their first
    dimension, which stacks Llava's images and joins Qwen2-VL's patch rows alike; samples without images
    add none, so text-only and image samples share a batch.
    """
    return _collate(processor, [encode(processor, s, with_answers) for s in samples], with_answers)


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


STAND_IN_EDGE = 56  # pixels a side: Qwen2-VL's smallest image (min_pixels 56 * 56); resized elsewhere


def stand_in() -> Decoded:
    """The sample that takes a slot's place without training on it (its labels are cleared): a blank
    image, an empty question and answer. Under ZeRO-3 every rank must run the same forward and backward
    passes, so a slot is never dropped: a too-long or bad sample, or an empty slot of the global batch,
    becomes this row, vision tower and all."""
    image = Image.new("RGB", (STAND_IN_EDGE, STAND_IN_EDGE), (127, 127, 127))
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": ""}]},
        {"role": "assistant", "content": [{"type": "text", "text": ""}]},
    ]
    return messages, [image]


def _stand_in_row(processor) -> _Row:
    row = encode(processor, stand_in())
    row.labels = [IGNORE_INDEX] * len(row.labels)
    return row


def check_max_length(processor, max_length: int) -> None:
    """`ConfigError` when even the stand-in sample is longer than `max_length` (data.max_length)."""
    batch = make_batch(processor, [stand_in()])
    length = int(batch["attention_mask"].sum())
    if length > max_length:
        image_id = getattr(processor, "image_token_id", None)
        images = f", {int((batch['input_ids'] == image_id).sum())} of them image tokens" if image_id else ""
        raise ConfigError(
            f"data.max_length ({max_length}) is shorter than the shortest possible sample: a blank "
            f"{STAND_IN_EDGE}x{STAND_IN_EDGE} image with an empty prompt and answer takes {length} tokens"
            f"{images}"
        )


def limit_length(
    processor,
    samples: list[Decoded | None],
    max_length: int | None,
    *,
    rejected: dict[int, str] | None = None,
) -> tuple[dict, list[int]]:
    """A training micro batch: `make_batch`, with each `None` slot (no sample) and each sample longer than
    `max_length` tokens (all its turns, image tokens and end-of-turn tokens) replaced by the label-less
    `stand_in()`. Returns the batch and the positions of the too-long samples.

    With `rejected` given, a sample that the processor or the chat template rejects (a `ValueError` such
    as "Found 1 <image> tokens in the text but no images", or the template's own `raise_exception`) is a
    bad row: it is replaced by the stand-in too, and its position and why go into `rejected`. The same
    row fails at every attempt, so it must not fail the step. Without `rejected` the error propagates.

    Too-long samples are skipped, not truncated: cutting image tokens breaks the model's image-token
    count, and cutting an answer would train on part of it.

    A batch without any image gets one stand-in row more. Under ZeRO-3 the vision tower's forward gathers
    its parameters and, when it is trained, its backward reduce-scatters their gradients: a rank that
    skipped the tower would leave the other ranks waiting in those collectives forever. A real image row
    through the model's own forward works for every architecture, where calling the tower on the side
    (and adding 0 times its output to the loss) would need each architecture's vision call; its labels are
    all IGNORE_INDEX, so it changes neither the loss nor the gradient.
    """
    from jinja2 import TemplateError  # what a chat template's raise_exception raises

    rows = []
    for i, sample in enumerate(samples):
        try:
            rows.append(_stand_in_row(processor) if sample is None else encode(processor, sample))
        except (ValueError, TemplateError) as err:
            if rejected is None or sample is None:
                raise
            rejected[i] = (
                f"the processor rejects it ({type(err).__name__}: {' '.join(str(err).split())[:300]})"
            )
            rows.append(_stand_in_row(processor))
    too_long = [i for i, r in enumerate(rows) if max_length is not None and len(r.labels) > max_length]
    for i in too_long:
        rows[i] = _stand_in_row(processor)
    if not any(r.vision for r in rows):
        rows.append(_stand_in_row(processor))
    return _collate(processor, rows, with_answers=True), too_long
