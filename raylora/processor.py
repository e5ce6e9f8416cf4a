"""Loading a model folder's processor, with an image-only fallback for machines without torchvision.

In transformers 5 the Qwen2-VL family's processors require a video processor, and video processors
require torchvision. raylora trains on images only, so where torchvision is missing (CPU machines with
the CPU torch wheel, where PyPI's torchvision does not import) it builds the same processor class
without its video part. The folder on disk stays a standard one that `AutoProcessor` loads elsewhere.
"""

from __future__ import annotations

import functools
import json
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


def load_processor(model_path: str | Path):
    """`AutoProcessor.from_pretrained(model_path)`, or its image-only form where video needs torchvision."""
    try:
        return transformers.AutoProcessor.from_pretrained(model_path)
    except (AttributeError, ImportError, OSError, ValueError, TypeError) as err:
        config_file = Path(model_path) / "processor_config.json"
        if not config_file.exists():
            raise
        class_name = json.loads(config_file.read_text()).get("processor_class", "")
        cls = getattr(transformers, class_name, None)
        if cls is None or "video_processor" not in cls.get_attributes():
            raise
        try:
            return image_only_processor_class(cls).from_pretrained(model_path)
        except Exception:
            raise err from None
