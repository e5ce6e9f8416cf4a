"""Video rows, end to end: decoded with PyAV, sampled as the peers sample, trained exactly.

The videos are written here with PyAV, as a phone or a screen recorder writes them: H.264 in MP4 and MPEG-4
Part 2 in AVI, the two containers of LLaMA-Factory's `data/mllm_demo_data/` (1.mp4, 2.avi, 3.mp4). The data
files are written as the peers write them: LLaMA-Factory's `data/mllm_video_demo.json` and its
`dataset_info.json` entry (verbatim from tests/test_peer_formats.py), ms-swift's `videos`
(`docs/source_en/Customization/Custom-dataset.md`), Qwen's content parts (`{"type": "video", "video": path}`,
the Qwen2-VL / Qwen3-VL model cards), OpenAI's `video_url` parts, and a `datasets.save_to_disk` folder whose
column holds video paths, as a Hub video data set arrives.
"""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from raylora.config import ConfigError
from raylora.data import packing, video
from raylora.data.batches import (
    NO_VIDEO_STAND_IN,
    _collate,
    limit_length,
    packed_passes,
    read,
    stand_in_micro_batch,
    use_video_stand_in,
)
from raylora.data.formats import BadRow, load_video, open_rows
from raylora.data.labels import IGNORE_INDEX, encode
from raylora.data.processor import load_processor
from tests.run_logs import labelled_runs
from tests.support import tiny_processor, tiny_run_config
from tests.test_packing import TOLERANCE, _loss_and_grads, _model, _relative
from tests.test_peer_formats import DATASET_INFO

QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
FPS, FRAMES, EDGE = 6, 12, 32  # a two-second clip: 12 frames at 6 fps, 32x32


def write_video(path: Path, frames: int = FRAMES, fps: int = FPS, edge: int = EDGE) -> Path:
    """A clip whose frames differ (a bar that grows), encoded by FFmpeg through PyAV: H.264 for .mp4,
    MPEG-4 Part 2 for .avi."""
    codec = {".mp4": "libx264", ".avi": "mpeg4"}[path.suffix]
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width = stream.height = edge
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            picture = np.full((edge, edge, 3), 60, np.uint8)
            picture[..., 2] = 40 + 15 * i
            picture[:, : 2 * i + 1] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_audio_only(path: Path) -> Path:
    """A WAV file: a container FFmpeg reads, with no video stream."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)
    return path


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    """LLaMA-Factory's `data/` folder for its video demo: mllm_video_demo.json, dataset_info.json and
    mllm_demo_data/ with 1.mp4, 2.avi, 3.mp4 (written here: the real clips are larger, same containers)."""
    data = tmp_path_factory.mktemp("llamafactory")
    for name in ("1.mp4", "2.avi", "3.mp4"):
        write_video(data / "mllm_demo_data" / name)
    Image.new("RGB", (16, 16), (200, 30, 30)).save(data / "mllm_demo_data" / "1.jpg")
    # data/mllm_video_demo.json as LLaMA-Factory ships it (its three records)
    demo = [
        (["<video>Why is this video funny?", "Because a baby is reading, and he is so cute!"], "1.mp4"),
        (["<video>What is she doing?", "She is cooking."], "2.avi"),
        (["<video>What's in the video?", "A baby is playing in the living room."], "3.mp4"),
    ]
    records = [
        {
            "messages": [{"content": q, "role": "user"}, {"content": a, "role": "assistant"}],
            "videos": [f"mllm_demo_data/{name}"],
        }
        for (q, a), name in demo
    ]
    (data / "mllm_video_demo.json").write_text(json.dumps(records, indent=2))
    (data / "dataset_info.json").write_text(json.dumps(DATASET_INFO, indent=2))
    return data


# ---- part 1: decoding and sampling ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["1.mp4", "2.avi"])
def test_pyav_decodes_mp4_and_avi_sampled_by_fps_or_frame_count(clips, name):
    path = str(clips / "mllm_demo_data" / name)
    by_fps = load_video(path, video.Sampling())  # 2 frames a second of a 2-second clip
    assert by_fps.frames.shape == (4, EDGE, EDGE, 3) and by_fps.frames.dtype == np.uint8
    meta = by_fps.metadata
    assert (meta.total_num_frames, meta.fps, meta.frames_indices) == (FRAMES, FPS, [0, 4, 7, 11])
    assert meta.timestamps == [i / FPS for i in (0, 4, 7, 11)]
    # the frames are the sampled ones: the bar grows by 2 columns a frame
    assert [int((f[EDGE // 2, :, 0] > 200).sum()) for f in by_fps.frames] == pytest.approx(
        [1, 9, 15, 23], abs=1
    )
    assert (
        load_video(path, video.Sampling(fps=3.0)).metadata.frames_indices
        == np.linspace(0, 11, 6).round().astype(int).tolist()
    )
    assert len(load_video(path, video.Sampling(num_frames=8)).frames) == 8
    assert len(load_video(path, video.Sampling(num_frames=8, max_frames=5)).frames) == 4  # capped, then even
    assert len(load_video(path, video.Sampling(fps=30.0)).frames) == FRAMES  # never more than it has


def test_a_one_frame_video_gives_its_frame_twice(tmp_path):
    """Qwen's temporal patch takes frames in pairs (qwen-vl-utils rounds to 2)."""
    clip = load_video(str(write_video(tmp_path / "still.mp4", frames=1)), video.Sampling())
    assert clip.metadata.frames_indices == [0, 0] and clip.metadata.total_num_frames == 1


