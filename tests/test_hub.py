"""model.path as a Hugging Face Hub id, resolved offline from a Hub cache laid out as huggingface_hub does.

No network: HF_HUB_OFFLINE=1 and HF_HOME pointing at a cache built here from a tiny model folder. The
distributed test trains on 2 Ray workers from the Hub id, through a fault drill and a resume, with its
data and its run storage given as `file://` URIs (pyarrow's filesystem path, as for s3:// or gs://).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants

from raylora import checkpoint, hub
from raylora.config import ConfigError
from raylora.driver import preflight, run
from raylora.hub import base_model_fingerprint
from raylora.progress import read_metrics
from raylora.resume import check_resume
from tests.ray_env import start_ray
from tests.support import tiny_run_config

REPO = "tiny-org/tiny-llava"


def lay_out_hub_cache(hf_home: Path, repo_id: str, model_dir: str) -> str:
    """Put `model_dir` into `hf_home`'s Hub cache as huggingface_hub stores a download; returns the commit.

    `hub/models--ORG--NAME/blobs/<etag>` holds each file once, `snapshots/<commit>/<file>` is a relative
    symlink to its blob, and `refs/main` holds the commit hash that main points to.
    """
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()  # any 40 hex digits look like a commit
    for file in sorted(p for p in Path(model_dir).rglob("*") if p.is_file()):
        data = file.read_bytes()
        # A blob is named by the file's ETag: the LFS sha256 for weights, the git blob sha1 for the rest.
        if file.suffix == ".safetensors":
            etag = hashlib.sha256(data).hexdigest()
        else:
            etag = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        blob = repo / "blobs" / etag
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / file.relative_to(model_dir)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return commit


def offline(mp: pytest.MonkeyPatch, hf_home: Path) -> dict[str, str]:
    """HF_HOME and HF_HUB_OFFLINE for this process; returns them for other processes' environments."""
    env = {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    for key, value in env.items():
        mp.setenv(key, value)
    mp.delenv("HF_HUB_CACHE", raising=False)
    # huggingface_hub reads these once, when it is imported, and this process imported it long ago
    mp.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    mp.setattr(constants, "HF_HUB_OFFLINE", True)
    mp.setattr(hub, "_resolved", {})
    return env


@pytest.fixture(scope="module")
def hub_cache(tiny_models, tmp_path_factory):
    """(HF_HOME, commit) of a Hub cache holding the tiny llava as REPO."""
    hf_home = tmp_path_factory.mktemp("hf_home")
    return hf_home, lay_out_hub_cache(hf_home, REPO, tiny_models("llava"))


@pytest.fixture
def offline_hub(hub_cache):
    with pytest.MonkeyPatch.context() as mp:
        offline(mp, hub_cache[0])
        yield hub_cache


def test_hub_id_resolves_from_the_cache(offline_hub, tiny_models):
    hf_home, commit = offline_hub
    snapshot = hf_home / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / commit
    assert Path(hub.resolve(REPO)) == snapshot
    assert Path(hub.resolve(REPO, commit)) == snapshot
    assert Path(hub.resolve(REPO, "main", config_only=True)) == snapshot
    assert base_model_fingerprint(snapshot) == base_model_fingerprint(tiny_models("llava"))


def test_unresolvable_hub_ids_are_config_errors(offline_hub, digits, tmp_path):
    with pytest.raises(ConfigError, match=r"model.path nobody/no-such-model .*HF_HUB_OFFLINE"):
        preflight(tiny_run_config("nobody/no-such-model", digits[0], tmp_path, "unknown"))
    with pytest.raises(ConfigError, match=r"model.path tiny-org/tiny-llava \(model.revision (deadbeef){5}\)"):
        preflight(
            tiny_run_config(REPO, digits[0], tmp_path, "bad-revision", f"model.revision={'deadbeef' * 5}")
        )
    with pytest.raises(ConfigError, match="model.path: model folder not found: ./no/such/folder"):
        preflight(tiny_run_config("./no/such/folder", digits[0], tmp_path, "missing"))


def test_revision_of_a_local_folder_is_refused(tiny_models):
    with pytest.raises(ConfigError, match="model.revision .* local folder"):
        hub.resolve(tiny_models("llava"), "main")


# Two processes resolve the same Hub id at once; snapshot_download is replaced by a slow stand-in that
# "downloads" (creates the folder) only when the folder is not there yet, and logs what it did.
RESOLVE_PROBE = r"""
import os, sys, time
from pathlib import Path
import huggingface_hub
from raylora import hub

log, target = Path(sys.argv[1]), Path(sys.argv[2])

def write(line):
    with open(log, "a") as f:
        f.write(f"{line} {os.getpid()}\n")

def slow_snapshot_download(repo_id, revision=None, allow_patterns=None):
    write("start")
    fetched = not target.exists()
    if fetched:
        time.sleep(1.0)
        target.mkdir(exist_ok=True)
    write("download" if fetched else "cached")
    return str(target)

huggingface_hub.snapshot_download = slow_snapshot_download
write("ready")
while log.read_text().count("ready") < 2:  # both processes resolve at the same moment
    time.sleep(0.01)
hub.resolve("tiny-org/tiny-llava")
"""


def test_one_process_per_node_downloads(tmp_path):
    log, target = tmp_path / "log", tmp_path / "snapshot"
    log.touch()
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    procs = [
        subprocess.Popen([sys.executable, "-c", RESOLVE_PROBE, str(log), str(target)], env=env)
        for _ in range(2)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    events = [line.split()[0] for line in log.read_text().splitlines() if not line.startswith("ready")]
    assert events == ["start", "download", "start", "cached"], events
    assert (tmp_path / "hf_home" / "hub" / ".locks" / "raylora" / "tiny-org--tiny-llava@main.lock").exists()


@pytest.fixture(scope="module")
def offline_ray(hub_cache):
    """A Ray of this module's own whose workers see the offline Hub cache (HF_HOME, HF_HUB_OFFLINE)."""
    import ray

    with pytest.MonkeyPatch.context() as mp:
        env = offline(mp, hub_cache[0])
        ray.shutdown()  # a Ray started by an earlier module has no Hub cache in its workers' environment
        start_ray(num_cpus=4, env_vars=env)
        yield hub_cache
        ray.shutdown()  # the next module's ray_cluster starts a Ray without it


def _state(result) -> checkpoint.TrainState:
    with result.checkpoint.as_directory() as folder:
        return checkpoint.TrainState.from_dict(json.loads((Path(folder) / checkpoint.STATE).read_text()))


@pytest.mark.distributed
@pytest.mark.slow
def test_trains_and_resumes_from_a_hub_id_on_uri_storage(offline_ray, tiny_models, digits, tmp_path):
    """The model named by its Hub id; the data and the run's storage as pyarrow filesystem URIs (here
    `file://`, the code path of s3:// and gs://)."""
    _, commit = offline_ray
    local = base_model_fingerprint(tiny_models("llava"))
    storage, data = f"file://{tmp_path / 'uri-storage'}", f"file://{digits[0]}"

    # A worker kills itself before step 3; the new worker group resumes from the step-2 checkpoint.
    first = run(tiny_run_config(REPO, data, storage, "hub", "train.max_steps=4", "fault.kill_at_steps=[3]"))
    assert first.error is None
    assert first.checkpoint.path.startswith(str(tmp_path / "uri-storage" / "hub"))
    state = _state(first)
    assert (state.step, state.restarts) == (4, 1)
    assert state.config["model"]["path"] == REPO  # the workers resolved the Hub id themselves
    assert state.base_model == local
    rows = read_metrics(storage, "hub")
    assert [r["step"] for r in rows if r["restarts"] == 1] == [3, 4]

    # The same run continued with the revision pinned to the commit main pointed to: the same base
    # model, so the driver's resume check (which fingerprints the resolved files) accepts it.
    pinned = tiny_run_config(REPO, data, storage, "hub", "train.max_steps=6", f"model.revision={commit}")
    assert check_resume(pinned).step == 4
