"""Single-process pieces: architectures, sampler, batches, checkpoint format."""

from __future__ import annotations

import json

import pytest
import torch

from raylora import checkpoint, config
from raylora.arch import REGISTRY, detect, for_model, lora_target_regex
from raylora.config import ConfigError
from raylora.data.batches import make_batch, read
from raylora.data.formats import open_rows
from raylora.data.labels import IGNORE_INDEX, end_of_turn_ids, last_answer
from raylora.data.processor import load_processor
from raylora.data.sampler import GlobalSampler
from tests import whole_checkpoint
from tests.ray_env import free_port


def test_qwen2_vl_aligner_inside_vision_tower():
    arch = REGISTRY["qwen2_vl"]
    assert arch.part_of("model.visual.merger.mlp.0.weight") == "aligner"
    assert arch.part_of("model.visual.blocks.0.attn.qkv.weight") == "vision_tower"
    assert arch.part_of("model.language_model.layers.0.mlp.up_proj.weight") == "language_model"
    assert arch.part_of("lm_head.weight") is None


def test_qwen3_vl_aligner_is_the_merger_and_the_deepstack_mergers(tiny_models):
    """A part spans several prefixes: Qwen3-VL's DeepStack mergers are aligner, not vision tower, so
    `train.freeze_vision: true` with a trained aligner trains all of them. Named in the config as a list
    for a model the registry does not know, they give the same parts."""
    arch = REGISTRY["qwen3_vl"]
    assert arch.part_of("model.visual.merger.linear_fc1.weight") == "aligner"
    assert arch.part_of("model.visual.deepstack_merger_list.1.norm.weight") == "aligner"
    assert arch.part_of("model.visual.blocks.0.attn.qkv.weight") == "vision_tower"
    assert arch.part_of("model.visual.pos_embed.weight") == "vision_tower"
    named = config.load(
        None,
        [
            f"model.path={tiny_models('qwen3_vl')}",
            "data.train=t.parquet",
            "model.arch=my_qwen3_vl",
            "model.language_model=model.language_model",
            "model.vision_tower=model.visual",
            "model.aligner=[model.visual.merger,model.visual.deepstack_merger_list]",
        ],
    )
    custom = for_model(named.model.path, named.model)
    assert (custom.model_type, custom.tested) == ("my_qwen3_vl", False)
    assert (custom.language_model, custom.vision_tower, custom.aligner) == (
        arch.language_model,
        arch.vision_tower,
        arch.aligner,
    )


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl"])
def test_detect_and_lora_targets(arch, tiny_models):
    from transformers import AutoModelForImageTextToText

    folder = tiny_models(arch)
    a = detect(folder)
    assert a.model_type == arch
    model = AutoModelForImageTextToText.from_pretrained(folder)
    import re

    regex = re.compile(lora_target_regex(model, a, None))
    targets = [n for n, _ in model.named_modules() if regex.match(n)]
    assert targets and all(n.startswith("model.language_model.") for n in targets)
    assert {n.rsplit(".", 1)[1] for n in targets} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    with pytest.raises(ConfigError, match="lora.target_modules: qkv not linear layers"):
        lora_target_regex(model, a, ["qkv"])


def test_sampler_is_global_and_deterministic():
    s = GlobalSampler(num_samples=100, global_batch_size=8, seed=3)
    assert s.global_batch(5) == GlobalSampler(100, 8, 3).global_batch(5)
    assert s.global_batch(5) != GlobalSampler(100, 8, 4).global_batch(5)
    epoch0 = [i for step in range(s.steps_per_epoch) for i in s.global_batch(step)]
    assert len(set(epoch0)) == len(epoch0) == 96  # no repeats within an epoch (drop last)
    assert s.epoch(12) == 1 and s.global_batch(12) != s.global_batch(0)
    for world in (1, 2, 4):  # the global batch is the same whatever the number of workers
        shares = [i for r in range(world) for mb in s.micro_batches(7, r, world, 2) for i in mb]
        assert shares == s.global_batch(7)


