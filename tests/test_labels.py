"""Labels on the tokenizers and chat templates of real checkpoints (tests/real_tokenizers.py): the trained
sequence is the whole conversation tokenised once, as inference tokenises it, and every answer is
labelled with a stop token, the template's own or the EOS that raylora adds where the template has none."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from raylora.data.batches import make_batch
from raylora.data.labels import encode, end_of_turn_ids, final_answer
from raylora.data.processor import load_processor
from raylora.tiny_text import (
    GEMMA3_TOKENS,
    GEMMA4_TOKENS,
    GEMMA4_TURN_TOKENS,
    IDEFICS3_TOKENS,
    QWEN3_5_CHAT_TEMPLATE,
)
from tests import real_tokenizers as rt
from tests.run_logs import labelled_runs

# arch: (tokenizer, the model card's template, the stop token, whether raylora adds it)
FAMILIES = {
    "llava": (lambda: rt.sentencepiece_llama(("<image>",)), rt.LLAVA_15_TEMPLATE, "</s>", True),
    "qwen2_vl": (rt.byte_level_qwen, rt.QWEN2_VL_TEMPLATE, "<|im_end|>", False),
    "qwen3_vl": (rt.byte_level_qwen, rt.QWEN3_VL_TEMPLATE, "<|im_end|>", False),
    "idefics3": (
        lambda: rt.byte_level_smolvlm((*IDEFICS3_TOKENS[:2], "<image>")),
        rt.IDEFICS3_TEMPLATE,
        "<end_of_utterance>",
        False,
    ),
    "gemma3": (lambda: rt.sentencepiece_gemma(GEMMA3_TOKENS), rt.GEMMA3_TEMPLATE, "<end_of_turn>", False),
    "gemma4": (
        lambda: rt.sentencepiece_gemma(GEMMA4_TOKENS, tuple(GEMMA4_TURN_TOKENS)),
        rt.GEMMA4_TEMPLATE,
        "<turn|>",
        False,
    ),
    "glm4v": (rt.byte_level_glm, rt.GLM4V_TEMPLATE, "<|endoftext|>", True),
}
QUESTION = "Which digit is this ?"
ANSWERS = ["seven", "three , a nine"]


def _turn(role: str, *parts: str | None) -> dict:
    return {
        "role": role,
        "content": [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts],
    }


def _image(shade: int) -> Image.Image:
    return Image.new("RGB", (8, 8), (shade, 255 - shade, shade // 2))


SAMPLES = [
    (  # multi-turn, one image
        [_turn("user", None, QUESTION), _turn("assistant", ANSWERS[0])]
        + [_turn("user", "Which digit ?"), _turn("assistant", ANSWERS[1])],
        [_image(10)],
    ),
    ([_turn("user", "Count the objects :"), _turn("assistant", "1 2 3")], []),  # text only
]


# reasoning templates: answers without reasoning need data.chat_template_kwargs (tested on their own below)
REASONING = {"qwen3_5": (rt.byte_level_qwen3_5, QWEN3_5_CHAT_TEMPLATE, "<|im_end|>", False)}


def hub_like_processor(tiny_folder: str, arch: str, out: Path, **template_kwargs):
    """The tiny model's processor with a real family's tokenizer and template, saved and loaded again."""
    make_tokenizer, template, _, _ = (FAMILIES | REASONING)[arch]
    shutil.rmtree(out, ignore_errors=True)
    load_processor(tiny_folder).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.json"):
        (out / name).unlink(missing_ok=True)
    make_tokenizer().save_pretrained(out)
    (out / "chat_template.jinja").write_text(template)
    return load_processor(out, template_kwargs=template_kwargs)


@pytest.fixture(scope="module")
def processors(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("hub_like")
    return {arch: hub_like_processor(tiny_models(arch), arch, root / arch) for arch in FAMILIES}


@pytest.mark.parametrize("arch", FAMILIES)
def test_labels_are_the_answers_and_their_stop_token_in_the_whole_tokenisation(arch, processors):
    processor = processors[arch]
    tok = processor.tokenizer
    _, _, stop, added = FAMILIES[arch]
    stop_id = tok.convert_tokens_to_ids(stop)
    for (messages, images), answers in zip(SAMPLES, [ANSWERS, ["1 2 3"]], strict=True):
        row = encode(processor, (messages, images))
        ids, labels = row.tokens["input_ids"], row.labels
        runs = labelled_runs(labels)
        assert len(runs) == len(answers)
        for (a, b), answer in zip(runs, answers, strict=True):
            assert ids[b - 1] == stop_id and labels[a:b] == ids[a:b]
            assert tok.decode(ids[a : b - 1]).strip() == answer
        # as inference sees it: the whole rendering through the processor, images expanded, in one call
        text = processor.apply_chat_template(messages, tokenize=False)
        special = not (tok.bos_token and text.startswith(tok.bos_token))
        whole = processor(text=[text], images=images or None, add_special_tokens=special)["input_ids"][0]
        whole = list(whole)
        appended = [b - 1 for _, b in runs] if added else []
        assert [t for k, t in enumerate(ids) if k not in appended] == whole
        assert len(row.tokens["attention_mask"]) == len(ids)
    assert end_of_turn_ids(processor) == [stop_id]


def test_sentencepiece_answer_tokens_are_the_ones_inference_continues_into(processors):
    """llava-1.5's SentencePiece: the answer after 'ASSISTANT:' is '▁seven' as in the whole rendering,
    not a lone '▁' followed by the word tokenised on its own."""
    processor = processors["llava"]
    tok = processor.tokenizer
    messages, images = SAMPLES[0]
    row = encode(processor, (messages, images))
    (a, b), _ = labelled_runs(row.labels)
    answer = tok.convert_ids_to_tokens(row.tokens["input_ids"][a : b - 1])
    assert answer == ["▁seven"]  # a piece tokenised alone would be ['▁', '▁seven']


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl", "qwen3_vl", "gemma4", "glm4v"])
def test_generation_prompt_is_the_training_prefix(arch, processors):
    """The prompt generation starts from is token for token what training put before the last answer."""
    processor = processors[arch]
    batch = make_batch(processor, SAMPLES)
    prompts = make_batch(processor, SAMPLES, with_answers=False)
    for ids, mask, train_ids, labels in zip(
        prompts["input_ids"], prompts["attention_mask"], batch["input_ids"], batch["labels"], strict=True
    ):
        last = labelled_runs(labels.tolist())[-1][0]
        assert torch.equal(ids[mask.bool()], train_ids[:last])


def test_qwen3_5_reasoning_template_trains_each_turn_as_the_conversation_shows_it(tiny_models, tmp_path):
    """Qwen3.5's template writes the turn after the last user turn with its reasoning block and the turns
    before it without theirs, and its generation prompt opens a block (`<think>\n`). Its tokenizer makes
    `\n\n` one token, so an answer without reasoning would train `<think>`, `\n\n` where inference
    continues from `<think>`, `\n`: refused, naming data.chat_template_kwargs. With `enable_thinking: false`
    every turn trains its answer and `<|im_end|>` after an empty block in the prompt; a row with reasoning
    trains it with the default."""
    thinking = hub_like_processor(tiny_models("qwen3_5"), "qwen3_5", tmp_path / "thinking")
    plain = hub_like_processor(tiny_models("qwen3_5"), "qwen3_5", tmp_path / "plain", enable_thinking=False)
    tok = plain.tokenizer
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    assert len(tok("\n\n", add_special_tokens=False)["input_ids"]) == 1
    messages, images = SAMPLES[0]
    with pytest.raises(ValueError, match="enable_thinking: false"):
        encode(thinking, (messages, images))

    row = encode(plain, (messages, images))
    ids, runs = row.tokens["input_ids"], labelled_runs(row.labels)
    assert [tok.decode(ids[a:b]) for a, b in runs] == [f"{a}<|im_end|>" for a in ANSWERS]
    assert all(ids[b - 1] == stop for _, b in runs)
    text = tok.decode(ids)
    assert text.count("<think>\n\n</think>\n\n") == 1 and "<think>" not in tok.decode(ids[runs[0][0] :][:2])
    prompt = encode(plain, (messages, images), with_answers=False).tokens["input_ids"]
    assert prompt == ids[: runs[-1][0]] and tok.decode(prompt).endswith("<think>\n\n</think>\n\n")

    reasoned = [*messages[:3], _turn("assistant", "<think>\nIt is a loop .\n</think>\n\nthree , a nine")]
    row = encode(thinking, (reasoned, images))
    ids, runs = row.tokens["input_ids"], labelled_runs(row.labels)
    # the first turn as the conversation shows it; the last after the generation prompt's `<think>\n`
    trained = [tok.decode(ids[a:b]) for a, b in runs]
    assert trained == ["seven<|im_end|>", "It is a loop .\n</think>\n\nthree , a nine<|im_end|>"]
    assert final_answer(trained[1].removesuffix("<|im_end|>")) == "three , a nine"
