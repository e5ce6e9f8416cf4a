"""QLoRA (model.quantization): a 4-bit language model under ZeRO-3 on real Ray workers, on CPU.

bitsandbytes 0.50 runs its 4-bit layers on the CPU; these tests load the tiny Llava's language model in NF4,
train LoRA on it (vision tower and aligner unquantized and trained), kill a worker and resume, evaluate
between steps, resume on another worker count, export, and compare one step with transformers + PEFT +
bitsandbytes in one process.
"""

from __future__ import annotations

import sys

import pytest
import torch
from ray.train import TrainingFailedError

from raylora import config
from raylora.config import ConfigError
from raylora.driver import run
from raylora.progress import read_metrics
from tests.probes import assert_weights_close
from tests.run_logs import final_checkpoint
from tests.support import tiny_run_config

pytest.importorskip("bitsandbytes")

QLORA = ("model.quantization=nf4", "lora.dropout=0.0", "train.max_steps=4")
LANGUAGE_MODEL_LINEARS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
OUTSIDE = ["model.vision_tower", "model.multi_modal_projector", "lm_head"]  # as a user would write them


def _bnb(dtype=torch.float32):
    """A user's own BitsAndBytesConfig for the tiny Llava, as the QLoRA guides write it."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=dtype,
        llm_int8_skip_modules=OUTSIDE,
    )


# ------------------------------------------------------------------------------ refused before Ray


def test_int8_is_refused_naming_why():
    with pytest.raises(ConfigError, match=r"model.quantization=int8 .*DeepSpeed casts.*accepted: nf4, fp4"):
        config.load(None, ["model.quantization=int8"])
    with pytest.raises(ConfigError, match="model.quantization: expected one of nf4, fp4"):
        config.load(None, ["model.quantization=nf3"])


@pytest.mark.parametrize(
    ("arch", "overrides", "named"),
    [
        ("qwen3_vl_moe", ["lora.dropout=0"], "experts are fused 3-D tensors"),
        ("llava", ["lora.init=pissa"], "lora.init=pissa with model.quantization"),
        ("llava", ["lora.use_dora=true"], "lora.use_dora with model.quantization"),
    ],
)
def test_what_cannot_work_is_refused_before_ray(arch, overrides, named, tiny_models, digits, tmp_path):
    from raylora.resume import expected_trainable

    cfg = tiny_run_config(
        tiny_models(arch), digits[0], tmp_path, "refused", "model.quantization=nf4", *overrides
    )
    with pytest.raises(ConfigError, match=named):
        expected_trainable(cfg)


def test_without_bitsandbytes_the_run_says_what_to_install(tiny_models, digits, tmp_path, monkeypatch):
    from raylora.resume import expected_trainable

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as on a node where it is not installed
    cfg = tiny_run_config(tiny_models("llava"), digits[0], tmp_path, "no-bnb", "model.quantization=nf4")
    with pytest.raises(ConfigError, match=r"pip install 'raylora\[qlora\]'"):
        expected_trainable(cfg)


# ------------------------------------------------------------------------------ runs on 2 workers


@pytest.fixture(scope="module")
def runs(ray_cluster, tiny_models, digits, tmp_path_factory):
    """QLoRA runs of 4 steps on the digits, a checkpoint every 2: uninterrupted with an evaluation every 2
    steps; killed before step 3 and restarted; failed before step 3 and resumed on 1 worker."""
    storage = tmp_path_factory.mktemp("qlora")
    model, (train, held) = tiny_models("llava"), digits
    evaluated = (f"data.eval={held}", "train.eval_every=2", "train.eval_samples=8")
    straight = run(tiny_run_config(model, train, storage, "straight", *QLORA, *evaluated))
    killed = run(tiny_run_config(model, train, storage, "killed", *QLORA, "fault.kill_at_steps=3"))
    assert straight.error is None and killed.error is None
    once = ("run.max_failures=0", "fault.kill_at_steps=3")
    with pytest.raises(TrainingFailedError):
        run(tiny_run_config(model, train, storage, "elastic", *QLORA, *once))
    elastic = run(tiny_run_config(model, train, storage, "elastic", *QLORA, "scaling.num_workers=1"))
    assert elastic.error is None
    return storage, straight, killed, elastic


@pytest.mark.distributed
@pytest.mark.slow
def test_killed_run_and_evaluations_leave_training_bitwise_the_same(runs):
    storage, straight, killed, _ = runs
    rows = {r["step"]: r for r in read_metrics(str(storage), "straight")}
    assert all("eval_loss" in rows[step] for step in (2, 4)), "the straight run evaluates between steps"
    killed_rows = read_metrics(str(storage), "killed")
    assert max(r["restarts"] for r in killed_rows) == 1, "the drill killed a worker"
    for row in killed_rows:
        assert row["loss"] == rows[row["step"]]["loss"], row["step"]
    ref, got = final_checkpoint(straight), final_checkpoint(killed)
    assert ref.weights.keys() == got.weights.keys()
    for name, value in ref.weights.items():
        assert torch.equal(value, got.weights[name]), name
    for name, value in ref.moments.items():
        assert torch.equal(value, got.moments[name]), name


@pytest.mark.distributed
@pytest.mark.slow
def test_checkpoint_holds_the_adapter_and_trained_parts_only(runs):
    _, straight, _, _ = runs
    final = final_checkpoint(straight)
    names = list(final.weights)
    assert any(".lora_A." in n and "language_model" in n for n in names)
    assert not any("base_layer" in n for n in names), "a quantized base weight was saved"
    lm = [n for n in names if "language_model" in n]
    assert all(".lora_" in n for n in lm), [n for n in lm if ".lora_" not in n][:3]
    assert any(n.startswith("model.vision_tower.") for n in names), "the trained vision tower is saved"
    trainable = sum(t.numel() for t in final.weights.values())
    with straight.checkpoint.as_directory() as folder:
        from pathlib import Path

        size = sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())
    # fp32 masters and two Adam moments: 12 bytes a parameter, plus the manifest and configs
    assert 12 * trainable <= size < 12 * trainable * 1.1 + 200_000, (size, trainable)


@pytest.mark.distributed
@pytest.mark.slow
def test_resuming_on_another_worker_count_stays_within_tolerance(runs):
    storage, straight, _, elastic = runs
    rows = read_metrics(str(storage), "elastic")
    assert [r["world_size"] for r in rows if r["restarts"] == 1] == [1, 1]
    assert_weights_close(final_checkpoint(straight).weights, final_checkpoint(elastic).weights, 1e-5)


@pytest.mark.distributed
@pytest.mark.slow
def test_raylora_eval_scores_the_4bit_model_training_evaluated(runs, digits):
    from raylora.evaluate import evaluate, load_for_inference

    storage, straight, _, _ = runs
    with straight.checkpoint.as_directory() as folder:
        model, processor = load_for_inference(folder, device="cpu")
    layers = dict(model.base_model.model.named_modules())
    assert type(layers["model.language_model.layers.0.self_attn.q_proj.base_layer"]).__name__ == "Linear4bit"
    assert type(layers["model.vision_tower.encoder.layers.0.self_attn.q_proj"]) is torch.nn.Linear
    assert type(layers["model.multi_modal_projector.linear_1"]) is torch.nn.Linear
    assert type(layers["lm_head"]) is torch.nn.Linear
    result = evaluate(model, processor, str(digits[1]), max_samples=8)
    last = read_metrics(str(storage), "straight")[-1]
    assert result["loss"] == pytest.approx(last["eval_loss"], rel=1e-5)
    assert result["accuracy"] == last["eval_accuracy"]


@pytest.mark.distributed
@pytest.mark.slow
def test_export_loads_on_the_4bit_and_the_full_base_and_merges_into_the_original(
    runs, tiny_models, digits, tmp_path
):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from raylora.data.batches import make_batch, read
    from raylora.data.formats import open_rows
    from raylora.data.processor import load_processor
    from raylora.evaluate import load_for_inference
    from raylora.export import export
    from raylora.quant import no_cpu_repack

    _, straight, _, _ = runs
    base_dir = tiny_models("llava")
    processor = load_processor(base_dir)
    rows = open_rows(str(digits[1]))
    batch = make_batch(processor, [read(rows, i) for i in range(2)])
    batch.pop("labels")

    def logits(model):
        with torch.no_grad():
            return model.eval()(**batch).logits

    with straight.checkpoint.as_directory() as folder:
        export(folder, tmp_path / "adapter")
        export(folder, tmp_path / "merged", merge=True, device="cpu")
        raylora_model, _ = load_for_inference(folder, device="cpu")
    on_4bit = PeftModel.from_pretrained(
        AutoModelForImageTextToText.from_pretrained(
            base_dir, quantization_config=_bnb(), dtype=torch.float32
        ),
        str(tmp_path / "adapter"),
    )
    full = AutoModelForImageTextToText.from_pretrained(base_dir, dtype=torch.float32)
    original = full.model.language_model.layers[0].self_attn.q_proj.weight.detach().clone()
    on_full = PeftModel.from_pretrained(full, str(tmp_path / "adapter"))
    # the adapter holds LoRA only: the trained vision tower and aligner come with raylora's own loading
    trained = final_checkpoint(straight).weights
    for model in (on_4bit, on_full):
        model.base_model.model.load_state_dict(
            {n: t for n, t in trained.items() if ".lora_" not in n}, strict=False
        )
    # bitsandbytes' CPU eval path repacks 4-bit weights and computes otherwise: compare as training computes
    no_cpu_repack(on_4bit)
    torch.testing.assert_close(logits(on_4bit), logits(raylora_model), atol=1e-5, rtol=0)
    assert not torch.allclose(logits(on_full), logits(on_4bit), atol=1e-5), "the full base is another model"
    # merged into the base's original weights: W + scale * B @ A, not the 4-bit rounding of W
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    q = "model.language_model.layers.0.self_attn.q_proj"
    scale = 8 / 4  # tiny_run_config's lora.alpha / lora.r
    expected = (
        original + scale * trained[f"{q}.lora_B.default.weight"] @ trained[f"{q}.lora_A.default.weight"]
    )
    torch.testing.assert_close(merged.model.language_model.layers[0].self_attn.q_proj.weight, expected)
    torch.testing.assert_close(logits(merged), logits(on_full), atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------ one step, two ways


def _first_step(cfg, examples: list) -> dict:
    """On each worker: raylora's QLoRA setup (`worker.setup`), this rank's share of `examples` forward and
    backward as one global batch (the loss a mean over all ranks' answer tokens); rank 0 returns the loss
    and every trainable parameter's whole gradient."""
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad

    from raylora.data.batches import make_batch
    from raylora.loss import answer_token_losses
    from raylora.worker import setup

    s = setup(cfg, None)
    rank, world = dist.get_rank(), dist.get_world_size()
    share = len(examples) // world
    batch = make_batch(s.processor, examples[rank * share : (rank + 1) * share])
    labels = batch.pop("labels")
    per_token, _ = answer_token_losses(s.engine, batch, labels)
    totals = torch.stack([per_token.sum().detach(), torch.tensor(float(per_token.numel()))])
    dist.all_reduce(totals)
    s.engine.backward(per_token.sum() * world / totals[1])
    grads = {name: safe_get_full_grad(p) for name, p in s.params.items()}  # collectives: every rank
    s.engine.destroy()
    return {"loss": float(totals[0] / totals[1]), "grads": grads} if rank == 0 else {}


@pytest.mark.distributed
@pytest.mark.slow
def test_one_step_equals_transformers_peft_and_bitsandbytes_in_one_process(
    ray_cluster, probes, tiny_models, digits, tmp_path
):
    """The same 4-bit base, adapter initialisation and global batch of 4, fp32 compute on both sides, and
    `peft.prepare_model_for_kbit_training` on neither: the loss and every LoRA gradient agree within 1e-5."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    from raylora.data.batches import make_batch, read
    from raylora.data.formats import open_rows
    from raylora.data.processor import load_processor

    model_dir = tiny_models("llava")
    cfg = tiny_run_config(
        model_dir,
        digits[0],
        tmp_path,
        "one-step",
        *QLORA,
        "lora.init=false",  # B random too, so that A gets a gradient in the first step
        "train.freeze_vision=true",
        "train.freeze_aligner=true",
        "train.precision=fp32",
        "train.global_batch_size=4",
    )
    rows = open_rows(str(digits[0]))
    examples = [read(rows, i) for i in range(4)]
    got = probes(lambda: _first_step(cfg, examples))

    base = AutoModelForImageTextToText.from_pretrained(
        model_dir, quantization_config=_bnb(), dtype=torch.float32
    )
    base.config.use_cache = False
    torch.manual_seed(cfg.train.seed)
    lora = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LANGUAGE_MODEL_LINEARS, init_lora_weights=False
    )
    model = get_peft_model(base, lora, autocast_adapter_dtype=False).train()  # a training step, as raylora's
    batch = make_batch(load_processor(model_dir), examples)
    labels = batch.pop("labels")
    logits = model(**batch).logits[:, :-1].float()
    loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels[:, 1:], ignore_index=-100)
    loss.backward()
    expected = {
        n.removeprefix("base_model.model."): p.grad for n, p in model.named_parameters() if p.requires_grad
    }

    assert got["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert got["grads"].keys() == expected.keys()
    for name, grad in expected.items():
        assert grad.abs().max() > 0, name
        assert (got["grads"][name] - grad).abs().max() <= 1e-5 * grad.abs().max(), name