def test_uneven_global_batch_splits_within_one_sample():
    from raylora import config

    cfg = config.load(
        None,
        [
            "model.path=m",
            "data.train=t.parquet",
            "scaling.num_workers=[8,16]",
            "train.global_batch_size=128",
            "train.micro_batch_size=4",
        ],
    )
    s = GlobalSampler(num_samples=1000, global_batch_size=128, seed=0)
    for world in cfg.world_sizes:
        shares = s.shares(world)
        assert sum(shares) == 128 and max(shares) - min(shares) <= 1, (world, shares)
        micro = [s.micro_batches(3, rank, world, 4) for rank in range(world)]
        # ZeRO-3: every rank runs as many micro batches as the engine accumulates
        assert {len(m) for m in micro} == {cfg.grad_accum_steps(world)}, world
        assert [i for m in micro for mb in m for i in mb if i is not None] == s.global_batch(3)
        for rank, m in enumerate(micro):
            assert sum(len(mb) for mb in m if mb != [None]) == shares[rank]
            assert all(mb != [None] for mb in m[:-1]) and all(len(mb) <= 4 for mb in m)
    # 8 over 3 ranks, 2 per micro batch: shares 3, 3, 2; the last rank's second pass is a stand-in
    s = GlobalSampler(num_samples=100, global_batch_size=8, seed=0)
    batch = s.global_batch(0)
    assert [s.micro_batches(0, r, 3, 2) for r in range(3)] == [
        [batch[0:2], batch[2:3]],
        [batch[3:5], batch[5:6]],
        [batch[6:8], [None]],
    ]
    with pytest.raises(
        ConfigError, match=r"train.global_batch_size \(4\) is smaller than scaling.num_workers"
    ):
        config.load(
            None,
            [
                "model.path=m",
                "data.train=t.parquet",
                "scaling.num_workers=[2,6]",
                "train.global_batch_size=4",
            ],
        )


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl"])
def test_batches_train_only_on_answer_tokens(arch, tiny_models, digits):
    processor = load_processor(tiny_models(arch))
    data = open_rows(str(digits[0]))
    examples = [read(data, i) for i in range(3)]
    batch = make_batch(processor, examples)
    labels = batch["labels"]
    tok = processor.tokenizer
    for row, (messages, _) in zip(labels, examples, strict=True):
        kept = row[row != IGNORE_INDEX].tolist()  # the answer and the token that ends the assistant's turn
        assert tok.decode(kept[:-1]) == last_answer(messages) and kept[-1] == end_of_turn_ids(processor)[-1]
    assert batch["input_ids"].shape == labels.shape == batch["attention_mask"].shape
    gen = make_batch(processor, examples, with_answers=False)
    assert "labels" not in gen and (gen["input_ids"][:, -1] != tok.pad_token_id).all()  # left padded


def _tiny_state(trainable):
    return checkpoint.TrainState(
        step=3,
        epoch=0,
        sampler={"seed": 0, "num_samples": 10, "global_batch_size": 2},
        scheduler={"last_epoch": 3},
        world_size=2,
        trainable=trainable,
        config={},
        versions=checkpoint.versions(),
    )


class _AdapterConfig:
    def save_pretrained(self, folder):
        (__import__("pathlib").Path(folder) / checkpoint.ADAPTER_CONFIG).write_text("{}")


