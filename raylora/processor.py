"""Loading a model folder's processor: image size caps (`cap_image_size`: data.max_pixels,
data.min_pixels), and an image-only fallback for machines without torchvision.

In transformers 5 the Qwen2-VL family's processors require a video processor, and video processors
require torchvision. raylora trains on images only, so where torchvision is missing (CPU machines with
the CPU torch wheel, where PyPI's torchvision does not import) it builds the same processor class
without its video part. Pixtral's processor (Mistral3) needs torchvision only for one import, which
`pixtral_processor_class` answers from transformers' PIL image processor. The folder on disk stays a
standard one that `AutoProcessor` loads elsewhere.
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

from raylora.config import ConfigError


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


def load_processor(model_path: str | Path, max_pixels: int | None = None, min_pixels: int | None = None):
    """The model folder's processor, with images capped at `max_pixels` / `min_pixels` (data.max_pixels,
    data.min_pixels) where the architecture's image processor has a resolution knob (`cap_image_size`)."""
    processor = _from_pretrained(model_path)
    cap_image_size(processor.image_processor, max_pixels, min_pixels)
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


def _from_pretrained(model_path: str | Path):
    """`AutoProcessor.from_pretrained(model_path)`; where torchvision is missing, the same class loaded
    without it (`TORCHVISION_FREE`) or in its image-only form (processors with a video part)."""
    try:
        return transformers.AutoProcessor.from_pretrained(model_path)
    except (AttributeError, ImportError, OSError, ValueError, TypeError) as err:
        config_file = Path(model_path) / "processor_config.json"
        if not config_file.exists():
            raise
        class_name = json.loads(config_file.read_text()).get("processor_class", "")
        if class_name in TORCHVISION_FREE:
            return TORCHVISION_FREE[class_name]().from_pretrained(model_path)
        cls = getattr(transformers, class_name, None)
        if cls is None or "video_processor" not in cls.get_attributes():
            raise
        try:
            return image_only_processor_class(cls).from_pretrained(model_path)
        except Exception:
            raise err from None
