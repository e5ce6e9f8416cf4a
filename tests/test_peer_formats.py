"""The data the peer tools ship and document, read as their users have it (issue 19).

Each row below is written as the peer writes it: LLaMA-Factory's `data/mllm_demo.json`,
`data/mllm_video_demo.json`, `data/dataset_info.json` and `data/README.md`; ms-swift's
`docs/source_en/Customization/Custom-dataset.md`; axolotl's `docs/multimodal.qmd`; OpenAI's chat content
parts. Only the image files are ours: real PNG/JPEG files written with PIL, each of its own colour, so that
which image landed where can be told from its pixels.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
from PIL import Image

from raylora.config import ConfigError
from raylora.data.batches import read
from raylora.data.formats import BadRow, check_source, load_image, open_rows

IMAGE, VIDEO = {"type": "image"}, {"type": "video"}


def text(value: str) -> dict:
    return {"type": "text", "text": value}


def picture(path: Path, colour: tuple[int, int, int]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 6), colour).save(path)  # the format from the suffix: .jpg is a real JPEG
    return path


def png_bytes(colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 6), colour).save(buf, format="PNG")
    return buf.getvalue()


def colour(entry) -> tuple[int, int, int]:
    return load_image(entry).getpixel((3, 3))


def near(got: tuple[int, int, int], want: tuple[int, int, int]) -> bool:  # JPEG is lossy by a few levels
    return all(abs(a - b) <= 8 for a, b in zip(got, want, strict=True))


def write_json(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=2, ensure_ascii=False), encoding="utf-8")
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


RED, GREEN, BLUE = (200, 30, 30), (30, 200, 30), (30, 30, 200)

# The first two records of LLaMA-Factory's data/mllm_demo.json, as it ships them.
MLLM_DEMO = [
    {
        "messages": [
            {"content": "<image>Who are they?", "role": "user"},
            {"content": "They're Kane and Gretzka from Bayern Munich.", "role": "assistant"},
            {"content": "What are they doing?<image>", "role": "user"},
            {"content": "They are celebrating on the soccer field.", "role": "assistant"},
        ],
        "images": ["mllm_demo_data/1.jpg", "mllm_demo_data/1.jpg"],
    },
    {
        "messages": [
            {"content": "<image>Who is he?", "role": "user"},
            {"content": "He's Thomas Muller from Bayern Munich.", "role": "assistant"},
            {"content": "Why is he on the ground?", "role": "user"},
            {"content": "Because he's sliding on his knees to celebrate.", "role": "assistant"},
        ],
        "images": ["mllm_demo_data/2.jpg"],
    },
]
# Its data/mllm_video_demo.json, first record.
MLLM_VIDEO_DEMO = [
    {
        "messages": [
            {"content": "<video>Why is this video funny?", "role": "user"},
            {"content": "Because a baby is reading, and he is so cute!", "role": "assistant"},
        ],
        "videos": ["mllm_demo_data/1.mp4"],
    }
]
# Its data/dataset_info.json entries for them, verbatim.
DATASET_INFO = {
    "mllm_demo": {
        "file_name": "mllm_demo.json",
        "formatting": "sharegpt",
        "columns": {"messages": "messages", "images": "images"},
        "tags": {
            "role_tag": "role",
            "content_tag": "content",
            "user_tag": "user",
            "assistant_tag": "assistant",
        },
    },
    "mllm_video_demo": {
        "file_name": "mllm_video_demo.json",
        "formatting": "sharegpt",
        "columns": {"messages": "messages", "videos": "videos"},
        "tags": {
            "role_tag": "role",
            "content_tag": "content",
            "user_tag": "user",
            "assistant_tag": "assistant",
        },
    },
    "alpaca_en_demo": {"file_name": "alpaca_en_demo.json"},
    "glaive_toolcall_en_demo": {
        "file_name": "glaive_toolcall_en_demo.json",
        "formatting": "sharegpt",
        "columns": {"messages": "conversations", "tools": "tools"},
    },
    "alpaca_en": {"hf_hub_url": "llamafactory/alpaca_en", "ms_hub_url": "llamafactory/alpaca_en"},
}


@pytest.fixture
def llamafactory_data(tmp_path) -> Path:
    """A folder laid out as LLaMA-Factory's `data/`: dataset_info.json, the demo files, mllm_demo_data/."""
    data = tmp_path / "data"
    picture(data / "mllm_demo_data" / "1.jpg", RED)
    picture(data / "mllm_demo_data" / "2.jpg", GREEN)
    (data / "mllm_demo_data" / "1.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")  # never decoded here
    write_json(data / "mllm_demo.json", MLLM_DEMO)
    write_json(data / "mllm_video_demo.json", MLLM_VIDEO_DEMO)
    write_json(data / "dataset_info.json", DATASET_INFO)
    return data


