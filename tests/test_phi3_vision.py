"""Phi-3-vision and Phi-3.5-vision as Microsoft ships them: model code written for transformers 4, loaded
through model.trust_remote_code and bridged for transformers 5 by `raylora.remote_compat` (the folder's
files untouched), with the chat template's own numbered image tags.

The model is `tests/phi3v_fixture.py`'s stand-in folder, which uses what transformers 5 removed as the
real files do. How it was checked against the real files: Microsoft's `modeling_phi3_v.py`,
`image_embedding_phi3_v.py`, `processing_phi3_v.py`, `image_processing_phi3_v.py`,
`configuration_phi3_v.py`, `config.json`, `preprocessor_config.json` and tokenizer files of
microsoft/Phi-3-vision-128k-instruct, read in public GitHub copies of the Hub folder
(lamm-mit/Cephalo-Phi-3-Vision-MoE `Phi_3V_MoE/`, and Aritra02091998/Phi-3-vision-128k-instruct-Improvised-
for-QLORA-Training, which differs only in casts of its flash-attention branches); the bridges were also run
on those real files with a tiny config.json and random weights outside the project (load, save, a training
step with labels, cached generation equal to full recomputation). Nothing of them is in the project.

The distributed part shares the session's worker group (`probes`): 2 steps on 2 workers under ZeRO-3 with
LoRA on every linear layer of the language model and the vision tower trained, the step-2 checkpoint
restored into a fresh engine and step 3 resumed bit for bit; the same checkpoint resumed on 1 rank
(elastic, in a child process); `raylora eval` and `export --merge` on it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from raylora.arch import REGISTRY, auto_model_class, detect, lora_target_regex, remote_code
from raylora.config import ConfigError
from raylora.data.batches import make_batch
from raylora.data.labels import IGNORE_INDEX, _render, end_of_turn_ids, numbered_image_text
from raylora.data.processor import load_processor
from raylora.data.turns import content
from tests import whole_checkpoint
from tests.phi3v_fixture import make_phi3v_model
from tests.probes import resume_probe
from tests.ray_env import free_port
from tests.support import tiny_run_config

TRUST = "model.trust_remote_code=true"  # the registry's phi3_v entry names the parts
LINEAR = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}


@pytest.fixture(scope="module")
def phi3v(tmp_path_factory) -> Path:
    return make_phi3v_model(tmp_path_factory.mktemp("phi3v") / "Phi-3-vision-tiny")


def _load(folder: Path, **kwargs):
    return auto_model_class(remote_code(folder)).from_pretrained(folder, trust_remote_code=True, **kwargs)


def _hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _image_sample(answer: str = "seven") -> tuple[list[dict], list[Image.Image]]:
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which digit is this ?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
    ]
    return messages, [Image.new("RGB", (40, 30), (200, 10, 10))]


def _text_sample() -> tuple[list[dict], list[Image.Image]]:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "one"}]},
    ]
    return messages, []


def test_image_parts_become_numbered_tags_counted_over_the_conversation():
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "Count ."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "one ?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "one"}]},
        # an `<image>` tag as LLaVA / LLaMA-Factory rows write it, read as raylora reads them
        {"role": "user", "content": content("<image>\nand <image>\ntwo ?", "user", None)},
    ]
    got = numbered_image_text(parts, "<|image_{}|>")
    assert [t["content"] for t in got] == [
        "Count .",
        "<|image_1|>\none ?",
        "one",
        "<|image_2|>\nand <|image_3|>\ntwo ?",  # the tag's own line break is not doubled
    ]


def test_the_registry_entry_describes_the_folder_and_lora_covers_the_language_model(phi3v):
    from raylora import config
    from raylora.model import add_lora, set_trainable

    arch = detect(phi3v, trust_remote_code=True)
    assert arch is REGISTRY["phi3_v"]
    model = _load(phi3v)
    names = [n for n, _ in model.named_parameters()]
    for part in ("language_model", "vision_tower", "aligner"):
        for prefix in getattr(arch, part):
            assert any(n.startswith(prefix + ".") and arch.part_of(n) == part for n in names), prefix
    regex = re.compile(lora_target_regex(model, arch, None))
    targets = [n for n, m in model.named_modules() if regex.match(n)]
    assert {t.rsplit(".", 1)[-1] for t in targets} == LINEAR
    assert len(targets) == len(LINEAR) * model.config.num_hidden_layers
    assert all(arch.part_of(t + ".weight") == "language_model" for t in targets)
    for frozen in (True, False):  # the vision tower frozen or trained, LoRA the same either way
        overrides = [f"model.path={phi3v}", "data.train=t.parquet", TRUST, f"train.freeze_vision={frozen}"]
        cfg = config.load(None, overrides)
        peft_model = add_lora(_load(phi3v), cfg, arch)
        set_trainable(peft_model, arch, cfg)
        trained = {n for n, p in peft_model.named_parameters() if p.requires_grad}
        vision = {n for n in trained if ".img_processor." in n}
        assert bool(vision) is not frozen
        assert {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n in trained if ".lora_A." in n} == LINEAR
        assert all(".lora_" in n or ".vision_embed_tokens." in n for n in trained)


def test_the_bridges_patch_the_loaded_classes_and_pick_an_attention_they_take(phi3v, tmp_path, caplog):
    from raylora import remote_compat

    before = _hashes(phi3v)
    config = json.loads((phi3v / "config.json").read_text())
    assert config["_attn_implementation"] == "flash_attention_2"
    with caplog.at_level(logging.INFO, logger="raylora"):
        model = _load(phi3v, attn_implementation="sdpa")  # raylora's default
    assert model.config._attn_implementation == "eager"
    assert "does not take attn_implementation=sdpa here: using eager" in caplog.text
    assert _hashes(phi3v) == before, "the user's files changed"
    module = sys.modules[type(model).__module__]
    assert getattr(module, remote_compat.BRIDGED)
    assert module.DynamicCache is remote_compat.LegacyDynamicCache
    assert isinstance(type(model)._tied_weights_keys, dict)
    model.save_pretrained(tmp_path / "saved")  # a list of tied keys fails here under transformers 5
    assert "model.vision_embed_tokens.wte.weight" not in json.dumps(_hashes(tmp_path / "saved"))
    # generation with the (bridged) cache gives what recomputing the whole sequence each step gives
    processor = load_processor(phi3v, trust_remote_code=True)
    samples = [_image_sample(), _text_sample()]
    prompts = make_batch(processor, samples, with_answers=False)
    model.eval()
    cached = model.generate(
        **prompts,
        max_new_tokens=4, do_sample=False, pad_token_id=processor.tokenizer.pad_token_id, eos_token_id=[],
    )  # fmt: skip
    ids, mask = prompts["input_ids"], prompts["attention_mask"]
    with torch.no_grad():
        for _ in range(4):
            logits = model(
                input_ids=ids.clone(), attention_mask=mask, pixel_values=prompts["pixel_values"],
                image_sizes=prompts["image_sizes"], use_cache=False,
            ).logits  # fmt: skip
            ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    assert torch.equal(cached[:, -4:], ids[:, -4:])
    # the file's embedding clears image ids in the tensor it gets: the bridged forward gets a copy, so a
    # batch run twice (a rank's repeated stand-in pass) runs the vision tower both times
    batch = make_batch(processor, [_image_sample()])
    batch.pop("labels")
    with torch.no_grad():
        model(**batch)
    assert (batch["input_ids"] < 0).any()


def test_the_processor_renders_numbered_tags_and_labels_the_answers(phi3v):
    processor = load_processor(phi3v, trust_remote_code=True)
    assert type(processor).__name__ == "Phi3VProcessor"
    tokenizer = processor.tokenizer
    assert tokenizer.convert_ids_to_tokens(end_of_turn_ids(processor)) == ["<|end|>"]
    tagged = [
        {"role": "user", "content": content("<image>\nWhich digit is this ?", "user", None)},
        {"role": "assistant", "content": [{"type": "text", "text": "seven"}]},
        {"role": "user", "content": content("And <image>", "user", None)},
        {"role": "assistant", "content": [{"type": "text", "text": "one"}]},
    ]
    text = _render(processor, tagged, generation_prompt=False)
    assert text == (
        "<|user|>\n<|image_1|>\nWhich digit is this ?<|end|>\n<|assistant|>\nseven<|end|>\n"
        "<|user|>\nAnd <|image_2|>\n<|end|>\n<|assistant|>\none<|end|>\n"
    )
    image = Image.new("RGB", (40, 30), (200, 10, 10))
    batch = make_batch(processor, [(tagged, [image, image.rotate(90, expand=True)]), _image_sample()])
    per_image = processor.image_processor.preprocess([image])["num_img_tokens"][0]
    row = batch["input_ids"][0]
    assert int((row == -1).sum()) == int((row == -2).sum()) == per_image
    for labels, answers in zip(batch["labels"], (["seven", "one"], ["seven"]), strict=True):
        assert tokenizer.decode(labels[labels != IGNORE_INDEX]) == "".join(f"{a}<|end|>" for a in answers)
    assert batch["pixel_values"].shape[:2] == (3, 2)  # one crop and the global view per image


def test_a_changed_revision_is_refused_naming_the_file_and_symbol(phi3v, tmp_path):
    changed = tmp_path / "Phi-3-vision-changed"
    shutil.copytree(phi3v, changed)
    modeling = changed / "modeling_phi3_v.py"
    source = modeling.read_text()
    modeling.write_text(
        source.replace("past_key_values.get_usable_length(seq_length)", "past_key_values.get_seq_length()")
    )
    with pytest.raises(ConfigError, match=r"modeling_phi3_v.py: Phi3VModel.forward no longer contains"):
        _load(changed)
    renamed = tmp_path / "Phi-3-vision-renamed"
    shutil.copytree(phi3v, renamed)
    processing = renamed / "processing_phi3_v.py"
    processing.write_text(processing.read_text().replace("_convert_images_texts_to_inputs", "_inputs"))
    with pytest.raises(
        ConfigError, match=r"processing_phi3_v.py: Phi3VProcessor._convert_images_texts_to_inputs is missing"
    ):
        load_processor(renamed, trust_remote_code=True)


def test_the_driver_preflight_takes_the_folder(phi3v, digits, tmp_path):
    from raylora.driver import preflight
    from raylora.resume import expected_trainable

    cfg = tiny_run_config(phi3v, digits[0], tmp_path, "preflight", TRUST)
    assert preflight(cfg) is REGISTRY["phi3_v"]
    trained = expected_trainable(cfg)  # the meta-device model, built from the folder's own (bridged) code
    assert any(".lora_A." in n for n in trained) and any(".img_processor." in n for n in trained)


# ------------------------------------------------------------------------------------------ distributed

ELASTIC = """
import json, os, pickle, sys
import torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                  LOCAL_WORLD_SIZE="1")
dist.init_process_group("gloo", rank=0, world_size=1)
import torch
from raylora import zero
from raylora.worker import setup, train_step
from tests import whole_checkpoint
cfg = pickle.loads(open(sys.argv[2], "rb").read())
loaded = whole_checkpoint.load(sys.argv[3])
s = setup(cfg, loaded)
masters, _ = zero.gather_trainable_state(s.engine, s.params)
restored = all(torch.equal(masters[n], loaded.weights[n]) for n in loaded.weights)
metrics = train_step(s)
open(sys.argv[4], "w").write(json.dumps({"restored": restored, "world_size": s.world_size, **metrics}))
"""


@pytest.fixture(scope="module")
def trained(ray_cluster, probes, phi3v, digits, tmp_path_factory):
    """2 steps on 2 workers under ZeRO-3 (LoRA on the language model, vision tower and projection
    trained), the step-2 checkpoint restored into a fresh engine and step 3 trained from it, on the
    session's worker group."""
    storage = tmp_path_factory.mktemp("phi3v-runs")
    overrides = [TRUST, "train.max_steps=3", "train.checkpoint_every=2", "data.workers=0"]
    cfg = tiny_run_config(phi3v, digits[0], storage, "phi3v", *overrides)
    folder = storage / "checkpoint-phi3v"
    resumed = probes(lambda: resume_probe(cfg, 2, folder))
    return cfg, resumed, resumed["restored"], folder