def test_video_settings_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="video_fps and data.video_num_frames are both set"):
        tiny_run_config("m", "d", tmp_path, "v", "data.video_fps=1", "data.video_num_frames=4")
    with pytest.raises(ConfigError, match="data.video_max_frames must be positive"):
        tiny_run_config("m", "d", tmp_path, "v", "data.video_max_frames=0")
    with pytest.raises(ConfigError, match="data.video_total_pixels must be positive"):
        tiny_run_config("m", "d", tmp_path, "v", "data.video_total_pixels=0")
    with pytest.raises(
        ConfigError, match=r"data.video_min_pixels \(512\) exceeds data.video_max_pixels \(256\)"
    ):
        tiny_run_config("m", "d", tmp_path, "v", "data.video_min_pixels=512", "data.video_max_pixels=256")


def test_a_video_that_cannot_be_trained_on_is_a_bad_row_naming_why(tmp_path):
    (tmp_path / "garbage.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"\x01" * 64)
    empty = tmp_path / "empty.avi"
    with av.open(str(empty), "w") as container:  # a video stream and not one frame
        stream = container.add_stream("mpeg4", rate=6)
        stream.width = stream.height = EDGE
        container.start_encoding()  # the header, which PyAV otherwise writes with the first packet
    cases = {
        str(tmp_path / "garbage.mp4"): "video: the video does not decode",
        str(write_audio_only(tmp_path / "sound.wav")): "video: the file has no video stream",
        str(empty): "video: the video has no frames",
        str(tmp_path / "missing.mp4"): "video not found",
    }
    for path, reason in cases.items():
        with pytest.raises(BadRow) as err:
            load_video(path, video.Sampling())
        assert err.value.reason.startswith(reason), (path, err.value.reason)


def test_without_pyav_a_video_row_says_what_to_install(clips, monkeypatch):
    monkeypatch.setattr(video, "decoder_installed", lambda: False)
    with pytest.raises(BadRow) as err:
        read(open_rows(str(clips / "mllm_video_demo.json")), 0)
    assert err.value.reason == video.NO_DECODER and "pip install 'av" in err.value.reason


# ---- parts 1-2: the peers' layouts, rendered and labelled by each Qwen family -----------------------


def _answers(processor, row) -> list[str]:
    return [processor.tokenizer.decode(row.labels[a:b]) for a, b in labelled_runs(torch.tensor(row.labels))]


@pytest.mark.parametrize("arch", QWEN)
def test_llamafactory_video_demo_trains_on_the_answers_only(arch, clips, tiny_models):
    """LLaMA-Factory's mllm_video_demo through its dataset_info.json entry: each clip (mp4, avi) decoded,
    its video tokens in the prompt and unlabelled, the answer and its end of turn labelled."""
    processor = tiny_processor(tiny_models(arch))
    rows = open_rows(f"{clips / 'dataset_info.json'}#mllm_video_demo")
    assert len(rows) == 3
    for i in range(3):
        sample = read(rows, i)
        assert len(sample) == 3 and len(sample[2]) == 1 and sample[1] == []
        row = encode(processor, sample)
        ids = torch.tensor(row.tokens["input_ids"])
        video_tokens = ids == processor.video_token_id
        grid = row.vision["video_grid_thw"][0][0]  # (frames / 2, rows, columns) of its one video
        assert int(video_tokens.sum()) == int(grid.prod()) // processor.video_processor.merge_size**2
        assert (torch.tensor(row.labels)[video_tokens] == IGNORE_INDEX).all()  # video tokens never trained
        assert len(_answers(processor, row)) == 1  # the one answer and its <|im_end|>
        assert _answers(processor, row)[0].endswith("<|im_end|>")
        assert int(grid[0]) == 2  # 4 frames sampled at 2 fps, in temporal pairs
        if arch == "qwen2_5_vl":  # seconds per temporal patch: 2 frames at the sampled 2 fps
            assert row.vision["second_per_grid_ts"][0].tolist() == pytest.approx([1.0])
        if arch == "qwen3_vl":  # each temporal patch's timestamp: the mean of its frames' times
            text = processor.tokenizer.decode(row.tokens["input_ids"])
            assert text.count("<|vision_start|>") == 3  # the template's, then one per temporal patch


@pytest.mark.parametrize("arch", ["glm4v", "gemma4", "internvl"])
def test_glm_gemma4_and_internvl_train_on_video_rows(arch, clips):
    """Beyond Qwen: GLM-4.1V writes a video as frames of image tokens with their timestamps, Gemma 4 as
    its own <|video|> soft tokens, InternVL3.5 as numbered frames, each an image (each family's template
    and processor). LLaMA-Factory's video demo renders with its frames in the prompt, unlabelled, the
    answer labelled, and a batch of its rows trains the vision tower."""
    model, processor = _model(arch)
    rows = open_rows(f"{clips / 'dataset_info.json'}#mllm_video_demo")
    encoded = [encode(processor, read(rows, i)) for i in range(3)]
    vision_token = processor.video_token_id if arch == "gemma4" else processor.image_token_id
    frames = "pixel_values" if arch == "internvl" else "pixel_values_videos"  # InternVL: frames as images
    for row in encoded:
        assert len(row.vision[frames]) > 0
        ids, labels = torch.tensor(row.tokens["input_ids"]), torch.tensor(row.labels)
        assert int((ids == vision_token).sum()) > 0 and (labels[ids == vision_token] == IGNORE_INDEX).all()
        assert len(_answers(processor, row)) == 1
    vision = model.model.visual if arch == "glm4v" else model.model.vision_tower
    batch = _collate(processor, encoded, with_answers=True)
    if arch == "internvl":
        assert len(batch["pixel_values"]) == 3 * 4  # every sampled frame of the 3 clips, each an image
    loss, _ = _loss_and_grads(model, batch)
    assert torch.isfinite(loss) and float(loss) > 0
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in vision.parameters())


