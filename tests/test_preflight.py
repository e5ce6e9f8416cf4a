"""Nothing silent: what the driver checks before Ray starts (the processor, the chat template, a sample of
data.train read, decoded, rendered and tokenised), a row the processor rejects counted as a bad row, and
a step whose every sample was skipped ending the run once instead of training on nothing."""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image

from raylora import failures
from raylora.cli import main
from raylora.config import ConfigError
from raylora.data.batches import limit_length
from raylora.data.formats import open_rows
from raylora.data.labels import IGNORE_INDEX
from raylora.data.preflight import check_unread_fields
from raylora.data.processor import load_processor
from raylora.data.sampler import GlobalSampler
from raylora.driver import preflight
from tests.support import tiny_run_config


def _write_chat_jsonl(folder, digits, rows: int, kinds: dict[int, str], image_token: str = "<image>") -> str:
    """A chat JSONL file (Hugging Face chat style, content as a list of parts) of `rows` digits, each with
    its image file beside it; row i is of kind `kinds.get(i, "good")`:
    - "good": one image part, one image;
    - "mismatch": string content with two `<image>` tags (LLaMA-Factory's and ms-swift's layout) and one
      image ("2 image placeholders, 1 images");
    - "corrupt": an image file that does not decode;
    - "literal": no image, and the text holds the model's literal `image_token` (the processor refuses a
      text whose image tokens have no image);
    - "video": LLaMA-Factory's video row, a `<video>` tag in string content and `videos`."""
    table = pq.read_table(digits[0]).slice(0, rows).to_pylist()
    lines = []
    for i, row in enumerate(table):
        kind = kinds.get(i, "good")
        names = {"good": [f"{i}.png"], "mismatch": [f"{i}.png"], "corrupt": [f"{i}.png"]}
        for name in names.get(kind, []):
            (folder / name).write_bytes(b"not a png" if kind == "corrupt" else row["image"])
        question = [{"type": "text", "text": row["prompt"]}]
        if kind in ("good", "corrupt"):
            question.insert(0, {"type": "image"})
        if kind == "literal":
            question = [{"type": "text", "text": f"{image_token}\n{row['prompt']}"}]
        messages = [
            {"role": "user", "content": question},
            {"role": "assistant", "content": [{"type": "text", "text": row["answer"]}]},
        ]
        if kind == "video":
            (folder / f"{i}.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")
            messages = [
                {"role": "user", "content": f"<video>{row['prompt']}"},
                {"role": "assistant", "content": row["answer"]},
            ]
            lines.append(json.dumps({"messages": messages, "videos": [f"{i}.mp4"]}))
            continue
        if kind == "mismatch":
            messages = [
                {"role": "user", "content": f"<image><image>{row['prompt']}"},
                {"role": "assistant", "content": row["answer"]},
            ]
        lines.append(json.dumps({"messages": messages, "images": names.get(kind, [])}))
    path = folder / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_a_source_with_a_video_row_is_refused_however_few_without_a_decoder(
    tiny_models, digits, tmp_path, monkeypatch
):
    """One video row in 40 is under data.max_bad_fraction, but where PyAV is not installed it would be
    skipped at every step and never trained: the preflight refuses it, saying what to install. With the
    decoder, the same row (a bare mp4 header: no frames) is one bad row among 40, skipped and named."""
    from raylora.data import video

    data = _write_chat_jsonl(tmp_path, digits, 40, {7: "video"})
    cfg = _cfg(tiny_models("qwen2_vl"), data, tmp_path, "data.max_bad_fraction=0.5")
    monkeypatch.setattr(video, "decoder_installed", lambda: False)
    with pytest.raises(ConfigError, match=r"row 7: video rows need PyAV.*pip install 'av"):
        preflight(cfg)
    monkeypatch.undo()
    preflight(cfg)


def _cfg(model, data, tmp_path, *overrides: str):
    return tiny_run_config(model, data, tmp_path / "runs", "preflight", *overrides)


