"""The data checks of the driver's preflight, before Ray starts: the model folder's processor and chat
template load and serve, no media field goes unread, and a sample of data.train reads, decodes, renders and
tokenises as a training step would (`raylora.preflight.preflight` calls them, the cheap checks first).
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import numpy as np
from jinja2 import TemplateError

from raylora.config import Config, ConfigError
from raylora.data import video
from raylora.data.batches import read
from raylora.data.formats import BadRow, Rows
from raylora.data.labels import check_chat_template, encode
from raylora.data.processor import load_processor

log = logging.getLogger("raylora")


# Files a model folder's processor, tokenizer and chat template are read from (named when they fail).
PROCESSOR_FILES = (
    "processor_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "tokenizer_config.json",
    "tokenizer.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)


def checked_processor(cfg: Config, model_dir: Path):
    """The model folder's processor, loaded and its chat template cut into turns as the workers will,
    or a `ConfigError` naming the files that do not serve."""
    try:
        processor = load_processor(
            model_dir,
            cfg.data.max_pixels,
            cfg.data.min_pixels,
            cfg.model.trust_remote_code,
            video.PixelCaps.of(cfg.data),
            cfg.data.chat_template_kwargs,
        )
    except ConfigError:
        raise
    except Exception as err:  # transformers raises many types for a folder it cannot load
        present = [f for f in PROCESSOR_FILES if (model_dir / f).is_file()]
        # transformers' own message seldom says which file: a JSON file that does not parse is named here
        broken = [f for f in present if f.endswith(".json") and not _parses(model_dir / f)]
        files = ", ".join(broken or present) or f"none of {', '.join(PROCESSOR_FILES)} found"
        what = "is not valid JSON" if broken else "does not load from its files"
        raise ConfigError(
            f"model.path: the processor of {model_dir} {what} ({files}): {type(err).__name__}: {err}"
        ) from err
    try:
        check_chat_template(processor)
    except Exception as err:  # a template's own errors (TemplateError), ValueError from the cutting, ...
        where = ", ".join(_template_files(model_dir)) or (
            "none found: no chat_template.jinja, chat_template.json or chat_template in tokenizer_config.json"
        )
        raise ConfigError(
            f"model.path: the chat template of {model_dir} ({where}) cannot render a conversation for "
            f"training: {type(err).__name__}: {err}"
        ) from err
    return processor


def _parses(path: Path) -> bool:
    try:
        json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return True


def _template_files(model_dir: Path) -> list[str]:
    """The files of `model_dir` that hold a chat template."""
    found = [f for f in ("chat_template.jinja", "chat_template.json") if (model_dir / f).is_file()]
    for name in ("processor_config.json", "tokenizer_config.json"):
        try:
            if "chat_template" in json.loads((model_dir / name).read_text()):
                found.append(f"{name} (its chat_template)")
        except (OSError, ValueError):
            continue
    return found


# Unread fields that hold the media of the turns that are read (`Rows.unread_fields` names the others too:
# turns, a system prompt, a preference pair's rejected side, which supervised fine-tuning has no use for).
MEDIA_FIELDS = ("images", "image", "videos", "video", "audios", "audio")


def check_unread_fields(rows: Rows) -> None:
    """Name the fields of data.train that hold media or turns and that raylora's reader of its format does
    not read: a `ConfigError` for media (training would drop it while keeping the text around it), a
    warning for turns."""
    unread = list(getattr(rows, "unread_fields", None) or [])
    media = [f for f in unread if f.lower() in MEDIA_FIELDS]
    if media:
        raise ConfigError(
            f"data.train: {rows.uri}: field(s) {', '.join(media)} hold media that raylora's reader of the "
            f"{rows.format} format does not read: training would drop it and keep the text around it. "
            f"Remove the field(s) or write the rows in a format that carries them (docs/data.md)"
        )
    if unread:
        log.warning(
            "data.train: %s: field(s) %s are not read by raylora's %s reader; they are ignored",
            rows.uri,
            ", ".join(unread),
            rows.format,
        )


# The preflight's sample of data.train: the first rows (where a source's mistakes show first) and a seeded
# random sample of the rest (a bad shard, a layout that changes part way), read in row order so that a
# Parquet row group is decoded once; within a time budget, so that slow storage keeps it to seconds.
SAMPLE_FIRST = 32
SAMPLE_RANDOM = 224
SAMPLE_SECONDS = 10.0
SHOWN_REASONS = 3


def sample_rows(num_rows: int, seed: int) -> list[int]:
    """The rows the preflight reads: the first SAMPLE_FIRST, then SAMPLE_RANDOM drawn from the rest."""
    first = list(range(min(num_rows, SAMPLE_FIRST)))
    rest = num_rows - len(first)
    drawn = np.random.default_rng([seed, num_rows]).choice(rest, min(rest, SAMPLE_RANDOM), replace=False)
    return first + sorted(int(i) + len(first) for i in drawn)


def check_sample(cfg: Config, rows: Rows, processor) -> None:
    """Read, decode, render and tokenise a sample of data.train as a training step would; `ConfigError`
    when more than data.max_bad_fraction of it is bad, naming the most common reasons with a row each.

    A row is bad when it does not read or its images or videos do not decode (`BadRow`), or when the
    processor or the chat template rejects it (what `data.limit_length` skips during training).

    Video rows are decoded as a step would decode them (data.video_fps, ...), and the time they took is
    logged. data.video_stand_in, when unset, is resolved here, for the workers: on where the sample holds a
    video row or the source has a video field."""
    d = cfg.data
    limit_key, limit = cfg.length_limit or (None, None)
    bad: list[tuple[int, str]] = []
    checked = too_long = 0
    videos, video_s = 0, 0.0  # video rows read, and the seconds reading them took (their decoding, mostly)
    sampling = video.Sampling.of(d)
    deadline = time.monotonic() + SAMPLE_SECONDS
    for i in sample_rows(len(rows), cfg.train.seed):
        if checked and time.monotonic() > deadline:
            break
        checked += 1
        started = time.monotonic()
        try:
            sample = read(rows, i, sampling)
        except BadRow as err:
            bad.append((i, err.reason))
            sample = None
        if (len(sample) > 2) if sample is not None else "video" in bad[-1][1]:  # a video row (read or not)
            videos += 1
            video_s += time.monotonic() - started
        if sample is None:
            continue
        try:
            tokens = len(encode(processor, sample).labels)
        except (ValueError, TemplateError) as err:  # as data.limit_length catches them
            why = " ".join(str(err).split())[:300]
            bad.append((i, f"the processor rejects it ({type(err).__name__}: {why})"))
            continue
        too_long += limit is not None and tokens > limit
    where = f"data.train: {rows.uri}"
    undecodable = next((row for row, reason in bad if reason == video.NO_DECODER), None)
    if undecodable is not None:  # however few: video rows would be skipped at every step, never trained
        raise ConfigError(f"{where}: row {undecodable}: {video.NO_DECODER}")
    if videos:
        log.info("%s: decoded %d video row(s) of the sample in %.2f s", where, videos, video_s)
    if d.video_stand_in is None:
        fields = getattr(getattr(rows, "records", None), "names", None) or []
        d.video_stand_in = bool(videos) or any(f in ("videos", "video") for f in fields)
    if bad and d.on_bad_row == "error":
        row, reason = bad[0]
        raise ConfigError(f"{where}: row {row}: {reason} (data.on_bad_row: error)")
    share = f"{len(bad)} of the {checked} rows read before the start"
    if len(bad) > d.max_bad_fraction * checked:
        raise ConfigError(
            f"{where}: {share} are bad, more than data.max_bad_fraction ({d.max_bad_fraction}); "
            f"{common_reasons(bad)}"
        )
    if bad:
        log.warning("%s: %s are bad and will be skipped; %s", where, share, common_reasons(bad))
    good = checked - len(bad)
    if good and too_long == good:
        raise ConfigError(
            f"{where}: every good row of the {checked} read before the start is longer than "
            f"{limit_key} ({limit}) and would be skipped: nothing would be trained on"
        )
    if too_long:
        log.warning("%s: %d of %d rows read are longer than %s, skipped", where, too_long, checked, limit_key)


def common_reasons(bad: list[tuple[int, str]]) -> str:
    """The most common reasons among `bad` ((row, reason) pairs), each with its count and a row.

    Reasons that differ only in numbers, addresses and quoted names (a count, a path) are one reason."""
    groups: dict[str, list[tuple[int, str]]] = {}
    for row, reason in bad:
        key = re.sub(r"0x[0-9a-f]+|\d+", "#", re.sub(r"'[^']*'|\"[^\"]*\"", "''", reason))
        groups.setdefault(key, []).append((row, reason))
    ranked = sorted(groups.values(), key=len, reverse=True)
    shown = [f"{len(g)} x {g[0][1]} (e.g. row {g[0][0]})" for g in ranked[:SHOWN_REASONS]]
    more = f"; and {len(ranked) - SHOWN_REASONS} other reason(s)" if len(ranked) > SHOWN_REASONS else ""
    return "; ".join(shown) + more