def test_llamafactory_mllm_demo_string_content_with_image_tags(llamafactory_data):
    for uri in (llamafactory_data / "mllm_demo.json", f"{llamafactory_data / 'dataset_info.json'}#mllm_demo"):
        rows = open_rows(str(uri))
        assert (rows.format, len(rows)) == ("chat", 2)
        first = rows.sample(0)
        assert first.messages == [
            {"role": "user", "content": [IMAGE, text("Who are they?")]},
            {"role": "assistant", "content": [text("They're Kane and Gretzka from Bayern Munich.")]},
            {"role": "user", "content": [text("What are they doing?"), IMAGE]},
            {"role": "assistant", "content": [text("They are celebrating on the soccer field.")]},
        ]
        assert first.images == [str(llamafactory_data / "mllm_demo_data" / "1.jpg")] * 2
        second = rows.sample(1)
        assert second.image_count == 1 and near(colour(second.images[0]), GREEN)
        assert rows.unread_fields == []


def test_llamafactory_video_demo_carries_videos_and_never_the_tag_as_text(llamafactory_data):
    for uri in (
        llamafactory_data / "mllm_video_demo.json",
        f"{llamafactory_data / 'dataset_info.json'}#mllm_video_demo",
    ):
        sample = open_rows(str(uri)).sample(0)
        assert sample.messages[0] == {"role": "user", "content": [VIDEO, text("Why is this video funny?")]}
        assert sample.videos == [str(llamafactory_data / "mllm_demo_data" / "1.mp4")]
        assert sample.images == [] and sample.video_count == 1
        assert "<video>" not in json.dumps(sample.messages)
        # the fixture's 1.mp4 is a bare header: decoding it (tests/test_video.py decodes real clips) makes
        # the row a bad row that says why, never a text row
        with pytest.raises(BadRow, match="video: the video does not decode"):
            read(open_rows(str(uri)), 0)