def _rows(tmp_path: Path, records: list[dict]) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _turns(question, answer: str = "seven") -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def test_every_peer_video_layout_reads_and_encodes(clips, tmp_path, tiny_models):
    """ms-swift's `videos`, Qwen's parts, OpenAI's `video_url` (a path and a data: URL), a row mixing an
    image and a video, and a save_to_disk folder (and Parquet) whose column holds the video paths."""
    mp4, avi, jpg = (str(clips / "mllm_demo_data" / n) for n in ("1.mp4", "2.avi", "1.jpg"))
    data_url = "data:video/mp4;base64," + base64.b64encode(Path(mp4).read_bytes()).decode()
    records = [
        {"messages": _turns("<video>What moves?"), "videos": [avi]},  # ms-swift
        {"messages": _turns("What moves?"), "videos": [mp4]},  # ms-swift, untagged: at the turn's start
        {
            "messages": _turns([{"type": "video", "video": mp4}, {"type": "text", "text": "What moves?"}])
        },  # Qwen
        {
            "messages": _turns(
                [{"type": "video_url", "video_url": {"url": avi}}, {"type": "text", "text": "?"}]
            )
        },
        {
            "messages": _turns(
                [{"type": "video_url", "video_url": {"url": data_url}}, {"type": "text", "text": "?"}]
            )
        },
        {"messages": _turns("<image><video>Same colour?"), "images": [jpg], "videos": [mp4]},  # mixed
    ]
    processor = load_processor(tiny_models("qwen2_vl"))
    rows = open_rows(_rows(tmp_path, records))
    for i in range(len(records)):
        sample = read(rows, i)
        assert len(sample[2]) == 1 and len(sample[1]) == (i == 5), i
        row = encode(processor, sample)
        assert "pixel_values_videos" in row.vision and ("pixel_values" in row.vision) == (i == 5)
        assert [a.replace(" ", "") for a in _answers(processor, row)] == ["seven<|im_end|>"]
    # a data set folder as a Hub video data set arrives: save_to_disk, and Parquet, a column of paths
    from datasets import Dataset

    table = {"messages": [_turns("<video>What moves?")] * 2, "videos": [[mp4], [avi]]}
    Dataset.from_dict(table).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "parquet").mkdir()
    pq.write_table(pa.Table.from_pydict(table), tmp_path / "parquet" / "part-0.parquet")
    for folder in ("saved", "parquet"):
        rows = open_rows(str(tmp_path / folder))
        assert [read(rows, i)[2][0].metadata.total_num_frames for i in range(2)] == [FRAMES, FRAMES]