@pytest.mark.parametrize("packed", [False, True])
def test_a_token_budget_every_row_exceeds_is_refused_before_ray(tiny_models, digits, tmp_path, packed):
    """A pass's token budget (train.max_tokens_per_micro_batch, padded or packed) skips a longer sample as
    data.max_length does: a budget that every row read exceeds would train on nothing."""
    from raylora.data.batches import read
    from raylora.data.labels import encode

    model = tiny_models("llava")
    processor, rows = load_processor(model), open_rows(str(digits[0]))
    shortest = min(len(encode(processor, read(rows, i)).labels) for i in range(50))
    budget = [f"train.max_tokens_per_micro_batch={shortest - 1}", *(["train.packing=true"] if packed else [])]
    with pytest.raises(
        ConfigError, match=rf"longer than train.max_tokens_per_micro_batch \({shortest - 1}\)"
    ):
        preflight(_cfg(model, digits[0], tmp_path, *budget))
    preflight(_cfg(model, digits[0], tmp_path, f"train.max_tokens_per_micro_batch={shortest}"))


def test_an_all_bad_source_is_refused_before_ray_naming_reason_and_row(tiny_models, digits, tmp_path, capsys):
    # the most common reason first: 26 rows of one, 14 of the other
    data = _write_chat_jsonl(tmp_path, digits, 40, {i: "mismatch" if i % 3 else "corrupt" for i in range(40)})
    cfg = _cfg(tiny_models("llava"), data, tmp_path)
    with pytest.raises(ConfigError) as err:
        preflight(cfg)
    message = str(err.value)
    assert "40 of the 40 rows read before the start are bad" in message, message
    assert "more than data.max_bad_fraction (0.01)" in message, message
    assert re.search(
        r"26 x 2 image placeholders, 1 images \(e.g. row 1\); 14 x image does not decode", message
    )
    assert "(e.g. row 0)" in message, message
    # the CLI: exit 2, the same message, and no run folder (nothing started)
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(cfg.to_dict()))
    assert main(["train", str(config_file)]) == 2
    assert "image does not decode" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_one_bad_row_in_300_passes_and_is_named(tiny_models, digits, tmp_path, caplog):
    data = _write_chat_jsonl(tmp_path, digits, 300, {5: "corrupt"})
    model = tiny_models("llava")
    with caplog.at_level(logging.WARNING, logger="raylora"):
        preflight(_cfg(model, data, tmp_path))
    assert any("row 5" in r.getMessage() and "decode" in r.getMessage() for r in caplog.records), caplog.text
    with pytest.raises(
        ConfigError, match=r"1 of the \d+ rows read .* are bad, more than data.max_bad_fraction"
    ):
        preflight(_cfg(model, data, tmp_path, "data.max_bad_fraction=0"))
    with pytest.raises(ConfigError, match=r"row 5: image does not decode .*\(data.on_bad_row: error\)"):
        preflight(_cfg(model, data, tmp_path, "data.on_bad_row=error"))


def test_a_row_the_processor_rejects_is_a_bad_row_in_the_preflight(tiny_models, digits, tmp_path):
    kinds = {i: "literal" for i in range(0, 40, 2)}
    data = _write_chat_jsonl(tmp_path, digits, 40, kinds)
    with pytest.raises(ConfigError, match=r"20 of the 40 rows .* bad.*\(e.g. row 0\)"):
        preflight(_cfg(tiny_models("llava"), data, tmp_path))


