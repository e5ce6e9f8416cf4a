"""Tokenizers and chat templates that behave like the real model families', for tests of labels.

The tiny models' own word-level tokenizer and EOS-ending templates hide what real checkpoints do, so these
are built as the real ones are (their tokenizer.json pipelines and their model cards' templates), trained on
a small corpus with the `tokenizers` library: nothing is copied from a model.

- `sentencepiece_llama`: Llama / llava-1.5's tokenizer. BPE with byte fallback; the normaliser prepends
  '▁' and replaces spaces with '▁' (`Prepend('▁')` + `Replace(' ', '▁')`), so every text it is given
  starts with '▁'; `<s>` is added in front; `</s>` is EOS.
- `sentencepiece_gemma`: Gemma's. BPE with byte fallback, spaces replaced by '▁' but nothing prepended.
- `byte_level_qwen`: Qwen2's byte-level BPE (GPT-2 bytes, Qwen's split pattern), no BOS, `<|im_start|>`,
  `<|im_end|>` and the vision tokens added as special tokens, EOS `<|im_end|>` as in the Instruct models.
- `byte_level_smolvlm`: SmolVLM's (Idefics3) GPT-2 style byte-level BPE with `<end_of_utterance>`.

The templates are the model cards' own shapes: llava-1.5 renders an answer as its text and a space with no
`</s>`; Qwen2-VL inserts its default system prompt; Idefics3 closes turns with `<end_of_utterance>`; Gemma3
writes `<start_of_turn>model` and `<end_of_turn>`.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

CORPUS = [
    "Which digit is this ? It is seven .",
    "Which digit ? three , a nine . one two four five six eight zero",
    "Describe the image in one word . A dog ! The cat sat on the mat .",
    "You are a helpful assistant . What is shown here ? Count the objects : 1 2 3 4 5 6 7 8 9 0",
    "Hello world , how are you today ? Fine , thank you .",
    "USER: ASSISTANT: User: Assistant: user assistant model system",
] * 20
BYTES = [f"<0x{b:02X}>" for b in range(256)]
# Qwen2's pre-tokenizer pattern (tokenizer.json of the Qwen2 family): words, numbers one digit at a time,
# punctuation runs and whitespace, as GPT-4's cl100k does.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def _sentencepiece(prepend: bool, specials: list[str], vocab_size: int = 640) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    steps = [normalizers.Prepend("▁")] if prepend else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if prepend else [])
    )
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials + BYTES, show_progress=False)
    # SentencePiece learns pieces within words ('▁seven', never 'n▁s'); the tokenizer.json of a Llama has
    # no pre-tokenizer, so the split is there for training only.
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok.train_from_iterator(CORPUS, trainer)
    tok.pre_tokenizer = None
    return tok


def sentencepiece_llama(extra_special: tuple[str, ...] = ("<image>",)) -> PreTrainedTokenizerFast:
    tok = _sentencepiece(True, ["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<unk>"
    )
    fast.add_special_tokens({"additional_special_tokens": list(extra_special)})
    return fast


def sentencepiece_gemma(
    named: dict[str, str], turns: tuple[str, ...] = ("<start_of_turn>", "<end_of_turn>")
) -> PreTrainedTokenizerFast:
    """`named`: the image tokens Gemma3's processor reads as tokenizer attributes (boi_token, ...);
    `turns`: the turn tokens (Gemma 4: `<|turn>`, `<turn|>`, and the `<|video|>` its processor adds)."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", *turns, *named.values()]
    tok = _sentencepiece(False, specials)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", tok.token_to_id("<bos>"))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=specials[4:],
        model_specific_special_tokens=named,
    )


def _byte_level(
    specials: list[str], split: str | None, vocab_size: int = 640, corpus: list[str] = CORPUS
) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
    tok.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
        if split
        else byte_level
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]


def byte_level_qwen() -> PreTrainedTokenizerFast:
    tok = _byte_level(QWEN_SPECIALS, QWEN_SPLIT)
    tok.normalizer = normalizers.NFC()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS[1:]})
    return fast


def byte_level_qwen3_5() -> PreTrainedTokenizerFast:
    """Qwen3.5's: Qwen's byte-level BPE over text with blank lines, so that `\n\n` is one token (`ĊĊ`, as in
    the real vocabulary), and `<think>` / `</think>` added as tokens that are not special (decoding keeps
    them)."""
    corpus = CORPUS + ["It is seven .\n\nIt is nine .\n\nOne\n\ntwo\n"] * 20
    tok = _byte_level(QWEN_SPECIALS, QWEN_SPLIT, corpus=corpus)
    tok.normalizer = normalizers.NFC()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS[1:]})
    fast.add_tokens(["<think>", "</think>"])
    return fast


