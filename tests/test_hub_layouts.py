"""Model folders laid out as the Hub lays them out load, without torchvision and without weights.

Each folder starts as a raylora tiny model and is rewritten into the files a Hub folder holds, with the
keys of the real ones (shrunk): Qwen/Qwen2-VL-7B-Instruct and Qwen/Qwen2.5-VL-7B-Instruct name their
processor class only in `preprocessor_config.json` (no `processor_config.json`), keep the chat template
in `chat_template.json` (re-saved folders: `chat_template.jinja`, or `tokenizer_config.json`) and ship a
byte-level BPE as `vocab.json` + `merges.txt` (+ `tokenizer.json`); llava-1.5 style folders ship Llama's
SentencePiece `tokenizer.model`. The tokenizers are real ones trained here (`tokenizers`' BPE trainer,
the `sentencepiece` trainer), so they behave as the real families do, not as raylora's word-level tiny
tokenizer. The weights are left out: the driver's checks load the processor from such a folder.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import raylora.data.processor as processor_module
from raylora.assets import make_tiny_model
from tests.real_tokenizers import LLAVA_15_TEMPLATE, QWEN2_VL_TEMPLATE, QWEN3_VL_TEMPLATE

CORPUS = [
    "You are a helpful assistant.",
    "Which digit is this? The digit is seven.",
    "user assistant system zero one two three four five six seven eight nine",
    "USER: What is shown here? ASSISTANT: A handwritten digit, 0 1 2 3 4 5 6 7 8 9.",
] * 20
QUESTION = "Which digit is this?"
# 16x16 px: 4x4 patches, merged 2x2 for Qwen
IMAGE_TOKENS = {"qwen2_vl": 4, "qwen2_5_vl": 4, "qwen3_vl": 4, "llava": 16}
PROCESSOR_CLASS = {
    "qwen2_vl": "Qwen2VLProcessor",
    "qwen2_5_vl": "Qwen2_5_VLProcessor",
    "qwen3_vl": "Qwen3VLProcessor",
    "llava": "LlavaProcessor",
}

# Qwen2-VL's added tokens, in their Hub order (ids follow the BPE vocabulary), shrunk to the ones in use.
QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]

# (architecture, where the chat template is, tokenizer files, a video_preprocessor_config.json)
LAYOUTS = [
    ("qwen2_vl", "chat_template.json", "tokenizer.json", False),  # Qwen2-VL-7B-Instruct as the Hub has it
    ("qwen2_vl", "chat_template.jinja", "vocab+merges", True),
    ("qwen2_5_vl", "chat_template.json", "tokenizer.json", True),
    ("qwen2_5_vl", "chat_template.jinja", "vocab+merges", False),
    ("qwen2_5_vl", "tokenizer_config.json", "vocab+merges", False),
    ("qwen3_vl", "chat_template.json", "tokenizer.json", True),  # Qwen3-VL-8B-Instruct as the Hub has it
    ("llava", "chat_template.json", "tokenizer.model", False),
    ("llava", "tokenizer_config.json", "tokenizer.model", False),
]


def _added(tokens: dict[int, str]) -> dict:
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    return {str(i): {"content": t, **flags} for i, t in tokens.items()}


def _byte_level_bpe():
    """A Qwen2-style byte-level BPE trained on CORPUS (its special tokens are added tokens, not vocab)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    bpe.train_from_iterator(CORPUS, trainer)
    return bpe


def _sentencepiece_model() -> bytes:
    """A Llama-style SentencePiece model (BPE, byte fallback, dummy prefix, <unk> <s> </s> as 0 1 2)."""
    spm = pytest.importorskip("sentencepiece")
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=out,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
        add_dummy_prefix=True,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        normalization_rule_name="identity",
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    return out.getvalue()


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2))