def test_limit_length_skips_a_sample_the_processor_rejects(tiny_models):
    processor = load_processor(tiny_models("qwen2_vl"))
    image = Image.new("RGB", (8, 8), (30, 60, 90))
    good = (
        [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which digit?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "one"}]},
        ],
        [image],
    )
    literal = (  # ms-swift's `image` key read as text: the model's image token with no image
        [
            {"role": "user", "content": [{"type": "text", "text": f"{processor.image_token}\nWhich digit?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "two"}]},
        ],
        [],
    )
    with pytest.raises(ValueError, match="tokens in the text but no images"):
        limit_length(processor, [good, literal], None)  # without `rejected`: as before, the error
    rejected: dict[int, str] = {}
    batch, too_long = limit_length(processor, [good, literal], None, rejected=rejected)
    assert too_long == [] and list(rejected) == [1], rejected
    assert "processor rejects it" in rejected[1] and "no images" in rejected[1]
    assert (batch["labels"][1] == IGNORE_INDEX).all()  # the stand-in: trains on nothing
    assert (batch["labels"][0] != IGNORE_INDEX).any()


def test_step_batches_counts_a_rejected_row_as_bad(tiny_models, digits, tmp_path, caplog):
    from raylora.data.steps import step_batches

    model = tiny_models("qwen2_vl")
    processor = load_processor(model)
    data = _write_chat_jsonl(tmp_path, digits, 8, {3: "literal"}, processor.image_token)
    cfg = _cfg(model, data, tmp_path, "scaling.num_workers=1")
    rows = open_rows(data)
    s = SimpleNamespace(
        cfg=cfg,
        sampler=GlobalSampler(len(rows), 8, cfg.train.seed),  # one step holds every row
        rank=0,
        world_size=1,
        processor=processor,
        data=rows,
    )
    with caplog.at_level(logging.WARNING, logger="raylora"):
        built = step_batches(s, 0)
    assert built.bad_rows == 1 and [row for row, _ in built.reasons] == [3], built.reasons
    assert any("row 3" in r.getMessage() and "skipped" in r.getMessage() for r in caplog.records)
    s.cfg = _cfg(model, data, tmp_path, "scaling.num_workers=1", "data.on_bad_row=error")
    with pytest.raises(failures.PermanentError, match=r"row 3: .*\(data.on_bad_row: error\)"):
        step_batches(s, 0)


def test_a_processor_or_template_that_cannot_serve_names_the_file(tiny_models, digits, tmp_path):
    data = _write_chat_jsonl(tmp_path, digits, 8, {})
    broken = tmp_path / "broken-tokenizer"
    shutil.copytree(tiny_models("llava"), broken)
    (broken / "tokenizer.json").write_text("{")
    with pytest.raises(ConfigError, match=r"processor of .* is not valid JSON \(tokenizer.json\)"):
        preflight(_cfg(str(broken), data, tmp_path))
    template = tmp_path / "broken-template"
    shutil.copytree(tiny_models("llava"), template)
    (template / "chat_template.jinja").write_text("{{ raise_exception('this template takes no images') }}")
    with pytest.raises(ConfigError, match=r"chat template .*chat_template.jinja.*takes no images"):
        preflight(_cfg(str(template), data, tmp_path))


def test_unread_fields_are_named(digits, tmp_path, caplog):
    rows = open_rows(_write_chat_jsonl(tmp_path, digits, 2, {}))
    rows.unread_fields = ["videos", "conversations"]
    with pytest.raises(ConfigError, match=r"field\(s\) videos hold media"):
        check_unread_fields(rows)
    rows.unread_fields = ["conversations"]
    with caplog.at_level(logging.WARNING, logger="raylora"):
        check_unread_fields(rows)
    assert "conversations" in caplog.text


@pytest.mark.parametrize(
    "command, section, message",
    [
        ("train", "data: {train: t.parquet, shufle: true}", "unknown config key data.shufle"),
        ("train", "data: {train: t.parquet}\ntrain: {max_steps: ten}", "train.max_steps: expected int"),
        ("tune", "data: {train: t.parquet, shufle: true}", "unknown config key data.shufle"),
    ],
)
def test_a_config_error_comes_before_torch_ray_and_deepspeed(tmp_path, command, section, message):
    """The cheap checks first: a wrong key or type is reported without importing the training stack."""
    config_file = tmp_path / "run.yaml"
    config_file.write_text(f"model: {{path: m}}\n{section}\n")
    probe = (
        "import json, sys, time\n"
        "start = time.perf_counter()\n"
        "from raylora.cli import main\n"
        f"code = main([{command!r}, {str(config_file)!r}])\n"
        "heavy = [m for m in ('torch', 'ray', 'deepspeed', 'transformers') if m in sys.modules]\n"
        "print(json.dumps([code, heavy, time.perf_counter() - start]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    code, heavy, seconds = json.loads(proc.stdout.splitlines()[-1])
    assert (code, heavy) == (2, []), (proc.stdout, proc.stderr)
    assert message in proc.stderr, proc.stderr
    print(f"config error reported in {seconds:.2f} s")


def test_bad_rows_so_far_count_a_redone_step_once(tmp_path):
    from raylora.progress import METRICS_FILE, bad_rows_before

    folder = tmp_path / "run"
    folder.mkdir()
    # steps 1-3, a restart resumed at step 2 (its step 3 redone with the same rows), then step 4
    rows = [(1, 2, 0), (2, 0, 0), (3, 1, 0), (3, 1, 1), (4, 5, 1)]
    lines = [json.dumps({"step": s, "bad_rows": b, "restarts": r}) for s, b, r in rows]
    (folder / METRICS_FILE).write_text("\n".join(lines) + "\n")
    assert bad_rows_before(str(tmp_path), "run", 3) == 3
    assert bad_rows_before(str(tmp_path), "run", 4) == 8
    assert bad_rows_before(str(tmp_path), "other", 4) == 0


# ------------------------------------------------------------------------------------------ distributed


@pytest.mark.distributed
@pytest.mark.slow
def test_a_step_with_every_sample_skipped_ends_the_run_once(ray_cluster, tiny_models, digits, tmp_path):
    """Let through by the preflight (data.max_bad_fraction=1), a run on rows that are all bad fails at its
    first step, once, naming why, instead of training on nothing with loss 0.0 and exiting 0."""
    from raylora.driver import run
    from raylora.progress import read_metrics
    from raylora.resume import ATTEMPTS_FILE

    data = _write_chat_jsonl(tmp_path, digits, 8, dict.fromkeys(range(8), "corrupt"))
    cfg = _cfg(
        tiny_models("qwen2_vl"),
        data,
        tmp_path,
        "train.max_steps=2",
        "data.max_bad_fraction=1.0",
        "data.workers=0",
    )
    with pytest.raises(failures.PermanentError) as err:
        run(cfg)
    message = str(err.value)
    assert "step 1: every sample of the global batch (8) was skipped" in message, message
    assert "8 bad row(s)" in message and "row 0: image does not decode" in message, message
    run_dir = tmp_path / "runs" / "preflight"
    assert json.loads((run_dir / ATTEMPTS_FILE).read_text())["attempts"] == 1, "retried"
    assert read_metrics(str(tmp_path / "runs"), "preflight") == []
    assert not list(run_dir.glob("checkpoint_*"))


def test_a_reasoning_template_with_answers_without_reasoning_is_refused_naming_the_setting(
    tiny_models, digits, tmp_path
):
    """Qwen3.5's generation prompt opens a reasoning block (`<think>\n`) and its vocabulary has `\n\n` as one
    token: an answer without reasoning would train a token inference never continues from. The preflight
    refuses the run (its check of the template), naming data.chat_template_kwargs; with
    `{enable_thinking: false}` it starts."""
    model = tiny_models("qwen3_5")
    with pytest.raises(
        ConfigError, match=r"chat template .* set data.chat_template_kwargs: {enable_thinking: false}"
    ):
        preflight(_cfg(model, digits[0], tmp_path, "data.chat_template_kwargs={}"))
    preflight(_cfg(model, digits[0], tmp_path, "data.chat_template_kwargs={enable_thinking: false}"))
