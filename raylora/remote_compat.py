"""Model code written for transformers 4 (Phi-3-vision's and Phi-3.5-vision's, `model.trust_remote_code`),
run under the transformers 5 raylora pins, by patching the classes once they are loaded.

The folder's files stay as the user has them. Its modules are imported by transformers' remote-code
loader (`get_class_from_dynamic_module`, one module object per file, kept in `sys.modules`), and the
bridges here replace names in those module objects and wrap methods of their classes, before the auto
class builds the model from them. What they bridge:

- `DynamicCache`: transformers 5 dropped `from_legacy_cache`, `to_legacy_cache`, `get_usable_length`,
  `seen_tokens` and item access, which the attention forwards, `Phi3VModel.forward` and
  `prepare_inputs_for_generation` call, and `get_max_length()` now says -1 (or the sliding window) where it
  said None: read as a length, -1 would crop the attention mask to its last column in generation.
  `LegacyDynamicCache` has them; the module's `DynamicCache` name is pointed at it, and a cache that
  `generate` made is adopted as one (same object, class swapped: the subclass adds methods only).
- `_tied_weights_keys`: a list in the file, a dict {target: source} in transformers 5, whose
  `save_pretrained` calls `.keys()` on it.
- attention: the classes set transformers 4's `_supports_flash_attn_2` (5 reads `_supports_flash_attn`)
  and `_supports_sdpa = False`, while raylora defaults to sdpa and the folder's config.json asks for
  flash_attention_2; `attn_implementation` picks one the classes take, and says which.
- `logits_to_keep`: raylora's loss passes it (as every transformers 5 model takes it); the file's forward
  predates it. The forward also gets a copy of `input_ids`, which the file's image embedding edits in place.
- the processor: transformers 5's `ProcessorMixin` reads `chat_template` from the instance, which
  `Phi3VProcessor.__init__` (not calling the mixin's) never sets; its `__call__` takes one text as a
  string, where raylora passes a list of one and `add_special_tokens`.

Each bridge first checks that the symbol it patches is there and still reads as expected (a marker from
its source, a signature): a revision that changed it is refused with a `ConfigError` naming the file and
the symbol, not patched blindly.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from transformers.cache_utils import DynamicCache

from raylora.config import ConfigError

log = logging.getLogger("raylora")

# The class references of the folders bridged here, as their `auto_map` names them.
PHI3_V_MODEL = "modeling_phi3_v.Phi3VForCausalLM"
PHI3_V_PROCESSOR = "processing_phi3_v.Phi3VProcessor"
# How Phi-3-vision's template and processor expect image N of a conversation in the text: its processor
# splits the text there (`re.split(r"<\|image_\d+\|>", text)`) and puts the image's tokens in its place.
PHI3_V_IMAGE_TAG = "<|image_{}|>"
BRIDGED = "_raylora_bridged"  # set on a module once patched: a re-executed module (changed file) has none


class LegacyDynamicCache(DynamicCache):
    """transformers 5's `DynamicCache` with the transformers 4 API the remote code calls."""

    @classmethod
    def from_legacy_cache(cls, past_key_values=None) -> LegacyDynamicCache:
        """A cache holding `past_key_values` ((key, value) per layer), or an empty one."""
        return cls(past_key_values) if past_key_values is not None else cls()

    def to_legacy_cache(self) -> tuple:
        """(key, value) per layer, as transformers 4 returned a cache to callers that passed tuples."""
        return tuple((layer.keys, layer.values) for layer in self.layers)

    def get_max_length(self, layer_idx: int | None = None) -> int | None:
        """transformers 4's meaning: None where the cache has no maximum (transformers 5 says -1)."""
        if not self.layers:
            return None
        length = super().get_max_length(layer_idx)
        return None if length < 0 else length

    def get_usable_length(self, new_seq_length: int, layer_idx: int = 0) -> int:
        """Cached tokens the next `new_seq_length` tokens attend to (transformers 4's rule)."""
        previous = self.get_seq_length(layer_idx)
        most = self.get_max_length(layer_idx)
        return most - new_seq_length if most is not None and previous + new_seq_length > most else previous

    @property
    def seen_tokens(self) -> int:
        """Tokens the cache has taken in (transformers 4 counted them apart; here they are its length)."""
        return self.get_seq_length()

    def __getitem__(self, layer_idx: int) -> tuple:
        layer = self.layers[layer_idx]
        return layer.keys, layer.values


def _adopt(cache) -> None:
    """A `DynamicCache` made by transformers (`generate` makes one) becomes a `LegacyDynamicCache`."""
    if type(cache) is DynamicCache:
        cache.__class__ = LegacyDynamicCache


