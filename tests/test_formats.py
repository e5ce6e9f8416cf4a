"""Every data format reads the same digits into the same samples, and trains to the same weights.

Unit tests (no Ray) read the formats and their refusals, and build from each format the micro batches a
worker trains on, bitwise those of raylora Parquet; the distributed test trains 2 workers on LLaMA-Factory's
layout, killed and resumed, to the weights of one uninterrupted run on raylora Parquet.
"""

from __future__ import annotations

import base64
import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raylora import config
from raylora.config import ConfigError
from raylora.data import formats, records
from raylora.data.formats import BadRow, check_source, load_image, open_rows
from raylora.data.sample import Sample
from tests.run_logs import final_checkpoint as _final

ROWS = 64  # enough for 4 steps of 8 samples without repeating an epoch


def write_sources(train_parquet: str | Path, out: Path, rows: int = ROWS) -> dict[str, dict]:
    """The first `rows` rows of the digits in every format: {name: {"uri", "format", "overrides"}}."""
    import datasets

    table = pq.read_table(train_parquet).slice(0, rows)
    images, prompts, answers = (table.column(c).to_pylist() for c in ("image", "prompt", "answer"))
    folder = out / "images"
    folder.mkdir(parents=True)
    for i, image in enumerate(images):
        (folder / f"{i}.png").write_bytes(image)

    def chat(prompt: str, answer: str, plain: bool) -> list[dict]:
        return [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]},
            # content as a plain string, the other form it takes (Arrow needs one type per column)
            {"role": "assistant", "content": answer if plain else [{"type": "text", "text": answer}]},
        ]

    messages = [chat(p, a, plain=False) for p, a in zip(prompts, answers, strict=True)]
    pq.write_table(table, out / "raylora.parquet")
    pq.write_table(pa.table({"messages": messages, "images": [[i] for i in images]}), out / "chat.parquet")
    parts = out / "parts"  # a folder of Parquet files with small row groups, as Ray Data writes
    parts.mkdir()
    half = rows // 2
    for k, (start, stop) in enumerate([(0, half), (half, rows)]):
        piece = pa.table({"messages": messages[start:stop], "images": [[i] for i in images[start:stop]]})
        pq.write_table(piece, parts / f"part-{k}.parquet", row_group_size=5)
    with open(out / "chat.jsonl", "w") as f:
        for i, (p, a) in enumerate(zip(prompts, answers, strict=True)):
            f.write(json.dumps({"messages": chat(p, a, plain=True), "images": [f"images/{i}.png"]}) + "\n")
    llava = [
        {
            "id": str(i),
            "image": f"{i}.png",
            "conversations": [{"from": "human", "value": f"<image>\n{p}"}, {"from": "gpt", "value": a}],
        }
        for i, (p, a) in enumerate(zip(prompts, answers, strict=True))
    ]
    (out / "llava").mkdir()
    (out / "llava" / "data.json").write_text(json.dumps(llava, indent=1))
    # as `datasets` writes images: a list of {bytes, path} structs (its Image feature)
    # and with LLaMA-Factory's layout, as its Hub data sets hold it: string content with <image> tags
    tags = [
        [{"role": "user", "content": f"<image>{p}"}, {"role": "assistant", "content": a}]
        for p, a in zip(prompts, answers, strict=True)
    ]
    saved = datasets.Dataset.from_dict({"messages": tags, "images": [[i] for i in images]})
    saved.cast_column("images", datasets.Sequence(datasets.Image())).save_to_disk(str(out / "saved"))
    # the peers' layouts (tests/test_peer_formats.py has their documented rows): the question with an
    # <image> tag in string content, the images in a list beside it
    tagged, listed = [f"<image>{p}" for p in prompts], [[f"images/{i}.png"] for i in range(rows)]
    swift = [  # ms-swift's query/response, its single image under `image`
        {"query": q, "response": a, "image": im[0]} for q, a, im in zip(tagged, answers, listed, strict=True)
    ]
    mllm = [
        {"messages": [{"content": q, "role": "user"}, {"content": a, "role": "assistant"}], "images": im}
        for q, a, im in zip(tagged, answers, listed, strict=True)
    ]
    (out / "mllm_digits.json").write_text(json.dumps(mllm, indent=2))
    info = {"columns": {"messages": "messages", "images": "images"}}
    info["tags"] = {
        "role_tag": "role",
        "content_tag": "content",
        "user_tag": "user",
        "assistant_tag": "assistant",
    }
    (out / "dataset_info.json").write_text(
        json.dumps({"digits": {"file_name": "mllm_digits.json", "formatting": "sharegpt", **info}})
    )
    sharegpt = [
        {"conversations": [{"from": "user", "value": q}, {"from": "assistant", "value": a}], "images": im}
        for q, a, im in zip(tagged, answers, listed, strict=True)
    ]
    alpaca = [
        {"instruction": q, "input": "", "output": a, "images": im}
        for q, a, im in zip(tagged, answers, listed, strict=True)
    ]
    openai = [
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(image)}},
                        {"type": "text", "text": p},
                    ],
                },
                {"role": "assistant", "content": a},
            ]
        }
        for image, p, a in zip(images, prompts, answers, strict=True)
    ]
    for name, layout in [("sharegpt", sharegpt), ("alpaca", alpaca), ("openai", openai), ("swift", swift)]:
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in layout))
    return {
        "raylora": {"uri": out / "raylora.parquet", "format": "raylora", "overrides": []},
        "chat_parquet": {"uri": out / "chat.parquet", "format": "chat", "overrides": []},
        "parquet_folder": {"uri": parts, "format": "chat", "overrides": []},
        "chat_jsonl": {"uri": out / "chat.jsonl", "format": "chat", "overrides": ["data.format=chat"]},
        "llava": {
            "uri": out / "llava" / "data.json",
            "format": "llava",
            "overrides": [f"data.image_root={folder}"],
        },
        "save_to_disk": {"uri": out / "saved", "format": "chat", "overrides": []},
        "llamafactory": {"uri": f"{out / 'dataset_info.json'}#digits", "format": "chat", "overrides": []},
        "sharegpt": {"uri": out / "sharegpt.jsonl", "format": "llava", "overrides": []},
        "alpaca": {"uri": out / "alpaca.jsonl", "format": "alpaca", "overrides": []},
        "openai": {"uri": out / "openai.jsonl", "format": "chat", "overrides": []},
        "swift": {"uri": out / "swift.jsonl", "format": "query_response", "overrides": []},
    }


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def sources(digits, tmp_path_factory):
    return write_sources(digits[0], tmp_path_factory.mktemp("formats"))


