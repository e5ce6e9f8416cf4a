"""Checkpoints that bring their own code (model.trust_remote_code): refused unless asked for, and with it
loaded through transformers' remote-code path from the folder, with the config naming the model's parts.
The distributed proof (trained on 2 workers, killed, resumed bit for bit, exported) is in
tests/test_formats.py, where it shares that module's uninterrupted reference run."""

from __future__ import annotations

import pytest

from raylora import config
from raylora.arch import for_model
from raylora.config import ConfigError
from raylora.driver import preflight
from tests.remote_model import REMOTE_PARTS, make_remote_code_model
from tests.support import tiny_run_config


@pytest.fixture(scope="module")
def remote_model(tiny_models, tmp_path_factory):
    return make_remote_code_model(tiny_models("llava"), tmp_path_factory.mktemp("remote") / "model")


def test_a_folder_with_its_own_code_is_refused_naming_the_key(remote_model, digits, tmp_path):
    cfg = tiny_run_config(remote_model, digits[0], tmp_path, "refused")
    with pytest.raises(ConfigError, match="model.trust_remote_code: .* carries its own modeling code"):
        preflight(cfg)


def test_an_unknown_architecture_needs_its_parts_named(remote_model, digits, tmp_path):
    cfg = tiny_run_config(remote_model, digits[0], tmp_path, "parts", "model.trust_remote_code=true")
    with pytest.raises(ConfigError, match="model.language_model, model.vision_tower and model.aligner"):
        preflight(cfg)
    with pytest.raises(ConfigError, match="set together"):
        config.load(None, ["model.path=m", "data.train=t.parquet", "model.language_model=model.layers"])


def test_with_trust_remote_code_the_preflight_builds_it_from_its_own_code(remote_model, digits, tmp_path):
    from transformers import AutoConfig

    from raylora.resume import expected_trainable

    cfg = tiny_run_config(remote_model, digits[0], tmp_path, "trusted", *REMOTE_PARTS)
    arch = preflight(cfg)
    assert (arch.model_type, arch.language_model, arch.aligner) == (
        "raylora_remote_vlm",
        ("model.language_model",),
        ("model.multi_modal_projector",),
    )
    assert for_model(str(remote_model), cfg.model) == arch
    model_config = AutoConfig.from_pretrained(remote_model, trust_remote_code=True)
    assert type(model_config).__name__ == "RemoteVlmConfig"  # the folder's class, not transformers'
    trained = expected_trainable(cfg)  # the meta-device model, built from the folder's code
    assert any(".lora_A." in n for n in trained) and any(n.startswith("model.vision_tower.") for n in trained)


def test_weights_the_files_lack_are_refused_not_initialised_at_random(tiny_models, digits, tmp_path):
    """transformers only warns when a weight is missing from the files; raylora refuses the model."""
    from raylora.arch import for_model
    from raylora.model import build_model

    model = make_remote_code_model(tiny_models("llava"), tmp_path / "legacy", legacy_names=True)
    cfg = tiny_run_config(model, digits[0], tmp_path, "legacy", *REMOTE_PARTS)
    arch = for_model(str(model), cfg.model)
    with pytest.raises(ConfigError, match=r"lm_head.weight.*language_model.lm_head.weight"):
        build_model(cfg, arch, {"zero_optimization": {"stage": 0}})
    fine = make_remote_code_model(tiny_models("llava"), tmp_path / "named")
    cfg = tiny_run_config(fine, digits[0], tmp_path, "named", *REMOTE_PARTS)
    built, _ = build_model(cfg, for_model(str(fine), cfg.model), {"zero_optimization": {"stage": 0}})
    assert type(built.base_model.model).__name__ == "RemoteVlmForConditionalGeneration"
