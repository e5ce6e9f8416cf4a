"""Loading a model folder's processor: image size caps (`cap_image_size`: data.max_pixels,
data.min_pixels), video size caps (`cap_video_size`: data.video_min_pixels, data.video_max_pixels,
data.video_total_pixels), folders laid out as the Hub lays them out, and an image-only fallback for
nodes without torchvision.

The processor class is found where transformers 5.23's `AutoProcessor` looks for it
(`processor_class_name`): the Hub's Qwen2-VL and Qwen2.5-VL folders have no `processor_config.json` and
name it in `preprocessor_config.json`. raylora depends on torchvision (pinned with torch), and with it a
folder's processor loads whole, as `AutoProcessor` loads it: the Qwen families' torchvision image
processors and their video processors. In transformers 5 the Qwen-VL families' processors require a video
processor, and video processors require torchvision; on a node where torchvision is missing (an image
without it), raylora builds the same processor class without its video part, and a
`video_preprocessor_config.json` in the folder is then left unread. Pixtral's processor (Mistral3) needs
torchvision only for one import, which `pixtral_processor_class` answers from transformers' PIL image
processor there. The folder on disk stays a standard one that `AutoProcessor` loads elsewhere.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import math
import sys
from pathlib import Path

import transformers
from transformers.image_utils import SizeDict
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES, processor_class_from_name
from transformers.models.auto.tokenization_auto import tokenizer_class_from_name
from transformers.utils import (
    IMAGE_PROCESSOR_NAME,
    PROCESSOR_NAME,
    VIDEO_PROCESSOR_NAME,
    is_torchvision_available,
)

from raylora.config import ConfigError
from raylora.data.video import PixelCaps


@functools.cache
def image_only_processor_class(cls: type) -> type:
    """A subclass of `cls` (same name, so saved folders name the real class) with no video processor.

    transformers takes a processor's parts from `get_attributes()`: without `video_processor` there,
    `from_pretrained` loads no video processor and `ProcessorMixin.__init__` ignores the `None` that
    `cls.__init__` passes for it. `cls.__init__` itself is kept, so settings it takes by name (InternVL's
    `image_seq_length`) are still saved and loaded.
    """

    def get_attributes(klass) -> list[str]:
        return [a for a in cls.get_attributes() if a != "video_processor"]

    return type(
        cls.__name__, (cls,), {"get_attributes": classmethod(get_attributes), "__module__": cls.__module__}
    )


@functools.cache
def pixtral_processor_class() -> type:
    """transformers' own `PixtralProcessor`, also where torchvision is not installed.

    transformers 5.23 marks the class as needing torchvision because its module imports one helper,
    `get_resize_output_image_size` (used only to count image tokens ahead of a request), from the
    torchvision image processor module; the PIL image processor module defines the same function.
    raylora imports the processor module once with the PIL module answering that single import, then
    takes the import back out, so the real class is used and no other module sees the stand-in.
    """
    if importlib.util.find_spec("torchvision") is not None:
        return transformers.PixtralProcessor
    stand_in = "transformers.models.pixtral.image_processing_pixtral"
    pil = importlib.import_module("transformers.models.pixtral.image_processing_pil_pixtral")
    sys.modules[stand_in] = pil
    try:
        module = importlib.import_module("transformers.models.pixtral.processing_pixtral")
    finally:
        del sys.modules[stand_in]
    return module.PixtralProcessor


# Processor classes whose transformers import needs torchvision, and where raylora finds them without it.
TORCHVISION_FREE = {"PixtralProcessor": pixtral_processor_class}


def load_processor(
    model_path: str | Path,
    max_pixels: int | None = None,
    min_pixels: int | None = None,
    trust_remote_code: bool = False,
    video_caps: PixelCaps | None = None,
    template_kwargs: dict | None = None,
):
    """The model folder's processor, with images capped at `max_pixels` / `min_pixels` (data.max_pixels,
    data.min_pixels) where the architecture's image processor has a resolution knob (`cap_image_size`),
    and videos at `video_caps` (data.video_*_pixels, `cap_video_size`).
    `trust_remote_code` (model.trust_remote_code): a processor the folder's own code defines (`auto_map`).
    `template_kwargs` (data.chat_template_kwargs): what every rendering hands the chat template."""
    processor = _from_pretrained(model_path, trust_remote_code)
    cap_image_size(processor.image_processor, max_pixels, min_pixels)
    cap_video_size(processor, video_caps or PixelCaps())
    processor.chat_template_kwargs = dict(template_kwargs or {})  # read by raylora.data.labels
    return processor


def cap_image_size(image_processor, max_pixels: int | None, min_pixels: int | None) -> None:
    """Hand the pixel caps to the image processor's own resolution knob, or refuse them (`ConfigError`).

    - Qwen2-VL and Qwen2.5-VL keep each image's aspect ratio and scale it so that its pixel count lies in
      `[size.shortest_edge, size.longest_edge]` (pixel counts, whatever the names say): the caps go there.
      An image costs pixels / (patch_size * merge_size)^2 tokens, so the cap bounds its tokens.
    - Pixtral (Mistral3) shrinks an image whose longest edge exceeds `size.longest_edge`; Idefics3 scales
      each image to `size.longest_edge` and cuts it into tiles of `max_image_size`. A longest edge of
      isqrt(max_pixels) keeps any aspect ratio within max_pixels. Neither has a minimum.
    - The others (Llava's CLIP crop, Gemma3, InternVL's tiles, Idefics3 without image splitting) resize
      every image to one fixed size, so there is nothing to cap: setting a cap is an error that says so.
    """
    if max_pixels is None and min_pixels is None:
        return
    name = type(image_processor).__name__
    size = dict(image_processor.size)
    if name.startswith("Qwen2VLImageProcessor"):
        size["shortest_edge"] = min_pixels or size["shortest_edge"]
        size["longest_edge"] = max_pixels or size["longest_edge"]
        if size["shortest_edge"] > size["longest_edge"]:
            raise ConfigError(
                f"data.min_pixels ({size['shortest_edge']}) exceeds the most pixels per image "
                f"({size['longest_edge']}, data.max_pixels or the model folder's own)"
            )
    elif name.startswith("PixtralImageProcessor") or (
        name.startswith("Idefics3ImageProcessor") and image_processor.do_image_splitting
    ):
        if min_pixels is not None:
            raise ConfigError(f"data.min_pixels: {name} has no minimum image size; leave it unset")
        size["longest_edge"] = math.isqrt(max_pixels)
    else:
        raise ConfigError(
            f"data.max_pixels / data.min_pixels: the model's processor ({name}) resizes every image to "
            f"{_fixed_size(image_processor)}, so there is no resolution to cap; leave them unset"
        )
    image_processor.size = SizeDict(**size)


# Video processors that scale each frame on its own, and those that scale a video as a whole (smart_resize
# over frames x height x width), as transformers 5.23 writes them.
PER_FRAME = ("Qwen2VLVideoProcessor",)  # Qwen2-VL, Qwen2.5-VL
# Qwen3-VL, Qwen3.5; GLM-4.1V, GLM-4.5V; GLM-4.6V
WHOLE_VIDEO = ("Qwen3VLVideoProcessor", "Glm4vVideoProcessor", "Glm46VVideoProcessor")
# Qwen2-VL's video budget is 90% of `max_video_tokens` tokens' worth of pixels (qwen-vl-utils' total_pixels)
BUDGET_SHARE = 0.9


def cap_video_size(processor, caps: PixelCaps) -> None:
    """Hand the video pixel caps to the processor's video processor, or refuse them (`ConfigError`).

    - Qwen2-VL and Qwen2.5-VL (`Qwen2VLVideoProcessor`) scale each frame so that its pixel count lies in
      `[size.shortest_edge, size.longest_edge]`: data.video_min_pixels and data.video_max_pixels go there.
      Its whole-video budget is `cap_pixels_per_frame` with `max_video_tokens`: each frame gets at most
      2 * int(max_video_tokens * factor^2 * 0.9) / frames pixels (two frames make one temporal patch, as
      qwen-vl-utils counts its total_pixels) and never fewer than 1.05 * size.shortest_edge.
      data.video_total_pixels turns it on with the most whole tokens that keep frames x pixels within it.
    - Qwen3-VL, Qwen3.5 (`Qwen3VLVideoProcessor`) and the GLM-V families (`Glm4vVideoProcessor`,
      `Glm46VVideoProcessor`) scale a video as a whole so that frames x pixels lies in
      `[size.shortest_edge, size.longest_edge]`: data.video_total_pixels is size.longest_edge, and there
      is no minimum per frame. Qwen3-VL's ceiling per frame is `cap_pixels_per_frame` with
      `max_video_tokens` tokens a frame, floored at 1.05 * size.shortest_edge: data.video_max_pixels turns
      it on (in whole tokens); the GLM-V processors have none.
    - Any other video processor (or none) has no such caps: setting one is an error that says so.
    """
    if not caps:
        return
    video_processor = getattr(processor, "video_processor", None)
    if video_processor is None:
        raise ConfigError(
            f"data.video_*_pixels: the model's processor ({type(processor).__name__}) takes no videos; "
            "leave them unset"
        )
    name = type(video_processor).__name__
    if name not in PER_FRAME + WHOLE_VIDEO:
        raise ConfigError(
            f"data.video_*_pixels: the model's video processor ({name}) has no pixel caps raylora can "
            f"set (its size: {getattr(video_processor, 'size', None)}); leave them unset"
        )
    size = dict(video_processor.size)
    factor = video_processor.patch_size * video_processor.merge_size
    if name in PER_FRAME:
        size["shortest_edge"] = caps.min_pixels or size["shortest_edge"]
        size["longest_edge"] = caps.max_pixels or size["longest_edge"]
        if size["shortest_edge"] > size["longest_edge"]:
            raise ConfigError(
                f"data.video_min_pixels ({size['shortest_edge']}) exceeds the most pixels per frame "
                f"({size['longest_edge']}, data.video_max_pixels or the model folder's own)"
            )
        if caps.total_pixels is not None:
            # frames x pixels <= total: the budget per frame pair (one temporal patch) is half of it
            tokens = int(caps.total_pixels // 2 / (factor * factor * BUDGET_SHARE)) + 1
            while tokens and int(tokens * factor * factor * BUDGET_SHARE) > caps.total_pixels // 2:
                tokens -= 1  # the processor's own rounding decides: the most tokens within the cap
            _at_least_a_token("data.video_total_pixels", caps.total_pixels, factor, tokens)
            video_processor.cap_pixels_per_frame = True
            video_processor.max_video_tokens = tokens
    else:
        if caps.min_pixels is not None:
            raise ConfigError(
                f"data.video_min_pixels: {name} scales a video as a whole (frames x pixels) and has no "
                "minimum per frame; leave it unset"
            )
        if caps.total_pixels is not None:
            size["longest_edge"] = caps.total_pixels
            if size["shortest_edge"] > size["longest_edge"]:
                raise ConfigError(
                    f"data.video_total_pixels ({caps.total_pixels}) is below the model folder's fewest "
                    f"pixels per video ({size['shortest_edge']}, {name}'s size.shortest_edge)"
                )
        if caps.max_pixels is not None:
            if name != "Qwen3VLVideoProcessor":
                raise ConfigError(
                    f"data.video_max_pixels: {name} has no cap per frame, only per video; set "
                    "data.video_total_pixels instead"
                )
            tokens = caps.max_pixels // (factor * factor)
            _at_least_a_token("data.video_max_pixels", caps.max_pixels, factor, tokens)
            floor = int(size["shortest_edge"] * 1.05)
            if tokens * factor * factor < floor:
                raise ConfigError(
                    f"data.video_max_pixels ({caps.max_pixels}) is below the floor {name} keeps per frame "
                    f"({floor}: 1.05 x its size.shortest_edge, {size['shortest_edge']}), so it would not cap"
                )
            video_processor.cap_pixels_per_frame = True
            video_processor.max_video_tokens = tokens
    video_processor.size = SizeDict(**size)


def _at_least_a_token(key: str, pixels: int, factor: int, tokens: int) -> None:
    if tokens < 1:
        raise ConfigError(
            f"{key} ({pixels}) is too few pixels for one video token ({factor}x{factor} pixels of a frame)"
        )


def check_image_caps(model_path: str | Path, max_pixels: int | None, min_pixels: int | None) -> None:
    """Before Ray starts: refuse pixel caps the model's image processor cannot honour (its config only)."""
    if max_pixels is not None or min_pixels is not None:
        cap_image_size(transformers.AutoImageProcessor.from_pretrained(model_path), max_pixels, min_pixels)


