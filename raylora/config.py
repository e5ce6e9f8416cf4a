"""Typed run configuration: YAML plus dotted `key=value` overrides, validated before Ray starts.

Every default lives here, one docstring per field. The same `Config` object crosses from the driver
to the workers, so a worker never reads a loose dict.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pydantic
import yaml

from raylora import storage


class ConfigError(ValueError):
    """Bad configuration or input, found before any expensive work starts (the CLI exits with 2)."""


# raylora.data.formats' FORMATS and ALIASES, named here so that a config is checked without importing the
# readers (pyarrow, PIL); tests/test_config.py holds the two lists equal.
DataFormat = typing.Literal["raylora", "chat", "llava", "sharegpt", "alpaca", "query_response"]
DATA_FORMATS = typing.get_args(DataFormat)
AttnImplementation = typing.Literal["sdpa", "eager", "flash_attention_2"]
ATTN_IMPLEMENTATIONS = typing.get_args(AttnImplementation)


@dataclass
class ModelConfig:
    path: str = ""
    """A local Hugging Face model folder (config.json, safetensors weights, tokenizer, processor), or a Hub
    id (`org/name`) that each node resolves through its huggingface_hub cache (HF_HOME, HF_HUB_OFFLINE)."""
    revision: str | None = None
    """Hub revision (commit hash, branch or tag) of a Hub id in model.path; unset: main. Pin a commit hash
    so that every node and every resume trains the same weights."""
    arch: str | None = None
    """Registry name (`raylora.arch`); unset: detected from config.json's model_type."""
    attn_implementation: AttnImplementation = "sdpa"
    """Attention kernel: `sdpa` (PyTorch's fused attention), `eager`, or `flash_attention_2` (needs the
    flash_attn package on every node, GPUs and bf16)."""
    trust_remote_code: bool = False
    """Load a model folder that carries its own modeling code (`auto_map` in config.json, e.g.
    Phi-3-vision) through transformers' remote-code path, from the folder or Hub cache: that code runs on
    every node. Off: such a folder is refused before Ray starts."""
    language_model: str | list[str] | None = None
    """Parameter-name prefix (or list of prefixes) of the language model (where LoRA goes), for an
    architecture raylora has no entry for (`raylora.arch`); with model.vision_tower and model.aligner.
    Unset: the registry's."""
    vision_tower: str | list[str] | None = None
    """Parameter-name prefix (or list of prefixes) of the vision tower, for an architecture raylora has no
    entry for."""
    aligner: str | list[str] | None = None
    """Parameter-name prefix (or list of prefixes, e.g. [model.visual.merger,
    model.visual.deepstack_merger_list]) of the aligner (projector), for an architecture raylora has no
    entry for; where it sits inside the vision tower, the aligner's prefixes win."""
    quantization: typing.Literal["nf4", "fp4"] | None = None
    """QLoRA: the frozen language model's linear layers loaded in 4 bits by bitsandbytes (`nf4`, or
    `fp4`), stored in the run's dtype so ZeRO-3 can partition them; the vision tower, aligner and lm_head
    stay unquantized. Unset: no quantization. `int8` is refused (docs: QLoRA)."""


@dataclass
class LoraConfig:
    r: int = 16
    """LoRA rank."""
    alpha: int = 32
    """LoRA scaling numerator (the update is scaled by alpha / r)."""
    dropout: float = 0.05
    """Dropout on the LoRA input."""
    parts: list[typing.Literal["language_model", "vision_tower", "aligner"]] = field(
        default_factory=lambda: ["language_model"]
    )
    """The model parts whose linear layers get LoRA: `language_model` (default), `vision_tower`, `aligner`
    (the mixture-of-experts tensors count as the language model's). A part cannot also be trained fully
    (train.freeze_vision / train.freeze_aligner false)."""
    target_modules: list[str] | None = None
    """Names of linear layers (or mixture-of-experts tensors: gate_up_proj, down_proj) to adapt within
    lora.parts (e.g. [q_proj, v_proj]); unset: every one."""
    use_dora: bool = False
    """DoRA: a trained magnitude vector per adapted layer beside LoRA (PEFT's use_dora)."""
    use_rslora: bool = False
    """Rank-stabilised LoRA: scale the update by alpha / sqrt(r) instead of alpha / r (PEFT's use_rslora)."""
    init: bool | str = True
    """LoRA initialisation (PEFT's init_lora_weights): true, false, gaussian, orthogonal, pissa or olora; the
    others are refused, with the reason (docs/models.md: PEFT options)."""
    modules_to_save: list[str] | None = None
    """Modules trained fully and saved in the adapter under PEFT's keys (PEFT's modules_to_save, e.g.
    [lm_head]); each name must match a module, as PEFT matches them (by name or name suffix)."""


