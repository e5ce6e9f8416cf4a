"""`model.path` to a local model folder: a folder is used as it is; a Hugging Face Hub id (`org/name`,
with `model.revision`) is resolved through huggingface_hub's cache, so HF_HOME, HF_HUB_CACHE,
HF_HUB_OFFLINE and HF_TOKEN mean what they mean to huggingface_hub. A resolved folder's fingerprint
(`base_model_fingerprint`) is what a checkpoint records of the base model it was trained on.

Each process resolves a model once. The download itself runs under a file lock in the node's Hub cache,
one per repo and revision: the first worker of a node downloads, the others wait and then find every
file in the cache instead of fetching the same weights eight times.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import huggingface_hub
from filelock import FileLock
from huggingface_hub import constants
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from raylora.config import ConfigError

log = logging.getLogger("raylora")

# What the driver's checks read (config.json for the architecture and the meta-device model; the
# processor, tokenizer and chat template, which the preflight loads and renders a sample of the data
# with), never the weights: the driver of a cluster usually runs on a head node that does not train, and
# a 7B model's weights are 15 GB. Tokenizers come as tokenizer.json, as vocab.json + merges.txt (byte-level
# BPE), as a SentencePiece `*.model` or a tiktoken file; templates as JSON or `chat_template.jinja`; a
# model's own modeling and processing code (`*.py`, model.trust_remote_code), which its config needs.
CONFIG_FILES = ["*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken", "*.py"]

_resolved: dict[tuple[str, str | None, bool], str] = {}


def is_hub_id(path: str) -> bool:
    """Whether `path` is shaped like a Hub model id (`org/name`); an existing folder never is."""
    if Path(path).is_dir() or path.count("/") != 1 or path.startswith((".", "/", "~")):
        return False
    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def resolve(path: str, revision: str | None = None, *, config_only: bool = False) -> str:
    """The local folder that `path` (model.path) names, downloading a Hub id into the cache if needed.

    `config_only`: only the small JSON files (what the driver's checks read), not the weights.
    Raises `ConfigError` naming model.path / model.revision when it cannot be resolved.
    """
    for key in ((path, revision, False), (path, revision, config_only)):
        if key in _resolved:
            return _resolved[key]
    if Path(path).is_dir():
        if revision is not None:
            raise ConfigError(
                f"model.revision ({revision}) is for a Hub id, but model.path {path} is a local folder"
            )
        return path
    if not is_hub_id(path):
        raise ConfigError(f"model.path: model folder not found: {path}")
    folder = _download(path, revision, CONFIG_FILES if config_only else None)
    _resolved[(path, revision, config_only)] = folder
    return folder


def _download(repo_id: str, revision: str | None, allow_patterns: list[str] | None) -> str:
    name = f"{repo_id}@{revision or 'main'}.lock".replace("/", "--")
    lock = Path(constants.HF_HUB_CACHE) / ".locks" / "raylora" / name
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(lock):
            folder = huggingface_hub.snapshot_download(
                repo_id, revision=revision, allow_patterns=allow_patterns
            )
    # huggingface_hub's errors for a repo that is not cached while offline, unknown, gated or private, or a
    # revision that does not exist are OSErrors (LocalEntryNotFoundError, HfHubHTTPError and their kin)
    except (OSError, HFValidationError) as err:
        offline = " with HF_HUB_OFFLINE set (only the local Hub cache is searched)"
        raise ConfigError(
            f"model.path {repo_id} (model.revision {revision or 'main'}) is not a local folder and could not "
            f"be resolved on the Hugging Face Hub{offline if constants.is_offline_mode() else ''}: "
            f"{type(err).__name__}: {err}"
        ) from err
    log.info("model.path %s (revision %s) resolved to %s", repo_id, revision or "main", folder)
    return os.fspath(folder)


def base_model_fingerprint(model_path: str | Path, sample: int = 1 << 20) -> dict[str, str | int]:
    """What identifies a base model folder cheaply: config.json, and the weight files' sizes and the
    first and last MiB of each (hashing every byte of a 15 GB model on each start would be slow)."""
    folder = Path(model_path)
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    weight_bytes = 0
    for path in sorted(folder.glob("*.safetensors")):
        size = path.stat().st_size
        weight_bytes += size
        with open(path, "rb") as f:
            digest.update(f"{path.name}:{size}".encode())
            digest.update(f.read(sample))
            f.seek(max(0, size - sample))
            digest.update(f.read(sample))
    return {"sha256": digest.hexdigest(), "weight_bytes": weight_bytes}
