"""Config parsing and the errors a user sees before anything expensive starts."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raylora import config
from raylora.config import ConfigError
from raylora.driver import preflight


def _base(model_dir="m", train="t.parquet"):
    return [f"model.path={model_dir}", f"data.train={train}"]


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: {path: m}\ndata: {train: t.parquet}\ntrain: {lr: 1e-4, max_steps: 5}\n")
    cfg = config.load(path, ["train.max_steps=7", "lora.target_modules=q_proj,v_proj", "model.arch=llava"])
    assert cfg.train.lr == 1e-4 and cfg.train.max_steps == 7
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.model.arch == "llava"
    assert config.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.max_stepz=3", "unknown config key train.max_stepz"),
        ("trian.lr=1", "unknown config key trian"),
        ("train.max_steps=ten", "train.max_steps: expected int"),
        ("train.freeze_vision=maybe", "train.freeze_vision: expected bool"),
        ("train.max_steps=2.5", "train.max_steps: expected int"),
        ("train.max_steps=true", "train.max_steps: expected int, got bool"),
        ("fault.kill_at_steps=3,x", "fault.kill_at_steps[1]: expected int, got str"),
        ("model.path=3", "model.path: expected str, got int"),
        ("train=5", "train: expected a mapping"),
        ("lora.r=0", "lora.r must be positive"),
        ("train.precision=fp16", "train.precision: expected one of bf16, fp32 or null, got str 'fp16'"),
        ("run.checkpoint_upload=later", "run.checkpoint_upload: expected one of async, sync"),
        ("data.on_bad_row=warn", "data.on_bad_row: expected one of skip, error"),
        ("data.format=csv", "data.format: expected one of raylora, chat, llava, sharegpt, alpaca"),
        ("train.global_batch_size=1", "train.global_batch_size (1) is smaller than scaling.num_workers (2"),
        ("run.name=a/b", "run.name"),
        ("lora.dropout=1.5", "lora.dropout"),
        ("train", "must look like key=value"),
    ],
)
def test_bad_config_names_the_key(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config.load(None, _base() + [override])


def test_missing_required_keys():
    with pytest.raises(ConfigError, match="model.path is required"):
        config.load(None, ["data.train=x"])
    with pytest.raises(ConfigError, match="data.train is required"):
        config.load(None, ["model.path=x"])


def test_missing_model_folder_and_bad_parquet(tmp_path, tiny_models, digits):
    with pytest.raises(ConfigError, match="model folder not found: .*nowhere"):
        preflight(config.load(None, _base(tmp_path / "nowhere", digits[0])))
    with pytest.raises(ConfigError, match="no config.json"):
        preflight(config.load(None, _base(tmp_path, digits[0])))
    model = tiny_models("llava")
    with pytest.raises(ConfigError, match="data.train: data file or folder not found"):
        preflight(config.load(None, _base(model, tmp_path / "none.parquet")))
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"image": [b"x"], "question": ["q"]}), bad)
    with pytest.raises(ConfigError, match="no known format; its fields: image, question"):
        preflight(config.load(None, _base(model, bad)))
    # a model type transformers ships: the message says so, and how to name the parts (lists included)
    shipped = r"unsupported architecture 'blip', which transformers \S+ ships but raylora does not register"
    with pytest.raises(ConfigError, match=rf"model.arch: {shipped}.*each one prefix or a list of them"):
        preflight(config.load(None, _base(model, digits[0]) + ["model.arch=blip"]))
    with pytest.raises(ConfigError, match=r"unsupported architecture 'mine' \(supported: .*gemma4.*glm4v"):
        preflight(config.load(None, _base(model, digits[0]) + ["model.arch=mine"]))
    assert preflight(config.load(None, _base(model, digits[0]))).model_type == "llava"


def test_cli_exits_2_naming_the_problem(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"model: {{path: {tmp_path / 'missing-model'}}}\ndata: {{train: {tmp_path / 'x.parquet'}}}\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "raylora.cli", "train", str(cfg)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "model.path: model folder not found" in proc.stderr and "missing-model" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "raylora.cli", "train", str(cfg), "train.bogus=1"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "unknown config key train.bogus" in proc.stderr


def test_load_makes_local_paths_absolute_and_keeps_hub_ids_and_uris(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    path = tmp_path / "c.yaml"
    path.write_text(
        "model: {path: model}\n"
        "data: {train: d/train.parquet, eval: d/eval.parquet}\n"
        "run: {storage_path: out}\n"
    )
    cfg = config.load(path)
    here = Path.cwd()
    assert cfg.model.path == str(here / "model")
    assert (cfg.data.train, cfg.data.eval) == (str(here / "d/train.parquet"), str(here / "d/eval.parquet"))
    assert cfg.run.storage_path == str(here / "out")

    remote = ["data.train=s3://bucket/train.parquet", "data.eval=gs://bucket/eval.parquet"]
    cfg = config.load(None, ["model.path=org/name", *remote, "run.storage_path=s3://bucket/runs"])
    assert cfg.model.path == "org/name"  # a Hub id: each node resolves it through its own cache
    assert (cfg.data.train, cfg.data.eval) == ("s3://bucket/train.parquet", "gs://bucket/eval.parquet")
    assert cfg.run.storage_path == "s3://bucket/runs"


def test_make_trainer_leaves_the_config_as_it_is(tmp_path, monkeypatch):
    from raylora.driver import make_trainer

    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    loaded = config.load(None, ["model.path=model", "data.train=t.parquet", "data.eval=e.parquet"])
    # Relative paths, as a config that bypassed `config.load` would hold: the trainer must not fix them up.
    cfg = dataclasses.replace(
        loaded,
        model=dataclasses.replace(loaded.model, path="model"),
        data=dataclasses.replace(loaded.data, train="t.parquet", eval="e.parquet"),
    )
    for c in (loaded, cfg):
        before = c.to_dict()
        make_trainer(c)
        assert c.to_dict() == before


def test_trainer_leaves_out_the_helper_actors_a_raylora_run_does_not_use(tmp_path, monkeypatch):
    """No Ray Datasets, so no DatasetManager actor at each worker-group start; the placement-group
    cleaner only where the Ray may outlive the driver (not one that raylora's init_ray started).
    Fails if a Ray upgrade renames or moves either callback."""
    from ray.train.v2._internal.callbacks.backend_setup import BackendSetupCallback
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    from raylora import ray_runtime
    from raylora.driver import make_trainer
    from raylora.ray_runtime import LOCAL_RAY_MARK

    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    cfg = config.load(None, ["model.path=model", "data.train=t.parquet"])
    monkeypatch.delenv(LOCAL_RAY_MARK, raising=False)
    # as a driver that joined a cluster sees it, whether or not an earlier test started a Ray here
    monkeypatch.setattr(ray_runtime, "_started_session", None)

    def kinds() -> set[type]:
        return {type(cb) for cb in make_trainer(cfg)._create_default_callbacks()}

    on_a_cluster = kinds()
    assert BackendSetupCallback in on_a_cluster  # Ray's own list, less what raylora leaves out
    assert DatasetsCallback not in on_a_cluster
    assert PlacementGroupCleanerCallback in on_a_cluster
    monkeypatch.setenv(LOCAL_RAY_MARK, "1")  # as a Tune trial's driver on raylora's own Ray sees it
    assert kinds() == on_a_cluster - {PlacementGroupCleanerCallback}


def test_a_runs_controller_polls_faster_than_it_reports(tmp_path, monkeypatch):
    """Ray Train takes one report per poll and a report waits for the previous one to be taken: a run's
    trainer polls at least twice per report interval (every step reporting: 0.1 s), and no faster than
    every 0.1 s nor slower than every 0.25 s, however seldom it reports."""
    from raylora.driver import make_trainer
    from raylora.ray_runtime import controller_poll_s

    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    for every in (0.0, 0.05, 0.3, 1.0, 2.0, 600.0):
        cfg = config.load(None, ["model.path=model", "data.train=t.parquet", f"run.report_every_s={every}"])
        poll = make_trainer(cfg).poll_s
        assert poll == controller_poll_s(every)
        assert 0.1 <= poll <= 0.25
        assert poll <= every / 2 or poll == 0.1, (every, poll)


def _worker_poll() -> str | None:
    """In a Train worker: the controller poll it was handed."""
    import os

    from raylora.ray_runtime import POLL_ENV

    return os.environ.get(POLL_ENV)


@pytest.mark.slow
@pytest.mark.distributed
def test_the_controller_and_workers_get_the_trainers_poll_and_the_env_is_restored(
    ray_cluster, probes, tmp_path, monkeypatch
):
    """Ray Train's controller reads its poll from the driver's environment as `fit` starts it, and hands
    it on to the workers: a run's `Trainer` sets it for its fit and removes it after; one that the
    environment already holds (the probe group's 1 s here, or a user's) is left as it is."""
    import os

    from raylora.ray_runtime import POLL_ENV
    from tests.probes import on_workers

    monkeypatch.delenv(POLL_ENV, raising=False)
    assert probes(lambda: os.environ.get(POLL_ENV)) == "1"
    assert POLL_ENV not in os.environ
    assert on_workers(_worker_poll, tmp_path, "poll", num_workers=1, poll_s=0.25) == "0.25"
    assert POLL_ENV not in os.environ


def test_data_formats_named_in_config_are_the_readers():
    from raylora.config import DATA_FORMATS
    from raylora.data import formats

    assert set(DATA_FORMATS) == set(formats.FORMATS) | set(formats.ALIASES)


def test_new_keys_defaults_and_checks(tmp_path):
    cfg = config.load(None, _base())
    assert cfg.train.deterministic is True and cfg.run.local_dir is None
    assert config.load(None, _base() + ["train.deterministic=false"]).train.deterministic is False
    assert config.load(None, _base() + [f"run.local_dir={tmp_path}"]).run.local_dir == str(tmp_path)
    for bad in ("scratch", "s3://bucket/scratch"):  # a node-local folder: relative to what, on which node?
        with pytest.raises(ConfigError, match="run.local_dir must be an absolute local path"):
            config.load(None, _base() + [f"run.local_dir={bad}"])


def test_staging_folder_is_under_run_local_dir(tmp_path):
    import tempfile

    from raylora import resume

    unset = config.load(None, _base())
    assert resume.staging_folder(unset).parent == Path(tempfile.gettempdir()) / "raylora-staging"
    cfg = config.load(None, _base() + [f"run.local_dir={tmp_path / 'nvme'}"])
    folder = Path(resume.new_staging_folder(cfg, 4))
    assert folder.parent == resume.staging_folder(cfg)
    assert folder.parent.parent == tmp_path / "nvme" / "raylora-staging"
    assert folder.name.startswith("step4-") and folder.is_dir()
