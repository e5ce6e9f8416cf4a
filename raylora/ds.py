"""DeepSpeed, imported the way raylora's workers need it: without MLflow, and without TorchInductor.

DeepSpeed's autotuner imports MLflow whenever it is installed (`try: import mlflow`), and raylora installs
it for its MLflow metrics sink. That import is about a second of every worker start, restarts included
(measured: `import raylora.worker` 5.6 s with it, 4.9 s without), and no worker uses it: the sink runs
in Ray Train's controller, and raylora never runs DeepSpeed's autotuner. So MLflow is marked absent
while DeepSpeed imports (the autotuner catches the ImportError) and unmarked right after: an
`import mlflow` later in the same process works as usual. Every raylora module imports DeepSpeed
from here.
"""

from __future__ import annotations

import os
import sys

_hidden = "mlflow" not in sys.modules
if _hidden:
    sys.modules["mlflow"] = None  # a None entry makes `import mlflow` raise ImportError
try:
    import deepspeed  # noqa: E402
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # noqa: E402
finally:
    if _hidden:
        del sys.modules["mlflow"]

# DeepSpeed's communication backend loads its CPU shared-memory op (`deepspeed_shm_comm`) at
# `init_distributed`, compiling it with ninja on first use (about a minute on 2 cores, again whenever
# the virtualenv's path or compiler changes), for `inference_all_reduce` alone: DeepSpeed's inference
# engine, which raylora never runs (training reduces through torch.distributed). Marked incompatible,
# the backend skips it (`build_shm_op` returns None) and every collective raylora uses is unchanged.
SKIPPED_OPS = ("deepspeed_shm_comm",)
for _name in SKIPPED_OPS:
    deepspeed.ops.__compatible_ops__[_name] = False

# DeepSpeed's ZeRO engines import its Muon optimizer at every start, whose `torch.compile` decorators import
# TorchInductor, seconds of CPU per worker start (dev/LOG.md), for an optimizer raylora never runs. So the
# module is imported here first while DeepSpeed's own compile hook hands functions back as they are: the
# class exists for DeepSpeed's checks, its kernels stay eager, and torch.compile itself is left alone.
from deepspeed.runtime import compiler as _compiler  # noqa: E402

_compile = _compiler.compile
_compiler.compile = lambda: _compiler.dummy_decorator
try:
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: E402, F401
finally:
    _compiler.compile = _compile


def tell_local_size() -> None:
    """Give DeepSpeed's CPU accelerator the number of ranks on this node, as DeepSpeed's own launcher does
    (`LOCAL_SIZE`, deepspeed/launcher/launch.py). Without it, its `device_count()` runs `numactl --hardware`
    in a child process each time it is asked, and ZeRO-3 asks at every gradient reduce-scatter: a fork and
    exec per step on every rank (numactl or not), and, through `os.get_exec_path`'s `catch_warnings`, every
    warning filter reset, so torch's deprecation warnings for DeepSpeed's collectives print again each step
    and, in a Ray worker, go through Ray's log monitor to the driver. The GPU accelerators count devices
    without it; the variable is read only by the CPU one."""
    local = os.environ.get("LOCAL_WORLD_SIZE")  # set by Ray Train (and torchrun) on every worker
    if local and "LOCAL_SIZE" not in os.environ:
        os.environ["LOCAL_SIZE"] = local


__all__ = ["SKIPPED_OPS", "ZeroParamStatus", "deepspeed", "tell_local_size"]