def _image_root(source: dict) -> str | None:
    return next((o.split("=", 1)[1] for o in source["overrides"] if o.startswith("data.image_root=")), None)


def _pixels(entry) -> np.ndarray:
    return np.asarray(load_image(entry))


def test_every_format_reads_the_same_samples(sources):
    reference = open_rows(str(sources["raylora"]["uri"]))
    expected = [reference.sample(i) for i in range(ROWS)]
    assert expected[0].messages == [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which digit is this?"}]},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": expected[0].messages[1]["content"][0]["text"]}],
        },
    ]
    for name, source in sources.items():
        rows = open_rows(str(source["uri"]), image_root=_image_root(source))
        assert (rows.format, len(rows)) == (source["format"], ROWS), name
        assert check_source(str(source["uri"]), "data.train", image_root=_image_root(source)) == (
            source["format"],
            ROWS,
        )
        for i in [0, 1, 7, ROWS - 1, 33]:  # out of order, across row groups and files
            got = rows.sample(i)
            assert got.messages == expected[i].messages, (name, i)
            assert len(got.images) == 1 and np.array_equal(
                _pixels(got.images[0]), _pixels(expected[i].images[0])
            )
        copy = pickle.loads(pickle.dumps(rows))  # the input pipeline's processes get a copy
        assert copy.sample(5) == rows.sample(5)


def test_reads_row_groups_when_used_and_keeps_few(sources):
    rows = open_rows(str(sources["parquet_folder"]["uri"]))
    assert not rows.records.__dict__.get("_cache"), "opening read rows"
    for i in range(ROWS):
        rows.sample(i)
    assert len(rows.records._cache) == records.ROW_GROUP_CACHE
    assert len(pickle.dumps(rows)) < 4096  # a copy carries the footers' offsets, not the rows