def _qwen_files(folder: Path, arch: str, tokenizer_files: str, video_config: bool) -> dict:
    """Rewrite a tiny Qwen folder's processor and tokenizer files into the Hub's; the tokenizer_config."""
    from transformers import Qwen2Tokenizer

    image = json.loads((folder / "processor_config.json").read_text())["image_processor"]
    (folder / "processor_config.json").unlink()  # the Hub's Qwen folders have none
    pixels = image["size"]["longest_edge"]
    shared = dict(
        min_pixels=pixels,
        max_pixels=pixels,
        patch_size=image["patch_size"],
        temporal_patch_size=image["temporal_patch_size"],
        merge_size=image["merge_size"],
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
        processor_class=PROCESSOR_CLASS[arch],
    )
    # Qwen3-VL's folders name the torchvision image processor by its transformers 4 name, and its own
    # video processor (which samples frames and writes timestamps)
    qwen3 = arch == "qwen3_vl"
    image_type = "Qwen2VLImageProcessorFast" if qwen3 else "Qwen2VLImageProcessor"
    _write_json(folder / "preprocessor_config.json", shared | {"image_processor_type": image_type})
    if video_config:
        video_type = "Qwen3VLVideoProcessor" if qwen3 else "Qwen2VLVideoProcessor"
        _write_json(folder / "video_preprocessor_config.json", shared | {"video_processor_type": video_type})
    bpe = _byte_level_bpe()
    bpe.model.save(str(folder))  # vocab.json + merges.txt, the slow Qwen2Tokenizer's files
    n = bpe.get_vocab_size()
    tokenizer_config = {
        "add_prefix_space": False,
        "added_tokens_decoder": _added({n + i: t for i, t in enumerate(QWEN_SPECIALS)}),
        "additional_special_tokens": QWEN_SPECIALS[1:],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": "<|endoftext|>",
        "padding_side": "left",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    _write_json(folder / "tokenizer_config.json", tokenizer_config)
    tokenizer = Qwen2Tokenizer.from_pretrained(folder)
    if tokenizer_files == "tokenizer.json":
        tokenizer.backend_tokenizer.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "config.json").read_text())  # the model's token ids follow the tokenizer
    for key, token in [("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>")]:
        config[key] = tokenizer.convert_tokens_to_ids(token)
    config["vision_start_token_id"] = tokenizer.convert_tokens_to_ids("<|vision_start|>")
    config["vision_end_token_id"] = tokenizer.convert_tokens_to_ids("<|vision_end|>")
    _write_json(folder / "config.json", config)
    return tokenizer_config


def _llava_files(folder: Path) -> dict:
    """Rewrite a tiny Llava folder into llava-1.5's files with only a SentencePiece tokenizer.model."""
    import sentencepiece as spm

    processor = json.loads((folder / "processor_config.json").read_text())
    image = processor.pop("image_processor")
    image_config = {
        "crop_size": image["crop_size"],
        "do_center_crop": True,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": CLIP_MEAN,
        "image_processor_type": "CLIPImageProcessor",
        "image_std": CLIP_STD,
        "processor_class": "LlavaProcessor",
        "resample": 3,
        "rescale_factor": 0.00392156862745098,
        "size": image["size"],
    }
    _write_json(folder / "preprocessor_config.json", image_config)
    keys = ("image_token", "num_additional_image_tokens", "patch_size", "vision_feature_select_strategy")
    _write_json(
        folder / "processor_config.json",
        {k: processor[k] for k in keys} | {"processor_class": "LlavaProcessor"},
    )
    model = _sentencepiece_model()
    (folder / "tokenizer.model").write_bytes(model)
    n = spm.SentencePieceProcessor(model_proto=model).get_piece_size()
    tokenizer_config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": _added({0: "<unk>", 1: "<s>", 2: "</s>", n: "<image>", n + 1: "<pad>"}),
        "bos_token": "<s>",
        "clean_up_tokenization_spaces": False,
        "eos_token": "</s>",
        "legacy": False,
        "model_max_length": 1000000000000000019884624838656,
        "pad_token": "<pad>",
        "padding_side": "left",
        "processor_class": "LlavaProcessor",
        "sp_model_kwargs": {},
        "tokenizer_class": "LlamaTokenizer",
        "unk_token": "<unk>",
        "use_default_system_prompt": False,
    }
    _write_json(folder / "tokenizer_config.json", tokenizer_config)
    config = json.loads((folder / "config.json").read_text())
    config["image_token_index"] = n
    _write_json(folder / "config.json", config)
    return tokenizer_config


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(root / arch, arch) for arch in IMAGE_TOKENS}


