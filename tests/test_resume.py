"""Kill a worker after a checkpoint; the resumed run must equal the uninterrupted one bit for bit.

Real Ray workers, real DeepSpeed ZeRO-3 (every parameter partitioned), gloo on CPU, 2 workers. The killed
run also meets what a real crash leaves and a real storage does: a checkpoint folder whose upload never
completed, a local folder rank 0 was writing a checkpoint into, and reads of the newest checkpoint that
fail for a moment on one rank, which must be retried rather than taken for damage (that rank would fall
back to an older step than the others restore).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from raylora import checkpoint
from tests import whole_checkpoint
from tests.probes import restore_probe
from tests.run_logs import final_checkpoint as _final
from tests.support import tiny_run_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

KILL_AT = 5  # rank 1 dies before step 6 (5 steps done); the last checkpoints were at steps 4 and 2
VISION_LR = "train.vision_lr=5e-4"  # the vision tower and aligner on a schedule of their own


# One architecture here: Qwen2-VL (its aligner inside the vision tower, prefixes that overlap) is killed
# and resumed bit for bit in tests/test_batches.py, the families from Qwen3-VL on (Qwen3-VL in bf16) in
# tests/test_architectures.py, where every other architecture restores exactly too.
@pytest.fixture(scope="module", params=["llava"])
def runs(request, ray_cluster, straight_runs, tiny_models, digits, tmp_path_factory):
    """The uninterrupted run is the session's; the killed one is this module's: rank 1 dies before step
    6, then its first two reads of a checkpoint fail, and the run folder holds a crashed attempt's
    leftovers."""
    from raylora import resume
    from raylora.driver import run

    arch = request.param
    storage = tmp_path_factory.mktemp(f"runs-{arch}")
    model_dir = tiny_models(arch)
    straight = straight_runs(arch, VISION_LR)
    cfg = tiny_run_config(
        model_dir,
        digits[0],
        storage,
        "killed",
        VISION_LR,
        f"fault.kill_at_steps={KILL_AT}",
        "fault.read_errors=2",
        "fault.read_error_rank=1",
    )
    partial = storage / "killed" / "checkpoint_0000-partial"
    partial.mkdir(parents=True)
    (partial / checkpoint.ADAPTER_WEIGHTS).write_bytes(b"cut short")
    staged = Path(resume.new_staging_folder(cfg, 4))
    (staged / checkpoint.STATE).write_text("{")
    killed = run(cfg)
    assert killed.error is None
    return {
        "arch": arch,
        "model_dir": model_dir,
        "straight": straight,
        "killed": killed,
        "storage": storage,
        "leftovers": [partial, staged],
    }


def test_resumed_run_equals_uninterrupted_bitwise(runs):
    straight, killed = _final(runs["straight"]), _final(runs["killed"])
    assert killed.state.restarts == 1, "the fault drill should have forced exactly one resume"
    assert straight.state.restarts == 0
    assert straight.state.step == killed.state.step == 6
    assert straight.weights.keys() == killed.weights.keys()
    for name, value in straight.weights.items():
        assert torch.equal(value, killed.weights[name]), f"{name} differs after resume"
    for name, value in straight.moments.items():
        assert torch.equal(value, killed.moments[name]), f"{name} differs after resume"
    # vision tower and aligner were trained (not silently frozen again by the restore)
    parts = {n.split(".")[1] for n in straight.weights if ".lora_" not in n}
    assert parts, "no vision tower / aligner weights in the checkpoint"


def test_transient_read_error_on_one_rank_still_restores_the_newest(runs):
    """Rank 1's failed reads were retried, not taken for damage: every rank resumed from step 4, not 2;
    the crashed attempt's leftovers were cleared, and the checkpoints Ray recorded (as raylora reads Ray's
    snapshot) are the ones in the run folder."""
    import pyarrow.fs

    from raylora.progress import read_metrics
    from raylora.storage import recorded_checkpoints

    run_dir = runs["storage"] / "killed"
    assert (run_dir / ".raylora-drill-read-errors").read_text() == "2", "the read drill did not fire twice"
    rows = read_metrics(str(runs["storage"]), "killed")
    assert [r["step"] for r in rows if r["restarts"] == 1][0] == KILL_AT
    assert not any(folder.exists() for folder in runs["leftovers"])
    kept = {p.name for p in run_dir.glob("checkpoint_*") if p.is_dir()}
    assert recorded_checkpoints(pyarrow.fs.LocalFileSystem(), str(run_dir)) == kept and len(kept) == 3


def test_losses_after_resume_equal_uninterrupted(runs):
    straight = {m["step"]: m["loss"] for m in runs["straight"].return_value}
    resumed = runs["killed"].return_value  # the last attempt's steps: 5 and 6, after resuming at step 4
    assert [m["step"] for m in resumed] == [5, 6]
    for m in resumed:
        assert m["loss"] == straight[m["step"]], f"loss at step {m['step']} differs after resume"
    assert all(m["restarts"] == 1 for m in resumed)


def test_metrics_carry_the_lr_each_step_trained_at(runs):
    """Each row's lr and vision_lr are the rates its own step used, read off the schedule, not the next."""
    from transformers import get_cosine_schedule_with_warmup

    peak = {"lr": 1e-3, "vision_lr": 5e-4}  # tiny_run_config's train.lr and VISION_LR
    groups = [{"params": [torch.zeros(1, requires_grad=True)], "lr": lr} for lr in peak.values()]
    optimizer = torch.optim.SGD(groups)
    schedule = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=6)
    expected = {}
    for step in range(1, 7):
        expected[step] = schedule.get_last_lr()
        optimizer.step()
        schedule.step()
    rows = runs["straight"].return_value + runs["killed"].return_value
    for m in rows:
        assert [m["lr"], m["vision_lr"]] == pytest.approx(expected[m["step"]], rel=1e-12), m["step"]
    last = max(rows, key=lambda m: m["step"])
    assert last["step"] == 6 and last["lr"] > 0, (
        "the last step trained at a positive lr, not the 0.0 after it"
    )


