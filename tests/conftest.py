"""Shared fixtures: tiny model folders and the digits, built once per session; one local Ray for all."""

from __future__ import annotations

import os

import pytest

from raylora import config
from raylora.assets import make_digits, make_tiny_model

os.environ.setdefault("RAY_AUTH_MODE", "token")  # Ray's default; explicit so tests do not depend on ~/.ray


@pytest.fixture(scope="session")
def digits(tmp_path_factory):
    """(train.parquet, eval.parquet) of the handwritten digits."""
    return make_digits(tmp_path_factory.mktemp("digits"))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Model folders by architecture, built lazily."""
    root = tmp_path_factory.mktemp("models")
    built: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in built:
            built[arch] = str(make_tiny_model(root / arch, arch))
        return built[arch]

    return get


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray shared by the distributed tests (4 logical CPUs on 2 cores: 2 workers plus headroom).

    Module-scoped so that a module that needs a Ray of its own (several nodes) can shut this one down.
    """
    import ray

    from raylora.driver import init_ray

    init_ray(num_cpus=4)
    return ray


def tiny_config(model_dir: str, train_file, storage, name: str, *overrides: str) -> config.Config:
    """A small, fully partitioned ZeRO-3 run: vision tower and aligner trained, dropout on."""
    return config.load(
        None,
        [
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