def test_llamafactory_sharegpt_conversations_with_images_and_roles(tmp_path):
    picture(tmp_path / "a.png", RED)
    picture(tmp_path / "b.png", BLUE)
    rows = [  # data/README.md, "Multimodal Image Dataset" (sharegpt), with two images and a system turn
        {
            "conversations": [
                {"from": "system", "value": "system prompt"},
                {"from": "human", "value": "<image>user instruction"},
                {"from": "gpt", "value": "model response"},
                {"from": "user", "value": "And <image>?"},  # the user/assistant that its users also write
                {"from": "assistant", "value": "Blue."},
            ],
            "images": ["a.png", "b.png"],
        }
    ]
    got = open_rows(str(write_json(tmp_path / "sharegpt.json", rows)))
    assert got.format == "llava"
    sample = got.sample(0)
    assert [t["role"] for t in sample.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert sample.messages[1]["content"] == [IMAGE, text("user instruction")]
    assert sample.messages[3]["content"] == [text("And "), IMAGE, text("?")]
    assert [colour(e) for e in sample.images] == [RED, BLUE]


@pytest.mark.parametrize("speaker", ["function_call", "observation"])
def test_llamafactory_tool_turns_are_refused_naming_why(tmp_path, speaker):
    rows = [  # data/README.md, sharegpt "Supervised Fine-Tuning Dataset"
        {
            "conversations": [
                {"from": "human", "value": "user instruction"},
                {"from": "function_call", "value": "tool arguments"},
                {"from": "observation", "value": "tool result"},
                {"from": "gpt", "value": "model response"},
            ],
            "system": "system prompt (optional)",
            "tools": "tool description (optional)",
        }
    ]
    if speaker == "observation":  # the observation turn alone
        del rows[0]["conversations"][1]
    got = open_rows(str(write_json(tmp_path / "tools.json", rows)))
    with pytest.raises(BadRow, match=f"a '{speaker}' turn .*tool-call turns are not supported"):
        got.sample(0)
    assert got.unread_fields == ["tools"]


def test_llamafactory_alpaca_with_history_system_and_images(tmp_path):
    picture(tmp_path / "img" / "x.png", GREEN)
    rows = [  # data/README.md, "Alpaca Format", plus an image as its multimodal section says
        {
            "instruction": "<image>user instruction (required)",
            "input": "user input (optional)",
            "output": "model response (required)",
            "system": "system prompt (optional)",
            "history": [
                [
                    "user instruction in the first round (optional)",
                    "model response in the first round (optional)",
                ],
                [
                    "user instruction in the second round (optional)",
                    "model response in the second round (optional)",
                ],
            ],
            "images": ["img/x.png"],
        }
    ]
    got = open_rows(str(write_json(tmp_path / "alpaca.json", rows)))
    assert got.format == "alpaca"
    sample = got.sample(0)
    assert [t["role"] for t in sample.messages] == ["system", "user", "assistant", "user", "assistant"] + [
        "user",
        "assistant",
    ]
    assert sample.messages[1]["content"] == [text("user instruction in the first round (optional)")]
    assert sample.messages[5]["content"] == [
        IMAGE,
        text("user instruction (required)\nuser input (optional)"),
    ]
    assert sample.messages[6]["content"] == [text("model response (required)")]
    assert sample.images == [str(tmp_path / "img" / "x.png")]


def test_ms_swift_documented_rows(tmp_path):
    for name, c in (("x.jpg", RED), ("x.png", BLUE), ("y.png", GREEN)):
        picture(tmp_path / name, c)
    (tmp_path / "x.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")
    x_jpg, x_png, y_png, x_mp4 = (str(tmp_path / n) for n in ("x.jpg", "x.png", "y.png", "x.mp4"))
    rows = [  # Custom-dataset.md, "Multimodal", supervised fine-tuning (its /xxx/ paths made real)
        {
            "messages": [
                {"role": "user", "content": "Where is the capital of Zhejiang?"},
                {"role": "assistant", "content": "The capital of Zhejiang is Hangzhou."},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "<image><image>What is the difference between the two images?"},
                {"role": "assistant", "content": "The first one is a kitten, and the second one is a puppy."},
            ],
            "images": [x_jpg, x_png],
        },
        {
            "messages": [
                {"role": "system", "content": "You are a helpful and harmless assistant."},
                {"role": "user", "content": "<image>What is in the image, <video>What is in the video?"},
                {
                    "role": "assistant",
                    "content": "The image shows an elephant, and the video shows a puppy running on "
                    "the grass.",
                },
            ],
            "images": [x_jpg],
            "videos": [x_mp4],
        },
        {  # "images: image, images": a single image under `image`
            "messages": [
                {"role": "user", "content": "<image>What is this"},
                {"role": "assistant", "content": "A rabbit"},
            ],
            "image": y_png,
        },
        {  # base64 instead of a path, as the page shows it
            "messages": [
                {"role": "user", "content": "<image>Colour?"},
                {"role": "assistant", "content": "Blue."},
            ],
            "images": ["data:image/png;base64," + base64.b64encode(png_bytes(BLUE)).decode()],
        },
    ]
    got = open_rows(str(write_jsonl(tmp_path / "swift.jsonl", rows)))
    assert got.format == "chat" and len(got) == 5
    assert got.sample(0).messages[0] == {
        "role": "user",
        "content": [text("Where is the capital of Zhejiang?")],
    }
    two = got.sample(1)
    assert two.messages[0]["content"] == [
        IMAGE,
        IMAGE,
        text("What is the difference between the two images?"),
    ]
    assert near(colour(two.images[0]), RED) and colour(two.images[1]) == BLUE
    mixed = got.sample(2)
    assert mixed.messages[1]["content"] == [
        IMAGE,
        text("What is in the image, "),
        VIDEO,
        text("What is in the video?"),
    ]
    assert (mixed.images, mixed.videos) == ([x_jpg], [x_mp4])
    # `images` is the source's field; `image` beside it is not read, and said so
    assert got.unread_fields == ["image"]
    alone = open_rows(str(write_jsonl(tmp_path / "single.jsonl", [rows[3]])))
    assert alone.sample(0).images == [y_png] and alone.unread_fields == []
    assert colour(got.sample(4).images[0]) == BLUE


