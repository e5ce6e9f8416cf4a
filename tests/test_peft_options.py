"""PEFT options under ZeRO-3: DoRA, rsLoRA, PiSSA / OLoRA init, modules_to_save; and the refused ones.

Two option sets, each mixing several options, train 2 steps of a 3-step schedule on 2 Ray workers
(fully partitioned ZeRO-3). The step-2 checkpoint is restored on the same 2 workers and compared with
itself (parameters, fp32 masters, Adam moments), and the restored ZeRO-3 model's logits with what
plain PEFT (`load_for_inference`) and a merged export compute from the same checkpoint: an option that
ZeRO-3 broke in the forward pass (DoRA reads the partitioned base weight) or that the checkpoint saves
under the wrong keys shows there.
"""

from __future__ import annotations

import json
import math

import peft
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from raylora import checkpoint, cli, config, config_checks
from raylora.arch import detect
from raylora.data.batches import make_batch, read
from raylora.data.formats import open_rows
from raylora.data.processor import load_processor
from raylora.driver import preflight
from raylora.evaluate import load_for_inference
from raylora.model import add_lora, base_name, set_trainable, trainable_parameters
from tests import whole_checkpoint
from tests.probes import restore_probe, train_and_save
from tests.support import tiny_run_config

RUNS = {
    "dora": ("lora.use_dora=true", "lora.use_rslora=true", "lora.init=olora"),
    "saved": ("lora.modules_to_save=[lm_head]", "lora.init=pissa"),
    # LoRA on the vision tower's linear layers too (lora.parts), its other weights frozen; the aligner
    # trained fully
    "vision": ("lora.parts=[language_model,vision_tower]", "train.freeze_vision=true"),
}
# no warmup: the first step already moves every trained tensor
SHORT = ("train.max_steps=3", "train.warmup_steps=0")


@pytest.fixture(scope="module")
def runs(ray_cluster, probes, tiny_models, digits, tmp_path_factory):
    """Each option set RUNS names trained 2 steps (mid-schedule: the moments are nonzero) and its
    checkpoint restored, one after the other on one group of 2 workers (a group's start is most of a
    tiny run's time)."""
    model_dir = tiny_models("llava")
    storage = tmp_path_factory.mktemp("peft")
    examples = [read(open_rows(str(digits[1])), i) for i in range(3)]
    out = {}
    for name, options in RUNS.items():
        cfg = tiny_run_config(model_dir, digits[0], storage, name, *SHORT, *options)
        probe = tiny_run_config(model_dir, digits[0], storage, f"probe-{name}", *SHORT, *options)
        out[name] = {"name": name, "model_dir": model_dir, "folder": storage / f"checkpoint-{name}"}
        out[name].update(cfg=cfg, probe_cfg=probe, examples=examples)

    def each():
        return {
            name: (
                train_and_save(trained["cfg"], 2, trained["folder"]),
                restore_probe(trained["probe_cfg"], trained["folder"], examples),
            )
            for name, trained in out.items()
        }

    done = probes(each)
    for name, (metrics, probe) in done.items():
        assert [m["step"] for m in metrics] == [1, 2], name
        out[name]["probe"] = probe
    return out


@pytest.fixture(scope="module", params=list(RUNS))
def trained(request, runs):
    return runs[request.param]


@pytest.mark.distributed
@pytest.mark.slow
def test_restore_equals_checkpoint(trained):
    probe = trained["probe"]
    assert probe["step"] == 2 and probe["moments_nonzero"]
    assert probe["params_equal"], "model parameters differ from the checkpoint after restore"
    assert probe["masters_equal"], "fp32 masters differ from the checkpoint after restore"
    assert probe["moments_equal"], "Adam moments differ from the checkpoint after restore"