def test_a_video_given_as_its_frames(clips, tmp_path, tiny_models):
    """Qwen's `{"type": "video", "video": [frame, ...]}` (its model cards) and a `videos` entry that is a list
    of frames (ms-swift, LLaMA-Factory): the frames taken as they are, at data.video_fps (2 unset)."""
    frames = []
    for k in range(4):
        frames.append(str(tmp_path / f"frame{k}.png"))
        Image.new("RGB", (EDGE, EDGE), (60 * k, 0, 0)).save(frames[-1])
    question = [{"type": "video", "video": frames}, {"type": "text", "text": "?"}]
    rows = open_rows(
        _rows(
            tmp_path, [{"messages": _turns(question)}, {"messages": _turns("<video>?"), "videos": [frames]}]
        )
    )
    processor = load_processor(tiny_models("qwen3_vl"))
    for i in range(2):
        clip = read(rows, i)[2][0]
        assert clip.frames.shape == (4, EDGE, EDGE, 3) and clip.metadata.fps == video.DEFAULT_FPS
        assert [int(f[0, 0, 0]) for f in clip.frames] == [0, 60, 120, 180]
        assert "pixel_values_videos" in encode(processor, read(rows, i)).vision


def test_tags_and_videos_that_differ_in_number_are_bad_rows(clips, tmp_path):
    mp4 = str(clips / "mllm_demo_data" / "1.mp4")
    rows = open_rows(
        _rows(
            tmp_path,
            [
                {"messages": _turns("<video><video>Which?"), "videos": [mp4]},
                {"messages": _turns("<video>Which?"), "videos": [mp4, mp4]},
            ],
        )
    )
    for i, reason in enumerate(["2 video placeholders, 1 videos", "1 video placeholders, 2 videos"]):
        with pytest.raises(BadRow, match=reason):
            rows.sample(i)


def test_video_tokens_count_towards_max_length(clips, tiny_models):
    processor = load_processor(tiny_models("qwen2_vl"))
    use_video_stand_in(processor, True)
    sample = read(open_rows(str(clips / "mllm_video_demo.json")), 0)
    length = len(encode(processor, sample).labels)
    four = read(open_rows(str(clips / "mllm_video_demo.json")), 0, video.Sampling(num_frames=8))
    assert len(encode(processor, four).labels) > length  # more frames, more tokens
    _, too_long = limit_length(processor, [sample], max_length=length - 1)
    assert too_long == [0]
    _, too_long = limit_length(processor, [sample], max_length=length)
    assert too_long == []


# ---- part 2: the video processor's pixel caps, per frame and per video ------------------------------