def test_ms_swift_query_response_and_untagged_images(tmp_path):
    picture(tmp_path / "a.png", RED)
    rows = [  # Custom-dataset.md, "Query-Response format", with an image and no tag (ms-swift puts it first)
        {
            "system": "<system>",
            "query": "<query2>",
            "response": "<response2>",
            "history": [["<query1>", "<response1>"]],
            "images": ["a.png"],
        }
    ]
    got = open_rows(str(write_jsonl(tmp_path / "qr.jsonl", rows)))
    assert got.format == "query_response"
    sample = got.sample(0)
    assert sample.messages == [
        {"role": "system", "content": [text("<system>")]},
        {"role": "user", "content": [IMAGE, text("<query1>")]},
        {"role": "assistant", "content": [text("<response1>")]},
        {"role": "user", "content": [text("<query2>")]},
        {"role": "assistant", "content": [text("<response2>")]},
    ]
    assert colour(sample.images[0]) == RED
    alpaca = {
        "system": "<system>",
        "instruction": "<query-inst>",
        "input": "<query-input>",
        "output": "<response>",
    }
    sample = open_rows(str(write_jsonl(tmp_path / "al.jsonl", [alpaca]))).sample(0)
    assert sample.messages[1] == {"role": "user", "content": [text("<query-inst>\n<query-input>")]}


def test_openai_image_url_parts_data_urls_paths_and_file_urls(tmp_path):
    picture(tmp_path / "p.png", GREEN)
    data = "data:image/png;base64," + base64.b64encode(png_bytes(RED)).decode()
    rows = [
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Compare these images."},
                        {"type": "image_url", "image_url": {"url": data}},
                        {"type": "image_url", "image_url": {"url": "p.png"}},
                        {"type": "image_url", "image_url": {"url": (tmp_path / "p.png").as_uri()}},
                    ],
                },
                {"role": "assistant", "content": [{"type": "text", "text": "Red, then green twice."}]},
            ]
        }
    ]
    sample = open_rows(str(write_jsonl(tmp_path / "openai.jsonl", rows))).sample(0)
    assert sample.messages[0]["content"] == [text("Compare these images."), IMAGE, IMAGE, IMAGE]
    assert sample.images[0] == png_bytes(RED)  # the data: URL decoded once, when the row is read
    assert sample.images[1:] == [str(tmp_path / "p.png")] * 2
    assert [colour(e) for e in sample.images] == [RED, GREEN, GREEN]
    assert colour(data) == RED  # load_image takes a data: URL itself, too


def test_axolotl_image_parts_path_and_base64(tmp_path):
    picture(tmp_path / "bee.png", BLUE)
    raw = base64.b64encode(png_bytes(GREEN)).decode()
    rows = [  # docs/multimodal.qmd's example, its image given by `path` and by `base64`
        {
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": "You are a helpful assistant."}]},
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "path": "bee.png"},
                        {"type": "image", "base64": raw},
                        {"type": "text", "text": "Describe this image in detail."},
                    ],
                },
                {"role": "assistant", "content": [{"type": "text", "text": "The image is a bee."}]},
            ]
        }
    ]
    sample = open_rows(str(write_json(tmp_path / "axolotl.json", rows))).sample(0)
    assert sample.messages[1]["content"] == [IMAGE, IMAGE, text("Describe this image in detail.")]
    assert sample.images == [str(tmp_path / "bee.png"), png_bytes(GREEN)]
    assert [colour(e) for e in sample.images] == [BLUE, GREEN]
    # raw base64 (no data: prefix) in an `images` list is an image, not a path
    row = {"messages": [{"role": "user", "content": "<image>?"}, {"role": "assistant", "content": "Green."}]}
    got = open_rows(str(write_jsonl(tmp_path / "raw.jsonl", [{**row, "images": [raw]}]))).sample(0)
    assert got.images == [png_bytes(GREEN)]


@pytest.mark.parametrize(
    "content",
    [  # axolotl's own example (docs/multimodal.qmd); OpenAI's; ms-swift's `images` of URLs
        [
            {
                "type": "image",
                "image": "https://huggingface.co/datasets/huggingface/documentation-images/resolve/main/bee.jpg",
            }
        ],
        [{"type": "image_url", "image_url": {"url": "https://example.com/input.png"}}],
        "<image>",
    ],
)
def test_web_image_urls_are_refused_with_why(tmp_path, content):
    row = {
        "messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "A bee."}],
        "images": ["http://example.com/x.jpg"] if content == "<image>" else None,
    }
    rows = open_rows(str(write_jsonl(tmp_path / "web.jsonl", [row])))
    with pytest.raises(BadRow) as err:
        rows.sample(0)
    assert err.value.reason.startswith("remote image URL http")
    assert "not the web" in err.value.reason and "download it" in err.value.reason


