"""Loading a model folder's processor, with an image-only fallback for machines without torchvision.

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
import sys
from pathlib import Path

import transformers


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


def load_processor(model_path: str | Path):
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