def _fixed_size(image_processor) -> str:
    """'WxH' of the one size an image processor gives every image."""
    if getattr(image_processor, "do_center_crop", False) and getattr(image_processor, "crop_size", None):
        size = image_processor.crop_size
    elif getattr(image_processor, "max_image_size", None):  # Idefics3 without image splitting
        edge = image_processor.max_image_size["longest_edge"]
        return f"{edge}x{edge}"
    else:
        size = image_processor.size
    fixed = f"{size['width']}x{size['height']}"
    if getattr(image_processor, "crop_to_patches", False):  # InternVL: the tile count is its max_patches
        return f"{fixed} tiles (at most {image_processor.max_patches}: max_patches in the model folder)"
    return fixed


# Where a folder names its processor class, in the order transformers 5.23's AutoProcessor reads them
# (models/auto/processing_auto.py); config.json last, by its own `processor_class` or its model type.
PROCESSOR_CLASS_FILES = (
    "processor_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",  # read only where there is no preprocessor_config.json
    "tokenizer_config.json",
    "config.json",
)


def processor_class_name(model_path: str | Path) -> str | None:
    """The name of the processor class the model folder asks for, found as `AutoProcessor` finds it."""
    folder = Path(model_path)
    configs = {
        name: json.loads((folder / name).read_text())
        for name in PROCESSOR_CLASS_FILES
        if (folder / name).exists()
    }
    if "preprocessor_config.json" in configs:
        configs.pop("video_preprocessor_config.json", None)
    for config in configs.values():  # in PROCESSOR_CLASS_FILES order
        if config.get("processor_class"):
            return config["processor_class"]
    return PROCESSOR_MAPPING_NAMES.get(configs.get("config.json", {}).get("model_type"))