def test_dataset_info_columns_and_tags_rename_fields(tmp_path):
    data = tmp_path / "data"
    picture(data / "pics" / "1.png", RED)
    info = {  # a user's own entries, as data/README.md describes `columns` and `tags`
        "my_vqa": {
            "file_name": "vqa/train.jsonl",
            "formatting": "sharegpt",
            "columns": {"messages": "dialog", "images": "pictures", "system": "preamble"},
            "tags": {
                "role_tag": "speaker",
                "content_tag": "words",
                "user_tag": "asker",
                "assistant_tag": "answerer",
                "system_tag": "setup",
                "function_tag": "call",
            },
        },
        "my_alpaca": {
            "file_name": "alpaca.json",
            "columns": {
                "prompt": "ask",
                "query": "detail",
                "response": "reply",
                "history": "before",
                "images": "pics",
            },
        },
    }
    write_json(data / "dataset_info.json", info)
    write_jsonl(
        data / "vqa" / "train.jsonl",
        [
            {
                "dialog": [
                    {"speaker": "asker", "words": "<image>What colour?"},
                    {"speaker": "answerer", "words": "Red."},
                ],
                "pictures": ["pics/1.png"],  # against the json's folder (LLaMA-Factory's media_dir)
                "preamble": "Be brief.",
                "audios": ["never.wav"],
            },
            {
                "dialog": [{"speaker": "asker", "words": "x"}, {"speaker": "call", "words": "{}"}],
                "pictures": [],
            },
            {
                "dialog": [{"speaker": "human", "words": "x"}, {"speaker": "gpt", "words": "y"}],
                "pictures": [],
            },
        ],
    )
    rows = open_rows(f"{data / 'dataset_info.json'}#my_vqa")
    assert rows.format == "llava" and len(rows) == 3
    sample = rows.sample(0)
    assert sample.messages == [
        {"role": "system", "content": [text("Be brief.")]},
        {"role": "user", "content": [IMAGE, text("What colour?")]},
        {"role": "assistant", "content": [text("Red.")]},
    ]
    assert sample.images == [str(data / "pics" / "1.png")] and colour(sample.images[0]) == RED
    assert rows.unread_fields == ["audios"]
    with pytest.raises(BadRow, match=r"a 'call' turn \(function_tag\): tool-call turns are not supported"):
        rows.sample(1)
    with pytest.raises(BadRow, match=r"unknown speaker 'human' \(setup, asker, answerer\)"):
        rows.sample(2)  # the entry's tags replace the defaults, as in LLaMA-Factory

    write_json(
        data / "alpaca.json",
        [
            {
                "ask": "<image>Name it",
                "detail": "briefly",
                "reply": "A dot.",
                "before": [["Hi", "Hello"]],
                "pics": ["pics/1.png"],
            }
        ],
    )
    alpaca = open_rows(f"{data / 'dataset_info.json'}#my_alpaca")
    assert alpaca.format == "alpaca"
    assert alpaca.sample(0).messages == [
        {"role": "user", "content": [text("Hi")]},
        {"role": "assistant", "content": [text("Hello")]},
        {"role": "user", "content": [IMAGE, text("Name it\nbriefly")]},
        {"role": "assistant", "content": [text("A dot.")]},
    ]
    assert check_source(f"{data / 'dataset_info.json'}#my_alpaca", "data.train") == ("alpaca", 1)


def test_dataset_info_refusals_name_the_entry(llamafactory_data):
    info = llamafactory_data / "dataset_info.json"
    with pytest.raises(ConfigError, match=r"no entry 'nope' \(its entries: alpaca_en, alpaca_en_demo"):
        check_source(f"{info}#nope", "data.train")
    with pytest.raises(
        ConfigError, match=r"alpaca_en is not a local file \(hf_hub_url=llamafactory/alpaca_en\)"
    ):
        check_source(f"{info}#alpaca_en", "data.train")
    with pytest.raises(ConfigError, match=r"LLaMA-Factory's list of data sets: name one, as .*#name"):
        check_source(str(info), "data.train")
    with pytest.raises(ConfigError, match="data file or folder not found: .*alpaca_en_demo.json"):
        check_source(f"{info}#alpaca_en_demo", "data.train")


