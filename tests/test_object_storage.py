"""A run whose every byte lives in object storage, against a real S3 endpoint on 127.0.0.1 (moto_server,
tests.s3_server.S3Server): the source data and its images on `s3://`, `prepare-data` reading and writing
`s3://`, the input pipeline's forked workers reading images from `s3://`, the run's storage on `s3://`, a
worker killed and the run resumed bitwise equal to its uninterrupted twin, and the commands a user runs on
the result (`inspect`, `eval`, `export`, `plot`) given `s3://` checkpoint URIs.

The cluster this stands for shares object storage and no disk: nothing here is read from a local path
that the training wrote.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from raylora.cli import main
from raylora.data.formats import open_rows
from raylora.progress import read_metrics
from tests.ray_env import start_ray
from tests.run_logs import final_checkpoint
from tests.support import straight_and_killed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROWS = 48
KILL_AT = 3  # rank 1 dies before step 4; the last checkpoint was at step 2


@pytest.fixture(scope="module")
def s3_ray(s3):
    """A Ray of this module's own, started after the S3 endpoint's environment is in this process's, so
    that its workers (and the input pipeline's processes they fork) reach the endpoint."""
    import ray

    ray.shutdown()  # a Ray started by an earlier module has no endpoint in its workers' environment
    start_ray(num_cpus=4, env_vars=s3.env)
    yield s3
    ray.shutdown()


@pytest.fixture(scope="module")
def s3_source(s3, digits):
    """LLaVA JSON on `s3://`, its images in an `s3://` folder, as a user's bucket holds them."""
    fs = s3.fs()
    records = []
    for i, row in enumerate(pq.read_table(digits[0]).slice(0, ROWS).to_pylist()):
        with fs.open_output_stream(f"{s3.bucket}/source/images/{i}.png") as f:
            f.write(row["image"])
        turns = [
            {"from": "human", "value": "<image>\n" + row["prompt"]},
            {"from": "gpt", "value": row["answer"]},
        ]
        records.append({"id": str(i), "image": f"{i}.png", "conversations": turns})
    with fs.open_output_stream(f"{s3.bucket}/source/data.json") as f:
        f.write(json.dumps(records).encode())
    return s3.uri("source", "data.json"), s3.uri("source", "images"), records


@pytest.fixture(scope="module")
def runs(s3_ray, s3_source, tiny_models):
    source, images, _ = s3_source
    storage = s3_ray.uri("runs")
    overrides = ("train.max_steps=4", f"data.image_root={images}", "data.workers=2")
    straight, killed = straight_and_killed(tiny_models("llava"), source, storage, KILL_AT, *overrides)
    return {"storage": storage, "straight": straight, "killed": killed}


def test_killed_run_on_object_storage_equals_uninterrupted_bitwise(runs):
    straight, killed = final_checkpoint(runs["straight"]), final_checkpoint(runs["killed"])
    assert runs["killed"].checkpoint.path.startswith("raylora-test/runs/killed/")  # in the bucket
    assert (killed.state.restarts, straight.state.restarts) == (1, 0)
    assert straight.state.step == killed.state.step == 4
    assert straight.weights.keys() == killed.weights.keys() and straight.weights
    for name, value in straight.weights.items():
        assert torch.equal(value, killed.weights[name]), f"{name} differs after resume"
    for name, value in straight.moments.items():
        assert torch.equal(value, killed.moments[name]), f"{name} differs after resume"
    rows = read_metrics(runs["storage"], "killed")
    assert [r["step"] for r in rows if r["restarts"] == 1] == [3, 4]
    assert all(r["bad_rows_so_far"] == 0 for r in rows), "every image on s3:// should have been read"


def test_prepare_data_reads_and_writes_object_storage(s3_ray, s3_source, tiny_models):
    source, images, records = s3_source
    out = s3_ray.uri("prepared")
    argv = ["prepare-data", source, "--out", out, "--image-root", images, "--model", tiny_models("llava")]
    with (
        contextlib.redirect_stdout(io.StringIO()) as printed,
        contextlib.redirect_stderr(io.StringIO()) as err,
    ):
        code = main(argv)
    assert code == 0, printed.getvalue() + err.getvalue()
    prepared = open_rows(out)  # the prepared Parquet folder, read back from the bucket
    assert len(prepared) == len(records)
    first = prepared.sample(0)
    with s3_ray.fs().open_input_file(f"{s3_ray.bucket}/source/images/0.png") as f:
        assert first.images == [f.read()], "prepare-data should embed each row's image bytes"
    assert s3_ray.fs().get_file_info(f"{s3_ray.bucket}/prepared/summary.json").size > 0


def _cli(*argv: str) -> tuple[int, str, str]:
    """The raylora command in this process (exit code, stdout, stderr). The commands in processes of
    their own, as a user runs them, are tests/test_export.py's and tests/test_inspect_plot.py's."""
    with (
        contextlib.redirect_stdout(io.StringIO()) as out,
        contextlib.redirect_stderr(io.StringIO()) as err,
    ):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_commands_take_checkpoint_uris(runs, s3_source, tmp_path):
    uri = "s3://" + runs["straight"].checkpoint.path
    code, printed, err = _cli("inspect", uri, "--json")
    assert code == 0, err
    assert json.loads(printed)["step"] == 4

    code, printed, err = _cli("export", uri, "--out", str(tmp_path / "adapter"))
    assert code == 0, err
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()

    source, images, _ = s3_source
    code, printed, err = _cli("eval", uri, "--data", source, "--image-root", images, "--max-samples", "4")
    assert code == 0, err
    assert "accuracy" in printed

    code, printed, err = _cli("plot", runs["storage"] + "/straight", "--out", str(tmp_path / "loss.png"))
    assert code == 0, err
    assert Path(tmp_path / "loss.png").stat().st_size > 0