@pytest.mark.distributed
@pytest.mark.slow
def test_options_in_effect_and_saved_as_peft_saves_them(trained):
    folder, cfg = trained["folder"], trained["cfg"]
    adapter_config = json.loads((folder / checkpoint.ADAPTER_CONFIG).read_text())
    assert adapter_config["use_dora"] == cfg.lora.use_dora
    assert adapter_config["use_rslora"] == cfg.lora.use_rslora
    assert adapter_config["init_lora_weights"] == cfg.lora.init
    assert adapter_config["modules_to_save"] == cfg.lora.modules_to_save
    adapter = load_file(folder / checkpoint.ADAPTER_WEIGHTS)
    trained_modules = load_file(folder / checkpoint.TRAINED_MODULES)
    base = AutoModelForImageTextToText.from_pretrained(trained["model_dir"])
    original = {n: t.clone() for n, t in base.state_dict().items()}  # PiSSA / OLoRA rewrite it in place
    model = peft.PeftModel.from_pretrained(base, str(folder))
    loaded = {base_name(n): p.detach() for n, p in model.named_parameters()}
    saved = whole_checkpoint.load(folder).weights
    # plain PEFT loads every adapter tensor the checkpoint holds (no key left behind as unexpected)
    for name, tensor in saved.items():
        if checkpoint.is_adapter(name):
            assert torch.equal(loaded[name], tensor), f"PEFT did not load {name}"
    layers = [n.removesuffix(".lora_A.weight") for n in adapter if n.endswith(".lora_A.weight")]
    assert layers
    if cfg.lora.use_dora:
        for layer in layers:
            magnitude = adapter[f"{layer}.lora_magnitude_vector"]
            weight = original[layer.removeprefix(checkpoint.PEFT_PREFIX) + ".weight"]
            norm = torch.linalg.norm(weight, dim=1)  # DoRA starts from the base weight's row norms
            assert not torch.equal(magnitude, norm), f"{layer}: the magnitude was not trained"
            torch.testing.assert_close(magnitude, norm, atol=0.05, rtol=0)
    layer = next(m for m in model.modules() if isinstance(m, peft.tuners.lora.Linear))
    r, alpha = cfg.lora.r, cfg.lora.alpha
    assert layer.scaling["default"] == (alpha / math.sqrt(r) if cfg.lora.use_rslora else alpha / r)
    if cfg.lora.modules_to_save:
        assert "base_model.model.lm_head.weight" in adapter
        assert not any("lm_head" in n for n in trained_modules)
        copy = loaded["lm_head.modules_to_save.default.weight"]
        assert not torch.equal(copy, original["lm_head.weight"]), "lm_head was not trained"
        assert torch.equal(loaded["lm_head.original_module.weight"], original["lm_head.weight"])
    # LoRA where lora.parts says, nothing else of those parts trained or saved
    arch = detect(trained["model_dir"])
    lora_parts = {arch.part_of(layer.removeprefix(checkpoint.PEFT_PREFIX) + ".weight") for layer in layers}
    assert lora_parts == set(cfg.lora.parts)
    assert {arch.part_of(n) for n in trained_modules} == {"vision_tower", "aligner"} - set(cfg.lora.parts)
    if cfg.lora.init in ("olora", "pissa"):
        # the init moved part of each base weight into the adapter; PEFT redoes it when it loads one
        name = layers[0].removeprefix(checkpoint.PEFT_PREFIX) + ".base_layer.weight"
        assert not torch.equal(loaded[name], original[name.replace(".base_layer", "")])


@torch.no_grad()
def _logits(model, processor, examples) -> torch.Tensor:
    batch = make_batch(processor, examples)
    batch.pop("labels")
    return model(**batch).logits