def _from_pretrained(model_path: str | Path, trust_remote_code: bool = False):
    """The folder's processor: `AutoProcessor.from_pretrained(model_path)`, but a processor with a video
    part in its image-only form where that part cannot load (`image_only`), and the classes transformers
    marks as needing torchvision loaded without it where it is missing (`TORCHVISION_FREE`). Reads only the
    config, tokenizer and processor files, so it serves the driver's checks on a folder without weights."""
    folder = Path(model_path)
    if _sentencepiece_only(folder) and importlib.util.find_spec("sentencepiece") is None:
        # transformers would fall through to its tiktoken reader and ask for tiktoken instead
        raise ConfigError(
            f"{folder / 'tokenizer.model'}: the folder's only tokenizer is this SentencePiece model, and "
            "reading it needs the sentencepiece package: pip install sentencepiece"
        )
    name = processor_class_name(folder)
    if trust_remote_code and _remote_processor(folder):
        from raylora import remote_compat  # Phi-3-vision's processor, bridged for transformers 5

        remote_compat.bridge_processor(folder, _remote_processor(folder))
        processor = transformers.AutoProcessor.from_pretrained(
            model_path, trust_remote_code=trust_remote_code
        )
    elif name is not None and image_only(folder, name, is_torchvision_available()):
        processor = image_only_processor_class(processor_class_from_name(name)).from_pretrained(model_path)
    elif name in TORCHVISION_FREE and not is_torchvision_available():
        processor = TORCHVISION_FREE[name]().from_pretrained(model_path)
    else:
        processor = transformers.AutoProcessor.from_pretrained(model_path)
    _complete_from_tokenizer_files(processor, folder)
    return processor