@dataclass
class DataConfig:
    train: str = ""
    """Training data (a path or any pyarrow filesystem URI): a Parquet, JSON or JSONL file, a folder of
    Parquet files or a `datasets.save_to_disk` folder, in a format of data.format (docs/data.md)."""
    eval: str | None = None
    """Held-out data in the same formats, for evaluation: the prompt is every turn before the last assistant
    turn, the answer that turn's text."""
    format: DataFormat | None = None
    """Format of data.train and data.eval: `raylora` (image, prompt, answer), `chat` (messages with string or
    part content, images/image/videos), `llava` or `sharegpt` (conversations of from/value, image/images),
    `alpaca` (instruction, input, output) or `query_response` (ms-swift's query, response). Unset: detected
    from the fields found (docs/data.md)."""
    image_root: str | None = None
    """Folder (or URI) that relative image paths in the data are resolved against. Unset: the data file's
    folder."""
    on_bad_row: typing.Literal["skip", "error"] = "skip"
    """A row whose image does not decode or whose answer is empty: `skip` (counted, reported) or `error`."""
    max_bad_fraction: float = 0.01
    """Largest fraction of bad rows in the sample of data.train that the driver reads, renders and tokenises
    before Ray starts (the first rows and a seeded random sample); more and the run is refused, naming why."""
    max_length: int | None = None
    """Most tokens per sample (every turn, image tokens, end-of-turn tokens); a longer sample is skipped, not
    cut, and counted in the step's `too_long` metric (docs/gpus-memory.md: Memory). Unset: no limit."""
    max_pixels: int | None = None
    """Most pixels per image, handed to the processor's resolution knob (Qwen2-VL family: max_pixels;
    Idefics3, Pixtral: a longest edge of its square root); refused where the processor resizes every
    image to one fixed size. Unset: the model folder's own setting."""
    min_pixels: int | None = None
    """Fewest pixels per image (Qwen2-VL family only: smaller images are upscaled). Unset: the model
    folder's own setting."""
    workers: int = 1
    """Processes that build the next steps' micro batches (read, decode, tokenise) while the current step
    computes (docs/data.md: Input pipeline); 0 builds them inline, in the training process."""
    video_fps: float | None = None
    """Frames sampled per second of video (LLaMA-Factory's video_fps); unset: 2, or data.video_num_frames."""
    video_num_frames: int | None = None
    """Frames sampled per video, evenly spaced, instead of data.video_fps (setting both is refused)."""
    video_max_frames: int = 128
    """Most frames sampled from one video (LLaMA-Factory's video_maxlen); a longer one is sampled sparser."""
    video_max_pixels: int | None = None
    """Most pixels per video frame (LLaMA-Factory's video_max_pixels), handed to the video processor;
    refused where it has no such cap (docs/data.md). Unset: the model folder's own setting."""
    video_min_pixels: int | None = None
    """Fewest pixels per video frame (LLaMA-Factory's video_min_pixels; Qwen2-VL family only: smaller
    frames are upscaled). Unset: the model folder's own setting."""
    video_total_pixels: int | None = None
    """Most pixels of one video, all its sampled frames together (qwen-vl-utils' total_pixels, which
    counts frame pairs, is half of it). Unset: the model folder's own setting."""
    video_stand_in: bool | None = None
    """Give each pass a video (a blank stand-in where it has none): ZeRO-3 ranks run the same video passes;
    unset: on where the driver's preflight finds video rows or a video field in data.train."""


