"""The checkpoint format's one owner, and what a restart checks and clears, single process.

Format versions (a newer one refused, the older one read), typed fields, the retrying read of one
checkpoint, the sampler check on resume, the removal of leftovers of crashed attempts, and which
worker errors end a run at once.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pyarrow.fs
import pyarrow.parquet as pq
import pytest
import torch

from raylora import checkpoint, config, resume, storage
from raylora.config import ConfigError
from raylora.failures import PERMANENT, EndOnPermanentError, PermanentError
from tests import whole_checkpoint

LORA = "model.language_model.layers.0.self_attn.q_proj.lora_A.default.weight"


class _AdapterConfig:
    def save_pretrained(self, folder):
        (Path(folder) / checkpoint.ADAPTER_CONFIG).write_text('{"r": 4}')


def _save(folder: Path, **state_fields) -> Path:
    weights = {LORA: torch.randn(4, 8)}
    moments = {f"{LORA}.{k}": torch.randn(4, 8) for k in ("exp_avg", "exp_avg_sq")}
    fields = {
        "step": 4,
        "epoch": 0,
        "sampler": {"seed": 0, "num_samples": 1437, "global_batch_size": 8},
        "scheduler": {},
        "world_size": 2,
        "trainable": {LORA: [4, 8]},
        "config": {},
        "versions": {},
        **state_fields,
    }
    whole_checkpoint.save(folder, weights, moments, checkpoint.TrainState(**fields), _AdapterConfig())
    return folder


def _cfg(tmp_path: Path, train_file, *overrides: str) -> config.Config:
    return config.load(
        None,
        [
            "model.path=unused-by-these-checks",
            f"data.train={train_file}",
            f"run.storage_path={tmp_path / 'runs'}",
            "run.name=fmt",
            "train.global_batch_size=8",
            "train.micro_batch_size=2",
            *overrides,
        ],
    )


def test_newer_format_is_refused_naming_both_versions(tmp_path, digits):
    newer = checkpoint.FORMAT_VERSION + 1
    folder = _save(tmp_path / "runs" / "fmt" / "checkpoint_000000", format=newer)
    current = checkpoint.FORMAT_VERSION
    both = f"format {newer} was written by a newer raylora; this raylora reads format {current}"
    with pytest.raises(checkpoint.NewerFormatError, match=both):
        whole_checkpoint.load(folder)
    with pytest.raises(checkpoint.NewerFormatError, match=both):
        checkpoint.read_state(folder)
    # the driver refuses it before Ray starts, instead of taking it for damage and resuming from older
    with pytest.raises(ConfigError, match=f"run fmt cannot resume: .*{both}"):
        resume.check_resume(_cfg(tmp_path, digits[0]))
    # a manifest of a newer format is refused the same way
    manifest = json.loads((folder / checkpoint.MANIFEST).read_text())
    (folder / checkpoint.MANIFEST).write_text(json.dumps({**manifest, "format": newer}))
    with pytest.raises(checkpoint.NewerFormatError, match=both):
        checkpoint.verify(folder)


def test_format_1_reads_into_typed_fields(tmp_path):
    fingerprint = {"sha256": "ab" * 32, "weight_bytes": 123}
    folder = _save(tmp_path / "new", arch="llava", base_model=fingerprint, data_rows=1437)
    state = whole_checkpoint.load(folder).state
    assert (state.arch, state.base_model, state.data_rows, state.format) == (
        "llava",
        fingerprint,
        1437,
        checkpoint.FORMAT_VERSION,
    )
    old = state.to_dict()  # as format 1 wrote it: the architecture and fingerprint in `extra`
    for key in ("arch", "base_model", "data_rows"):
        del old[key]
    old.update(format=1, extra={"arch": "llava", "base_model": fingerprint})
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / checkpoint.STATE).write_text(json.dumps(old))
    state = checkpoint.read_state(tmp_path / "old")
    assert (state.arch, state.base_model, state.data_rows, state.extra) == ("llava", fingerprint, None, {})
    with pytest.raises(checkpoint.CheckpointError, match="state.json missing or unreadable"):
        checkpoint.read_state(tmp_path)


def test_read_retries_storage_errors_but_not_damage(tmp_path):
    folder = str(_save(tmp_path / "ckpt"))
    fs = pyarrow.fs.LocalFileSystem()
    calls = []

    def failing(times):
        def before_read(path):
            calls.append(path)
            if len(calls) <= times:
                raise OSError("connection reset by peer")

        return before_read

    # transient: two failures, then the read succeeds
    assert resume.read_checkpoint(folder, fs, failing(2), tries=3, backoff_s=0).state.step == 4
    assert len(calls) == 3
    # persistent: gives up after `tries`, as an OSError (Ray retries the attempt), not as damage
    calls.clear()
    with pytest.raises(OSError, match="reading the checkpoint failed 3 times.*connection reset") as raised:
        resume.read_checkpoint(folder, fs, failing(10), tries=3, backoff_s=0)
    assert not isinstance(raised.value, checkpoint.CheckpointError) and len(calls) == 3
    # damage (a file that does not match the manifest): raised at once, never retried
    calls.clear()
    path = Path(folder) / checkpoint.OPTIMIZER
    path.write_bytes(path.read_bytes()[:-1] + b"\0")
    with pytest.raises(checkpoint.CheckpointError, match="does not match its sha256"):
        resume.read_checkpoint(folder, fs, failing(0), tries=3, backoff_s=0)
    assert len(calls) == 1


def test_changed_sampler_is_refused_naming_the_key(tmp_path, digits):
    rows = pq.read_metadata(digits[0]).num_rows
    _save(tmp_path / "runs" / "fmt" / "checkpoint_000000", data_rows=rows)
    with pytest.raises(ConfigError, match=r"^train.seed: .* trained with seed 0, this config gives 1"):
        resume.check_resume(_cfg(tmp_path, digits[0], "train.seed=1"))
    with pytest.raises(ConfigError, match=r"^train.global_batch_size: .* global batch size 8, .* gives 16"):
        resume.check_resume(_cfg(tmp_path, digits[0], "train.global_batch_size=16"))
    fewer = tmp_path / "fewer.parquet"
    pq.write_table(pq.read_table(digits[0]).slice(0, 100), fewer)
    with pytest.raises(
        ConfigError, match=rf"^data.train: .* trained on {rows} rows, .*fewer.parquet has 100"
    ):
        resume.check_resume(_cfg(tmp_path, fewer))
    # on a worker, the usable rows (after bad rows are skipped) are compared exactly
    saved = {"seed": 0, "num_samples": 1437, "global_batch_size": 8}
    with pytest.raises(
        ConfigError, match=r"^data.train: here was trained with usable rows of data.train 1437"
    ):
        resume.check_sampler(saved, {**saved, "num_samples": 1436}, "here")
    resume.check_sampler(saved, dict(saved), "here")


def test_partial_uploads_are_removed_recorded_ones_kept(tmp_path):
    fs, run_dir = pyarrow.fs.LocalFileSystem(), tmp_path / "run"
    recorded_torn = run_dir / "checkpoint_a"  # recorded by Ray: the restore's fallback deals with it
    partial = run_dir / "checkpoint_b"  # an upload cut short: no manifest, unrecorded
    complete = _save(run_dir / "checkpoint_c")  # complete but unrecorded: not a partial upload
    for folder in (recorded_torn, partial):
        folder.mkdir(parents=True)
        (folder / checkpoint.ADAPTER_WEIGHTS).write_bytes(b"partial")
    # the fields Ray Train 2.60's CheckpointManager writes (test_restore_decision checks a real one)
    snapshot = {
        "checkpoint_results": [{"checkpoint_dir_name": "checkpoint_a", "metrics": {}}],
        "latest_checkpoint_result": {"checkpoint_dir_name": "checkpoint_a", "metrics": {}},
        "pending_training_results": [],
    }
    (run_dir / storage.RAY_SNAPSHOT).write_text("{ torn")
    assert resume.remove_partial_uploads(fs, str(run_dir)) == []  # unreadable record: remove nothing
    (run_dir / storage.RAY_SNAPSHOT).write_text(json.dumps(snapshot))
    assert resume.remove_partial_uploads(fs, str(run_dir)) == [str(partial)]
    assert recorded_torn.is_dir() and complete.is_dir() and not partial.exists()


def test_staging_folders_of_this_run_are_removed_at_start(tmp_path, digits, caplog):
    cfg = _cfg(tmp_path, digits[0])
    other = _cfg(tmp_path / "elsewhere", digits[0])  # same run name, another storage path
    mine, theirs = Path(resume.new_staging_folder(cfg, 4)), Path(resume.new_staging_folder(other, 4))
    try:
        assert mine.parent != theirs.parent
        (mine / "adapter_model.safetensors").write_bytes(b"half written")
        partial = tmp_path / "runs" / "fmt" / "checkpoint_x"
        partial.mkdir(parents=True)
        with caplog.at_level("WARNING", logger="raylora"):
            resume.remove_leftovers(cfg, rank=0)
        assert not mine.exists() and theirs.is_dir() and not partial.exists()
        assert mine.name in caplog.text and str(partial) in caplog.text
    finally:
        shutil.rmtree(resume.staging_folder(cfg), ignore_errors=True)
        shutil.rmtree(resume.staging_folder(other), ignore_errors=True)


def test_only_start_errors_that_cannot_pass_end_the_run():
    for err in (ConfigError("data.train: x"), AssertionError("dtype"), FileNotFoundError("/x")):
        assert isinstance(err, PERMANENT), err
    assert isinstance(checkpoint.CheckpointError("made for another model"), PERMANENT)
    for err in (OSError("timed out"), ConnectionError("reset"), RuntimeError("NCCL"), MemoryError()):
        assert not isinstance(err, PERMANENT), err
    err = PermanentError.at_start(FileNotFoundError("/data/train.parquet"), rank=1)
    assert str(err).startswith("rank 1: FileNotFoundError: /data/train.parquet")
    assert str(pickle.loads(pickle.dumps(err))) == str(err)  # it crosses from a worker to the controller
    callback = EndOnPermanentError()
    callback.after_exception(None, {0: RuntimeError("connection closed by peer")})  # retried: no raise
    with pytest.raises(PermanentError, match="train.parquet"):
        callback.after_exception(None, {0: RuntimeError("peer gone"), 1: err})


def test_read_error_drill_is_validated():
    base = ["model.path=m", "data.train=d.parquet", "train.global_batch_size=8", "train.micro_batch_size=2"]
    with pytest.raises(ConfigError, match="fault.read_errors"):
        config.load(None, [*base, "fault.read_errors=-1"])
    with pytest.raises(ConfigError, match=r"fault.read_error_rank \(2\) must be a rank of 2 workers"):
        config.load(None, [*base, "fault.read_errors=1", "fault.read_error_rank=2"])


def test_writer_in_pieces_and_ranged_reads_match_safetensors(tmp_path):
    """The writer takes pieces in any order and writes what safetensors reads; `Ranges` reads exactly
    the elements asked for, and only those bytes (besides the headers)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    vis = "model.vision_tower.encoder.layers.0.mlp.fc1.weight"
    weights = {LORA: torch.randn(4, 8), vis: torch.randn(5, 3)}
    moments = {f"{n}.{k}": torch.randn_like(t) for n, t in weights.items() for k in checkpoint.MOMENTS}
    writer = checkpoint.Writer(tmp_path, {n: list(t.shape) for n, t in weights.items()})
    pieces = [(n, k, start) for n in weights for k in ("weight", *checkpoint.MOMENTS) for start in (0, 5, 9)]
    for name, kind, start in reversed(pieces):  # the last piece of each tensor first
        full = weights[name] if kind == "weight" else moments[f"{name}.{kind}"]
        stop = {0: 5, 5: 9, 9: full.numel()}[start]
        writer.write(name, kind, start, full.reshape(-1)[start:stop])
    state = {"step": 4, "epoch": 0, "sampler": {}, "scheduler": {}, "world_size": 2, "config": {}}
    trainable = {n: list(t.shape) for n, t in weights.items()}
    writer.finish(checkpoint.TrainState(**state, trainable=trainable, versions={}), _AdapterConfig())
    loaded = whole_checkpoint.load(tmp_path)  # safetensors' own reader, after the manifest check
    assert all(torch.equal(loaded.weights[n], t) for n, t in weights.items())
    assert all(torch.equal(loaded.moments[n], t) for n, t in moments.items())
    with safe_open(tmp_path / checkpoint.ADAPTER_WEIGHTS, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert list(f.keys()) == [checkpoint.adapter_key(LORA)]
    assert load_file(tmp_path / checkpoint.TRAINED_MODULES).keys() == {vis}

    ranges = checkpoint.Ranges(tmp_path)
    headers = ranges.bytes_read
    assert torch.equal(ranges.weight_range(vis, 4, 11), weights[vis].reshape(-1)[4:11])
    assert torch.equal(ranges.moment_range(LORA, "exp_avg_sq", 30, 40), moments[f"{LORA}.exp_avg_sq"][3, 6:])
    assert ranges.weight_range(LORA, 32, 40).numel() == 0  # a last rank's slice that is all padding
    assert ranges.bytes_read - headers == 4 * (7 + 2)
    ranges.close()
    # a file whose header disagrees with state.json is refused, even where hashes are not read
    (tmp_path / checkpoint.STATE).write_text(
        json.dumps({**json.loads((tmp_path / checkpoint.STATE).read_text()), "trainable": {vis: [3, 5]}})
    )
    manifest = json.loads((tmp_path / checkpoint.MANIFEST).read_text())
    manifest["files"][checkpoint.STATE]["bytes"] = (tmp_path / checkpoint.STATE).stat().st_size
    (tmp_path / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(
        checkpoint.CheckpointError, match=r"entry .*fc1.weight: state.json says shape \[3, 5\]"
    ):
        checkpoint.Ranges(tmp_path, hashes=False)
    with pytest.raises(checkpoint.CheckpointError, match="state.json does not match its sha256"):
        checkpoint.Ranges(tmp_path)


def test_staging_folder_a_live_upload_may_read_is_kept(tmp_path, digits):
    """A folder that a live process handed to Ray's asynchronous upload stays; one whose process has
    exited (a crashed rank) is removed."""
    import subprocess
    import sys

    cfg = _cfg(tmp_path, digits[0])
    held, dead = resume.new_staging_folder(cfg, 2), resume.new_staging_folder(cfg, 4)
    try:
        resume.hold_until_uploaded(held)
        hold = f"from raylora import resume; resume.hold_until_uploaded({dead!r})"
        subprocess.run([sys.executable, "-c", hold], check=True)
        resume.remove_leftovers(cfg, rank=1)
        assert Path(held).is_dir() and not Path(dead).exists()
    finally:
        shutil.rmtree(resume.staging_folder(cfg), ignore_errors=True)