def test_save_to_disk_is_memory_mapped(tmp_path):
    import datasets

    big = bytes(range(256)) * 4096  # 1 MiB a row
    datasets.Dataset.from_dict(
        {"image": [big] * 16, "prompt": ["p"] * 16, "answer": ["a"] * 16}
    ).save_to_disk(str(tmp_path / "big"))
    before = pa.total_allocated_bytes()
    rows = open_rows(str(tmp_path / "big"))
    assert len(rows) == 16 and rows.sample(3).images == [big]
    assert pa.total_allocated_bytes() - before < 1 << 20, "the rows were copied into memory"
    assert "datasets" in sys.modules  # imported by this test; the reader itself never imports it
    source = Path(formats.__file__).read_text()
    assert "import datasets" not in source and "from datasets" not in source


def test_llava_placeholders_become_image_parts_in_place(tmp_path):
    record = {
        "image": ["a.png", "sub/b.png"],
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Compare <image> with\n<image>\nWhich is larger?"},
            {"from": "gpt", "value": "The first."},
            {"from": "human", "value": "Why?"},
            {"from": "gpt", "value": "It has more ink."},
        ],
    }
    (tmp_path / "d.jsonl").write_text("\n" + json.dumps(record) + "\n\n")
    rows = open_rows(str(tmp_path / "d.jsonl"))
    assert (rows.format, len(rows)) == ("llava", 1)
    sample = rows.sample(0)
    assert sample.messages[:2] == [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare "},  # only the placeholder's line break goes
                {"type": "image"},
                {"type": "text", "text": " with"},
                {"type": "image"},
                {"type": "text", "text": "Which is larger?"},
            ],
        },
    ]
    assert [t["role"] for t in sample.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert sample.images == [str(tmp_path / "a.png"), str(tmp_path / "sub" / "b.png")]
    elsewhere = open_rows(str(tmp_path / "d.jsonl"), image_root="s3://bucket/pics")
    assert elsewhere.sample(0).images == ["s3://bucket/pics/a.png", "s3://bucket/pics/sub/b.png"]


def test_chat_forms_and_text_only_rows(tmp_path):
    png = tmp_path / "x.png"
    from PIL import Image

    Image.new("RGB", (4, 4), (1, 2, 3)).save(png)
    records = [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
        {  # the image in the part itself, HF style, and a JSON array file with non-ASCII text
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image", "image": "x.png"}, {"type": "text", "text": "Ça?"}],
                },
                {"role": "assistant", "content": [{"type": "text", "text": "Oui ✓"}]},
            ]
        },
    ]
    (tmp_path / "c.json").write_text(json.dumps(records, ensure_ascii=False), encoding="utf-8")
    rows = open_rows(str(tmp_path / "c.json"))
    assert rows.sample(0) == Sample(
        [
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
        ],
        [],
    )
    assert rows.sample(1).images == [str(png)] and rows.sample(1).messages[1]["content"][0]["text"] == "Oui ✓"
    assert load_image(rows.sample(1).images[0]).getpixel((0, 0)) == (1, 2, 3)


@pytest.mark.parametrize(
    ("messages", "images", "reason"),
    [
        ([{"role": "user", "content": "Hi"}], [], "no assistant turn"),
        ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  "}], [], "empty answer"),
        (
            [{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "a"}],
            [],
            "1 image",
        ),
        ([{"role": "bot", "content": "Hi"}], [], "unknown role 'bot'"),
        ([{"role": "user", "content": [{"type": "input_audio"}]}], [], "unknown content part"),
        ("not a list", [], "messages is not"),
    ],
)
def test_bad_rows_name_their_reason(tmp_path, messages, images, reason):
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": messages, "images": images}) + "\n")
    with pytest.raises(BadRow, match=reason) as err:
        open_rows(str(tmp_path / "c.jsonl")).sample(0)
    assert reason in err.value.reason


def test_broken_images_and_lines_are_bad_rows(tmp_path):
    with pytest.raises(BadRow, match="does not decode"):
        load_image(b"\x89PNG not really")
    with pytest.raises(BadRow, match="not found"):
        load_image(str(tmp_path / "missing.png"))
    good = json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
    (tmp_path / "c.jsonl").write_text(good + "\n{broken json\n")
    rows = open_rows(str(tmp_path / "c.jsonl"))
    assert len(rows) == 2 and rows.sample(0).messages[1]["content"][0]["text"] == "b"
    with pytest.raises(BadRow, match="not valid JSON"):
        rows.sample(1)
    pq.write_table(pa.table({"image": [b""], "prompt": ["p"], "answer": ["a"]}), tmp_path / "r.parquet")
    with pytest.raises(BadRow, match="image missing or empty"):
        open_rows(str(tmp_path / "r.parquet")).sample(0)