def _remote_processor(folder: Path) -> dict[str, str]:
    """The `auto_map` by which the folder's processor files name classes of its own code (Phi-3-vision's);
    {} where they name none."""
    for name in PROCESSOR_CLASS_FILES[:3]:
        if (folder / name).exists() and "auto_map" in json.loads((folder / name).read_text()):
            return json.loads((folder / name).read_text())["auto_map"]
    return {}


def _sentencepiece_only(folder: Path) -> bool:
    return (folder / "tokenizer.model").exists() and not (folder / "tokenizer.json").exists()


def image_only(folder: Path, name: str, torchvision: bool) -> bool:
    """Whether the folder's processor class `name` is loaded without its video processor (raylora trains
    on images only): where torchvision, which transformers' video processors need, is missing, and also
    where it is installed but the folder holds no video processor settings. A Hub folder holds them
    (Qwen2-VL's `preprocessor_config.json`, which transformers reads for the video processor too); one
    saved from an image-only processor (raylora's tiny models, built where torchvision may be missing)
    keeps only the image processor in `processor_config.json`, and `AutoProcessor` fails on it when
    torchvision is installed ("Can't load video processor")."""
    if name in TORCHVISION_FREE or not _has_video_part(processor_class_from_name(name)):
        return False
    if not torchvision:
        return True
    if (folder / VIDEO_PROCESSOR_NAME).exists() or (folder / IMAGE_PROCESSOR_NAME).exists():
        return False
    nested = folder / PROCESSOR_NAME
    return not (nested.exists() and "video_processor" in json.loads(nested.read_text()))


