"""Every tested architecture in the registry: its tiny model's prefixes, batches, and a ZeRO-3 round trip.

The fast tests load each tiny model folder as a worker does and check that the registry describes it;
the distributed test trains each newer architecture for 2 steps on 2 Ray workers under ZeRO-3 and
restores its checkpoint, all on one group of 2 workers (Llava and Qwen2-VL go through the longer
tests/test_resume.py).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForImageTextToText

from raylora.arch import REGISTRY, Architecture, detect, lora_targets
from raylora.assets import TINY_ARCHS
from raylora.data.batches import make_batch
from raylora.data.labels import IGNORE_INDEX
from tests import whole_checkpoint
from tests.probes import resume_probe
from tests.support import tiny_processor, tiny_run_config
from tests.test_batches import ANSWERS, SAMPLES, trained_turns, unspaced

PARTS = ("language_model", "vision_tower", "aligner")
# llava and qwen2_vl go through tests/test_resume.py
NEWER_ARCHS = [
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "glm4v",
    "glm4v_moe",
    "glm46v",
    "idefics3",
    "gemma3",
    "gemma4",
    "internvl",
    "mistral3",
]


# Mixture-of-experts models: LoRA on the fused experts (PEFT's target_parameters) takes no dropout.
MOE = {arch: ("lora.dropout=0",) for arch in ("qwen3_vl_moe", "qwen3_5_moe", "glm4v_moe")}


def test_tested_architectures_are_the_tiny_ones():
    assert {a.model_type for a in REGISTRY.values() if a.tested} == set(TINY_ARCHS)
    assert set(NEWER_ARCHS) < set(TINY_ARCHS)


def _check_prefixes(model: torch.nn.Module, arch: Architecture) -> None:
    """Each part's prefix names parameters of that part; LoRA targets lie under the language model only."""
    names = [n for n, _ in model.named_parameters()]
    for part in PARTS:
        for prefix in getattr(arch, part):
            assert any(n.startswith(prefix + ".") for n in names), f"{part} prefix {prefix} matches nothing"
            assert any(n.startswith(prefix + ".") and arch.part_of(n) == part for n in names), (
                f"{prefix} is shadowed by another part's prefix"
            )
    pattern, experts = lora_targets(model, arch, None)
    regex = re.compile(pattern)
    targets = [n for n, _ in model.named_modules() if regex.match(n)]
    assert targets, "no LoRA targets"
    # a mixture of experts: its fused expert tensors are the MLP's targets, under the language model
    assert all(arch.part_of(n) == "language_model" and ".experts." in n for n in experts)
    assert all(arch.part_of(n + ".weight") == "language_model" for n in targets)
    assert any(".self_attn." in n for n in targets) and any(".mlp." in n for n in targets + experts)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_registry_prefixes_match_tiny_model(arch, tiny_models):
    folder = tiny_models(arch)
    entry = detect(folder)
    assert entry.model_type == arch and entry.tested
    _check_prefixes(AutoModelForImageTextToText.from_pretrained(folder), entry)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_batch_feeds_forward_and_every_part_learns(arch, tiny_models):
    """make_batch on the folder's processor gives a batch the model takes, for training and generation:
    a multi-turn sample, one with two images of different sizes and a text-only one, side by side."""
    folder = tiny_models(arch)
    entry = detect(folder)
    processor = tiny_processor(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder)
    examples = SAMPLES
    batch = make_batch(processor, examples)
    labels = batch.pop("labels")
    tok = processor.tokenizer
    for row, answers in zip(labels, ANSWERS, strict=True):
        assert unspaced(tok.decode(row[row != IGNORE_INDEX])) == "".join(trained_turns(arch, answers))
    model.train()
    logits = model(**batch).logits
    assert logits.shape[:2] == labels.shape
    loss = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX
    )
    assert math.isfinite(loss.item())
    loss.backward()
    # the image reaches the loss: every part (the vision tower and aligner through the image tokens) learns
    for part in PARTS:
        grads = [p.grad for n, p in model.named_parameters() if entry.part_of(n) == part]
        assert any(g is not None and g.abs().sum() > 0 for g in grads), f"{part} gets no gradient"
    model.eval()
    prompts = make_batch(processor, examples, with_answers=False)
    out = model.generate(**prompts, max_new_tokens=2, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[0] == len(examples) and out.shape[1] > prompts["input_ids"].shape[1]


def test_gemma4_entry_serves_its_mixture_of_experts_checkpoints(tmp_path):
    """Gemma 4's MoE checkpoints are model_type `gemma4` with `enable_moe_block`: fused experts beside the
    dense MLP of each layer, a `router` whose projection is an nn.Linear. The entry names their parts, LoRA
    reaches the experts (raylora.moe) and never the router, and a batch trains every part and generates."""
    from raylora import moe
    from raylora.assets import make_tiny_model

    folder = str(make_tiny_model(tmp_path / "gemma4_moe", "gemma4", moe=True))
    model = AutoModelForImageTextToText.from_pretrained(folder)
    arch = REGISTRY["gemma4"]
    regex, experts = lora_targets(model, arch, None)
    layers = model.config.text_config.num_hidden_layers
    assert sorted(experts) == sorted(
        f"model.language_model.layers.{i}.experts.{leaf}"
        for i in range(layers)
        for leaf in ("gate_up_proj", "down_proj")
    )
    routers = moe.router_modules(model, arch)
    assert routers == [f"model.language_model.layers.{i}.router" for i in range(layers)]
    assert not any(re.match(regex, n) for n, _ in model.named_modules() if n.startswith(tuple(routers)))
    test_registry_prefixes_match_tiny_model("gemma4", lambda arch: folder)
    test_batch_feeds_forward_and_every_part_learns("gemma4", lambda arch: folder)


def test_internvl_entry_serves_internvl3_5_folders_with_a_qwen3_text_model(tmp_path):
    """InternVL3.5's -HF folders are model_type `internvl` (InternVLForConditionalGeneration) around a
    Qwen3 text model (q/k norms, explicit head_dim): the `internvl` entry names their parts, and a batch
    trains every part and generates, as for InternVL3's Qwen2."""
    from raylora.assets import make_tiny_model

    folder = str(make_tiny_model(tmp_path / "internvl3_5", "internvl", text_model="qwen3"))
    model = AutoModelForImageTextToText.from_pretrained(folder)
    assert model.config.text_config.model_type == "qwen3"
    assert any(n.endswith(".self_attn.q_norm.weight") for n, _ in model.named_parameters())
    test_registry_prefixes_match_tiny_model("internvl", lambda arch: folder)
    test_batch_feeds_forward_and_every_part_learns("internvl", lambda arch: folder)


@pytest.fixture(scope="module")
def round_trips(ray_cluster, probes, tiny_models, digits, tmp_path_factory):
    """Each newer architecture trained 2 steps, its step-2 checkpoint restored into a fresh engine, and
    step 3 trained from there as from the uninterrupted run, one after the other on one group of 2
    workers (a worker group's start is most of a tiny run's time). A real kill and restart goes through
    the same restore (tests/test_resume.py, tests/test_faults.py)."""
    storage = tmp_path_factory.mktemp("round-trips")
    runs = [
        (arch, four_steps(tiny_models(arch), digits[0], storage, f"two-steps-{arch}", arch), storage / arch)
        for arch in NEWER_ARCHS
    ]
    done = probes(
        lambda: {
            arch: resume_probe(cfg, 2, f"{folder}-checkpoint", f"{folder}.safetensors")
            for arch, cfg, folder in runs
        }
    )
    return {arch: (done[arch], f"{folder}-checkpoint", f"{folder}.safetensors") for arch, _, folder in runs}


# Qwen3-VL trains in bf16 here (its merger inside the vision tower, as Qwen2-VL's): the restore and the
# killed run below show bf16's fp32 masters surviving both.
BF16 = {"qwen3_vl": ("train.precision=bf16",)}


def four_steps(model_dir, data, storage, name: str, arch: str, *overrides: str):
    """The round trips' run: 4 steps, a checkpoint at step 2 (the round trip trains 3, 4 with `keep`)."""
    extra = ("train.max_steps=4", "train.checkpoint_every=2", *MOE.get(arch, ()), *BF16.get(arch, ()))
    return tiny_run_config(model_dir, data, storage, name, *extra, *overrides)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("arch", NEWER_ARCHS)
def test_zero3_two_steps_then_restore_equals_checkpoint_and_resumes_bitwise(arch, round_trips):
    resumed, folder, _ = round_trips[arch]
    probe = resumed["restored"]  # the restored engine before its first step
    metrics = resumed["metrics"]
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(math.isfinite(m["loss"]) for m in metrics)
    # step 3 from the restored engine is step 3 of the uninterrupted run, bit for bit
    assert resumed["resumed"]["step"] == 3 and resumed["resumed"]["loss"] == metrics[2]["loss"]
    assert resumed["masters_equal"] and resumed["moments_equal"]
    # a mixture of experts trains its load-balancing loss beside the answers' (raylora.moe)
    assert all(("aux_loss" in m) == (arch in MOE) for m in metrics)
    assert all(m["aux_loss"] > 0 for m in metrics if arch in MOE)
    loaded = whole_checkpoint.load(folder)
    assert loaded.state.step == 2
    entry = REGISTRY[arch]
    trained = {entry.part_of(n) for n in loaded.state.trainable}
    assert trained == set(PARTS), f"trained parts {trained}: LoRA, vision tower and aligner expected"
    assert probe["step"] == 2
    assert probe["lr"] == loaded.state.scheduler["_last_lr"][0]
    assert probe["moments_nonzero"]
    assert probe["params_equal"], "model parameters differ from the checkpoint after restore"
    assert probe["masters_equal"], "fp32 masters differ from the checkpoint: a step would undo the load"
    assert probe["moments_equal"]


# The families people fine-tune now also go through a real kill: Ray Train restarts the worker group after
# rank 1 dies, and the new workers resume from step 2's checkpoint. The round trips above are the
# uninterrupted reference, computed by the same `worker.setup` and `train_step`.
# (Qwen2.5-VL, Idefics3, Gemma 3 and Mistral 3 restore in the round trips only.)
KILLED_ARCHS = [a for a in NEWER_ARCHS if a not in ("qwen2_5_vl", "idefics3", "gemma3", "mistral3")]


@pytest.fixture(scope="module")
def killed_runs(ray_cluster, tiny_models, digits, tmp_path_factory):
    """`killed_runs(arch)`: the round trips' run on Ray Train, rank 1 killed after step 3 once Ray has
    step 2's checkpoint; the new workers train steps 3 and 4. Once per module and architecture."""
    from raylora.driver import run

    done = {}

    def get(arch: str):
        if arch not in done:
            storage = tmp_path_factory.mktemp(f"killed-{arch}")
            result = run(
                four_steps(tiny_models(arch), digits[0], storage, "killed", arch, "fault.kill_at_steps=3")
            )
            assert result.error is None
            done[arch] = (result, storage)
        return done[arch]

    return get


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("arch", KILLED_ARCHS)
def test_zero3_run_killed_after_its_checkpoint_resumes_bitwise(arch, round_trips, killed_runs):
    from safetensors.torch import load_file

    from raylora.progress import read_metrics
    from tests.run_logs import final_checkpoint

    uninterrupted, _, kept = round_trips[arch]
    reference = load_file(kept)
    killed, storage = killed_runs(arch)
    rows = read_metrics(str(storage), "killed")
    # step 3's first row died with the workers, before its report
    assert [(r["step"], r["restarts"]) for r in rows] == [(1, 0), (2, 0), (3, 1), (4, 1)]
    # both attempts trained as the uninterrupted run did, bit for bit
    assert [r["loss"] for r in rows] == [
        m["loss"] for m in (*uninterrupted["metrics"], uninterrupted["after"])
    ]
    final = final_checkpoint(killed)
    assert final.state.step == 4 and final.state.restarts == 1
    assert {f"weight.{n}" for n in final.weights} | {f"moment.{n}" for n in final.moments} == reference.keys()
    for name, value in final.weights.items():
        assert torch.equal(value, reference[f"weight.{name}"]), f"{name} differs after the resume"
    for name, value in final.moments.items():
        assert torch.equal(value, reference[f"moment.{name}"]), f"{name} differs after the resume"
    assert {REGISTRY[arch].part_of(n) for n in final.weights} == set(PARTS)


@pytest.mark.distributed
@pytest.mark.slow
def test_bf16_checkpoint_holds_fp32_masters_beyond_bf16(killed_runs):
    """The killed bf16 run's final checkpoint (Qwen3-VL, vision tower and aligner trained) holds fp32
    masters and moments, not bf16 values cast up."""
    from tests.run_logs import final_checkpoint

    final = final_checkpoint(killed_runs("qwen3_vl")[0])
    assert final.state.config["train"]["precision"] == "bf16"
    assert any(".lora_" not in n and ".merger." in n for n in final.weights), "the aligner should be trained"
    assert all(t.dtype == torch.float32 for t in final.weights.values())
    assert all(t.dtype == torch.float32 for t in final.moments.values())
    # masters that were only bf16 values cast up would equal their bf16 rounding everywhere; every
    # parameter that received gradients must not
    updated = [n for n in final.weights if final.moments[f"{n}.exp_avg_sq"].abs().sum() > 0]
    assert len(updated) > len(final.weights) // 2
    bf16_only = [n for n in updated if torch.equal(final.weights[n], final.weights[n].bfloat16().float())]
    assert not bf16_only, f"masters with bf16 precision only: {bf16_only}"
