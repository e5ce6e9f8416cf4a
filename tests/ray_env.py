"""The Ray the tests and the benchmarks start: its environment, a free port, a Ray of the caller's own."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Ray's default, explicit so that a test or benchmark does not depend on what ~/.ray holds.
RAY_TEST_ENV = {"RAY_AUTH_MODE": "token"}


def use_ray_test_env() -> None:
    """Put RAY_TEST_ENV into this process's environment, where it does not set those variables itself,
    and this interpreter's bin folder first on PATH, as an activated virtualenv has it.

    Every Ray process a test starts then finds the virtualenv's tools, as the `ray job submit` test's
    processes must (its entrypoint is `python`): DeepSpeed builds its CPU communication op with the
    `ninja` on PATH, and the system's ninja and the virtualenv's (other versions) alternating in the one
    build folder made each switch rebuild it, about 45 s on 2 cores.
    """
    for key, value in RAY_TEST_ENV.items():
        os.environ.setdefault(key, value)
    bin_dir = str(Path(sys.executable).parent)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != bin_dir:
        os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a rendezvous, a server, a Ray node's port)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ray(num_cpus: int | None = None, env_vars: dict[str, str] | None = None, address: str = "local"):
    """Start a Ray of the caller's own (`address="local"`) or connect to `address` (a
    `ray.cluster_utils.Cluster`'s), `env_vars` in its workers' runtime env; returns `ray`."""
    import ray

    use_ray_test_env()
    cpus = {} if num_cpus is None else {"num_cpus": num_cpus}  # connecting to a cluster takes no count
    ray.init(address=address, runtime_env={"env_vars": env_vars or {}}, **cpus)
    return ray
