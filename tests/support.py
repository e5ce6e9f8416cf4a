"""The tiny run the tests train (`tiny_run_config`), straight and with a killed rank.

The rest of what the tests share is in modules named for their concern: `ray_env`, `s3_server`, `probes`,
`run_logs`, `remote_model`, `whole_checkpoint`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def tiny_run_config(
    model_dir: str | Path, train_file: str | Path, storage: str | Path, name: str, *overrides: str
):
    """The small run that the tests and benchmarks train: fully partitioned ZeRO-3 on 2 workers
    (persistence threshold 0), LoRA r=4 with dropout, vision tower and aligner trained, 6 steps, a
    checkpoint every 2; `overrides` (dotted `key=value`) come last and win."""
    from raylora import config

    return config.load(
        None,
        [
            *template_overrides(model_dir),
            f"model.path={model_dir}",
            f"data.train={train_file}",
            f"run.storage_path={storage}",
            f"run.name={name}",
            "train.max_steps=6",
            "train.global_batch_size=8",
            "train.micro_batch_size=2",
            "train.lr=1e-3",
            "train.warmup_steps=2",
            "train.checkpoint_every=2",
            "train.freeze_vision=false",
            "train.freeze_aligner=false",
            "train.param_persistence_threshold=0",
            "lora.r=4",
            "lora.alpha=8",
            "lora.dropout=0.1",
            "scaling.num_workers=2",
            "run.max_failures=2",
            "run.num_to_keep=10",
            *overrides,
        ],
    )


def _template_kwargs(model_dir) -> dict | None:
    """The chat template arguments a tiny model's runs take (`raylora.tiny.TEMPLATE_KWARGS`), by the
    folder's model type; None for a folder without a config.json or an architecture that takes none."""
    from raylora.tiny import TEMPLATE_KWARGS

    config = Path(model_dir) / "config.json"
    return TEMPLATE_KWARGS.get(json.loads(config.read_text()).get("model_type")) if config.is_file() else None


def template_overrides(model_dir) -> tuple[str, ...]:
    """The override a tiny model's runs need for its chat template."""
    kwargs = _template_kwargs(model_dir)
    return (f"data.chat_template_kwargs={json.dumps(kwargs)}",) if kwargs else ()


def tiny_processor(model_dir, **options):
    """`load_processor` of a tiny model's folder, with the chat template arguments its runs take."""
    from raylora.data.processor import load_processor

    return load_processor(model_dir, template_kwargs=_template_kwargs(model_dir), **options)


def straight_and_killed(model_dir, data, storage, kill_at: int, *overrides: str) -> tuple[Any, Any]:
    """Two runs of `tiny_run_config`: uninterrupted (`straight`) and with the fault drill's rank killing
    itself before step `kill_at` (`killed`), each with `overrides`; both must succeed."""
    from raylora.driver import run

    straight = run(tiny_run_config(model_dir, data, storage, "straight", *overrides))
    killed = run(
        tiny_run_config(model_dir, data, storage, "killed", *overrides, f"fault.kill_at_steps={kill_at}")
    )
    assert straight.error is None and killed.error is None
    return straight, killed