def _video_grid(processor, sample) -> tuple[int, ...]:
    """(temporal patches, patch rows, patch columns) of the sample's one video, once its tokens are checked
    against the grid (each 2x2 merged patch of each temporal patch is one token)."""
    row = encode(processor, sample)
    grid = tuple(row.vision["video_grid_thw"][0][0].tolist())
    tokens = int((torch.tensor(row.tokens["input_ids"]) == processor.video_token_id).sum())
    assert tokens == math.prod(grid) // processor.video_processor.merge_size**2
    return grid


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_video_pixel_caps_qwen2_vl_scale_each_frame(arch, clips, tiny_models, tmp_path):
    """Qwen2-VL's video processor scales each frame into [data.video_min_pixels, data.video_max_pixels]
    (its smart_resize); data.video_total_pixels is its own whole-video budget (cap_pixels_per_frame,
    max_video_tokens): each frame gets 2 * int(max_video_tokens * factor^2 * 0.9) / frames pixels at most."""
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import smart_resize

    folder = tiny_models(arch)
    sample = read(open_rows(str(clips / "mllm_video_demo.json")), 0)
    frames = len(sample[2][0].frames)
    assert frames == 4 and sample[2][0].frames.shape[1:3] == (EDGE, EDGE)

    def expected(processor, max_pixels: int) -> tuple[int, ...]:
        vp = processor.video_processor
        h, w = smart_resize(EDGE, EDGE, vp.patch_size * vp.merge_size, vp.size.shortest_edge, max_pixels)
        return (frames // 2, h // vp.patch_size, w // vp.patch_size)

    own = load_processor(folder)
    assert _video_grid(own, sample) == expected(own, 2048) == (2, 8, 8)  # 32x32 fits the folder's 2048
    for caps, grid in [
        (video.PixelCaps(max_pixels=256), (2, 4, 4)),  # each frame down to 16x16
        (video.PixelCaps(max_pixels=1024), (2, 8, 8)),  # 32x32 fits: unchanged
        (video.PixelCaps(min_pixels=4096, max_pixels=8192), (2, 16, 16)),  # each frame up to 64x64
    ]:
        processor = load_processor(folder, video_caps=caps)
        assert _video_grid(processor, sample) == expected(processor, caps.max_pixels) == grid, caps
    for total in (2048, 4096, 16384):
        processor = load_processor(folder, video_caps=video.PixelCaps(total_pixels=total))
        vp = processor.video_processor
        factor = vp.patch_size * vp.merge_size
        budget = int(vp.max_video_tokens * factor**2 * 0.9)  # the processor's own arithmetic
        assert budget <= total // 2 < int((vp.max_video_tokens + 1) * factor**2 * 0.9)  # the most tokens
        per_frame = max(min(vp.size.longest_edge, budget * 2 // frames), int(vp.size.shortest_edge * 1.05))
        grid = _video_grid(processor, sample)
        assert grid == expected(processor, per_frame)
        assert frames * grid[1] * grid[2] * vp.patch_size**2 <= total
    assert [
        _video_grid(load_processor(folder, video_caps=video.PixelCaps(total_pixels=t)), sample)
        for t in (2048, 4096, 16384)
    ] == [(2, 4, 4), (2, 6, 6), (2, 8, 8)]  # 4 frames of 16x16, of 24x24 (4096 less the rounding), 32x32


def test_video_pixel_caps_qwen3_vl_scale_the_whole_video(clips, tiny_models):
    """Qwen3-VL's video processor scales a video as a whole, frames x pixels within size.longest_edge
    (data.video_total_pixels); data.video_max_pixels is its ceiling per frame, in tokens
    (cap_pixels_per_frame, max_video_tokens)."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    folder = tiny_models("qwen3_vl")
    sample = read(open_rows(str(clips / "mllm_video_demo.json")), 0)
    frames = len(sample[2][0].frames)

    def expected(processor, max_pixels: int) -> tuple[int, ...]:
        vp = processor.video_processor
        factor = vp.patch_size * vp.merge_size
        h, w = smart_resize(frames, EDGE, EDGE, 2, factor, vp.size.shortest_edge, max_pixels)
        return (frames // 2, h // vp.patch_size, w // vp.patch_size)

    own = load_processor(folder)
    assert _video_grid(own, sample) == expected(own, 2048) == (2, 4, 4)  # 4 x 32x32 is over 2048: 16x16
    processor = load_processor(folder, video_caps=video.PixelCaps(total_pixels=8192))
    assert _video_grid(processor, sample) == expected(processor, 8192) == (2, 8, 8)  # fits: 32x32
    processor = load_processor(folder, video_caps=video.PixelCaps(total_pixels=8192, max_pixels=600))
    vp = processor.video_processor
    assert vp.cap_pixels_per_frame and vp.max_video_tokens == 600 // 64  # whole tokens: 9 of 8x8 pixels
    per_frame = max(min(vp.max_video_tokens * 64, 8192 // frames), int(vp.size.shortest_edge * 1.05))
    assert _video_grid(processor, sample) == expected(processor, per_frame * frames) == (2, 6, 6)  # 24x24


@pytest.mark.parametrize(
    "arch, overrides, message",
    [
        ("llava", ["data.video_max_pixels=4096"], "the model's processor (LlavaProcessor) takes no videos"),
        (
            "gemma4",
            ["data.video_total_pixels=4096"],
            "video processor (Gemma4VideoProcessor) has no pixel caps",
        ),
        ("qwen3_vl", ["data.video_min_pixels=256"], "Qwen3VLVideoProcessor scales a video as a whole"),
        (
            "qwen3_vl",
            ["data.video_max_pixels=128"],
            "is below the floor Qwen3VLVideoProcessor keeps per frame",
        ),
        ("qwen3_vl", ["data.video_total_pixels=128"], "is below the model folder's fewest pixels per video"),
        ("glm4v", ["data.video_max_pixels=4096"], "Glm4vVideoProcessor has no cap per frame, only per video"),
        ("qwen2_vl", ["data.video_min_pixels=4096"], "data.video_min_pixels (4096) exceeds the most pixels"),
        ("qwen2_vl", ["data.video_total_pixels=100"], "too few pixels for one video token (8x8"),
    ],
)
def test_video_pixel_caps_a_processor_cannot_honour_are_refused_before_ray(
    arch, overrides, message, clips, tiny_models, tmp_path
):
    """The driver's preflight loads the processor as the workers will (`checked_processor`), before Ray."""
    from raylora.data.preflight import checked_processor

    model = tiny_models(arch)
    cfg = tiny_run_config(model, str(clips / "mllm_video_demo.json"), tmp_path, "v", *overrides)
    with pytest.raises(ConfigError) as err:
        checked_processor(cfg, Path(model))
    assert message in str(err.value)


# ---- part 3: exact training -------------------------------------------------------------------------


@pytest.mark.parametrize("arch", QWEN)
def test_packed_video_rows_give_the_padded_loss_and_gradients(arch, clips):
    """The model's own 3-D rotary positions for video (Qwen2.5-VL's second_per_grid_ts, Qwen3-VL's
    timestamps) in the packed row: loss and every gradient equal the padded batch's within 1e-5."""
    model, processor = _model(arch)
    rows = open_rows(f"{clips / 'dataset_info.json'}#mllm_video_demo")
    image = Image.open(clips / "mllm_demo_data" / "1.jpg").convert("RGB")
    mixed = (
        [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "?"}],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
        ],
        [image],
        read(rows, 1)[2],
    )
    text = ([{"role": "user", "content": [{"type": "text", "text": "?"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "no"}]}], [])  # fmt: skip
    samples = [read(rows, 0), mixed, text, read(rows, 2)]
    padded = _collate(processor, [encode(processor, s) for s in samples], with_answers=True)
    assert padded["video_grid_thw"].shape[0] == 3
    row = packing.packed(padded, packing.rope_index_of(model))
    loss, grads = _loss_and_grads(model, padded)
    packed_loss, packed_grads = _loss_and_grads(model, row)
    assert float(loss) > 0
    assert _relative(loss, packed_loss) <= TOLERANCE
    assert _relative(grads, packed_grads) <= TOLERANCE
    # the video's tokens carry its own 3-D ids: its two temporal patches (Qwen3-VL: a frame each, apart)
    first = row["input_ids"][0][: int(row["cu_seq_lens_q"][1])] == processor.video_token_id
    assert len(set(row["position_ids"][1, 0, : len(first)][first].tolist())) == 2


def _vision_passes(batch: dict) -> tuple[bool, bool]:
    return video.has_image(batch), video.has_video(batch)


@pytest.mark.parametrize("arch", (*QWEN, "glm4v", "gemma4", "qwen3_5"))
def test_every_pass_runs_an_image_and_a_video_whatever_its_rows(arch, clips, tiny_models):
    """Qwen-VL runs its vision tower once for a batch's images and once more for its videos: under ZeRO-3
    every rank's pass must run both, whatever mix of image, video and text rows it holds (the stand-in
    image row and, in a run with video rows, the stand-in video row)."""
    processor = tiny_processor(tiny_models(arch))
    rows = open_rows(str(clips / "mllm_video_demo.json"))
    clip = read(rows, 0)
    image = ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]},
              {"role": "assistant", "content": [{"type": "text", "text": "a"}]}],
             [Image.open(clips / "mllm_demo_data" / "1.jpg").convert("RGB")])  # fmt: skip
    text = ([{"role": "user", "content": [{"type": "text", "text": "?"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "b"}]}], [])  # fmt: skip
    # with the stand-in off (a run whose preflight found no video rows) a video row is a bad row
    use_video_stand_in(processor, False)
    rejected: dict[int, str] = {}
    batch, _ = limit_length(processor, [clip, image], None, rejected=rejected)
    assert rejected == {0: NO_VIDEO_STAND_IN} and _vision_passes(batch) == (True, False)
    use_video_stand_in(processor, True)
    for share in ([clip], [image], [text], [None], [clip, image, text]):
        batch, _ = limit_length(processor, share, None)
        assert _vision_passes(batch) == (True, True), share
        passes, _ = packed_passes(processor, share, 10_000, None, None)
        assert all(_vision_passes(p) == (True, True) for p in passes)
    assert _vision_passes(stand_in_micro_batch(processor)) == (True, True)
    # the stand-ins train on nothing: the labels are the real rows' alone
    alone, _ = limit_length(processor, [clip], None)
    assert (alone["labels"] != IGNORE_INDEX).sum() == (
        torch.tensor(encode(processor, clip).labels) != IGNORE_INDEX
    ).sum()