@pytest.mark.distributed
@pytest.mark.slow
def test_two_workers_train_and_resume_bitwise(trained):

    _, resumed, restored, folder = trained
    metrics = resumed["metrics"]
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(math.isfinite(m["loss"]) for m in metrics)
    assert resumed["resumed"]["loss"] == metrics[2]["loss"], "step 3 from the checkpoint differs"
    assert resumed["masters_equal"] and resumed["moments_equal"]
    assert restored["params_equal"] and restored["masters_equal"] and restored["moments_equal"]
    loaded = whole_checkpoint.load(folder)
    entry = REGISTRY["phi3_v"]
    assert {entry.part_of(n) for n in loaded.state.trainable} == {"language_model", "vision_tower", "aligner"}
    assert {
        n.split(".lora_A")[0].rsplit(".", 1)[-1] for n in loaded.state.trainable if ".lora_A." in n
    } == LINEAR


@pytest.mark.distributed
@pytest.mark.slow
def test_the_checkpoint_resumes_on_one_worker(trained, tmp_path):
    """Elastic to 1: the 2-worker checkpoint restored on a single rank (a child process with a one-rank
    gloo group, as a worker group of 1 has) restores every master exactly and trains step 3 to the loss the
    2 workers reached (the same global batch, summed in another order)."""
    cfg, resumed, _, folder = trained
    one = tmp_path / "cfg.pickle"
    one.write_bytes(pickle.dumps(tiny_run_config(cfg.model.path, cfg.data.train, tmp_path, "one", TRUST,
                                                 "train.max_steps=3", "scaling.num_workers=1")))  # fmt: skip
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, "-c", ELASTIC, str(free_port()), str(one), str(folder), str(out)],
        capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[1],
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["restored"] and got["world_size"] == 1 and got["step"] == 3
    assert got["loss"] == pytest.approx(resumed["metrics"][2]["loss"], rel=1e-4)


