"""Mixture-of-experts language models (raylora.moe) on a tiny Qwen3-VL-MoE: its folders in both expert
layouts load under ZeRO-3 on 2 workers, LoRA reaches the fused experts (and never the routers), the
load-balancing loss is trained as the model computes it, and the merged export loads again.

The tiny model stands for Qwen/Qwen3-VL-30B-A3B-Instruct as transformers 5.23 builds it: the same classes
(`Qwen3VLMoeTextExperts` with fused 3-D `gate_up_proj` [experts, 2 x intermediate, hidden] and
`down_proj` [experts, hidden, intermediate], a `Qwen3VLMoeTextTopKRouter` as `mlp.gate`), 4 experts, 2 per
token. Its "Hub layout" folder holds the expert tensors transposed ([experts, in, out]), as the Hub's
Qwen3-VL-MoE folders do (which is why transformers' conversion transposes them on load); the other is what
transformers 5.23's `save_pretrained` writes.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForImageTextToText

from raylora import config, moe
from raylora.arch import REGISTRY, lora_targets
from raylora.config import ConfigError
from raylora.driver import preflight
from tests.support import tiny_run_config

ARCH = "qwen3_vl_moe"
EXPERTS = ("gate_up_proj", "down_proj")


@pytest.fixture(scope="module")
def layouts(tiny_models, tmp_path_factory) -> dict[str, Path]:
    """Tiny MoE folders in each expert layout a user brings: Qwen3-VL-MoE as transformers 5.23 writes it
    (fused, [experts, out, in]) and as the Hub's folders hold it (fused, transposed: [experts, in, out]);
    GLM-4.5V with one `experts.N.{gate,up,down}_proj.weight` per expert, as zai-org/GLM-4.5V's safetensors
    hold them and as transformers 5.23 writes them too (its conversion merges them on load)."""
    written = Path(tiny_models("qwen3_vl_moe"))
    hub = Path(shutil.copytree(written, tmp_path_factory.mktemp("hub-layout") / "qwen3_vl_moe"))
    weights = load_file(written / "model.safetensors")
    transposed = {k: v.transpose(1, 2).contiguous() if ".experts." in k else v for k, v in weights.items()}
    save_file(transposed, hub / "model.safetensors", {"format": "pt"})
    return {
        "qwen3_vl_moe written": written,
        "qwen3_vl_moe hub": hub,
        "glm4v_moe": Path(tiny_models("glm4v_moe")),
    }


def _fused(weights: dict) -> dict:
    """The fused expert tensors a folder's weights give the model: as they are, or merged from one tensor
    per expert (gate and up concatenated, as transformers' conversion for GLM-4.5V does)."""
    out = {
        k: v
        for k, v in weights.items()
        if k.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))
    }
    layers = {k.split(".mlp.experts.")[0] for k in weights if ".mlp.experts.0." in k}
    for layer in layers:
        n = len(
            {k for k in weights if k.startswith(f"{layer}.mlp.experts.") and k.endswith(".down_proj.weight")}
        )
        expert = [
            [weights[f"{layer}.mlp.experts.{e}.{w}_proj.weight"] for e in range(n)]
            for w in ("gate", "up", "down")
        ]
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.cat(
            [torch.stack(expert[0]), torch.stack(expert[1])], 1
        )
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack(expert[2])
    return out


def test_lora_reaches_the_experts_and_never_the_routers(tiny_models):
    model = AutoModelForImageTextToText.from_pretrained(tiny_models(ARCH))
    arch = REGISTRY[ARCH]
    regex, experts = lora_targets(model, arch, None)
    layers = model.config.text_config.num_hidden_layers
    assert sorted(experts) == sorted(
        f"model.language_model.layers.{i}.mlp.experts.{leaf}" for i in range(layers) for leaf in EXPERTS
    )
    assert moe.router_modules(model, arch) == [
        f"model.language_model.layers.{i}.mlp.gate" for i in range(layers)
    ]
    assert "gate" not in regex
    # lora.target_modules picks among linear layers and expert tensors by leaf name
    regex, experts = lora_targets(model, arch, ["q_proj", "down_proj"])
    assert "q_proj" in regex and all(n.endswith(".down_proj") for n in experts) and len(experts) == layers
    with pytest.raises(ConfigError, match=r"lora.target_modules: gate not linear layers or expert tensors"):
        lora_targets(model, arch, ["gate"])


def test_expert_lora_options_peft_cannot_take_are_refused_before_ray(tiny_models, digits, tmp_path, caplog):
    """PEFT's ParamWrapper takes no dropout and no DoRA: refused in the driver's checks, naming the key,
    before any worker starts; with dropout 0 the driver logs what LoRA adapts, by kind."""
    folder = tiny_models(ARCH)
    with pytest.raises(ConfigError, match=r"lora.dropout=0.1: LoRA on a mixture-of-experts"):
        preflight(tiny_run_config(folder, digits[0], tmp_path, "moe"))
    with pytest.raises(ConfigError, match=r"lora.use_dora"):
        preflight(tiny_run_config(folder, digits[0], tmp_path, "moe", "lora.dropout=0", "lora.use_dora=true"))
    with caplog.at_level(logging.INFO, logger="raylora"):
        preflight(tiny_run_config(folder, digits[0], tmp_path, "moe", "lora.dropout=0"))
    assert "LoRA adapts 8 attention, 4 experts" in caplog.text
    # leaving the experts out takes the default dropout
    preflight(tiny_run_config(folder, digits[0], tmp_path, "moe", "lora.target_modules=[q_proj,v_proj]"))


