"""What a config is checked for when it loads (`raylora.config.from_dict` and `load` call these): its types,
as pydantic finds them and raylora words them, and its values, in range and consistent with each other.

Nothing here needs a model or Ray. This module imports nothing from `raylora.config` when it runs (`Config` is
named for the type checker only; the type checks take the dataclass to walk as an argument), so that
`raylora.config` imports it and no import goes the other way.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from typing import TYPE_CHECKING, Any

import pydantic
import yaml

from raylora.errors import ConfigError

if TYPE_CHECKING:
    from raylora.config import Config


def yaml_quirks(cls: type, data: Any, prefix: str) -> Any:
    """What the command line leaves to be read as a list before pydantic checks the types:
    `key=a,b` and `key=3`."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    out = dict(data)
    for name, value in data.items():
        tp = hints.get(name)
        if tp is None or value is None:
            continue
        if dataclasses.is_dataclass(tp):
            out[name] = yaml_quirks(tp, value, f"{prefix}{name}.")
            continue
        args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
        takes_list = any(typing.get_origin(a) is list for a in args)
        scalars = tuple(a for a in args if a in (bool, int, float, str))
        if isinstance(value, bool) and bool not in args and not takes_list:
            # pydantic's lax mode would read `true` as 1 for an int
            raise ConfigError(f"{prefix}{name}: expected {type_name(tp)}, got bool {value!r}")
        if takes_list and isinstance(value, str) and str not in args:
            out[name] = [yaml.safe_load(v) for v in value.split(",") if v]
        elif takes_list and not isinstance(value, list) and not isinstance(value, scalars):
            out[name] = [value]
    return out