def test_qwen_runs_its_vision_tower_once_per_kind_which_is_why_the_stand_in_video(clips):
    """What the video stand-in answers, counted: a batch with images and videos runs Qwen2-VL's vision
    tower twice, one with images only once; under ZeRO-3 each run gathers the tower's parameters."""
    model, processor = _model("qwen2_vl")
    calls = []
    model.model.visual.register_forward_hook(lambda *_: calls.append(1))
    rows = open_rows(str(clips / "mllm_video_demo.json"))
    image = ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]},
              {"role": "assistant", "content": [{"type": "text", "text": "a"}]}],
             [Image.open(clips / "mllm_demo_data" / "1.jpg").convert("RGB")])  # fmt: skip
    for samples, passes in (([image], 1), ([image, read(rows, 0)], 2)):
        calls.clear()
        batch = _collate(processor, [encode(processor, s) for s in samples], with_answers=True)
        _loss_and_grads(model, batch)
        assert len(calls) == passes


def test_the_preflight_turns_the_video_stand_in_on_for_a_source_with_video_rows(clips, tiny_models, tmp_path):
    from raylora.data.preflight import check_sample

    model = tiny_models("qwen2_vl")
    cfg = tiny_run_config(
        model, str(clips / "mllm_video_demo.json"), tmp_path, "v", "train.global_batch_size=2"
    )
    assert cfg.data.video_stand_in is None
    check_sample(cfg, open_rows(cfg.data.train), load_processor(model))
    assert cfg.data.video_stand_in is True