@pytest.mark.distributed
@pytest.mark.slow
def test_eval_generates_and_the_merged_export_loads_in_plain_transformers(trained, digits, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from raylora import cli, remote_compat
    from raylora.evaluate import load_for_inference

    _, _, _, folder = trained
    assert (
        cli.main(["eval", str(folder), "--data", str(digits[1]), "--max-samples", "4", "--device", "cpu"])
        == 0
    )
    scores = json.loads(capsys.readouterr().out)
    assert scores["samples"] == 4 and scores["bad_rows"] == 0 and math.isfinite(scores["loss"])
    model, processor = load_for_inference(folder, device="cpu")
    prompts = make_batch(processor, [_image_sample()], with_answers=False)
    pad = processor.tokenizer.pad_token_id
    out = model.generate(**prompts, max_new_tokens=3, do_sample=False, eos_token_id=[], pad_token_id=pad)
    assert out.shape[1] == prompts["input_ids"].shape[1] + 3

    out = tmp_path / "merged"
    assert cli.main(["export", str(folder), "--out", str(out), "--merge"]) == 0
    assert (out / "modeling_phi3_v.py").read_text() == (
        Path(model.base_model.model.config.name_or_path) / "modeling_phi3_v.py"
    ).read_text()
    # plain transformers 5.23, nothing of raylora's bridges in its module: it loads (attention falls back
    # to eager by itself: the saved config no longer asks for flash-attention), and runs and generates
    # with use_cache=False (the file's own cache code needs transformers 4's API, which only
    # raylora.remote_compat gives)
    plain = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert not getattr(sys.modules[type(plain).__module__], remote_compat.BRIDGED, False)
    assert not any(".lora_" in n for n in plain.state_dict())
    text = make_batch(processor, [_text_sample()], with_answers=False)
    greedy = {"max_new_tokens": 4, "do_sample": False, "eos_token_id": [], "pad_token_id": pad}
    plain_ids = plain.generate(**text, use_cache=False, **greedy)
    batch = make_batch(processor, [_image_sample()])
    batch.pop("labels")
    with torch.no_grad():
        plain_logits = plain(**{k: v.clone() for k, v in batch.items()}, use_cache=False).logits
        adapter_logits = model(**{k: v.clone() for k, v in batch.items()}).logits
    assert torch.allclose(plain_logits, adapter_logits, atol=1e-4), (
        "the merged model differs from the adapter"
    )
    # through raylora (bridged, with the cache) the same folder generates the same tokens
    bridged = _load(out).eval()
    assert torch.equal(bridged.generate(**text, use_cache=True, **greedy), plain_ids)
