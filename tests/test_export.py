"""`raylora export` and `raylora eval` on checkpoints written without Ray, on the local disk and in object
storage (a real S3 endpoint on 127.0.0.1, tests.s3_server.S3Server), and where they compute (`--device`).

The checkpoints are built the way a worker builds its model (`build_model`, `set_trainable`), with
every trainable tensor perturbed so that LoRA B and the vision tower / aligner are far from their
initial values, then written with `whole_checkpoint.save`, as `worker.save_checkpoint` writes them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.fs
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from raylora import checkpoint, cli, config, evaluate
from raylora.arch import detect
from raylora.config import ConfigError
from raylora.data.batches import make_batch, read
from raylora.data.formats import open_rows
from raylora.data.labels import end_of_turn_ids
from raylora.evaluate import load_for_inference
from raylora.model import build_model, set_trainable, shapes, trainable_parameters
from tests import whole_checkpoint
from tests.support import template_overrides, tiny_processor


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
            *template_overrides(model_dir),
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
    whole_checkpoint.save(folder, weights, moments, state, model.peft_config["default"])
    return folder


# Mixture-of-experts models: LoRA on the experts takes no dropout (raylora.moe).
OVERRIDES = {arch: ("lora.dropout=0",) for arch in ("qwen3_vl_moe", "qwen3_5_moe", "glm4v_moe")}


EXPORTED = [
    *("llava", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"),
    *("glm4v", "glm4v_moe", "glm46v", "gemma4", "internvl3_5"),
]


@pytest.fixture(scope="module", params=EXPORTED)
def trained(request, tiny_models, digits, tmp_path_factory):
    """(arch, model folder, checkpoint folder) with LoRA and vision tower / aligner trained."""
    model_dir = tiny_models(request.param)
    folder = tmp_path_factory.mktemp(f"ckpt-{request.param}")
    overrides = OVERRIDES.get(request.param, ())
    return request.param, model_dir, make_checkpoint(folder, model_dir, digits[0], *overrides)


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
    stop = end_of_turn_ids(tiny_processor(out))
    eos = merged.generation_config.eos_token_id
    assert set(stop) <= set(eos if isinstance(eos, list) else [eos])
    trained_modules = load_file(ckpt / checkpoint.TRAINED_MODULES)
    assert trained_modules, "the checkpoint should train the vision tower and aligner"
    state = merged.state_dict()
    for name, value in trained_modules.items():
        assert torch.equal(state[name], value), f"{name} not put in place in the merged model"

    reference, processor = load_for_inference(ckpt)  # PeftModel + trained modules
    expected = _logits(reference, processor, batch_examples)
    got = _logits(merged, tiny_processor(out), batch_examples)  # the processor saved beside it
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


# ---------------------------------------------------------------------------------- object storage


def _raylora(*argv: str) -> subprocess.CompletedProcess:
    """The `raylora` command as a user runs it: the virtualenv's script, in a process of its own, with the
    S3 endpoint's environment (the `s3` fixture put it into this process's)."""
    command = Path(sys.executable).parent / "raylora"
    return subprocess.run(
        [str(command), *argv], capture_output=True, text=True, env=dict(os.environ), timeout=600
    )


def _upload_folder(s3, local: Path, *parts: str) -> str:
    """Copy folder `local` to `s3://bucket/parts...`, recursively; returns its URI."""
    uri = s3.uri(*parts)
    pyarrow.fs.copy_files(str(local), uri.removeprefix("s3://"), pyarrow.fs.LocalFileSystem(), s3.fs())
    return uri


def _files(fs: pyarrow.fs.FileSystem, path: str) -> dict[str, bytes]:
    """Every file under `path` by its path relative to it, with its bytes."""
    out = {}
    for info in fs.get_file_info(pyarrow.fs.FileSelector(path, recursive=True)):
        if info.type == pyarrow.fs.FileType.File:
            with fs.open_input_stream(info.path) as f:
                out[info.path[len(path.rstrip("/")) + 1 :]] = f.read()
    return out


@pytest.fixture(scope="module")
def s3_checkpoint(s3, tiny_models, digits, tmp_path_factory):
    """(local checkpoint folder, the same uploaded to s3://bucket/runs/NAME/checkpoint_000005)."""
    local = make_checkpoint(
        tmp_path_factory.mktemp("s3-ckpt") / "checkpoint_000005", tiny_models("llava"), digits[0]
    )
    return local, _upload_folder(s3, local, "runs", "exported", "checkpoint_000005")


def test_eval_takes_an_s3_checkpoint_uri(s3, s3_checkpoint, digits, capsys):
    local, uri = s3_checkpoint
    data = s3.upload(digits[1], "data", "eval.parquet")  # the held-out data in the bucket as well
    proc = _raylora("eval", uri, "--data", data, "--max-samples", "6", "--batch-size", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    remote = json.loads(proc.stdout)
    assert remote["checkpoint"] == uri and remote["device"] == "cpu"  # no GPU here: auto is the CPU
    argv = ["eval", str(local), "--data", str(digits[1]), "--max-samples", "6", "--batch-size", "4"]
    assert cli.main(argv) == 0
    alone = json.loads(capsys.readouterr().out)
    assert {k: v for k, v in remote.items() if k not in ("checkpoint", "loss")} == {
        k: v for k, v in alone.items() if k not in ("checkpoint", "loss")
    }
    assert remote["loss"] == pytest.approx(alone["loss"], rel=1e-6)


def test_export_takes_s3_uris_both_ways(s3, s3_checkpoint, tmp_path):
    local, uri = s3_checkpoint
    fs = s3.fs()
    # s3 -> local adapter, in this process; and local -> s3, which must equal it file for file
    assert cli.main(["export", uri, "--out", str(tmp_path / "adapter")]) == 0
    assert cli.main(["export", str(local), "--out", s3.uri("exports", "adapter")]) == 0
    local_files = _files(pyarrow.fs.LocalFileSystem(), str(tmp_path / "adapter"))
    assert sorted(local_files) == sorted(
        [checkpoint.ADAPTER_CONFIG, checkpoint.ADAPTER_WEIGHTS, checkpoint.TRAINED_MODULES]
    )
    assert _files(fs, f"{s3.bucket}/exports/adapter") == local_files
    # s3 -> s3 merged, as a user runs it; the same files as a merge from the local folder
    proc = _raylora("export", uri, "--out", s3.uri("exports", "merged"), "--merge", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the last line (DeepSpeed, which transformers imports while saving, prints a line of its own before)
    assert proc.stdout.splitlines()[-1] == s3.uri("exports", "merged")
    assert cli.main(["export", str(local), "--out", str(tmp_path / "merged"), "--merge"]) == 0
    merged = _files(fs, f"{s3.bucket}/exports/merged")
    assert "config.json" in merged and "model.safetensors" in merged
    assert merged == _files(pyarrow.fs.LocalFileSystem(), str(tmp_path / "merged"))
    # an output prefix that holds files is refused before anything is read
    assert cli.main(["export", uri, "--out", s3.uri("exports", "adapter")]) == 2


def test_eval_and_export_name_a_damaged_or_missing_s3_checkpoint(s3, s3_checkpoint, digits, tmp_path, capsys):
    local, _ = s3_checkpoint
    damaged = tmp_path / "damaged"
    shutil.copytree(local, damaged)
    data = bytearray((damaged / checkpoint.ADAPTER_WEIGHTS).read_bytes())
    data[-1] ^= 0xFF
    (damaged / checkpoint.ADAPTER_WEIGHTS).write_bytes(bytes(data))
    uri = _upload_folder(s3, damaged, "runs", "damaged", "checkpoint_000005")
    assert cli.main(["eval", uri, "--data", str(digits[1])]) == 2
    err = capsys.readouterr().err
    assert f"{uri}: file adapter_model.safetensors does not match its sha256" in err, err
    assert cli.main(["export", uri, "--out", str(tmp_path / "out")]) == 2
    assert f"{uri}: file adapter_model.safetensors" in capsys.readouterr().err
    missing = s3.uri("runs", "nothing", "checkpoint_000001")
    assert cli.main(["export", missing, "--out", str(tmp_path / "out")]) == 2
    assert f"{missing}: no such folder" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------- devices


def test_device_and_dtype_choice(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert evaluate.inference_device("auto") == torch.device("cpu")
    assert evaluate.inference_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        evaluate.inference_device("cuda")
    assert evaluate.inference_dtype("cpu") == torch.float32
    # a GPU node: auto takes the GPU, in bf16 where the GPU computes in it, fp32 on older ones
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert evaluate.inference_device("auto") == torch.device("cuda")
    assert evaluate.inference_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert evaluate.inference_dtype(torch.device("cuda")) == torch.bfloat16
    assert evaluate.inference_dtype("cpu") == torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert evaluate.inference_dtype("cuda") == torch.float32


class _TooBigForTheGpu(torch.nn.Linear):
    """A model that the GPU has no room for: moving it there raises what CUDA raises."""

    def to(self, *args, **kwargs):
        if any(torch.device(a).type == "cuda" for a in args if isinstance(a, str | torch.device)):
            raise torch.OutOfMemoryError("CUDA out of memory")
        return super().to(*args, **kwargs)


def test_a_gpu_too_small_leaves_auto_on_the_cpu(caplog):
    model = _TooBigForTheGpu(2, 2).to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="raylora"):
        placed = evaluate.place(model, torch.device("cuda"), forced=False)
    assert placed.weight.device.type == "cpu" and placed.weight.dtype == torch.float32
    assert "does not fit on cuda" in caplog.text
    with pytest.raises(torch.OutOfMemoryError):  # --device cuda: asked for, so the error stands
        evaluate.place(model, torch.device("cuda"), forced=True)


def test_eval_on_cuda_without_a_gpu_is_refused_at_once(trained, digits, capsys):
    if torch.cuda.is_available():
        pytest.skip("this node has a GPU")
    _, _, ckpt = trained
    assert cli.main(["eval", str(ckpt), "--data", str(digits[1]), "--device", "cuda"]) == 2
    assert "--device cuda: this node has no CUDA GPU" in capsys.readouterr().err