def test_refusals_name_the_fields_found_and_the_formats_accepted(tmp_path, sources):
    pq.write_table(pa.table({"img": [b"x"], "question": ["q"]}), tmp_path / "odd.parquet")
    with pytest.raises(
        ConfigError,
        match=r"data.train: .*odd.parquet is in no known format; its fields: img, "
        r"question. Formats accepted: raylora \(Parquet: image, prompt, answer\), chat",
    ):
        check_source(str(tmp_path / "odd.parquet"), "data.train")
    (tmp_path / "odd.jsonl").write_text(json.dumps({"text": "a", "label": 1}) + "\n")
    with pytest.raises(ConfigError, match=r"data.eval: .* its fields: text, label\. Formats accepted"):
        check_source(str(tmp_path / "odd.jsonl"), "data.eval")
    with pytest.raises(
        ConfigError, match=r"not in the llava format \(data.format\), which needs conversations"
    ):
        check_source(str(sources["raylora"]["uri"]), "data.train", "llava")
    with pytest.raises(ConfigError, match="data.format must be one of raylora, chat, llava"):
        check_source(str(sources["raylora"]["uri"]), "data.train", "csv")
    with pytest.raises(ConfigError, match="data.train: data file or folder not found"):
        check_source(str(tmp_path / "none.parquet"), "data.train")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="neither Parquet files nor a datasets.save_to_disk state.json"):
        check_source(str(tmp_path / "empty"), "data.train")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ConfigError, match="neither Parquet nor JSON"):
        check_source(str(tmp_path / "notes.txt"), "data.train")
    with pytest.raises(ConfigError, match="data.image_root: folder not found"):
        check_source(str(sources["llava"]["uri"]), "data.train", image_root=str(tmp_path / "nowhere"))


def test_dataset_dict_folder_is_refused_naming_its_splits(tmp_path):
    import datasets

    split = datasets.Dataset.from_dict({"prompt": ["p"], "answer": ["a"], "image": [b"x"]})
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ConfigError, match=r"DatasetDict; point data.train at one split's folder .*dd/test"):
        check_source(str(tmp_path / "dd"), "data.train")


def test_cli_refuses_an_unknown_format_with_exit_2(tmp_path, tiny_models):
    pq.write_table(pa.table({"pixels": [b"x"], "caption": ["c"]}), tmp_path / "odd.parquet")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {{path: {tiny_models('llava')}}}\ndata: {{train: {tmp_path / 'odd.parquet'}}}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "raylora.cli", "train", str(cfg)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stderr
    assert "its fields: pixels, caption" in proc.stderr and "Formats accepted: raylora" in proc.stderr
    assert "Traceback" not in proc.stderr
    with pytest.raises(ConfigError, match="data.format: expected one of raylora, chat, llava"):
        config.load(None, ["model.path=m", "data.train=t.parquet", "data.format=csv"])


# --- the distributed proof: each format, killed and resumed, equals one uninterrupted run ---

STEPS = ("train.max_steps=4", "train.checkpoint_every=2", "train.warmup_steps=1")
KILL_AT = 3  # rank 1 dies before step 4; the run resumes from the checkpoint of step 2


@pytest.fixture(scope="module")
def reference(ray_cluster, tiny_models, sources, tmp_path_factory):
    """One uninterrupted run on the raylora Parquet file, shared by every format's comparison."""
    from raylora.driver import run
    from tests.support import tiny_run_config

    storage = tmp_path_factory.mktemp("format-runs")
    cfg = tiny_run_config(tiny_models("llava"), sources["raylora"]["uri"], storage, "reference", *STEPS)
    result = run(cfg)
    assert result.error is None
    return storage, _final(result)