def hub_folder(tiny: Path, out: Path, arch: str, template: str, tokenizer_files: str, video: bool) -> Path:
    """`tiny` rewritten as the Hub lays the architecture's folder out: config, tokenizer and processor
    files only (no weights), the chat template at `template`."""
    shutil.copytree(tiny, out, ignore=shutil.ignore_patterns("*.safetensors", "tokenizer*", "chat_template*"))
    if arch == "llava":
        tokenizer_config = _llava_files(out)
    else:
        tokenizer_config = _qwen_files(out, arch, tokenizer_files, video)
    chat_template = {"llava": LLAVA_15_TEMPLATE, "qwen3_vl": QWEN3_VL_TEMPLATE}.get(arch, QWEN2_VL_TEMPLATE)
    if template == "chat_template.json":
        _write_json(out / template, {"chat_template": chat_template})
    elif template == "chat_template.jinja":
        (out / template).write_text(chat_template)
    else:
        _write_json(out / "tokenizer_config.json", tokenizer_config | {"chat_template": chat_template})
    return out


@pytest.fixture(scope="module")
def image_only_folder(tiny_folders, tmp_path_factory) -> Path:
    """The tiny Qwen2-VL folder as a node without torchvision saves it (and raylora saved its tiny models
    before it required torchvision): processor_config.json holds the image processor only."""
    folder = shutil.copytree(tiny_folders["qwen2_vl"], tmp_path_factory.mktemp("image-only") / "qwen2_vl")
    saved = json.loads((folder / "processor_config.json").read_text())
    _write_json(folder / "processor_config.json", {k: v for k, v in saved.items() if k != "video_processor"})
    return folder


@pytest.fixture(params=["without torchvision", "with torchvision"])
def torchvision(request, monkeypatch) -> bool:
    """Whether the processor is loaded with torchvision: "with" is raylora's own runtime (torch and
    torchvision pinned together); "without" a node where it is missing, hidden here from the loader."""
    if request.param == "with torchvision":
        pytest.importorskip("torchvision", reason="torchvision is not installed")
        return True
    monkeypatch.setattr(processor_module, "is_torchvision_available", lambda: False)
    return False


@pytest.mark.parametrize(("arch", "template", "tokenizer_files", "video"), LAYOUTS, ids=lambda v: str(v))
def test_hub_layout_loads(tiny_folders, tmp_path, torchvision, arch, template, tokenizer_files, video):
    """load_processor turns a conversation with an image into the right image tokens and pixel values,
    with a tokenizer that tokenises as the folder's own tokenizer files do."""
    folder = hub_folder(tiny_folders[arch], tmp_path / arch, arch, template, tokenizer_files, video)
    processor = processor_module.load_processor(folder)
    assert type(processor).__name__ == PROCESSOR_CLASS[arch]
    if not torchvision:  # the image-only form: no video processor, which would need torchvision
        assert getattr(processor, "video_processor", None) is None
    elif arch != "llava" and video:  # the folder's video processor, as transformers loads it
        expected = "Qwen3VLVideoProcessor" if arch == "qwen3_vl" else "Qwen2VLVideoProcessor"
        assert type(processor.video_processor).__name__ == expected

    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
        {"role": "assistant", "content": [{"type": "text", "text": "seven"}]},
    ]
    text = processor.apply_chat_template(messages, tokenize=False)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (8, 8, 3), dtype=np.uint8))
    batch = processor(text=[text], images=[image], return_tensors="pt")
    assert int((batch["input_ids"] == processor.image_token_id).sum()) == IMAGE_TOKENS[arch]
    assert batch["pixel_values"].numel() > 0

    tokenizer = processor.tokenizer
    if arch == "llava":
        import sentencepiece as spm

        assert text.startswith("USER: <image>\n") and text.endswith("ASSISTANT: seven ")
        sp = spm.SentencePieceProcessor(model_proto=(folder / "tokenizer.model").read_bytes())
        for piece in (QUESTION, "seven", "ASSISTANT: A handwritten digit, 7."):
            assert tokenizer.tokenize(piece) == sp.encode(piece, out_type=str)
    else:  # Qwen2-VL's and Qwen2.5-VL's default system prompt; none in Qwen3-VL's
        system = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        assert text.startswith(system) != (arch == "qwen3_vl")
        bpe = _byte_level_bpe()
        for piece in (QUESTION, "seven", "The digit is seven."):
            assert tokenizer(piece, add_special_tokens=False).input_ids == bpe.encode(piece).ids
        for token in QWEN_SPECIALS:
            assert tokenizer.tokenize(token) == [token]