def test_a_hub_data_set_in_llamafactorys_layout_parquet_and_save_to_disk(tmp_path):
    """String content with `<image>` tags and a list of `Image` features, as Hub data sets made for
    LLaMA-Factory hold them (its mllm_demo pushed with `datasets`)."""
    import datasets

    images = [[png_bytes(RED), png_bytes(GREEN)], [png_bytes(BLUE)]]
    table = {
        "messages": [
            [
                {"role": "user", "content": "<image>Who are they?"},
                {"role": "assistant", "content": "Two dots."},
                {"role": "user", "content": "And here?<image>"},
                {"role": "assistant", "content": "A green one."},
            ],
            [{"role": "user", "content": "<image>Colour?"}, {"role": "assistant", "content": "Blue."}],
        ],
        "images": [[{"bytes": b, "path": None} for b in row] for row in images],
    }
    features = datasets.Features(
        {
            "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
            "images": datasets.Sequence(datasets.Image()),
        }
    )
    ds = datasets.Dataset.from_dict(table, features=features)
    ds.to_parquet(str(tmp_path / "train-00000-of-00001.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    for uri in (tmp_path / "train-00000-of-00001.parquet", tmp_path / "saved"):
        rows = open_rows(str(uri))
        assert (rows.format, len(rows)) == ("chat", 2)
        first = rows.sample(0)
        assert first.messages[0]["content"] == [IMAGE, text("Who are they?")]
        assert first.messages[2]["content"] == [text("And here?"), IMAGE]
        assert [colour(e) for e in first.images] == [RED, GREEN]
        assert [colour(e) for e in rows.sample(1).images] == [BLUE]


def test_tag_and_image_counts_that_differ_are_bad_rows(tmp_path):
    picture(tmp_path / "a.png", RED)
    row = {
        "messages": [{"role": "user", "content": "<image><image>?"}, {"role": "assistant", "content": "a"}]
    }
    rows = open_rows(str(write_jsonl(tmp_path / "m.jsonl", [{**row, "images": ["a.png"]}])))
    with pytest.raises(BadRow, match="2 image placeholders, 1 images"):
        rows.sample(0)


def test_batches_put_each_image_where_its_tag_stood(llamafactory_data, tiny_models, tmp_path):
    """Through the model's processor (Qwen2-VL's template, a byte-level BPE that decodes back to the exact
    text): every tag of a peer's string content is the image's tokens at that place in the batch."""
    import re

    from raylora.data.batches import make_batch
    from tests.test_labels import hub_like_processor

    processor = hub_like_processor(tiny_models("qwen2_vl"), "qwen2_vl", tmp_path / "qwen")
    picture(tmp_path / "x.png", BLUE)
    swift = {  # ms-swift's two-image row, and an alpaca row with history (LLaMA-Factory's layout)
        "messages": [
            {"role": "user", "content": "<image>First,<image> then what is different?"},
            {"role": "assistant", "content": "Colour."},
        ],
        "images": ["x.png", "x.png"],
    }
    alpaca = {"instruction": "Look:<image>", "input": "which colour?", "output": "Blue.", "images": ["x.png"]}
    sources = [
        (str(llamafactory_data / "dataset_info.json") + "#mllm_demo", MLLM_DEMO[0]["messages"]),
        (str(write_jsonl(tmp_path / "swift.jsonl", [swift])), swift["messages"]),
        (str(write_jsonl(tmp_path / "alpaca.jsonl", [alpaca])), [{"content": "Look:<image>\nwhich colour?"}]),
    ]
    image = re.escape("<|vision_start|>") + f"(?:{re.escape('<|image_pad|>')})+" + re.escape("<|vision_end|>")
    for uri, turns in sources:
        decoded = read(open_rows(uri), 0)
        batch = make_batch(processor, [decoded])
        text = processor.tokenizer.decode(batch["input_ids"][0])
        tags = 0
        for turn in turns:
            if "<image>" in turn["content"]:
                # a tag's own line break goes with it (LLaVA's "<image>\n"; docs/data.md)
                pieces = re.split(r"\n?<image>\n?", turn["content"])
                tags += len(pieces) - 1
                assert re.search(image.join(re.escape(p) for p in pieces), text), (uri, text)
        assert len(re.findall(image, text)) == tags == batch["image_grid_thw"].shape[0] == len(decoded[1])