def test_checkpoint_save_load_roundtrip_and_manifest(tmp_path):
    lora = "model.language_model.layers.0.self_attn.q_proj.lora_A.default.weight"
    vis = "model.vision_tower.encoder.layers.0.mlp.fc1.weight"
    weights = {lora: torch.randn(4, 8), vis: torch.randn(3, 5)}
    moments = {f"{n}.{k}": torch.randn_like(t) for n, t in weights.items() for k in ("exp_avg", "exp_avg_sq")}
    state = _tiny_state({n: list(t.shape) for n, t in weights.items()})
    whole_checkpoint.save(tmp_path, weights, moments, state, _AdapterConfig())
    loaded = whole_checkpoint.load(tmp_path)
    assert loaded.state == state
    assert all(torch.equal(loaded.weights[n], t) for n, t in weights.items())
    assert all(torch.equal(loaded.moments[n], t) for n, t in moments.items())
    manifest = json.loads((tmp_path / checkpoint.MANIFEST).read_text())
    assert set(manifest["files"]) == {
        checkpoint.ADAPTER_CONFIG,
        checkpoint.ADAPTER_WEIGHTS,
        checkpoint.TRAINED_MODULES,
        checkpoint.OPTIMIZER,
        checkpoint.STATE,
    }
    # damage: an altered byte, then a truncation, then a missing file
    path = tmp_path / checkpoint.OPTIMIZER
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match="optimizer.safetensors does not match its sha256"):
        whole_checkpoint.load(tmp_path)
    path.write_bytes(bytes(data[:-10]))
    with pytest.raises(checkpoint.CheckpointError, match="optimizer.safetensors has .* bytes"):
        whole_checkpoint.load(tmp_path)
    path.unlink()
    with pytest.raises(
        checkpoint.CheckpointError, match="optimizer.safetensors listed in the manifest is missing"
    ):
        whole_checkpoint.load(tmp_path)


def test_incompatible_checkpoint_names_first_difference():
    state = _tiny_state({"a.lora_A.default.weight": [4, 8], "b.lora_B.default.weight": [8, 4]})
    with pytest.raises(
        checkpoint.CheckpointError,
        match=r"a.lora_A.default.weight: expected shape \[2, 8\], "
        r"checkpoint has \[4, 8\]",
    ):
        checkpoint.check_compatible(
            state, {"a.lora_A.default.weight": [2, 8], "b.lora_B.default.weight": [8, 2]}
        )
    with pytest.raises(checkpoint.CheckpointError, match="lacks trainable parameter c.weight"):
        checkpoint.check_compatible(state, {"a.lora_A.default.weight": [4, 8], "c.weight": [1]})
    with pytest.raises(checkpoint.CheckpointError, match="has trainable parameter b.lora_B"):
        checkpoint.check_compatible(state, {"a.lora_A.default.weight": [4, 8]})


@pytest.mark.parametrize("frozen", ["true", "false"])
def test_what_is_trained_has_one_definition(frozen, tiny_models, digits, tmp_path):
    """The driver's meta-device shapes equal those of the model a worker builds and marks."""
    from transformers import AutoModelForImageTextToText

    from raylora.model import add_lora, mark_trained, shapes
    from raylora.resume import expected_trainable
    from tests.support import tiny_run_config

    folder = tiny_models("qwen2_vl")
    cfg = tiny_run_config(
        folder, digits[0], tmp_path, "one", f"train.freeze_vision={frozen}", "train.freeze_aligner=false"
    )
    arch = detect(folder)
    real = mark_trained(add_lora(AutoModelForImageTextToText.from_pretrained(folder), cfg, arch), arch, cfg)
    assert expected_trainable(cfg) == shapes(real)
    parts = {arch.part_of(n) for n in real if ".lora_" not in n}
    assert parts == ({"aligner"} if frozen == "true" else {"aligner", "vision_tower"})
    assert detect(folder) is arch  # detected once per process, then remembered