def test_every_format_builds_the_batches_a_worker_trains_on(sources, tiny_models, tmp_path, monkeypatch):
    """Per format, the micro batches of 4 steps on both ranks as `worker.step_batches` builds them, from a
    pickled copy of the rows (what the input pipeline's processes get) in another working directory (a Ray
    worker's): every tensor equal to raylora Parquet's. Training is deterministic in its batches, so equal
    batches train to equal weights; the distributed test below checks that on one format end to end."""
    from types import SimpleNamespace

    from raylora.data.processor import load_processor
    from raylora.data.sampler import GlobalSampler
    from raylora.worker import step_batches
    from tests.support import tiny_run_config

    processor = load_processor(tiny_models("llava"))
    monkeypatch.chdir(tmp_path)

    def batches(source: dict) -> list[dict]:
        cfg = tiny_run_config("m", source["uri"], tmp_path, "n", *STEPS, *source["overrides"])
        d = cfg.data
        rows = pickle.loads(pickle.dumps(open_rows(d.train, d.format, d.image_root)))
        sampler = GlobalSampler(len(rows), cfg.train.global_batch_size, cfg.train.seed)
        out = []
        for rank in range(2):
            s = SimpleNamespace(cfg=cfg, sampler=sampler, rank=rank, world_size=2, processor=processor,
                                data=rows, rope_index=None)  # fmt: skip
            for step in range(4):
                built = step_batches(s, step)
                assert built.bad_rows == built.too_long == 0 and built.tokens > 0
                out += [{**b, **p} for b, p in zip(built.batches, built.positions_of, strict=True)]
        return out

    expected = batches(sources["raylora"])
    for name, source in sources.items():
        got = batches(source)
        assert len(got) == len(expected) == 16, name
        for a, b in zip(expected, got, strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


@pytest.mark.distributed
@pytest.mark.slow
def test_llamafactory_data_on_a_remote_code_model_resumes_bitwise_and_exports(
    reference, sources, tiny_models, tmp_path
):
    """Two paths against the module's one uninterrupted run (raylora Parquet, Llava), in one killed run
    (each distributed run costs a worker group's start):

    - the data: LLaMA-Factory's dataset_info.json layout (string content with <image> tags, images beside
      the file), read by the input pipeline's processes on the workers. Every other format builds the same
      batches (test_every_format_builds_the_batches_a_worker_trains_on), and chat JSONL is killed and
      resumed in tests/test_batches.py with multi-turn, multi-image and text-only rows;
    - the model: a folder with its own modeling code (tests/test_remote_code.py; Llava's classes and
      weights under another model type), trained through the remote-code path.

    Killed and resumed, it ends equal to the reference bit for bit (the same rows and the same model under
    another name: this proves both paths train exactly as the native ones), and exports merged with its
    modeling file."""
    from transformers import AutoModelForImageTextToText

    from raylora import cli
    from raylora.driver import run
    from raylora.progress import read_metrics
    from tests.remote_model import REMOTE_PARTS, make_remote_code_model
    from tests.support import tiny_run_config

    storage, expected = reference
    source = sources["llamafactory"]
    model = make_remote_code_model(tiny_models("llava"), tmp_path / "remote")
    overrides = [*STEPS, *source["overrides"], *REMOTE_PARTS, f"fault.kill_at_steps={KILL_AT}"]
    killed = run(tiny_run_config(model, source["uri"], storage, "killed-remote", *overrides))
    assert killed.error is None
    logged = read_metrics(str(storage), "killed-remote")
    assert {r["step"] for r in logged} >= {1, 2, 3, 4} and all(r["bad_rows"] == 0 for r in logged)
    got = _final(killed)
    assert expected.state.restarts == 0
    assert got.state.restarts == 1 and got.state.step == expected.state.step == 4
    assert got.state.arch == "raylora_remote_vlm" and got.state.data_rows == ROWS
    assert got.weights.keys() == expected.weights.keys()
    for key, value in expected.weights.items():
        assert torch.equal(value, got.weights[key]), f"{key} differs from the raylora Parquet Llava run"
    out = tmp_path / "merged"
    with killed.checkpoint.as_directory() as folder:
        assert cli.main(["export", folder, "--out", str(out), "--merge"]) == 0
    assert (out / "modeling_remote_vlm.py").is_file()  # the merged folder carries the model's code too
    merged = AutoModelForImageTextToText.from_pretrained(out, trust_remote_code=True)
    assert type(merged).__name__ == "RemoteVlmForConditionalGeneration"
    assert not any(".lora_" in n for n in merged.state_dict())