@dataclass
class TrainConfig:
    max_steps: int = 100
    """Optimizer steps to train for."""
    global_batch_size: int = 16
    """Samples per optimizer step over all workers; independent of the number of workers."""
    micro_batch_size: int = 4
    """Samples per forward pass on one worker; gradient accumulation makes up the global batch."""
    lr: float = 2e-4
    """Peak learning rate (AdamW)."""
    vision_lr: float | None = None
    """Peak learning rate of a trained vision tower and aligner; unset: train.lr. Full training of
    pretrained modules usually wants a smaller one than LoRA."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 10
    """Linear warmup steps before the cosine decay."""
    grad_clip: float = 1.0
    """Gradient norm clipping; 0 turns it off."""
    seed: int = 0
    """Seed for the LoRA initialisation, the sample order and dropout."""
    checkpoint_every: int = 50
    """Report a Ray checkpoint every this many steps (and at the last step)."""
    eval_every: int | None = None
    """Evaluate on data.eval (generated answers: exact-match accuracy, answer loss) every this many steps."""
    eval_samples: int = 256
    """Held-out samples each evaluation scores (the first ones of data.eval)."""
    freeze_vision: bool = True
    """Keep the vision tower frozen; false trains it fully."""
    freeze_aligner: bool = True
    """Keep the aligner (projector) frozen; false trains it fully."""
    train_router: bool = False
    """Mixture-of-experts models: train the routers (the gates that pick each token's experts) fully, saved
    beside the adapter; off: frozen, as the base model routes."""
    param_persistence_threshold: int = 100_000
    """ZeRO-3 keeps parameters of at most this many elements whole on every rank, gathered once per
    optimizer step instead of at every use (DeepSpeed's stage3_param_persistence_threshold); at the largest
    parameter's size or more, the whole frozen base stays resident (docs/gpus-memory.md: Memory)."""
    precision: typing.Literal["bf16", "fp32"] | None = None
    """`bf16` (bf16 weights and activations, fp32 masters, Adam moments, gradient accumulation and
    reduction) or `fp32`; unset: bf16 with scaling.use_gpu, fp32 without. Independent of the device."""
    gradient_checkpointing: bool | None = None
    """Recompute each layer's activations in the backward pass (language model and vision tower) instead
    of keeping them; unset: on with scaling.use_gpu, off without."""
    packing: bool = False
    """Padding-free passes (raylora.data.packing): each rank's share of a step's global batch is packed,
    whole samples back to back, into rows of at most train.max_tokens_per_micro_batch tokens, none
    attending to another; the same loss and gradients as the padded micro batches, without their padding.
    train.micro_batch_size then only sets DeepSpeed's accumulation arithmetic."""
    sort_by_length: bool = False
    """Without packing: order each rank's share of a step by sample length before cutting it into micro
    batches, so each pads to near its own samples' length (the same samples and loss; their grouping into
    micro batches, and so the summation order and dropout noise, change). Implied by
    train.max_tokens_per_micro_batch without packing."""
    group_by_length: bool = False
    """Order each epoch so that every step's global batch holds samples of similar length (as the HF
    Trainer's group_by_length does): the shuffled epoch cut into groups of 50 steps' samples (a quarter
    of an epoch's steps where that is fewer), each sorted by tokens and cut into its steps, which run in a
    shuffled order (raylora.data.sampler). Every sample still trains once an epoch, but which samples
    share a step changes: steps of long samples and of short ones, so the loss per step swings more. The
    tokens of every row are counted once per run, by the workers at their start, and kept in the run's
    folder for its restarts."""
    max_tokens_per_micro_batch: int | None = None
    """Tokens per pass, image tokens included; required with train.packing (a packed row's length).
    Without packing: padded micro batches of at most this many positions (rows times their longest), each
    rank's share sorted by length and cut longest first, so a pass holds more short samples than long
    ones and a step of short samples runs fewer passes. Either way train.micro_batch_size then only sets
    DeepSpeed's accumulation arithmetic, and a sample longer than it is skipped as too long
    (data.max_length, when set, must not exceed it)."""
    deterministic: bool = True
    """Repeatable kernels on GPUs (raylora.determinism): torch's deterministic algorithms (an op that has
    none raises), a fixed cuBLAS workspace, deterministic cuDNN convolutions and attention backward, so a
    rerun on the same GPU type and world size should give the same bits. False: the faster
    nondeterministic kernels, equal up to rounding. On CPUs the tested runs are bitwise equal either way."""


@dataclass
class ScalingConfig:
    num_workers: int | list[int] = 2
    """Ray Train workers, one per GPU (or CPU slot); a [min, max] pair asks Ray for elastic training."""
    use_gpu: bool = False
    """One GPU per worker and NCCL (bf16 unless train.precision says otherwise); false: CPU and gloo."""
    cpus_per_worker: float = 1.0
    """CPUs Ray reserves for each worker."""


@dataclass
class RunConfig:
    storage_path: str = "runs"
    """Where Ray keeps the run's checkpoints and state: a shared folder or a pyarrow URI (s3://, gs://)."""
    name: str = "raylora"
    """Run name; starting a run with an existing name resumes it from its latest checkpoint."""
    max_failures: int = 3
    """Worker-group failures Ray recovers from before the run fails."""
    max_preemptions: int = 20
    """Node preemptions (spot reclaims announced by a drain, or nodes that died preempted) Ray recovers
    from before the run fails, counted apart from run.max_failures; -1: no limit."""
    num_to_keep: int = 2
    """Checkpoints kept in storage (the newest ones)."""
    checkpoint_upload: typing.Literal["async", "sync"] = "async"
    """How rank 0's checkpoint folder reaches storage: async (uploaded while training goes on; the run
    resumes only from checkpoints whose upload completed) or sync (every rank waits for the upload)."""
    local_dir: str | None = None
    """This node's folder for the checkpoints rank 0 writes before Ray uploads them (`raylora-staging/`
    in it): an absolute path on a fast local disk, such as the NVMe instance store. Unset: the system
    temporary folder (TMPDIR, else /tmp)."""
    report_every_s: float = 2.0
    """Seconds between the workers' metric reports to Ray Train (each one waits for every worker and for
    the controller's poll); the rows of the steps in between go with the next report, so the metric sinks
    still get every step. Checkpoint steps and the last step report at once; 0 reports every step."""
    tensorboard: bool = False
    """Also write the metrics as TensorBoard scalars into the run folder's `tensorboard/` (local storage)."""
    verbose: bool = False
    """Print Ray Train's, DeepSpeed's and transformers' own log lines and warnings beside raylora's."""
    mlflow_tracking_uri: str | None = None
    """Also log the metrics and config to this MLflow tracking URI (a server, or sqlite:///path/mlflow.db)."""
    wandb_project: str | None = None
    """Also log the metrics and config to this Weights & Biases project (`pip install -e '.[wandb]'`;
    the driver's WANDB_* variables, e.g. WANDB_MODE=offline, apply)."""


@dataclass
class FaultConfig:
    kill_at_steps: list[int] = field(default_factory=list)
    """Fault drill: before each of these steps a worker kills its own process, once per step. A kill
    between checkpoints first waits until Ray has recorded the last one, so the run resumes from it; a
    kill at a step that is itself checkpointed may come before Ray has taken that checkpoint."""
    kill_rank: int = 1
    """Fault drill: the rank that kills itself."""
    kill_checkpoint_steps: list[int] = field(default_factory=list)
    """Fault drill: the rank kills itself while writing the checkpoint of each of these steps, once."""
    read_errors: int = 0
    """Fault drill: this many of fault.read_error_rank's checkpoint reads in the run fail with a transient
    storage error (OSError) before one succeeds; each retry is a read."""
    read_error_rank: int = 1
    """Fault drill: the rank whose checkpoint reads fail (fault.read_errors)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The base vision-language model."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """The LoRA adapter on the language model."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training and evaluation data."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimisation, schedule, checkpoints and what is trained."""
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    """Workers and devices."""
    run: RunConfig = field(default_factory=RunConfig)
    """Storage, naming and fault tolerance."""
    fault: FaultConfig = field(default_factory=FaultConfig)
    """Fault drills for demos and tests."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def world_sizes(self) -> list[int]:
        """Every number of workers the run may have: one, or each of an elastic [min, max] range."""
        n = self.scaling.num_workers
        return list(range(n[0], n[1] + 1)) if isinstance(n, list) else [n]

    @property
    def world_size(self) -> int:
        """The most workers the run may have."""
        return self.world_sizes[-1]

    @property
    def bf16(self) -> bool:
        """Whether the run trains in bf16: `train.precision`, or bf16 exactly when it uses GPUs."""
        precision = self.train.precision
        return self.scaling.use_gpu if precision is None else precision == "bf16"

    @property
    def gradient_checkpointing(self) -> bool:
        """Whether layers recompute their activations: `train.gradient_checkpointing`, or on with GPUs."""
        on = self.train.gradient_checkpointing
        return self.scaling.use_gpu if on is None else on

    @property
    def length_limit(self) -> tuple[str, int] | None:
        """(setting, tokens): the limit past which a sample is skipped as too long, the smaller of
        data.max_length and a pass's token budget (train.max_tokens_per_micro_batch); None without
        either."""
        limits = [
            (key, value)
            for key, value in (
                ("data.max_length", self.data.max_length),
                ("train.max_tokens_per_micro_batch", self.train.max_tokens_per_micro_batch),
            )
            if value is not None
        ]
        return min(limits, key=lambda kv: kv[1]) if limits else None

    @property
    def uneven_passes(self) -> bool:
        """Whether a step's pass count depends on its samples (packed, or padded under a token budget), so
        that the ranks agree on the most any needs each step and a rank with fewer runs stand-ins."""
        return self.train.packing or self.train.max_tokens_per_micro_batch is not None

    def grad_accum_steps(self, world_size: int) -> int:
        """Micro batches per rank per step, so the global batch does not depend on the worker count: as
        many as the largest share of the global batch needs (`data.GlobalSampler.micro_batches`)."""
        largest_share = -(-self.train.global_batch_size // world_size)
        return -(-largest_share // self.train.micro_batch_size)


SECTIONS = (ModelConfig, LoraConfig, DataConfig, TrainConfig, ScalingConfig, RunConfig, FaultConfig, Config)
for _section in SECTIONS:
    # pydantic checks the dataclasses as they are, in its lax mode (YAML's `1e-4` string is a float,
    # `2.5` is not an int), and an unknown key is an error, not ignored.
    _section.__pydantic_config__ = pydantic.ConfigDict(extra="forbid")
_CHECK = pydantic.TypeAdapter(Config)


def _yaml_quirks(cls: type, data: Any, prefix: str) -> Any:
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
            out[name] = _yaml_quirks(tp, value, f"{prefix}{name}.")
            continue
        args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
        takes_list = any(typing.get_origin(a) is list for a in args)
        scalars = tuple(a for a in args if a in (bool, int, float, str))
        if isinstance(value, bool) and bool not in args and not takes_list:
            # pydantic's lax mode would read `true` as 1 for an int
            raise ConfigError(f"{prefix}{name}: expected {_type_name(tp)}, got bool {value!r}")
        if takes_list and isinstance(value, str) and str not in args:
            out[name] = [yaml.safe_load(v) for v in value.split(",") if v]
        elif takes_list and not isinstance(value, list) and not isinstance(value, scalars):
            out[name] = [value]
    return out


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is typing.Literal:
        return "one of " + ", ".join(str(choice) for choice in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    return str(tp).replace("<class '", "").replace("'>", "").replace("typing.", "")


def _config_error(err: pydantic.ValidationError) -> ConfigError:
    """pydantic's first error as raylora says it: the dotted key, what it expects, what it got."""
    first = err.errors()[0]
    cls, keys, tp = Config, [], None
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
    expected = _type_name(tp) if tp is not None else first["msg"]
    value = first.get("input")
    return ConfigError(f"{key}: expected {expected}, got {type(value).__name__} {value!r}")


REFUSED_QUANTIZATION = {
    "int8": "bitsandbytes keeps 8-bit weights as int8 tensors (with their scales beside them), and "
    "DeepSpeed casts the parameters it partitions to the run's dtype, which destroys them (4-bit weights "
    "are stored in the run's dtype instead: bnb_4bit_quant_storage)",
}
"""model.quantization values refused, with the reason."""


def from_dict(data: dict[str, Any]) -> Config:
    """Build a `Config` from nested plain data; unknown keys and wrong types raise `ConfigError`.

    Local paths come out absolute (`_absolute_paths`), so that nothing needs to change the config later.
    """
    quantization = ((data or {}).get("model") or {}).get("quantization")
    if isinstance(quantization, str) and quantization.lower() in REFUSED_QUANTIZATION:
        raise ConfigError(
            f"model.quantization={quantization} cannot be used under ZeRO-3: "
            f"{REFUSED_QUANTIZATION[quantization.lower()]}; accepted: nf4, fp4"
        )
    try:
        cfg = _CHECK.validate_python(_yaml_quirks(Config, data or {}, ""))
    except pydantic.ValidationError as err:
        raise _config_error(err) from None
    return _absolute_paths(cfg)


def _absolute_paths(cfg: Config) -> Config:
    """`cfg` with its local paths absolute (URIs as they are), made where the config is loaded: the
    workers run on other nodes and in other working directories."""
    model, data, run = cfg.model, cfg.data, cfg.run
    if os.path.isdir(model.path):  # a Hub id (`org/name`) is no folder here: each node resolves it
        model = dataclasses.replace(model, path=os.path.abspath(model.path))
    data = dataclasses.replace(
        data,
        train=storage.absolute(data.train) if data.train else data.train,  # empty: validate() names it
        eval=storage.absolute(data.eval) if data.eval else data.eval,
        image_root=storage.absolute(data.image_root) if data.image_root else data.image_root,
    )
    run = dataclasses.replace(run, storage_path=storage.absolute(run.storage_path))
    return dataclasses.replace(cfg, model=model, data=data, run=run)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b=value` overrides (values parsed as YAML) to nested plain data."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (for example train.lr=1e-4)")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key}: {part} is not a section")
        node[parts[-1]] = yaml.safe_load(raw) if raw != "" else None
    return data


def load(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read a YAML file (or nothing), apply overrides, type-check and validate."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from err
    cfg = from_dict(apply_overrides(data, list(overrides or [])))
    validate(cfg)
    return cfg


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


def markdown_reference() -> str:
    """The config reference table (docs/reference/config.md, written by `make docs`), generated from the
    dataclasses, their types (a `Literal` lists its choices) and their field docstrings."""
    import ast
    import inspect

    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    hints = typing.get_type_hints(Config)
    for section in dataclasses.fields(Config):
        cls = hints[section.name]
        tree = ast.parse(inspect.getsource(cls))
        body = tree.body[0].body
        docs = {
            a.target.id: " ".join(b.value.value.split())
            for a, b in zip(body, body[1:], strict=False)
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr)
        }
        default = cls()
        for f in dataclasses.fields(cls):
            tp = _type_name(typing.get_type_hints(cls)[f.name])
            rows.append(
                f"| `{section.name}.{f.name}` | {tp} | `{getattr(default, f.name)!r}` | {docs[f.name]} |"
            )
    return "\n".join(rows)