@dataclass(frozen=True)
class Patch:
    """One change to a loaded module: `symbol` ("Class.method" or a module-level name) in `file` must
    hold `marker` in its source (and take `params`) for `apply` to be what the code needs."""

    file: str
    symbol: str
    marker: str
    apply: Callable[[ModuleType], None]
    params: tuple[str, ...] = ()


def _lookup(module: ModuleType, symbol: str):
    obj = module
    for part in symbol.split("."):
        obj = getattr(obj, part, None) if obj is not None else None
    return obj


def _refuse(patch: Patch, why: str) -> ConfigError:
    return ConfigError(
        f"model.trust_remote_code: {patch.file}: {patch.symbol} {why}; raylora bridges this model's code "
        f"for transformers 5 as Microsoft's Phi-3-vision / Phi-3.5-vision revisions write it, and this "
        f"revision differs there (pin model.revision to one of those, or report the new revision)"
    )


def _check(module: ModuleType, patch: Patch) -> None:
    obj = _lookup(module, patch.symbol)
    if obj is None:
        raise _refuse(patch, "is missing")
    if patch.params:
        missing = [p for p in patch.params if p not in inspect.signature(obj).parameters]
        if missing:
            raise _refuse(patch, f"no longer takes {', '.join(missing)}")
    if patch.marker:
        # a name the module imports (DynamicCache) is checked in the module's own source
        own = getattr(obj, "__module__", None) == module.__name__
        try:
            source = inspect.getsource(obj if own else module)
        except (OSError, TypeError) as err:
            raise _refuse(patch, f"has no readable source ({err})") from err
        if patch.marker not in source:
            raise _refuse(patch, f"no longer contains {patch.marker!r}")


def _wrap(cls: type, name: str, before: Callable[[tuple, dict], None]) -> None:
    """Replace `cls.name` by a function that runs `before(args, kwargs)` (free to edit kwargs) first."""
    original = cls.__dict__[name]

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        before(args, kwargs)
        return original(*args, **kwargs)

    setattr(cls, name, wrapped)


def _adopt_cache_arg(name: str, position: int) -> Callable[[tuple, dict], None]:
    def before(args: tuple, kwargs: dict) -> None:
        _adopt(kwargs.get(name) if name in kwargs else (args[position] if len(args) > position else None))

    return before


def _point_dynamic_cache(module: ModuleType) -> None:
    module.DynamicCache = LegacyDynamicCache


def _tied_weights_as_dict(module: ModuleType) -> None:
    cls = module.Phi3VForCausalLM
    # {target: source}; transformers 5 ties only where config.tie_word_embeddings (False in these models).
    # The image embedding keeps the text embedding as its `wte` (one tensor under two names), which
    # transformers 5 saves only when declared here, as the Hub's files do: once, as model.embed_tokens.
    tied = {key: "model.embed_tokens.weight" for key in cls._tied_weights_keys}
    cls._tied_weights_keys = {**tied, "model.vision_embed_tokens.wte.weight": "model.embed_tokens.weight"}


def _flash_attention_flag(module: ModuleType) -> None:
    cls = module.Phi3VPreTrainedModel
    cls._supports_flash_attn = bool(cls._supports_flash_attn_2)


def _accept_logits_to_keep(module: ModuleType) -> None:
    cls = module.Phi3VForCausalLM
    original = cls.__dict__["forward"]

    @functools.wraps(original)
    def forward(self, *args, logits_to_keep: int = 0, **kwargs):
        # the image embedding clears the image ids in the tensor it is given (`clamp_min_`): a batch run
        # twice (the stand-in pass a rank repeats to keep in step) would skip the vision tower the second
        # time, on this rank only, and leave the others waiting in ZeRO-3's collectives
        if args:
            args = (args[0].clone() if args[0] is not None else None, *args[1:])
        elif kwargs.get("input_ids") is not None:
            kwargs["input_ids"] = kwargs["input_ids"].clone()
        out = original(self, *args, **kwargs)
        # 0 keeps every position (raylora's loss then selects them with a hook on lm_head)
        if logits_to_keep and out.logits is not None:
            out.logits = out.logits[:, -logits_to_keep:]
        return out

    forward.__signature__ = inspect.signature(original).replace(
        parameters=[
            *inspect.signature(original).parameters.values(),
            inspect.Parameter("logits_to_keep", inspect.Parameter.KEYWORD_ONLY, default=0),
        ]
    )
    cls.forward = forward


def _adopt_in_model_forward(module: ModuleType) -> None:
    _wrap(module.Phi3VModel, "forward", _adopt_cache_arg("past_key_values", 4))