def type_name(tp: Any) -> str:
    """A type as the errors and the config reference say it (`one of a, b`, `int or null`)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is typing.Literal:
        return "one of " + ", ".join(str(choice) for choice in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list[{type_name(typing.get_args(tp)[0])}]"
    return str(tp).replace("<class '", "").replace("'>", "").replace("typing.", "")


def type_error(err: pydantic.ValidationError, root: type) -> ConfigError:
    """pydantic's first error checking the dataclass `root` as raylora says it: the dotted key, what it
    expects, what it got."""
    first = err.errors()[0]
    cls, keys, tp = root, [], None
    for part in first["loc"]:
        hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
        if isinstance(part, str) and part in hints:
            keys.append(part)
            tp = cls = hints[part]
        elif isinstance(part, int) and keys:
            keys[-1] += f"[{part}]"
            options = (
                typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
            )
            tp = next((typing.get_args(a)[0] for a in options if typing.get_origin(a) is list), None)
        elif first["type"] == "unexpected_keyword_argument" or first["type"] == "extra_forbidden":
            keys.append(str(part))
            break
        else:
            break  # the branch of a union pydantic tried
    key = ".".join(keys) or "config"
    if first["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
        known = sorted(typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else [])
        return ConfigError(f"unknown config key {key} (known: {', '.join(known)})")
    expected = type_name(tp) if tp is not None else first["msg"]
    value = first.get("input")
    return ConfigError(f"{key}: expected {expected}, got {type(value).__name__} {value!r}")


REFUSED_QUANTIZATION = {
    "int8": "bitsandbytes keeps 8-bit weights as int8 tensors (with their scales beside them), and "
    "DeepSpeed casts the parameters it partitions to the run's dtype, which destroys them (4-bit weights "
    "are stored in the run's dtype instead: bnb_4bit_quant_storage)",
}
"""model.quantization values refused, with the reason."""


def refuse_quantization(data: dict[str, Any]) -> None:
    """A refused model.quantization, with the reason, before pydantic, which would only list the choices."""
    model = data.get("model") if isinstance(data, dict) else None
    quantization = model.get("quantization") if isinstance(model, dict) else None  # else pydantic names it
    if isinstance(quantization, str) and quantization.lower() in REFUSED_QUANTIZATION:
        raise ConfigError(
            f"model.quantization={quantization} cannot be used under ZeRO-3: "
            f"{REFUSED_QUANTIZATION[quantization.lower()]}; accepted: nf4, fp4"
        )


LORA_INITS = (True, False, "gaussian", "orthogonal", "pissa", "olora")
"""`lora.init` values that work under ZeRO-3 with raylora (PEFT's init_lora_weights). PiSSA and OLoRA move
part of each adapted base weight into the adapter (W - scale * B0 A0) on every worker at every start;
PEFT redoes the same exact SVD / QR when it loads the adapter, so export and eval see that base too."""

# Why each other PEFT `init_lora_weights` value is refused.
REFUSED_LORA_INITS = {
    "pissa_niter_<n>": (
        "draws a random sketch for its fast SVD and moves the result out of the base weights; PEFT draws "
        "another when it loads the adapter, so export and eval would rebuild another base than the one "
        "the adapter was trained against (lora.init=pissa, the exact SVD, is accepted)"
    ),
    "corda": (
        "needs PEFT's preprocess_corda data pass before wrapping, which raylora does not run; and it moves "
        "part of each base weight into the adapter in a way that loading the adapter cannot redo without "
        "that data, so export, eval and resume would put the adapter on a base it was not trained against"
    ),
    "lora_ga": (
        "needs PEFT's preprocess_loraga gradient pass before wrapping, which raylora does not run (without "
        "it PEFT silently falls back to the default init)"
    ),
    "eva": (
        "needs PEFT's initialize_lora_eva_weights data pass over the wrapped model, which raylora does not "
        "run (without it PEFT leaves a plain init under another name)"
    ),
    "loftq": (
        "is made for a base model loaded quantised (bitsandbytes 4-bit, with loftq_config), which raylora "
        "does not do under ZeRO-3; on a full-precision base it only replaces the base weights by their "
        "quantised values"
    ),
    "mica": (
        "freezes lora_B at the base weight's singular vectors, but raylora trains and checkpoints every "
        "adapter tensor, so it would train lora_B too"
    ),
}


def validate(cfg: Config) -> None:
    """Checks that need no model and no Ray: values in range and consistent with each other."""
    t, s = cfg.train, cfg.scaling
    positive = {
        "lora.r": cfg.lora.r,
        "train.max_steps": t.max_steps,
        "train.global_batch_size": t.global_batch_size,
        "train.micro_batch_size": t.micro_batch_size,
        "train.checkpoint_every": t.checkpoint_every,
        "run.num_to_keep": cfg.run.num_to_keep,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key} must be positive, got {value}")
    if not 0.0 <= cfg.lora.dropout < 1.0:
        raise ConfigError(f"lora.dropout must be in [0, 1), got {cfg.lora.dropout}")
    parts = cfg.lora.parts
    if not parts or len(set(parts)) != len(parts):
        raise ConfigError(
            f"lora.parts must name distinct parts (language_model, vision_tower, aligner), got {parts}"
        )
    for part, key in (("vision_tower", "freeze_vision"), ("aligner", "freeze_aligner")):
        if part in parts and not getattr(cfg.train, key):
            raise ConfigError(
                f"lora.parts has {part} and train.{key}=false trains it fully: choose one (LoRA on its "
                f"linear layers, or the whole {part.replace('_', ' ')} trained)"
            )
    init = cfg.lora.init
    if init not in LORA_INITS:
        family = "pissa_niter_<n>" if str(init).startswith("pissa_niter_") else init
        why = REFUSED_LORA_INITS.get(family) if isinstance(init, str) else None
        accepted = ", ".join(str(v).lower() for v in LORA_INITS)
        raise ConfigError(
            f"lora.init={init} cannot be used under ZeRO-3 with raylora: it {why}; accepted: {accepted}"
            if why
            else f"lora.init: unknown initialisation {init!r}; accepted: {accepted}"
        )
    if init == "orthogonal" and cfg.lora.r % 2:
        raise ConfigError(f"lora.init=orthogonal needs an even lora.r, got {cfg.lora.r}")
    saved = cfg.lora.modules_to_save
    if saved is not None and (not saved or not all(saved) or len(set(saved)) != len(saved)):
        raise ConfigError(f"lora.modules_to_save must be distinct non-empty module names, got {saved}")
    if t.lr <= 0 or (t.vision_lr is not None and t.vision_lr <= 0):
        raise ConfigError(f"train.lr and train.vision_lr must be positive, got {t.lr} and {t.vision_lr}")
    local = cfg.run.local_dir
    if local is not None and (not os.path.isabs(local) or "://" in local):
        raise ConfigError(f"run.local_dir must be an absolute local path on every node, got {local!r}")
    if cfg.run.report_every_s < 0:
        raise ConfigError(f"run.report_every_s must not be negative, got {cfg.run.report_every_s}")
    if t.warmup_steps < 0 or cfg.run.max_failures < 0:
        raise ConfigError("train.warmup_steps and run.max_failures must not be negative")
    if cfg.run.max_preemptions < -1:
        raise ConfigError(f"run.max_preemptions must be -1 (no limit) or more, got {cfg.run.max_preemptions}")
    n = s.num_workers
    if isinstance(n, list) and (len(n) != 2 or not 0 < n[0] <= n[1]):
        raise ConfigError(
            f"scaling.num_workers must be a count or a [min, max] pair with 0 < min <= max, got {n}"
        )
    if isinstance(n, int) and n <= 0:
        raise ConfigError(f"scaling.num_workers must be positive, got {n}")
    # Any split works (shares differ by at most one sample), as long as every rank has a sample.
    if t.global_batch_size < cfg.world_size:
        raise ConfigError(
            f"train.global_batch_size ({t.global_batch_size}) is smaller than scaling.num_workers "
            f"({cfg.world_size}, the most workers the run may have): every worker needs a sample per step"
        )
    if t.eval_every is not None and (t.eval_every <= 0 or not cfg.data.eval):
        raise ConfigError("train.eval_every must be positive and needs data.eval")
    drill = cfg.fault
    if drill.read_errors < 0 or (drill.read_errors and not 0 <= drill.read_error_rank < cfg.world_sizes[0]):
        raise ConfigError(
            f"fault.read_errors ({drill.read_errors}) must not be negative, and fault.read_error_rank "
            f"({drill.read_error_rank}) must be a rank of {cfg.world_sizes[0]} workers"
        )
    if cfg.data.workers < 0:
        raise ConfigError(f"data.workers must be 0 (inline) or more, got {cfg.data.workers}")
    if not 0.0 <= cfg.data.max_bad_fraction <= 1.0:
        raise ConfigError(f"data.max_bad_fraction must be in [0, 1], got {cfg.data.max_bad_fraction}")
    _validate_memory(cfg)
    parts = (cfg.model.language_model, cfg.model.vision_tower, cfg.model.aligner)
    if any(parts) and not all(parts):
        raise ConfigError(
            "model.language_model, model.vision_tower and model.aligner are set together (parameter-name "
            "prefixes of an architecture raylora has no entry for), or none of them"
        )
    if not cfg.model.path:
        raise ConfigError("model.path is required: a local Hugging Face model folder or a Hub id (org/name)")
    if cfg.model.revision is not None and not cfg.model.revision.strip():
        raise ConfigError("model.revision must be a commit hash, branch or tag when set, got an empty string")
    if not cfg.data.train:
        raise ConfigError("data.train is required: a data file or folder (docs/data.md)")
    if not cfg.run.name or "/" in cfg.run.name:
        raise ConfigError(f"run.name must be a non-empty name without '/', got {cfg.run.name!r}")


def _validate_memory(cfg: Config) -> None:
    """The memory controls: attention kernel, sample length and image resolution caps."""
    d = cfg.data
    if cfg.model.attn_implementation == "flash_attention_2" and not (cfg.scaling.use_gpu and cfg.bf16):
        raise ConfigError("model.attn_implementation=flash_attention_2 needs scaling.use_gpu and bf16")
    t = cfg.train
    if t.packing and t.max_tokens_per_micro_batch is None:
        raise ConfigError("train.packing needs train.max_tokens_per_micro_batch (tokens per packed pass)")
    if t.max_tokens_per_micro_batch is not None and t.max_tokens_per_micro_batch <= 0:
        raise ConfigError(
            f"train.max_tokens_per_micro_batch must be positive when set, got {t.max_tokens_per_micro_batch}"
        )
    if t.packing and t.sort_by_length:
        raise ConfigError("train.sort_by_length is for padded micro batches; train.packing has no padding")
    budget = t.max_tokens_per_micro_batch
    if budget is not None and d.max_length is not None and d.max_length > budget:
        raise ConfigError(
            f"data.max_length ({d.max_length}) exceeds train.max_tokens_per_micro_batch ({budget}): a "
            f"sample that long would not fit in a {'packed' if t.packing else 'padded'} pass"
        )
    for key, value in {"data.max_length": d.max_length, "data.max_pixels": d.max_pixels}.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{key} must be positive when set, got {value}")
    if d.min_pixels is not None and d.min_pixels <= 0:
        raise ConfigError(f"data.min_pixels must be positive when set, got {d.min_pixels}")
    if d.min_pixels is not None and d.max_pixels is not None and d.min_pixels > d.max_pixels:
        raise ConfigError(f"data.min_pixels ({d.min_pixels}) exceeds data.max_pixels ({d.max_pixels})")
    if d.video_fps is not None and d.video_num_frames is not None:
        raise ConfigError("data.video_fps and data.video_num_frames are both set: sample by one of them")
    for key, value in {
        "data.video_fps": d.video_fps,
        "data.video_num_frames": d.video_num_frames,
        "data.video_max_frames": d.video_max_frames,
        "data.video_max_pixels": d.video_max_pixels,
        "data.video_min_pixels": d.video_min_pixels,
        "data.video_total_pixels": d.video_total_pixels,
    }.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{key} must be positive when set, got {value}")
    if None not in (d.video_min_pixels, d.video_max_pixels) and d.video_min_pixels > d.video_max_pixels:
        raise ConfigError(
            f"data.video_min_pixels ({d.video_min_pixels}) exceeds "
            f"data.video_max_pixels ({d.video_max_pixels})"
        )