def test_a_folder_saved_image_only_loads_with_and_without_torchvision(image_only_folder, torchvision):
    """A Qwen2-VL folder saved from the image-only processor holds no video processor in its
    processor_config.json. Where torchvision is installed, transformers' AutoProcessor fails on it ("Can't
    load video processor"): it loads in its image-only form there too."""
    processor = processor_module.load_processor(image_only_folder)
    assert type(processor).__name__ == "Qwen2VLProcessor"
    assert getattr(processor, "video_processor", None) is None
    image = Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8))
    batch = processor(
        text=["<|vision_start|><|image_pad|><|vision_end|>"], images=[image], return_tensors="pt"
    )
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4]]


def test_which_folders_load_image_only(tiny_folders, image_only_folder, tmp_path):
    """Image-only where torchvision is missing, or where the folder holds nothing a video processor is
    read from (video_preprocessor_config.json, preprocessor_config.json, which transformers reads for it,
    or a `video_processor` in processor_config.json); a processor without a video part never."""
    image_only = processor_module.image_only
    assert not image_only(tiny_folders["qwen2_vl"], "Qwen2VLProcessor", torchvision=True)  # saved whole
    tiny = image_only_folder
    assert image_only(tiny, "Qwen2VLProcessor", torchvision=False)
    assert image_only(tiny, "Qwen2VLProcessor", torchvision=True)
    saved = json.loads((tiny / "processor_config.json").read_text())
    for name, settings in [
        ("preprocessor_config.json", saved["image_processor"]),  # as the Hub's Qwen2-VL folders hold it
        ("video_preprocessor_config.json", saved["image_processor"]),
        ("processor_config.json", saved | {"video_processor": saved["image_processor"]}),
    ]:
        folder = shutil.copytree(tiny, tmp_path / name)
        _write_json(folder / name, settings)
        assert not image_only(folder, "Qwen2VLProcessor", torchvision=True), name
        assert image_only(folder, "Qwen2VLProcessor", torchvision=False), name
    for torchvision in (False, True):
        assert not image_only(tiny_folders["llava"], "LlavaProcessor", torchvision=torchvision)


def test_processor_class_lookup_order(tmp_path):
    """processor_config.json, then preprocessor_config.json (or in its place the video processor's), then
    tokenizer_config.json, then config.json's model type: the order of transformers' AutoProcessor."""
    name = processor_module.processor_class_name
    _write_json(tmp_path / "config.json", {"model_type": "qwen2_vl"})
    assert name(tmp_path) == "Qwen2VLProcessor"
    _write_json(tmp_path / "tokenizer_config.json", {"processor_class": "FromTokenizer"})
    assert name(tmp_path) == "FromTokenizer"
    _write_json(tmp_path / "video_preprocessor_config.json", {"processor_class": "FromVideo"})
    assert name(tmp_path) == "FromVideo"
    _write_json(tmp_path / "preprocessor_config.json", {"image_processor_type": "Qwen2VLImageProcessor"})
    assert name(tmp_path) == "FromTokenizer"  # the video config is read only without preprocessor_config.json
    _write_json(tmp_path / "preprocessor_config.json", {"processor_class": "FromImage"})
    assert name(tmp_path) == "FromImage"
    _write_json(tmp_path / "processor_config.json", {"processor_class": "FromProcessor"})
    assert name(tmp_path) == "FromProcessor"


def test_tokenizer_model_without_sentencepiece_names_the_file(tiny_folders, tmp_path, monkeypatch):
    """Without the sentencepiece package, a tokenizer.model-only folder fails naming the file and the
    package (transformers would ask for tiktoken)."""
    import importlib.util

    from raylora.config import ConfigError

    folder = hub_folder(tiny_folders["llava"], tmp_path / "llava", "llava", "chat_template.json", "", False)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "sentencepiece" else find_spec(name, *a)
    )
    with pytest.raises(ConfigError, match=r"tokenizer\.model.*pip install sentencepiece"):
        processor_module.load_processor(folder)