def _has_video_part(cls) -> bool:
    # a class whose module needs a missing package comes back as a placeholder, not a ProcessorMixin
    return (
        isinstance(cls, type)
        and issubclass(cls, transformers.ProcessorMixin)
        and "video_processor" in cls.get_attributes()
    )


def _complete_from_tokenizer_files(processor, folder: Path) -> None:
    """Two things transformers 5.23's processors miss in Hub folders, taken from the tokenizer's files.

    - A chat template kept only in `tokenizer_config.json` (no chat_template.json / .jinja) reaches the
      tokenizer but not the processor, whose `apply_chat_template` then refuses to run.
    - A folder whose tokenizer is only a SentencePiece `tokenizer.model` (llava-1.5 style, no
      tokenizer.json) is converted by the generic `TokenizersBackend` for llava models (transformers lists
      llava's Hub tokenizer class as unreliable), and that conversion drops SentencePiece's dummy prefix:
      'hello' becomes ['he', 'llo'] where SentencePiece and the Hub's tokenizer.json give ['▁hello']. The
      class that `tokenizer_config.json` names (LlamaTokenizer) converts it as SentencePiece tokenises.
    """
    tokenizer = processor.tokenizer
    if processor.chat_template is None and tokenizer.chat_template is not None:
        processor.chat_template = tokenizer.chat_template
    if not _sentencepiece_only(folder):
        return
    config_file = folder / "tokenizer_config.json"
    named = json.loads(config_file.read_text()).get("tokenizer_class") if config_file.exists() else None
    cls = tokenizer_class_from_name(named) if named else None
    if cls is not None and not isinstance(tokenizer, cls):
        processor.tokenizer = cls.from_pretrained(folder)