GLM_SPECIALS = [
    "<|endoftext|>",
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|video|>",
    "<|end_of_video|>",
]


def byte_level_glm() -> PreTrainedTokenizerFast:
    """GLM-4's byte-level BPE (cl100k-style split, as Qwen's), no BOS, `<|endoftext|>` as EOS and padding."""
    tok = _byte_level(GLM_SPECIALS, QWEN_SPLIT)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": GLM_SPECIALS[1:]})
    return fast


def byte_level_smolvlm(image_tokens: tuple[str, ...]) -> PreTrainedTokenizerFast:
    specials = ["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", *image_tokens]
    fast = PreTrainedTokenizerFast(
        tokenizer_object=_byte_level(specials, None),
        bos_token="<|im_start|>",
        eos_token="<end_of_utterance>",
        pad_token="<|endoftext|>",
    )
    fast.add_special_tokens({"additional_special_tokens": specials[1:]})
    return fast


# llava-hf/llava-1.5-*-hf: images first, every text plus a space, no end-of-turn token.
LLAVA_15_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
    "{% endif %}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
# Qwen/Qwen2-VL-7B-Instruct's chat_template.json (Qwen2.5-VL-7B-Instruct's is the same): a default system
# prompt when the conversation has none.
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen/Qwen3-VL-*-Instruct (chat_template.json, tools branch left out): no default system prompt, a system
# turn written before the loop, content as a string or as parts, assistant text from its text parts.
QWEN3_VL_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].content is string %}{{- messages[0].content }}{%- else %}"
    "{%- for content in messages[0].content %}{%- if 'text' in content %}{{- content.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- set image_count = namespace(value=0) %}{%- set video_count = namespace(value=0) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}{%- else %}"
    "{%- for content in message.content %}"
    "{%- if content.type == 'image' or 'image' in content or 'image_url' in content %}"
    "{%- set image_count.value = image_count.value + 1 %}"
    "{%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif content.type == 'video' or 'video' in content %}"
    "{%- set video_count.value = video_count.value + 1 %}"
    "{%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in content %}{{- content.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}{%- else %}"
    "{%- for content_item in message.content %}{%- if 'text' in content_item %}{{- content_item.text }}"
    "{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# HuggingFaceTB/SmolVLM-* (Idefics3): "User:<image>...<end_of_utterance>\nAssistant: ..."
IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
# google/gemma-3-*-it: BOS, the system prompt folded into the first user turn, 'model' for the assistant.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set first_user_prefix = '' %}"
    "{% set loop_messages = messages %}{% endif %}{% for message in loop_messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}"
    "{{ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
# zai-org/GLM-4.1V-9B-Thinking's shape: `[gMASK]<sop>`, each turn opened by its role token and a line break,
# images as `<|begin_of_image|><|image|><|end_of_image|>`, and nothing after an answer: the next turn's role
# token ends it, so raylora adds and trains the EOS (GLM's generation config stops at `<|endoftext|>` too).
GLM4V_TEMPLATE = (
    "[gMASK]<sop>{%- for msg in messages %}{%- if msg.role == 'system' %}<|system|>\n"
    "{%- if msg.content is string %}{{ msg.content }}{%- else %}{%- for item in msg.content %}"
    "{%- if item.type == 'text' %}{{ item.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- elif msg.role == 'user' %}<|user|>\n{%- if msg.content is string %}{{ msg.content }}{%- else %}"
    "{%- for item in msg.content %}{%- if item.type == 'video' or 'video' in item %}"
    "<|begin_of_video|><|video|><|end_of_video|>"
    "{%- elif item.type == 'image' or 'image' in item %}<|begin_of_image|><|image|><|end_of_image|>"
    "{%- elif item.type == 'text' %}{{ item.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- elif msg.role == 'assistant' %}<|assistant|>\n{%- if msg.content is string %}{{ msg.content }}"
    "{%- else %}{%- for item in msg.content %}{%- if item.type == 'text' %}{{ item.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{%- endif %}"
)
# google/gemma-4-*-it's turn shape (as LLaMA-Factory's gemma4 template writes it): BOS, `<|turn>role`, a line
# break, the content, `<turn|>` and a line break; 'model' for the assistant; an image as `<|image|>`, which
# the processor expands to `<|image>` + soft tokens + `<image|>`.
GEMMA4_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<|turn>' + role + '\n' }}{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<|image|>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<turn|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|turn>model\n' }}{% endif %}"
)