def _adopt_in_generation(module: ModuleType) -> None:
    adopt = _adopt_cache_arg("past_key_values", 2)

    def before(args: tuple, kwargs: dict) -> None:
        adopt(args, kwargs)
        # transformers 5's generate passes position ids of the whole sequence at every step; the file
        # uses any it is given as they are, and makes its own (the new tokens' only) when given none,
        # as transformers 4's generate left it to
        kwargs.pop("position_ids", None)

    _wrap(module.Phi3VForCausalLM, "prepare_inputs_for_generation", before)


def _no_apply(module: ModuleType) -> None:
    """A check only: the symbol gets the bridged cache through a patch elsewhere."""


MODEL_FILE = "modeling_phi3_v.py"
PHI3_V_MODEL_PATCHES = (
    Patch(
        MODEL_FILE, "DynamicCache", "DynamicCache.from_legacy_cache(past_key_values)", _point_dynamic_cache
    ),
    Patch(
        MODEL_FILE,
        "Phi3VModel.forward",
        "past_key_values.get_usable_length(seq_length)",
        _adopt_in_model_forward,
        ("input_ids", "attention_mask", "position_ids", "past_key_values", "pixel_values", "image_sizes"),
    ),
    Patch(MODEL_FILE, "Phi3VModel.forward", "next_decoder_cache.to_legacy_cache()", _no_apply),
    Patch(
        MODEL_FILE,
        "Phi3Attention.forward",
        "past_key_value.get_usable_length(kv_seq_len, self.layer_idx)",
        _no_apply,
        ("past_key_value",),
    ),
    Patch(
        MODEL_FILE,
        "Phi3VForCausalLM.prepare_inputs_for_generation",
        'position_ids = kwargs.get("position_ids", None)',
        _adopt_in_generation,
        ("input_ids", "past_key_values"),
    ),
    Patch(
        MODEL_FILE,
        "Phi3VForCausalLM.prepare_inputs_for_generation",
        "past_key_values.get_max_length()",
        _no_apply,
    ),
    Patch(
        MODEL_FILE, "Phi3VForCausalLM.prepare_inputs_for_generation", "past_key_values.seen_tokens", _no_apply
    ),
    Patch(MODEL_FILE, "Phi3VForCausalLM", '_tied_weights_keys = ["lm_head.weight"]', _tied_weights_as_dict),
    Patch(MODEL_FILE, "Phi3VPreTrainedModel", "_supports_flash_attn_2 = True", _flash_attention_flag),
    Patch(MODEL_FILE, "Phi3VPreTrainedModel", "_supports_sdpa = False", _no_apply),
    Patch(
        MODEL_FILE,
        "Phi3VForCausalLM.forward",
        "logits = self.lm_head(hidden_states)",
        _accept_logits_to_keep,
        ("input_ids", "pixel_values", "image_sizes", "labels"),
    ),
)


def _chat_template_attribute(module: ModuleType) -> None:
    # None: raylora.data.processor then takes the tokenizer's template, where these folders keep it
    module.Phi3VProcessor.chat_template = None
    module.Phi3VProcessor.numbered_image_tag = PHI3_V_IMAGE_TAG  # raylora.data.labels renders with it


def _one_text(module: ModuleType) -> None:
    cls = module.Phi3VProcessor
    original = cls.__dict__["__call__"]

    @functools.wraps(original)
    def call(self, text=None, images=None, add_special_tokens: bool = True, **kwargs):
        # it splits one string at its image tags (a batch of texts only without images)
        if isinstance(text, (list, tuple)) and len(text) == 1:
            text = text[0]
        # it tokenises each piece between image tags with the tokenizer's defaults (a BOS in front of
        # each); raylora asks for special tokens only where the template wrote none (never, here)
        return original(self, text, images, **kwargs)

    cls.__call__ = call


PROCESSOR_FILE = "processing_phi3_v.py"
PHI3_V_PROCESSOR_PATCHES = (
    Patch(PROCESSOR_FILE, "Phi3VProcessor.__init__", "self.tokenizer = tokenizer", _chat_template_attribute),
    Patch(
        PROCESSOR_FILE,
        "Phi3VProcessor._convert_images_texts_to_inputs",
        "re.split(pattern, texts)",
        _one_text,
        ("images", "texts"),
    ),
    Patch(PROCESSOR_FILE, "Phi3VProcessor.__call__", "", _no_apply, ("text", "images", "return_tensors")),
)

PATCHES = {PHI3_V_MODEL: PHI3_V_MODEL_PATCHES, PHI3_V_PROCESSOR: PHI3_V_PROCESSOR_PATCHES}