def test_router_is_frozen_unless_asked(tiny_models, digits, tmp_path):
    from raylora.resume import expected_trainable

    frozen = expected_trainable(
        tiny_run_config(tiny_models(ARCH), digits[0], tmp_path, "r", "lora.dropout=0")
    )
    assert not any(".mlp.gate." in n for n in frozen)
    assert sum(".mlp.experts." in n and ".lora_A." in n for n in frozen) == 4
    trained = expected_trainable(
        tiny_run_config(
            tiny_models(ARCH), digits[0], tmp_path, "r", "lora.dropout=0", "train.train_router=true"
        )
    )
    assert sorted(set(trained) - set(frozen)) == [
        f"model.language_model.layers.{i}.mlp.gate.weight" for i in (0, 1)
    ]


def test_aux_loss_coef_where_the_model_computes_one(tiny_models):
    moe_model = AutoModelForImageTextToText.from_pretrained(tiny_models(ARCH))
    assert moe.aux_loss_coef(moe_model) == pytest.approx(0.001)
    assert moe.aux_loss_coef(AutoModelForImageTextToText.from_pretrained(tiny_models("qwen3_vl"))) is None


def _load_under_zero3(folders: dict[str, str], cfg) -> dict:
    """On each worker: each folder loaded as a worker loads it (ZeRO-3, partitioned as it loads); rank 0
    returns its gathered expert tensors by folder."""
    import deepspeed

    from raylora import zero
    from raylora.arch import detect
    from raylora.model import build_model

    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    for name, folder in folders.items():
        model, handle = build_model(
            config.load(None, [*cfg, f"model.path={folder}"]),
            detect(folder),
            zero.deepspeed_config(config.load(None, [*cfg, f"model.path={folder}"]), 2),
        )
        experts = [p for n, p in model.named_parameters() if ".mlp.experts." in n and ".lora_" not in n]
        assert experts and all(zero.is_partitioned(p) for p in experts)
        with deepspeed.zero.GatheredParameters(experts):
            out[name] = {
                n.removeprefix("base_model.model.").replace(".base_layer", ""): p.detach().clone()
                for n, p in model.named_parameters()
                if ".mlp.experts." in n and ".lora_" not in n
            }
        del model, handle
    return out if torch.distributed.get_rank() == 0 else {}


@pytest.mark.distributed
def test_every_expert_layout_loads_under_zero3(ray_cluster, probes, layouts, digits, tmp_path):
    """transformers 5.23 alone fails on the Qwen3-VL-MoE folder it writes itself under ZeRO-3 ("size
    mismatch for ...experts.down_proj"): its shape check compares with the empty partition. Every layout
    loads, with the values the written file holds, in the model's layout."""
    cfg = [
        f"data.train={digits[0]}",
        f"run.storage_path={tmp_path}",
        "lora.dropout=0",
        "scaling.num_workers=2",
    ]
    folders = {name: str(folder) for name, folder in layouts.items()}
    got = probes(lambda: _load_under_zero3(folders, cfg))
    for name in layouts:
        expected = _fused(load_file(layouts[name.replace("hub", "written")] / "model.safetensors"))
        assert expected and got[name].keys() == expected.keys(), name
        for key, value in got[name].items():
            assert torch.equal(value, expected[key]), (name, key)


def _routing_probe(cfg) -> dict:
    """On each worker: one step of `cfg` recording which experts each rank's tokens were routed to, then
    the same step from a fresh engine with the load-balancing loss left out; rank 0 returns both ranks'
    experts, the step's metrics, and whether leaving the loss out changed the step's gradients."""
    import torch.distributed as dist

    from raylora import zero
    from raylora.worker import setup, train_step

    def run(aux: bool):
        s = setup(cfg, None)
        if not aux:
            s.aux_coef = None
        routed = torch.zeros(4, dtype=torch.long)  # tokens routed to each of the 4 experts, every layer

        def count(_module, _inputs, out) -> None:
            routed.add_(torch.bincount(out[2].flatten().cpu(), minlength=4))

        hooks = [
            m.register_forward_hook(count)
            for n, m in s.engine.module.named_modules()
            if n.endswith(".mlp.gate")
        ]
        metrics = train_step(s)
        for hook in hooks:
            hook.remove()
        state = zero.gather_trainable_state(s.engine, s.params)
        s.engine.destroy()
        return metrics, routed, state

    metrics, routed, with_aux = run(aux=True)
    _, _, without_aux = run(aux=False)
    experts = [None] * dist.get_world_size()
    dist.all_gather_object(experts, routed.tolist())
    if dist.get_rank() != 0:
        return {}
    # Adam's first step moves each weight by about lr whatever its gradient's size: the gradients show in
    # the first moments
    moments, plain = with_aux[1], without_aux[1]
    return {
        "metrics": metrics,
        "experts": experts,
        "aux_changes_the_step": any(not torch.equal(v, plain[n]) for n, v in moments.items()),
    }


@pytest.mark.distributed
def test_ranks_routing_to_different_experts_step_together_and_train_the_aux_loss(
    ray_cluster, probes, tiny_models, digits, tmp_path
):
    """Each rank routes its own tokens: how many go to each expert differs between the ranks, and the step
    (whose expert tensors ZeRO-3 gathers whole, whichever experts a rank uses) completes on both. The
    load-balancing loss is in the objective: without it the same step has other gradients."""
    cfg = tiny_run_config(tiny_models(ARCH), digits[0], tmp_path, "routing", "lora.dropout=0")
    got = probes(lambda: _routing_probe(cfg))
    assert got["metrics"]["step"] == 1 and got["metrics"]["aux_loss"] > 0
    assert len(got["experts"]) == 2 and got["experts"][0] != got["experts"][1], got["experts"]
    assert got["aux_changes_the_step"]
