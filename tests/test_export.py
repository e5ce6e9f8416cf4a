"""`raylora export` and `raylora eval` on checkpoints written without Ray.

The checkpoints are built the way a worker builds its model (`build_model`, `set_trainable`), with
every trainable tensor perturbed so that LoRA B and the vision tower / aligner are far from their
initial values, then written with `checkpoint.save`, as `worker.save_checkpoint` writes them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from raylora import checkpoint, cli, config
from raylora.arch import detect
from raylora.data.batches import make_batch, read
from raylora.data.formats import open_rows
from raylora.data.labels import end_of_turn_ids
from raylora.data.processor import load_processor
from raylora.evaluate import load_for_inference
from raylora.model import build_model, set_trainable, shapes, trainable_parameters


def make_checkpoint(folder: Path, model_dir: str, train_file, *overrides: str) -> Path:
    """A checkpoint whose every trainable tensor (LoRA B included) is random and nonzero."""
    cfg = config.load(
        None,
        [
            f"model.path={model_dir}",
            f"data.train={train_file}",
            "train.freeze_vision=false",
            "train.freeze_aligner=false",
            "lora.r=4",
            "lora.alpha=8",
            "scaling.num_workers=1",
            "train.global_batch_size=4",
            "train.micro_batch_size=4",
            *overrides,
        ],
    )
    arch = detect(model_dir)
    # ZeRO stage 0: build_model's HfDeepSpeedConfig then leaves from_pretrained alone (no partitioning).
    model, zero3 = build_model(cfg, arch, {"zero_optimization": {"stage": 0}})
    del zero3
    set_trainable(model, arch, cfg)
    params = trainable_parameters(model)
    torch.manual_seed(1)
    weights = {name: p.detach() + 0.05 * torch.randn_like(p) for name, p in params.items()}
    moments = {f"{n}.{k}": torch.rand_like(t) for n, t in weights.items() for k in ("exp_avg", "exp_avg_sq")}
    state = checkpoint.TrainState(
        step=5,
        epoch=0,
        sampler={"seed": 0, "num_samples": 100, "global_batch_size": 4},
        scheduler={},
        world_size=1,
        trainable=shapes(params),
        config=cfg.to_dict(),
        versions=checkpoint.versions(),
    )
    checkpoint.save(folder, weights, moments, state, model.peft_config["default"])
    return folder


@pytest.fixture(scope="module", params=["llava", "qwen2_vl"])
def trained(request, tiny_models, digits, tmp_path_factory):
    """(arch, model folder, checkpoint folder) with LoRA and vision tower / aligner trained."""
    model_dir = tiny_models(request.param)
    folder = tmp_path_factory.mktemp(f"ckpt-{request.param}")
    return request.param, model_dir, make_checkpoint(folder, model_dir, digits[0])


@pytest.fixture(scope="module")
def batch_examples(digits):
    data = open_rows(str(digits[1]))
    return [read(data, i) for i in range(3)]


@torch.no_grad()
def _logits(model, processor, examples) -> torch.Tensor:
    batch = make_batch(processor, examples)
    batch.pop("labels")
    return model(**batch).logits


def test_merged_export_equals_base_plus_adapter(trained, batch_examples, tmp_path):
    arch, model_dir, ckpt = trained
    out = tmp_path / "merged"
    assert cli.main(["export", str(ckpt), "--out", str(out), "--merge"]) == 0

    merged = AutoModelForImageTextToText.from_pretrained(out).eval()
    assert not any(".lora_" in n for n in merged.state_dict())
    # generation stops where training labelled the stop (not only at the base config's EOS)
    stop = end_of_turn_ids(load_processor(out))
    eos = merged.generation_config.eos_token_id
    assert set(stop) <= set(eos if isinstance(eos, list) else [eos])
    trained_modules = load_file(ckpt / checkpoint.TRAINED_MODULES)
    assert trained_modules, "the checkpoint should train the vision tower and aligner"
    state = merged.state_dict()
    for name, value in trained_modules.items():
        assert torch.equal(state[name], value), f"{name} not put in place in the merged model"

    reference, processor = load_for_inference(ckpt)  # PeftModel + trained modules
    expected = _logits(reference, processor, batch_examples)
    got = _logits(merged, load_processor(out), batch_examples)  # the processor saved beside it
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    base = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    assert (_logits(base, processor, batch_examples) - expected).abs().max() > 1e-3, (
        "the checkpoint barely changes the model: the comparison above proves nothing"
    )


def test_adapter_export_loads_with_peft(trained, batch_examples, tmp_path):
    arch, model_dir, ckpt = trained
    out = tmp_path / "adapter"
    out.mkdir()  # an existing empty folder is accepted
    assert cli.main(["export", str(ckpt), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [checkpoint.ADAPTER_CONFIG, checkpoint.ADAPTER_WEIGHTS, checkpoint.TRAINED_MODULES]
    )
    base = AutoModelForImageTextToText.from_pretrained(model_dir)
    model = PeftModel.from_pretrained(base, str(out)).eval()
    _, unexpected = model.base_model.model.load_state_dict(
        load_file(out / checkpoint.TRAINED_MODULES), strict=False
    )
    assert not unexpected
    reference, processor = load_for_inference(ckpt)
    assert torch.equal(
        _logits(model, processor, batch_examples), _logits(reference, processor, batch_examples)
    )


def test_adapter_export_without_trained_modules(tiny_models, digits, tmp_path):
    model_dir = tiny_models("llava")
    ckpt = make_checkpoint(
        tmp_path / "ckpt", model_dir, digits[0], "train.freeze_vision=true", "train.freeze_aligner=true"
    )
    out = tmp_path / "adapter"
    assert cli.main(["export", str(ckpt), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [checkpoint.ADAPTER_CONFIG, checkpoint.ADAPTER_WEIGHTS]


def test_export_and_eval_refuse_bad_input(trained, digits, tmp_path, capsys):
    arch, model_dir, ckpt = trained
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    assert cli.main(["export", str(ckpt), "--out", str(busy)]) == 2
    assert "exists and is not an empty folder" in capsys.readouterr().err
    assert (busy / "keep.txt").read_text() == "mine"

    no_model = ["--model", str(tmp_path)]
    assert cli.main(["export", str(ckpt), "--out", str(tmp_path / "a"), "--merge", *no_model]) == 2
    assert "pass --model" in capsys.readouterr().err
    assert cli.main(["eval", str(ckpt), "--data", str(digits[1]), *no_model]) == 2
    assert "pass --model" in capsys.readouterr().err

    damaged = tmp_path / "damaged"
    shutil.copytree(ckpt, damaged)
    data = bytearray((damaged / checkpoint.ADAPTER_WEIGHTS).read_bytes())
    data[-1] ^= 0xFF
    (damaged / checkpoint.ADAPTER_WEIGHTS).write_bytes(bytes(data))
    assert cli.main(["export", str(damaged), "--out", str(tmp_path / "b"), "--merge"]) == 2
    assert "adapter_model.safetensors does not match its sha256" in capsys.readouterr().err
    assert cli.main(["eval", str(damaged), "--data", str(digits[1])]) == 2
    assert "does not match its sha256" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert [p.name for p in tmp_path.iterdir() if ".partial" in p.name] == []

    assert cli.main(["eval", str(ckpt), "--data", str(tmp_path / "none.parquet")]) == 2
    assert "--data: data file or folder not found" in capsys.readouterr().err


def test_eval_prints_accuracy_and_loss(trained, digits, capsys):
    arch, model_dir, ckpt = trained
    argv = ["eval", str(ckpt), "--data", str(digits[1]), "--max-samples", "6", "--batch-size", "4"]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["samples"] == 6 and result["step"] == 5
    # the same figures as scoring the same 6 samples in this process with plain PEFT
    from raylora.evaluate import evaluate, load_for_inference

    model, processor = load_for_inference(ckpt)
    alone = evaluate(model, processor, str(digits[1]), batch_size=4, max_samples=6)
    assert result["accuracy"] == alone["accuracy"]
    assert result["loss"] == pytest.approx(alone["loss"], rel=1e-6) and result["loss"] > 0