def test_a_worker_imports_deepspeed_without_mlflow_and_mlflow_still_imports_after():
    """raylora.ds keeps DeepSpeed's autotuner from importing MLflow at every worker start (about a
    second); a fresh process, as a Ray worker starts, then imports MLflow as usual."""
    import subprocess
    import sys

    code = (
        "import sys, raylora.worker\n"
        "assert 'deepspeed' in sys.modules\n"
        "assert 'mlflow' not in sys.modules, 'DeepSpeed imported MLflow'\n"
        "import mlflow\n"
        "assert mlflow.__version__\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _on_one_rank_zero3_engine(before: str, after: str) -> None:
    """Run `before`, a one-rank gloo group with a ZeRO-3 engine (`engine`) on a small Linear, then `after`,
    in a fresh Python process (what DeepSpeed imports and sets is process-wide); it must exit cleanly."""
    import subprocess
    import sys

    code = (
        "import os, sys, torch, torch.distributed as dist\n"
        + before
        + "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=sys.argv[1], RANK='0', WORLD_SIZE='1',"
        " LOCAL_RANK='0')\n"
        "dist.init_process_group('gloo', rank=0, world_size=1)\n"
        "deepspeed.init_distributed(dist_backend='gloo')\n"
        "config = {'train_micro_batch_size_per_gpu': 1, 'zero_optimization': {'stage': 3},\n"
        "          'optimizer': {'type': 'AdamW', 'params': {'lr': 1e-3, 'torch_adam': True}}}\n"
        "engine, *_ = deepspeed.initialize(model=torch.nn.Linear(4, 4), config=config)\n" + after
    )
    port = str(free_port())
    proc = subprocess.run([sys.executable, "-c", code, port], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_zero3_engine_starts_without_importing_torchinductor():
    """raylora.ds imports DeepSpeed's Muon module with DeepSpeed's compile hook handing functions back:
    a ZeRO-3 engine's start (which imports that module) no longer imports TorchInductor's compiler
    (2.7 s of every worker start), Muon's class is DeepSpeed's, and torch.compile is untouched."""
    _on_one_rank_zero3_engine(
        "from raylora.ds import deepspeed\n"
        "from deepspeed.runtime import compiler\n"
        "from deepspeed.runtime.zero.muon import original_muon\n",
        "assert type(engine.optimizer).__name__ == 'DeepSpeedZeroOptimizer_Stage3'\n"
        "assert 'torch._inductor.compile_fx' not in sys.modules, 'TorchInductor was imported'\n"
        "assert type(original_muon.zeropower_via_newtonschulz5).__name__ == 'function'  # eager\n"
        "assert compiler.compile() is torch.compile\n",
    )


def test_workers_skip_deepspeeds_inference_shm_op():
    """raylora.ds marks DeepSpeed's CPU shared-memory op (inference_all_reduce only) incompatible, so a
    worker's init_distributed neither compiles nor loads it; fails loudly if DeepSpeed renames the op."""
    from deepspeed.comm.torch import build_shm_op
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    from raylora.ds import SKIPPED_OPS

    assert ShareMemCommBuilder.NAME in SKIPPED_OPS
    assert build_shm_op() is None


def test_zero3_steps_start_no_process_once_the_local_size_is_told():
    """DeepSpeed's CPU accelerator counts its devices by running `numactl --hardware` unless LOCAL_SIZE
    is set, and ZeRO-3 asks at every gradient reduce-scatter: a child process per step on every rank (and
    every warning filter reset with it). `tell_local_size`, which `worker.setup` calls, passes it Ray
    Train's LOCAL_WORLD_SIZE; the audit hook sees each `subprocess.Popen`, before it and after it."""
    _on_one_rank_zero3_engine(
        "from raylora.ds import deepspeed, tell_local_size\n"
        "from deepspeed.accelerator import get_accelerator\n"
        "spawned = []\n"
        "sys.addaudithook(lambda event, args: event == 'subprocess.Popen' and spawned.append(args[1]))\n"
        "os.environ.update(LOCAL_WORLD_SIZE='1')\n"
        "os.environ.pop('LOCAL_SIZE', None)\n",
        "def steps(n):\n"
        "    spawned.clear()\n"
        "    for _ in range(n):\n"
        "        engine.backward(engine(torch.ones(1, 4)).sum())\n"
        "        engine.step()\n"
        "    return list(spawned)\n"
        "untold = steps(3)\n"
        "assert len(untold) >= 3 and all('numactl' in str(a) for a in untold), untold\n"
        "tell_local_size()\n"
        "assert os.environ['LOCAL_SIZE'] == '1' and get_accelerator().device_count() == 1\n"
        "assert steps(3) == [], 'a ZeRO-3 step still starts a process'\n",
    )