@pytest.mark.distributed
@pytest.mark.slow
def test_plain_peft_and_merged_export_equal_the_zero3_model(trained, tmp_path):
    folder, examples = trained["folder"], trained["examples"]
    zero3 = torch.from_numpy(trained["probe"]["logits"])
    reference, processor = load_for_inference(folder)
    torch.testing.assert_close(_logits(reference, processor, examples), zero3, atol=1e-5, rtol=0)
    out = tmp_path / "merged"
    assert cli.main(["export", str(folder), "--out", str(out), "--merge"]) == 0
    merged = AutoModelForImageTextToText.from_pretrained(out).eval()
    torch.testing.assert_close(_logits(merged, load_processor(out), examples), zero3, atol=1e-5, rtol=0)
    base = AutoModelForImageTextToText.from_pretrained(trained["model_dir"]).eval()
    assert (_logits(base, processor, examples) - zero3).abs().max() > 1e-3, (
        "the adapter barely changes the model: the comparisons above prove nothing"
    )


def _config(model_dir, train, *overrides):
    return config.load(None, [f"model.path={model_dir}", f"data.train={train}", "lora.r=4", *overrides])


@pytest.mark.parametrize("init", [*config_checks.REFUSED_LORA_INITS, "pissa_niter_16", "kaiming"])
def test_refused_inits_say_why(init, tmp_path):
    with pytest.raises(config.ConfigError, match=r"lora\.init") as err:
        _config(tmp_path, tmp_path / "train.parquet", f"lora.init={init}")
    assert "accepted: true, false, gaussian, orthogonal, pissa, olora" in str(err.value)
    why = config_checks.REFUSED_LORA_INITS.get("pissa_niter_<n>" if init.startswith("pissa_niter_") else init)
    assert why is None or why in str(err.value)


def test_a_part_with_lora_and_full_training_is_refused_naming_both_keys():
    for part, key in (("vision_tower", "freeze_vision"), ("aligner", "freeze_aligner")):
        with pytest.raises(config.ConfigError, match=rf"lora.parts has {part} and train.{key}=false"):
            _config("m", "t.parquet", f"lora.parts=[language_model,{part}]", f"train.{key}=false")
    with pytest.raises(config.ConfigError, match=r"lora.parts\[1\]: expected one of language_model"):
        _config("m", "t.parquet", "lora.parts=[language_model,vision]")


def test_bad_option_values_refused(tmp_path):
    train = tmp_path / "train.parquet"
    with pytest.raises(config.ConfigError, match="lora.init=orthogonal needs an even lora.r"):
        _config(tmp_path, train, "lora.init=orthogonal", "lora.r=3")
    for bad in ("[]", "[lm_head,lm_head]", "['']"):
        with pytest.raises(config.ConfigError, match="lora.modules_to_save"):
            _config(tmp_path, train, f"lora.modules_to_save={bad}")
    with pytest.raises(config.ConfigError, match="lora.use_dora: expected bool"):
        _config(tmp_path, train, "lora.use_dora=maybe")


def test_unmatched_modules_to_save_refused_before_ray(tiny_models, digits):
    cfg = _config(tiny_models("llava"), digits[0], "lora.modules_to_save=[lm_head,classifier]")
    with pytest.raises(config.ConfigError, match="lora.modules_to_save: classifier match no module"):
        preflight(cfg)


def test_checkpoint_keys_are_the_keys_peft_saves(tiny_models, digits):
    model_dir = tiny_models("llava")
    cfg = _config(model_dir, digits[0], "lora.use_dora=true", "lora.modules_to_save=[lm_head]")
    from raylora.arch import detect

    arch = detect(model_dir)
    model = add_lora(AutoModelForImageTextToText.from_pretrained(model_dir), cfg, arch)
    set_trainable(model, arch, cfg)
    adapter = [n for n in trainable_parameters(model) if checkpoint.is_adapter(n)]
    assert any(".lora_magnitude_vector." in n for n in adapter)
    assert "lm_head.modules_to_save.default.weight" in adapter
    assert not any(".original_module." in n for n in trainable_parameters(model))
    assert sorted(checkpoint.adapter_key(n) for n in adapter) == sorted(peft.get_peft_model_state_dict(model))
