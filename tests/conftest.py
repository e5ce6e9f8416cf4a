"""Shared fixtures: tiny model folders and the digits, built once per session; one local Ray for all."""

from __future__ import annotations

import pytest

from raylora.assets import make_digits, make_tiny_model
from tests.ray_env import use_ray_test_env

use_ray_test_env()


# Modules that replace the shared Ray with one of their own (several nodes, another environment) and shut
# it down: run last, so that the modules after them do not each start the shared Ray again.
OWN_RAY = (
    "test_hub.py",
    "test_multinode.py",
    "test_node_loss.py",
    "test_object_storage.py",
    "test_preemption.py",
)


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.path.name in OWN_RAY)  # stable: the order within each part stays


_probe_group = None  # the session's tests.probes.ProbeGroup, once `probes` started one


def _close_probe_group() -> None:
    global _probe_group
    group, _probe_group = _probe_group, None
    if group is not None and group.alive:
        group.close()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if item.path.name in OWN_RAY:  # before its fixtures shut the shared Ray down under the group
        _close_probe_group()


@pytest.fixture(scope="session")
def digits(tmp_path_factory):
    """(train.parquet, eval.parquet) of the handwritten digits."""
    return make_digits(tmp_path_factory.mktemp("digits"))


# Folders of one registry entry built another way: InternVL3.5's (-HF) folders hold the `internvl` model type
# around a Qwen3 text model (raylora.tiny_others._internvl)
VARIANTS = {"internvl3_5": ("internvl", {"text_model": "qwen3"})}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Model folders by architecture, built lazily."""
    root = tmp_path_factory.mktemp("models")
    built: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in built:
            name, variant = VARIANTS.get(arch, (arch, {}))
            built[arch] = str(make_tiny_model(root / arch, name, **variant))
        return built[arch]

    return get


@pytest.fixture(scope="session")
def s3():
    """A real S3 endpoint on 127.0.0.1 (tests.s3_server.S3Server) with its environment put into this
    process's, so that pyarrow's S3 client here and in every Ray started afterwards reaches it."""
    from tests.s3_server import S3Server

    server = S3Server()
    with pytest.MonkeyPatch.context() as mp:
        for key, value in server.env.items():
            mp.setenv(key, value)
        yield server
    server.stop()


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray shared by the distributed tests (6 logical CPUs on 2 cores: the 2 workers of
    `probes`, and 3 workers or 2 plus headroom for a run).

    Module-scoped so that a module that needs a Ray of its own (several nodes) can shut this one down.
    """
    import ray

    from raylora.ray_runtime import init_ray

    init_ray(num_cpus=6)
    return ray


@pytest.fixture(scope="session")
def probes(tmp_path_factory):
    """`probes(fn)`: `fn()` on 2 Ray Train workers (gloo, as raylora trains), rank 0's return value, like
    `tests.probes.on_workers`, but every test's probe runs in one worker group kept for the session
    (`tests.probes.ProbeGroup`): a group's start is about 13 s here, and the probes need only the
    workers. A probe that raises ends the group (its test fails, naming the error); the next starts
    another. Use it with the shared Ray up (`ray_cluster`); closed before the modules with a Ray of
    their own."""
    from tests.probes import ProbeGroup

    storage = tmp_path_factory.mktemp("probe-group")

    def call(fn):
        global _probe_group
        if _probe_group is None or not _probe_group.alive:  # none yet, or the last one's probe raised
            _probe_group = ProbeGroup(storage, 2)
        return _probe_group.call(fn)

    yield call
    _close_probe_group()


@pytest.fixture(scope="session")
def straight_runs(tiny_models, digits, tmp_path_factory):
    """Uninterrupted runs of `tests.support.tiny_run_config` on the digits, by (architecture, overrides),
    each trained once per session: a distributed run costs about 30 s here, and modules whose faulted
    runs compare against the same uninterrupted one share it. Call it with a Ray up (`ray_cluster`);
    the results' checkpoints stay on local disk, read-only to their users."""
    from raylora.driver import run
    from tests.support import tiny_run_config

    storage = tmp_path_factory.mktemp("straight-runs")
    results: dict[tuple[str, tuple[str, ...]], object] = {}

    def get(arch: str, *overrides: str):
        key = (arch, overrides)
        if key not in results:
            name = f"straight-{len(results)}"
            result = run(tiny_run_config(tiny_models(arch), digits[0], storage, name, *overrides))
            assert result.error is None
            results[key] = result
        return results[key]

    return get


@pytest.fixture
def one_rank():
    """A gloo process group of one rank in this process (collectives without Ray); destroyed after."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
