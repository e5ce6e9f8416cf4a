"""Every YAML the project ships is parsed and validated."""

from __future__ import annotations

from pathlib import Path

import pytest

from raylora import config
from raylora.ray_runtime import POLL_ENV

ROOT = Path(__file__).resolve().parent.parent
# kuberay-rayjob.yaml is a Kubernetes object, checked in tests/test_cluster_config.py
NOT_RUN_CONFIGS = {"runtime_env.yaml", "tune-space.yaml", "kuberay-rayjob.yaml"}
CONFIGS = sorted(p for p in (ROOT / "jobs").glob("*.yaml") if p.name not in NOT_RUN_CONFIGS)


def test_every_shipped_yaml_is_checked():
    names = {p.name for p in (ROOT / "jobs").glob("*.yaml")}
    assert names == {p.name for p in CONFIGS} | NOT_RUN_CONFIGS


def test_tune_space_loads():
    from raylora.tune import load_space

    space = load_space(ROOT / "jobs" / "tune-space.yaml", config.load(ROOT / "jobs" / "tiny.yaml"))
    assert set(space) == {"train.lr", "lora.r"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_loads(path):
    cfg = config.load(path)
    assert cfg.model.path and cfg.data.train and cfg.run.name
    header = path.read_text().splitlines()[0]
    assert header.startswith("#"), f"{path.name} needs a comment header saying what it is"
    assert "jobs/train.py" in path.read_text() or "raylora train" in path.read_text()
    if any(size in path.name for size in ("7b", "8b", "30b")):  # the GPU jobs
        assert cfg.scaling.use_gpu and cfg.run.storage_path.startswith(("s3://", "gs://"))


def test_runtime_env_is_valid():
    import yaml
    from ray.runtime_env import RuntimeEnv

    env = yaml.safe_load((ROOT / "jobs" / "runtime_env.yaml").read_text())
    RuntimeEnv(**env)  # Ray's own validation
    # raylora's driver sets the controller's poll for each run from run.report_every_s; one set here
    # would override it in every run of the job
    assert POLL_ENV not in env["env_vars"]


def _config_reference():
    import importlib.util

    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "dev" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_reference_page_is_current():
    """docs/reference/config.md is generated from the typed config; a config change regenerates it."""
    reference = _config_reference()
    assert reference.PAGE.read_text() == reference.page(), (
        "docs/reference/config.md differs from raylora/config.py: run `make docs` and commit the page"
    )


def test_config_reference_documents_every_config_key():
    import dataclasses
    import typing

    page = (ROOT / "docs" / "reference" / "config.md").read_text()
    hints = typing.get_type_hints(config.Config)
    for section in dataclasses.fields(config.Config):
        for f in dataclasses.fields(hints[section.name]):
            assert f"`{section.name}.{f.name}`" in page, f"the config reference lacks {section.name}.{f.name}"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_moe_config_takes_lora_on_its_experts(path):
    """LoRA on a mixture-of-experts model's fused experts (PEFT's target_parameters) refuses dropout and
    DoRA (raylora.moe.check_expert_lora): a shipped MoE job must not fail at its first worker."""
    from raylora import moe

    cfg = config.load(path)
    if cfg.model.arch in ("qwen3_vl_moe",):
        moe.check_expert_lora(cfg)
        assert cfg.gradient_checkpointing  # bench/on_paper.py: without it, far over 80 GB