# ---- part 3 on 2 ZeRO-3 workers: mixed ranks, packed = padded, kill and resume ----------------------


def _mixed_rows(clips: Path, folder: Path, rows: int = 16) -> str:
    """A chat JSONL file whose rows cycle through a video (mp4, avi), an image, text only, and an image with
    a video, so that in a step one rank holds videos and the other none, or images and no video."""
    mp4, avi, jpg = (str(clips / "mllm_demo_data" / n) for n in ("1.mp4", "2.avi", "1.jpg"))
    digits = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    kinds = [
        {"messages": _turns("<video>Which digit?", "{}"), "videos": [mp4]},
        {"messages": _turns("<image>Which digit?", "{}"), "images": [jpg]},
        {"messages": _turns("Which digit is a", "{}")},
        {"messages": _turns("<video>Which digit?", "{}"), "videos": [avi]},
        {"messages": _turns("<image><video>Which digit?", "{}"), "images": [jpg], "videos": [mp4]},
        {"messages": _turns("Which digit is a", "{}")},
    ]
    records = []
    for i in range(rows):
        record = json.loads(json.dumps(kinds[i % len(kinds)]))
        record["messages"][1]["content"] = digits[i % 10]
        records.append(record)
    return _rows(folder, records)


@pytest.mark.distributed
@pytest.mark.slow
def test_zero3_video_rows_pack_exactly_and_resume_bitwise(ray_cluster, probes, clips, tiny_models, tmp_path):
    """Qwen2.5-VL (second_per_grid_ts) on 2 ZeRO-3 workers, every parameter partitioned: ranks holding
    different mixes of video, image and text rows run in step (no collective waits forever); a packed step
    equals the padded step within 1e-5; a packed run saved at step 2 and resumed gives step 3 bit for bit;
    evaluation scores the video rows alike on gathered copies and under ZeRO-3. The frames are decoded in
    the input pipeline's process (data.workers=1)."""
    from tests.probes import resume_probe, train_and_save

    data = _mixed_rows(clips, tmp_path)
    # no dropout: its noise depends on the tensors' shapes, which packing changes
    common = ("train.max_steps=3", "lora.dropout=0", "data.video_stand_in=true")
    model = tiny_models("qwen2_5_vl")
    packed = tiny_run_config(
        model, data, tmp_path, "packed", *common, "train.packing=true", "train.max_tokens_per_micro_batch=512"
    )
    padded = tiny_run_config(model, data, tmp_path, "padded", *common)
    folders = tmp_path / "resume", tmp_path / "padded-step"

    def both():
        from raylora.evaluate import evaluate_sharded
        from raylora.worker import setup

        resumed, padded_metrics = resume_probe(packed, 2, folders[0]), train_and_save(padded, 1, folders[1])
        # train.eval_every's evaluation on video rows: on gathered copies, and under ZeRO-3 in lockstep,
        # where a rank whose batch holds no video runs the stand-in video
        s = setup(padded, None)
        rows = open_rows(data)
        evals = [evaluate_sharded(s.engine, s.processor, rows, 8, 2, gather=g) for g in (True, False)]
        return resumed, padded_metrics, evals

    resumed, padded_metrics, (copied, lockstep) = probes(both)
    assert copied["eval_loss"] > 0 and copied["eval_loss"] == pytest.approx(lockstep["eval_loss"], rel=1e-6)
    assert copied["eval_accuracy"] == lockstep["eval_accuracy"]
    metrics = resumed["metrics"]
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(m["bad_rows"] == 0 for m in metrics)
    assert abs(metrics[0]["loss"] - padded_metrics[0]["loss"]) <= TOLERANCE * abs(padded_metrics[0]["loss"])
    assert resumed["resumed"]["step"] == 3 and resumed["resumed"]["loss"] == metrics[2]["loss"]
    assert resumed["masters_equal"] and resumed["moments_equal"]


# ---- part 5: prepare-data ---------------------------------------------------------------------------