def test_checkpoint_holds_only_trained_state(runs):
    folder = Path(runs["straight"].checkpoint.path)
    state = json.loads((folder / checkpoint.STATE).read_text())
    names = set(state["trainable"])
    assert all(
        ".lora_" in n or ".vision_tower." in n or ".multi_modal_projector." in n or ".visual." in n
        for n in names
    )
    stored = set(load_file(folder / checkpoint.TRAINED_MODULES)) | {n for n in names if ".lora_" in n}
    assert stored == names
    assert not any(
        "embed_tokens" in n
        or "lm_head" in n
        or (".layers." in n and ".lora_" not in n and "language_model" in n)
        for n in stored
    )
    trainable = sum(math.prod(s) for s in state["trainable"].values())
    big = [checkpoint.ADAPTER_WEIGHTS, checkpoint.TRAINED_MODULES, checkpoint.OPTIMIZER]
    big_bytes = sum((folder / f).stat().st_size for f in big)
    # 12 bytes per trainable parameter (fp32 weight + two Adam moments) plus safetensors headers
    assert 12 * trainable <= big_bytes <= 12 * trainable * 1.02 + 3 * 64 * 1024
    small_bytes = sum(f.stat().st_size for f in folder.iterdir() if f.name not in big)
    assert small_bytes < 64 * 1024


def test_plain_peft_loads_the_adapter(runs):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    folder = Path(runs["straight"].checkpoint.path)
    saved = whole_checkpoint.load(folder).weights
    base = AutoModelForImageTextToText.from_pretrained(runs["model_dir"])
    model = PeftModel.from_pretrained(base, str(folder))
    loaded = {n.removeprefix("base_model.model."): p for n, p in model.named_parameters() if ".lora_" in n}
    lora_saved = {n: t for n, t in saved.items() if ".lora_" in n}
    assert loaded.keys() == lora_saved.keys()
    for name, tensor in lora_saved.items():
        assert torch.equal(loaded[name].detach(), tensor), name


def test_async_upload_killed_right_after_a_checkpoint_resumes_exactly(runs, digits):
    """Rank 0 dies right after handing the step-2 checkpoint to Ray's asynchronous upload: the run
    resumes only from a checkpoint Ray recorded (step 2's if its upload completed, else none) and ends
    equal to the uninterrupted run, bit for bit."""
    import pyarrow.fs

    from raylora import storage
    from raylora.driver import run

    name = "async-killed"
    cfg = tiny_run_config(
        runs["model_dir"],
        digits[0],
        runs["storage"],
        name,
        VISION_LR,
        "run.checkpoint_upload=async",
        "fault.kill_at_steps=2",
        "fault.kill_rank=0",
    )
    result = run(cfg)
    assert result.error is None
    straight, killed = _final(runs["straight"]), _final(result)
    assert killed.state.restarts == 1 and killed.state.step == 6
    for name_, value in straight.weights.items():
        assert torch.equal(value, killed.weights[name_]), f"{name_} differs after resume"
    for name_, value in straight.moments.items():
        assert torch.equal(value, killed.moments[name_]), f"{name_} differs after resume"
    resumed_from = result.return_value[0]["step"] - 1
    assert resumed_from in (0, 2), resumed_from
    run_dir = Path(runs["storage"]) / name
    recorded = storage.recorded_checkpoints(pyarrow.fs.LocalFileSystem(), str(run_dir))
    assert recorded, "Ray recorded no checkpoint"
    for folder in recorded:  # every checkpoint Ray may hand out is complete
        checkpoint.verify(run_dir / folder)


def test_restore_equals_checkpoint_before_any_step(runs, probes, tmp_path):
    arch_ckpt = runs["straight"].best_checkpoints[0][0]  # the step-2 checkpoint, mid-schedule
    with arch_ckpt.as_directory() as folder:
        state = whole_checkpoint.load(folder).state
        cfg = tiny_run_config(runs["model_dir"], state.config["data"]["train"], tmp_path, "probe", VISION_LR)
        probe = probes(lambda: restore_probe(cfg, folder))
    assert probe["step"] == state.step
    assert probe["lr"] == state.scheduler["_last_lr"][0]
    assert probe["moments_nonzero"]
    assert probe["params_equal"], "model parameters differ from the checkpoint after restore"
    assert probe["masters_equal"], (
        "fp32 masters differ from the checkpoint: the next step would undo the load"
    )
    assert probe["moments_equal"]
