"""The tiny models' words: vocabulary, special tokens, a word-level tokenizer and the chat templates.

The chat templates follow the real models' ones, so the tiny models of raylora.tiny are prompted as
the real ones are; the vocabulary is the digits demo's words and nothing more, which keeps the tiny
models' embeddings small.
"""

from __future__ import annotations

DIGIT_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]

# Chat templates modelled on the real models' ones, so the tiny models are prompted the same way.
# llava-hf/llava-1.5-*-hf's own: images first, each text plus a space, and no </s> after an answer (raylora
# adds and trains the EOS there: raylora.data.labels.encode).
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
    "{% endif %}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\\n' }}{% endfor %}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
QWEN2_VL_CHAT_TEMPLATE = (  # Qwen2-VL / Qwen2.5-VL Instruct's parts: an image or a video each in vision marks
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN3_VL_CHAT_TEMPLATE = (  # Qwen3-VL Instruct: no default system prompt; images and videos as parts
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3.5 (Qwen/Qwen3.5-*'s chat_template.jinja, without its tools): Qwen3-VL's parts; every assistant turn
# after the last user turn opens with its reasoning block (`<think>\n...\n</think>\n\n`, empty when the turn
# has none), the turns before it are their answers alone (reasoning dropped), and the generation prompt
# opens a reasoning block (`<think>\n`; an empty one with `enable_thinking=False`)
QWEN3_5_CHAT_TEMPLATE = (
    "{%- macro render(content) %}{%- if content is string %}{{- content }}{%- else %}"
    "{%- for c in content %}{%- if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{%- else %}{{- c['text'] }}{%- endif %}{%- endfor %}{%- endif %}{%- endmacro %}"
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}{%- set content = render(message['content'])|trim %}"
    "{%- if message['role'] == 'assistant' %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning|trim + '\\n</think>\\n\\n' + content }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)
SMOLVLM_CHAT_TEMPLATE = (  # Idefics3 / SmolVLM: "User:<image>...<end_of_utterance>\nAssistant:"
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'][0]['type'] == 'image' %}:{% else %}: {% endif %}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}"
    "{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
GEMMA3_CHAT_TEMPLATE = (  # the processor expands <start_of_image> into the image's soft tokens
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' }}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}<start_of_image>{% else %}"
    "{{ c['text'] | trim }}{% endif %}{% endfor %}{{ '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
INTERNVL_CHAT_TEMPLATE = (  # InternVL3 (-hf): Qwen2's turns, the image as <IMG_CONTEXT> on its own line
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}<IMG_CONTEXT>\n"
    "{% elif c['type'] == 'video' %}<video>\n"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# GLM-4.1V / 4.5V / 4.6V: [gMASK]<sop>, then <|role|> and a line break a turn; no end-of-turn token
GLM4V_CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|begin_of_image|><|image|><|end_of_image|>"
    "{% elif c['type'] == 'video' %}<|begin_of_video|><|video|><|end_of_video|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Gemma 4: <|turn>role ... <turn|>, 'model' for the assistant; one <|image|> per image and one <|video|> per
# video (the processor expands each), as google/gemma-4's template writes its parts
GEMMA4_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<|turn>' + role + '\\n' }}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}<|image|>"
    "{% elif c['type'] == 'video' %}<|video|>{% else %}"
    "{{ c['text'] | trim }}{% endif %}{% endfor %}{{ '<turn|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn>model\\n' }}{% endif %}"
)
MISTRAL3_CHAT_TEMPLATE = (  # Mistral-Small-3.1: [INST]...[/INST]answer</s>, the image as [IMG]
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}[INST]"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}[IMG]{% else %}{{ c['text'] }}"
    "{% endif %}{% endfor %}[/INST]{% else %}{% for c in message['content'] %}{{ c['text'] }}"
    "{% endfor %}</s>{% endif %}{% endfor %}"
)

SPECIAL_TOKENS = [
    "<pad>",
    "<s>",
    "</s>",
    "<unk>",
    "<image>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
WORDS = ["USER", "ASSISTANT", "user", "assistant", ":", "?", ".", ",", "Which", "digit", "is", "this", "a"]

# Tokens that only some architectures need, appended after the shared vocabulary so that the llava and
# qwen2_vl tokenizers stay what they were.
IDEFICS3_TOKENS = ["<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]
GEMMA3_TURN_TOKENS = ["<start_of_turn>", "<end_of_turn>"]
GEMMA3_TOKENS = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}
MISTRAL3_TOKENS = ["[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
GLM4V_TOKENS = [
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|begin_of_image|>",
    "<|image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|video|>",
    "<|end_of_video|>",
]
GEMMA4_TURN_TOKENS = ["<|turn>", "<turn|>", "<|video|>"]  # Gemma4Processor adds <|video|> if it is missing
GEMMA4_TOKENS = {  # what Gemma4Processor reads from its tokenizer (audio ones included: it checks them)
    "image_token": "<|image|>",
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "audio_token": "<|audio|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
}
INTERNVL_TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}


def build_tokenizer(
    extra_tokens: list[str] | tuple[str, ...] = (),
    named_tokens: dict[str, str] | None = None,
    extra_words: list[str] | tuple[str, ...] = (),
):
    """A word-level tokenizer over the demo's vocabulary, saved and loaded like any HF tokenizer.

    Written by hand because no pretrained tokenizer can be downloaded here; a word-level vocabulary of
    a few dozen entries also keeps the tiny model's embedding small. `named_tokens` become attributes
    (`tokenizer.boi_token`, `tokenizer.boi_token_id`), which Gemma3's and InternVL's processors read.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    named_tokens = named_tokens or {}
    specials = SPECIAL_TOKENS + list(extra_tokens) + list(named_tokens.values())
    vocab = {tok: i for i, tok in enumerate(specials + WORDS + DIGIT_NAMES + list(extra_words))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(behavior="isolated")]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=specials[4:],
        **({"model_specific_special_tokens": named_tokens} if named_tokens else {}),
    )
    return tokenizer


# Qwen2's pre-tokenizer pattern (the Qwen family's tokenizer.json): words with their leading space, numbers
# one digit at a time, punctuation runs, whitespace.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def build_byte_level_tokenizer(extra_words: list[str] | tuple[str, ...] = ()):
    """Qwen's byte-level BPE over the demo's vocabulary, for the families whose folders transformers loads
    with its own BPE class whatever tokenizer_config.json says (Qwen3.5: `Qwen3_5Tokenizer` rebuilds its
    pipeline from the folder's vocabulary and merges, so a word-level vocabulary would lose every word).

    Trained here on the demo's words, with and without a leading space, so that each is one token; the
    special tokens are `build_tokenizer`'s, so the chat templates and processors find the same ones.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    words = WORDS + DIGIT_NAMES + list(extra_words)
    trainer = trainers.BpeTrainer(
        vocab_size=4096,  # an upper bound: merging stops once every word is one token
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # and blank lines, one token in Qwen's vocabulary (`ĊĊ`), as Qwen3.5's reasoning block writes them
    backend.train_from_iterator([w for word in words for w in (word, " " + word)] + ["\n\n"] * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=SPECIAL_TOKENS[4:],
    )