def test_prepare_data_keeps_video_rows_and_counts_their_tokens(clips, tiny_models, monkeypatch, tmp_path):
    """`raylora prepare-data`'s task on LLaMA-Factory's video demo (run here without Ray Data: its ledger is
    a stand-in): each row's tokens counted with its video's, the video's file kept, the row trainable."""
    from types import SimpleNamespace

    from raylora import prepare

    recorded = {}
    ledger = SimpleNamespace(
        add=SimpleNamespace(remote=lambda first, bad, sizes: recorded.update(bad=bad, **sizes))
    )
    monkeypatch.setattr(prepare.ray, "get", lambda value: value)
    model = tiny_models("qwen2_vl")
    uri = str(clips / "mllm_video_demo.json")
    table = prepare.check_rows({"id": np.arange(3)}, uri, "chat", None, model, ledger)
    processor = load_processor(model)
    rows = open_rows(uri)
    assert recorded["bad"] == []
    assert recorded["tokens"].tolist() == [len(encode(processor, read(rows, i)).labels) for i in range(3)]
    assert table.column("videos").to_pylist()[1] == [(clips / "mllm_demo_data" / "2.avi").read_bytes()]
    assert table.column("messages").to_pylist()[0][0]["content"][0]["type"] == "video"
    pq.write_table(table, tmp_path / "prepared.parquet")  # as Ray Data's writer writes the blocks
    prepared = read(open_rows(str(tmp_path / "prepared.parquet")), 1)
    assert prepared[2][0].metadata.total_num_frames == FRAMES


def test_a_model_without_a_video_path_refuses_a_video_row(clips, tiny_models):
    """Llava's processor takes no videos, and its chat template writes nothing for a video part: the row
    would train as text with its video dropped. It is a bad row (the processor rejects it) instead."""
    processor = load_processor(tiny_models("llava"))
    with pytest.raises(ValueError, match=r"LlavaProcessor\) takes no videos"):
        encode(processor, read(open_rows(str(clips / "mllm_video_demo.json")), 0))


# ---- part 4: decoding off the training loop ---------------------------------------------------------


# What a Train worker does with data.workers >= 1, in a process of its own: it starts the pipeline before it
# decodes anything itself. The pytest process is no such parent: by this test it has run FFmpeg's thread
# pools (libx264 writes the clips with its own), and a worker forked from it hung in FFmpeg (dev/LOG.md).
PIPELINE_DECODES = """
import json, os, sys
import torch
from raylora.data import video
from raylora.data.batches import read
from raylora.data.formats import open_rows
from raylora.data.pipeline import step_inputs

rows = open_rows(sys.argv[1])
decoded_in, real = [], video.decode

def decode(data, sampling):
    decoded_in.append(os.getpid())  # the forked worker's own copy of this list
    return real(data, sampling)

video.decode = decode

def build(step):
    frames = read(rows, step)[2][0].frames
    return {"pid": torch.tensor(decoded_in[-1]), "frames": torch.from_numpy(frames)}

built = list(step_inputs(build, range(3), workers=1))
print(json.dumps({"shapes": [list(b["frames"].shape) for b in built], "pids": [int(b["pid"]) for b in built],
                  "here": os.getpid(), "decoded_here": decoded_in}))
"""


def test_frames_are_decoded_in_the_input_pipelines_process(clips):
    """With data.workers >= 1 a step's rows are read in the pipeline's forked process (`step_inputs`), so
    the frames are decoded there, beside training, not in the training loop."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", PIPELINE_DECODES, str(clips / "mllm_video_demo.json")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["shapes"] == [[4, EDGE, EDGE, 3]] * 3
    assert got["here"] not in got["pids"] and got["decoded_here"] == []


# ---- part 6: evaluation -----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_evaluation_scores_video_rows(arch, clips):
    """`raylora eval` and train.eval_every score through `evaluate.score`: the answer-token loss over video
    rows and an answer generated from each row's prompt, its video in it."""
    from raylora.evaluate import score

    model, processor = _model(arch)
    rows = open_rows(f"{clips / 'dataset_info.json'}#mllm_video_demo")
    got = score(model, processor, [read(rows, i) for i in range(3)])
    assert got["samples"] == 3 and got["tokens"] > 0 and got["loss_sum"] > 0


@pytest.mark.slow
def test_building_video_steps_does_not_grow_memory(clips, tiny_models):
    """What a worker's input side does at every step, 100 steps of video rows: the process's RSS at step 100
    is within 5% of its RSS at step 10 (no frame or batch kept from one step to the next)."""
    import psutil

    processor = load_processor(tiny_models("qwen2_5_vl"))
    use_video_stand_in(processor, True)
    rows = open_rows(f"{clips / 'dataset_info.json'}#mllm_video_demo")
    rss = {}
    for step in range(1, 101):
        batch, _ = limit_length(processor, [read(rows, step % 3), read(rows, (step + 1) % 3)], None)
        packing.packed(batch, None)
        if step in (10, 100):
            rss[step] = psutil.Process().memory_info().rss
    assert rss[100] <= 1.05 * rss[10], rss
