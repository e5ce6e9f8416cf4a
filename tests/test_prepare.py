"""`raylora prepare-data` on the digits written as LLaVA JSON with an image folder and a few corrupt rows."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from raylora.cli import main
from tests.ray_env import RAY_TEST_ENV

ROWS = 40
UNDECODABLE, EMPTY_ANSWER, MISSING_FILE, TOO_FEW_IMAGES = 3, 7, 11, 15
BAD = {UNDECODABLE, EMPTY_ANSWER, MISSING_FILE, TOO_FEW_IMAGES}
TEXT_ONLY, TWO_IMAGES = 20, 21


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def llava_source(digits, tmp_path_factory):
    """(data.json, image folder, {row: [image bytes]}) for the first ROWS digits, images of several sizes;
    rows in BAD are corrupt, one row has no image and one has two."""
    root = tmp_path_factory.mktemp("llava")
    folder = root / "images"
    folder.mkdir()
    records, images = [], {}
    for i, row in enumerate(pq.read_table(digits[0]).slice(0, ROWS).to_pylist()):
        size = (8 + 4 * (i % 5), 8 + 8 * (i % 3))
        pngs = [_png(Image.open(io.BytesIO(row["image"])).resize(size))]
        if i == TWO_IMAGES:
            pngs.append(_png(Image.new("RGB", (20, 12), (0, 90, 200))))
        if i == UNDECODABLE:
            pngs = [b"\x89PNG not really"]
        names = [f"{i}-{k}.png" for k in range(len(pngs))]
        for name, png in zip(names, pngs, strict=True):
            (folder / name).write_bytes(png)
        if i == MISSING_FILE:
            names = ["nowhere.png"]
        prompt = "<image>\n" * (len(names) + (i == TOO_FEW_IMAGES)) + row["prompt"]
        record = {"id": str(i), "image": names if len(names) > 1 else names[0]}
        if i == TEXT_ONLY:
            prompt, record, pngs = "Which digit follows three?", {"id": str(i)}, []
        answer = "" if i == EMPTY_ANSWER else row["answer"]
        record["conversations"] = [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}]
        records.append(record)
        images[i] = pngs
    path = root / "data.json"
    path.write_text(json.dumps(records))
    return path, folder, images


@pytest.fixture(scope="module")
def prepared(llava_source, tiny_models, ray_cluster, tmp_path_factory):
    """The prepared folder (tokens counted by the tiny Llava's processor) and what the command printed.

    4 bad rows of 40 are more than the default --max-bad-fraction (0.01): the command writes everything
    and exits 3, saying so."""
    source, folder, _ = llava_source
    out = tmp_path_factory.mktemp("prepared") / "out"
    model = tiny_models("llava")
    argv = ["prepare-data", str(source), "--out", str(out), "--image-root", str(folder), "--model", model]
    with (
        contextlib.redirect_stdout(io.StringIO()) as stdout,
        contextlib.redirect_stderr(io.StringIO()) as err,
    ):
        code = main(argv)
    printed = stdout.getvalue()
    assert code == 3, printed + err.getvalue()
    assert f"{len(BAD)} of {ROWS} rows" in err.getvalue() and "--max-bad-fraction (0.01)" in err.getvalue()
    return out, model, printed


def test_prepared_rows_equal_the_good_source_rows(llava_source, prepared):
    from raylora.data.formats import check_source, open_rows

    source, folder, images = llava_source
    out, _, _ = prepared
    good = [i for i in range(ROWS) if i not in BAD]
    src, rows = open_rows(str(source), image_root=str(folder)), open_rows(str(out))
    assert len(rows) == len(good)
    for k, i in enumerate(good):
        sample = rows.sample(k)
        assert sample.messages == src.sample(i).messages, i
        assert sample.images == images[i], i  # the encoded bytes as they were, in order
    assert rows.sample(good.index(TEXT_ONLY)).images == []
    assert check_source(str(out), "data.train") == (rows.format, len(good))  # training takes the folder
    for name in json.loads((out / "summary.json").read_text())["files"]:  # small row groups
        meta = pq.read_metadata(out / name)
        assert max(meta.row_group(g).num_rows for g in range(meta.num_row_groups)) <= 64


def test_bad_rows_are_named_with_a_reason(prepared):
    out, _, printed = prepared
    bad = [json.loads(line) for line in (out / "bad_rows.jsonl").read_text().splitlines()]
    assert [b["row"] for b in bad] == sorted(BAD)
    reasons = {b["row"]: b["reason"] for b in bad}
    assert all(reasons.values()), reasons
    assert "answer" in reasons[EMPTY_ANSWER].lower(), reasons
    assert "nowhere.png" in reasons[MISSING_FILE], reasons
    assert f"{ROWS - len(BAD)} good, {len(BAD)} bad" in printed


def test_statistics(llava_source, prepared):
    """Image sizes, images per row and tokens, computed here from the source files and the processor."""
    from raylora.data.batches import make_batch
    from raylora.data.formats import open_rows
    from raylora.data.processor import load_processor

    source, folder, images = llava_source
    out, model, printed = prepared
    good = [i for i in range(ROWS) if i not in BAD]
    decoded = [Image.open(io.BytesIO(png)) for i in good for png in images[i]]
    processor = load_processor(model)
    src = open_rows(str(source), image_root=str(folder))
    tokens = []  # as data.max_length counts them: the unpadded length of the sample's training batch
    for i in good:
        pixels = [Image.open(io.BytesIO(png)).convert("RGB") for png in images[i]]
        batch = make_batch(processor, [(src.sample(i).messages, pixels)])
        tokens.append(int(batch["attention_mask"].sum()))
    expected = {
        "width": [im.width for im in decoded],
        "height": [im.height for im in decoded],
        "images_per_row": [len(images[i]) for i in good],
        "tokens": tokens,
    }
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["rows"], summary["good_rows"], summary["bad_rows"]) == (ROWS, len(good), len(BAD))
    for name, values in expected.items():
        want = {
            "min": min(values),
            "median": float(np.median(values)),
            "p95": float(np.percentile(values, 95)),
            "max": max(values),
        }
        assert summary["statistics"][name] == pytest.approx(want), name
        assert printed.count(f"\n{name} ") == 1, printed
    assert summary["statistics"]["images_per_row"]["max"] == 2


def test_a_non_empty_out_is_refused(llava_source, prepared, capsys):
    source, folder, _ = llava_source
    out, _, _ = prepared
    before = sorted(p.name for p in out.iterdir())
    assert main(["prepare-data", str(source), "--out", str(out), "--image-root", str(folder)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == before


def test_a_source_in_no_known_format_exits_2_before_ray(tmp_path):
    source = tmp_path / "rows.jsonl"
    source.write_text(json.dumps({"question": "2+2?", "reply": "4"}) + "\n")
    # A Ray address that answers nothing: reaching Ray would fail some other way than exit 2.
    env = {**os.environ, **RAY_TEST_ENV, "RAY_ADDRESS": "127.0.0.1:9"}
    proc = subprocess.run(
        [sys.executable, "-m", "raylora.cli", "prepare-data", str(source), "--out", str(tmp_path / "out")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "SOURCE" in proc.stderr and "question" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def test_exit_codes_say_when_too_many_or_all_rows_are_bad(llava_source, prepared, tmp_path, capsys):
    """0 at or under --max-bad-fraction, 3 over it (the `prepared` run), 1 when no row is good; the bad rows
    are written with their reasons in every case."""
    from raylora.prepare import verdict

    summary = json.loads((prepared[0] / "summary.json").read_text())
    assert verdict(summary, 0.01)[0] == 3 and verdict(summary, len(BAD) / ROWS) == (0, None)
    source, folder, _ = llava_source
    ok = tmp_path / "ok"
    argv = [
        "prepare-data",
        str(source),
        "--out",
        str(ok),
        "--image-root",
        str(folder),
        "--max-bad-fraction",
        "0.1",
    ]
    assert main(argv) == 0
    # every row's image missing: nothing good, exit 1 after writing why
    records = json.loads(source.read_text())
    for record in records:
        record["image"] = "nowhere.png"
    all_bad = tmp_path / "all_bad.json"
    all_bad.write_text(json.dumps(records))
    out = tmp_path / "none"
    capsys.readouterr()
    assert main(["prepare-data", str(all_bad), "--out", str(out), "--image-root", str(folder)]) == 1
    captured = capsys.readouterr()
    assert f"0 good, {ROWS} bad" in captured.out and "no row of" in captured.err, captured
    bad = [json.loads(line) for line in (out / "bad_rows.jsonl").read_text().splitlines()]
    assert [b["row"] for b in bad] == list(range(ROWS)) and all(b["reason"] for b in bad)
    assert "nowhere.png" in bad[0]["reason"], bad[0]


def test_a_reasoning_template_counts_tokens_with_the_template_arguments_given(
    llava_source, tiny_models, monkeypatch
):
    """prepare-data's task with Qwen3.5's tokenizer and template (run without Ray Data: its ledger is a
    stand-in): answers without reasoning are bad rows that name data.chat_template_kwargs, and with
    `--chat-template-kwargs '{"enable_thinking": false}'` the same rows count their tokens."""
    from types import SimpleNamespace

    from raylora import prepare
    from raylora.cli import parser

    recorded = {}
    ledger = SimpleNamespace(
        add=SimpleNamespace(remote=lambda first, bad, sizes: recorded.update(bad=bad, **sizes))
    )
    monkeypatch.setattr(prepare.ray, "get", lambda value: value)
    source, folder, _ = llava_source
    model, ids = tiny_models("qwen3_5"), {"id": np.arange(3)}
    prepare.check_rows(ids, str(source), "llava", str(folder), model, ledger)
    assert [i for i, _ in recorded["bad"]] == [0, 1, 2]
    assert all("enable_thinking: false" in why for _, why in recorded["bad"])
    args = parser().parse_args(
        ["prepare-data", "src", "--out", "o", "--chat-template-kwargs", '{"enable_thinking": false}']
    )
    kwargs = json.dumps(args.chat_template_kwargs)
    prepare.check_rows(ids, str(source), "llava", str(folder), model, ledger, kwargs)
    assert recorded["bad"] == [] and all(n > 0 for n in recorded["tokens"].tolist())