def bridged(class_ref: str | None) -> bool:
    """Whether raylora bridges the remote class `class_ref` (an `auto_map` value)."""
    return class_ref in PATCHES


def bridge(class_ref: str, folder: str | Path) -> type:
    """The folder's class `class_ref` (an `auto_map` value), its module patched for transformers 5 where
    raylora knows the code (`PATCHES`); other remote code is returned as it is.

    Checks every patch before applying any, so a refused revision leaves its module untouched. Once per
    module object: transformers re-executes a module (new classes, no patches) when its file changed."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    cls = get_class_from_dynamic_module(class_ref, str(folder))
    patches = PATCHES.get(class_ref)
    module = sys.modules[cls.__module__]
    if not patches or getattr(module, BRIDGED, False):
        return cls
    for patch in patches:
        where = module if patch.file.removesuffix(".py") == cls.__module__.rsplit(".", 1)[-1] else None
        if where is None:
            raise _refuse(patch, f"is not where the folder's auto_map ({class_ref}) puts its code")
        _check(where, patch)
    for patch in patches:
        patch.apply(module)
    setattr(module, BRIDGED, True)
    log.info(
        "bridged %s for transformers 5 (%s)", class_ref, ", ".join(dict.fromkeys(p.symbol for p in patches))
    )
    return cls


def choose_attn_implementation(cls: type, requested: str | None) -> str:
    """An attention implementation the remote model class `cls` takes: `requested` (model.attn_implementation)
    where it does, else eager (the file's own attention, which every version of it has). Logged."""
    takes = {"eager"}
    if getattr(cls, "_supports_sdpa", False):
        takes.add("sdpa")
    if (getattr(cls, "_supports_flash_attn", False) or getattr(cls, "_supports_flash_attn_2", False)) and (
        importlib.util.find_spec("flash_attn") is not None
    ):
        takes.add("flash_attention_2")
    chosen = requested if requested in takes else "eager"
    if chosen != requested:
        log.warning(
            "%s (the model's own code) does not take attn_implementation=%s here: using %s",
            cls.__name__,
            requested,
            chosen,
        )
    else:
        log.info("%s runs with attn_implementation=%s", cls.__name__, chosen)
    return chosen


class BridgedAutoModel:
    """An auto class (`AutoModelForCausalLM`) for a folder whose modeling code raylora bridges: its
    `from_pretrained` and `from_config` patch the folder's classes (`bridge`) and ask for an attention
    implementation they take (`choose_attn_implementation`), then build the folder's class as the auto
    class builds a remote one (registered for the auto class, so that `save_pretrained` writes the code
    beside the weights, and with `GenerationMixin`). Not through the auto class itself: once it has loaded
    a remote class it maps the config class to it and, from the second load on, returns the class without
    `GenerationMixin` (an evaluation's gathered copy could not `generate`)."""

    def __init__(self, auto_class: type, class_ref: str) -> None:
        self.auto_class, self.class_ref = auto_class, class_ref

    def _model_class(self, folder: str | Path) -> type:
        cls = bridge(self.class_ref, folder)
        cls.register_for_auto_class(self.auto_class.__name__)
        return _with_generation(cls)

    def from_pretrained(self, path, *args, attn_implementation: str | None = None, **kwargs):
        """`AutoModelForCausalLM.from_pretrained(path, ...)` on the bridged class."""
        kwargs.pop("trust_remote_code", None)  # asked for already: raylora.arch.detect refuses it otherwise
        cls = self._model_class(path)
        chosen = choose_attn_implementation(cls, attn_implementation or "sdpa")
        return cls.from_pretrained(path, *args, attn_implementation=chosen, **kwargs)

    def from_config(self, config, attn_implementation: str | None = None, **kwargs):
        """`AutoModelForCausalLM.from_config(config, ...)` on the bridged class (`config.name_or_path` is
        the folder whose code it runs)."""
        kwargs.pop("trust_remote_code", None)
        cls = self._model_class(config.name_or_path)
        chosen = choose_attn_implementation(cls, attn_implementation or "sdpa")
        return cls._from_config(config, attn_implementation=chosen, **kwargs)


@functools.cache
def _with_generation(cls: type) -> type:
    """`cls` with `GenerationMixin`, as transformers' auto classes give remote classes; one per class."""
    from transformers.models.auto.auto_factory import add_generation_mixin_to_remote_model

    return add_generation_mixin_to_remote_model(cls)


def bridge_processor(folder: str | Path, auto_map: dict[str, str]) -> None:
    """Patch the folder's own processor class before `AutoProcessor` loads it, where raylora bridges it."""
    class_ref = auto_map.get("AutoProcessor")
    if bridged(class_ref):
        bridge(class_ref, folder)
