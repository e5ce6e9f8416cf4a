"""What the tests and the benchmarks share that is not a fixture: the Ray they start, the tiny run they
train, a probe that runs a function on Ray Train workers, and readers of what a run wrote.

bench/ imports this module too (bench/common.py puts the repository root on sys.path); nothing here is
part of raylora's training path.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

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


class S3Server:
    """A real S3 endpoint on 127.0.0.1: moto's server mode, an HTTP S3 API that pyarrow's S3 client (and
    so Ray Train's checkpoint upload) talks to as it talks to AWS. `env` is what a process needs to reach it
    (endpoint, any credentials, a region); `bucket` exists."""

    def __init__(self, bucket: str = "raylora-test"):
        import atexit
        import socket
        import subprocess
        import time

        port = free_port()
        moto = Path(sys.executable).parent / "moto_server"
        self.process = subprocess.Popen(
            [str(moto), "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.bucket = bucket
        self.env = {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_ACCESS_KEY_ID": "raylora",
            "AWS_SECRET_ACCESS_KEY": "raylora",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.1)
        atexit.register(self.stop)  # a script that ends by an error leaves no server behind
        self.fs().create_dir(bucket)  # pyarrow creates a bucket for a top-level folder

    def fs(self):
        """pyarrow's S3 client, pointed at this server."""
        import pyarrow.fs

        return pyarrow.fs.S3FileSystem(
            endpoint_override=self.env["AWS_ENDPOINT_URL"],
            access_key=self.env["AWS_ACCESS_KEY_ID"],
            secret_key=self.env["AWS_SECRET_ACCESS_KEY"],
            region=self.env["AWS_DEFAULT_REGION"],
            allow_bucket_creation=True,
        )

    def uri(self, *parts: str) -> str:
        return "s3://" + "/".join([self.bucket, *parts])

    def upload(self, local: str | Path, *parts: str) -> str:
        """Copy a local file to `s3://bucket/parts...`; returns its URI."""
        key = "/".join([self.bucket, *parts])
        with self.fs().open_output_stream(key) as f:
            f.write(Path(local).read_bytes())
        return "s3://" + key

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


class CountingFileSystem:
    """A pyarrow filesystem seen through a counter of what is written: every output stream opened and
    every byte written to one (on an object store, one upload each and the bytes uploaded)."""

    def __init__(self, fs):
        self.fs, self.streams, self.bytes = fs, 0, 0

    def __getattr__(self, name):
        return getattr(self.fs, name)

    def open_output_stream(self, path, *args, **kwargs):
        self.streams += 1
        return _CountedStream(self, self.fs.open_output_stream(path, *args, **kwargs))


class _CountedStream:
    def __init__(self, owner: CountingFileSystem, stream):
        self.owner, self.stream = owner, stream

    def write(self, data) -> int:
        self.owner.bytes += len(data)
        return self.stream.write(data)

    def close(self) -> None:
        self.stream.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def metrics_row(step: int, max_steps: int, restarts: int = 0, **extra) -> dict:
    """A row as the workers report it (the keys and magnitudes of a real run's row, about 330 bytes)."""
    return {
        "step": step,
        "loss": 3.5 / (1 + step) ** 0.5 + 1e-9 * step,
        "lr": 1e-4 * (1 - step / (max_steps + 1)),
        "vision_lr": 1e-5 * (1 - step / (max_steps + 1)),
        "samples_per_s": 37.85949056307141,
        "tokens_per_s": 1022.206245202928,
        "max_steps": max_steps,
        "epoch": 0,
        "restarts": restarts,
        "world_size": 2,
        "bad_rows": 0,
        "too_long": 0,
        "bad_rows_so_far": 0,
        "wall_time": 1796170227.1426444 + step,
        **extra,
    }


def tiny_run_config(
    model_dir: str | Path, train_file: str | Path, storage: str | Path, name: str, *overrides: str
):
    """The small run that the tests and benchmarks train: fully partitioned ZeRO-3 on 2 workers
    (persistence threshold 0), LoRA r=4 with dropout, vision tower and aligner trained, 6 steps, a
    checkpoint every 2; `overrides` (dotted `key=value`) come last and win."""
    from raylora import config

    return config.load(
        None,
        [
            f"model.path={model_dir}",
            f"data.train={train_file}",
            f"run.storage_path={storage}",
            f"run.name={name}",
            "train.max_steps=6",
            "train.global_batch_size=8",
            "train.micro_batch_size=2",
            "train.lr=1e-3",
            "train.warmup_steps=2",
            "train.checkpoint_every=2",
            "train.freeze_vision=false",
            "train.freeze_aligner=false",
            "train.param_persistence_threshold=0",
            "lora.r=4",
            "lora.alpha=8",
            "lora.dropout=0.1",
            "scaling.num_workers=2",
            "run.max_failures=2",
            "run.num_to_keep=10",
            *overrides,
        ],
    )


def straight_and_killed(model_dir, data, storage, kill_at: int, *overrides: str) -> tuple[Any, Any]:
    """Two runs of `tiny_run_config`: uninterrupted (`straight`) and with the fault drill's rank killing
    itself before step `kill_at` (`killed`), each with `overrides`; both must succeed."""
    from raylora.driver import run

    straight = run(tiny_run_config(model_dir, data, storage, "straight", *overrides))
    killed = run(
        tiny_run_config(model_dir, data, storage, "killed", *overrides, f"fault.kill_at_steps={kill_at}")
    )
    assert straight.error is None and killed.error is None
    return straight, killed


def on_workers(
    fn: Callable[[], Any],
    storage: str | Path,
    name: str,
    num_workers: int = 2,
    use_gpu: bool = False,
    poll_s: float = 0.1,
) -> Any:
    """Run `fn()` on `num_workers` Ray Train workers (gloo on CPU, NCCL with `use_gpu`, as raylora
    trains), the controller polling every `poll_s` seconds; returns rank 0's return value."""
    import ray.train

    from raylora import storage as storages
    from raylora.ray_runtime import Trainer  # Ray's TorchTrainer less the helper actors raylora does not use

    trainer = Trainer(
        fn,
        poll_s=poll_s,
        scaling_config=ray.train.ScalingConfig(num_workers=num_workers, use_gpu=use_gpu),
        # a URI (s3://) as it is: pathlib would fold its "//" into a local folder named "s3:"
        run_config=ray.train.RunConfig(name=name, storage_path=storages.absolute(str(storage))),
    )
    return trainer.fit().return_value


def _serve(requests, replies) -> None:
    """A probe group's training function: run each broadcast function until a None comes."""
    import torch.distributed as dist
    from ray import cloudpickle  # the functions are lambdas and closures, which pickle refuses

    rank = dist.get_rank()
    while True:
        box = [cloudpickle.dumps(requests.get()) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        fn = cloudpickle.loads(box[0])
        if fn is None:
            return
        # an exception ends this rank's training function, and Ray Train the group: rank 0 is not left
        # waiting in a collective of the function for a rank that gave up
        out = fn()
        if rank == 0:
            replies.put(("ok", out))


class ProbeGroup:
    """One Ray Train worker group, kept up in a thread of the driver, that runs function after function:
    `call(fn)` is `on_workers(fn, ...)` without a new group's start.

    A group's start costs about 13 s on 2 cores, nearly all of it fresh processes importing torch,
    transformers, PEFT and DeepSpeed, and the tests' and benchmarks' probes need only the workers. Ray
    Train has no call that runs a function on a group it keeps, so the group's training function serves:
    rank 0 takes each function from a Ray queue and broadcasts it to the other ranks, every rank runs it,
    and rank 0 puts its return value on the reply queue. A function that raises ends the group (the call
    raises, naming the error); `alive` then says so, and its user starts another.
    """

    def __init__(self, storage: str | Path, num_workers: int) -> None:
        from ray.util.queue import Queue

        from raylora.ray_runtime import POLL_ENV

        self.num_workers = num_workers
        self.requests, self.replies = Queue(), Queue()
        requests, replies = self.requests, self.replies

        def serve() -> None:
            try:
                on_workers(lambda: _serve(requests, replies), storage, "probe-group", num_workers)
                replies.put(("ended", "the probe group ended"))
            except Exception as err:  # the waiting call raises it
                replies.put(("ended", f"the probe group failed: {err!r}"))

        # Idle between probes, the group's controller still polls its workers every
        # RAY_TRAIN_HEALTH_CHECK_INTERVAL_S: at the 0.1 s of raylora's `Trainer` (for reports) that took
        # 0.03 cores here for as long as the group lives, most of a test session. The controller reads the
        # variable from this process's environment as it starts, so the group starts with 1 s, and the
        # environment is as it was once the group answers its first call: later runs poll as raylora's do.
        before = os.environ.get(POLL_ENV)
        os.environ[POLL_ENV] = "1"
        try:
            self.thread = threading.Thread(target=serve, name="probe-group", daemon=True)
            self.thread.start()
            self.call(lambda: None)
        finally:
            if before is None:
                os.environ.pop(POLL_ENV)
            else:
                os.environ[POLL_ENV] = before

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def call(self, fn: Callable[[], Any]) -> Any:
        self.requests.put(fn)
        kind, value = self.replies.get(timeout=1800)
        if kind != "ok":
            raise RuntimeError(value)
        return value

    def close(self) -> None:
        self.requests.put(None)
        self.thread.join(timeout=120)
        self.requests.shutdown()
        self.replies.shutdown()


def read_params(params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    """Full copies of the model's (not the optimizer's) parameter values, gathered per call, in fp32 on
    the CPU; every rank."""
    import deepspeed

    from raylora.zero import is_partitioned

    out = {}
    partitioned = [p for p in params.values() if is_partitioned(p)]
    with deepspeed.zero.GatheredParameters(partitioned):
        for name, param in params.items():
            out[name] = param.detach().float().cpu().clone()
    return out


def train_and_save(cfg, steps: int, out: str | Path, keep: bool = False) -> list:
    """On each Ray Train worker: raylora's training path without its loop (`worker.setup`, `steps` x
    `worker.train_step`, `worker.save_checkpoint`), the checkpoint moved to `out` by rank 0; returns the
    steps' metrics (and, with `keep`, the worker's `Setup` after them, to train on). Several of these in
    one `on_workers` function start one worker group, not one each."""
    import shutil

    import torch.distributed as dist

    from raylora import worker

    s = worker.setup(cfg, None)
    metrics = [worker.train_step(s) for _ in range(steps)]
    ckpt = worker.save_checkpoint(s)
    if s.rank == 0:
        shutil.move(ckpt.path, out)
    dist.barrier()  # the other ranks read `out` next
    return [*metrics, s] if keep else metrics


def resume_probe(cfg, steps: int, folder: str | Path) -> dict:
    """On each Ray Train worker: train `steps` steps, save the checkpoint to `folder` (rank 0 moves it
    there), train one step more; then build a fresh engine restored from `folder`, read back what it holds
    (`restored`: as `restore_probe` returns it), and train that step again. Rank 0 returns each step's
    metrics and whether the resumed step's loss, fp32 masters and Adam moments equal the uninterrupted
    ones bit for bit (what a killed and restarted worker resumes from)."""
    import torch

    from raylora import checkpoint, zero
    from raylora.worker import setup, train_step

    metrics = train_and_save(cfg, steps, folder, keep=True)
    s = metrics.pop()
    straight = train_step(s)
    uninterrupted = zero.gather_trainable_state(s.engine, s.params)  # on rank 0, None elsewhere
    s.engine.destroy()
    del s
    loaded = checkpoint.load(folder)
    resumed_setup = setup(cfg, loaded)
    restored = _restored(resumed_setup, loaded)
    resumed = train_step(resumed_setup)
    again = zero.gather_trainable_state(resumed_setup.engine, resumed_setup.params)
    if resumed_setup.rank != 0:
        return {}
    (masters, moments), (got_masters, got_moments) = uninterrupted, again
    return {
        "metrics": [*metrics, straight],
        "restored": restored,
        "resumed": resumed,
        "masters_equal": masters.keys() == got_masters.keys()
        and all(torch.equal(v, got_masters[n]) for n, v in masters.items()),
        "moments_equal": moments.keys() == got_moments.keys()
        and all(torch.equal(v, got_moments[n]) for n, v in moments.items()),
    }


def restore_probe(cfg, folder: str | Path, examples: list | None = None) -> dict:
    """On each Ray Train worker: restore from `folder` as `worker.setup` does, then read back what the
    engine holds before any step (and, given `examples`, the restored ZeRO-3 model's logits on them, in
    eval mode); rank 0 returns whether each part equals the checkpoint, the others `{}`."""
    from raylora import checkpoint
    from raylora.worker import setup

    loaded = checkpoint.load(folder)
    return _restored(setup(cfg, loaded), loaded, examples)


def _restored(s, loaded, examples: list | None = None) -> dict:
    """What the restored engine of Setup `s` holds against checkpoint `loaded`, before any step (every rank
    calls it; rank 0 gets the answer, the others `{}`)."""
    import torch

    from raylora import zero
    from raylora.data.batches import make_batch

    model_values = read_params(s.params)
    gathered = zero.gather_trainable_state(s.engine, s.params)
    logits = None
    if examples is not None:  # every rank takes part in a ZeRO-3 forward pass
        batch = make_batch(s.processor, examples)
        batch.pop("labels")
        s.engine.module.eval()
        with torch.no_grad():
            logits = s.engine.module(**{k: v.to(s.engine.device) for k, v in batch.items()}).logits
        logits = logits.cpu().numpy()  # Ray Train refuses tensors in a training function's return value
        s.engine.module.train()
    if s.rank != 0:
        return {}
    masters, moments = gathered
    return {
        "logits": logits,
        "step": s.step,
        "lr": s.scheduler.get_last_lr()[0],
        "params_equal": all(torch.equal(model_values[n], loaded.weights[n]) for n in loaded.weights),
        "masters_equal": all(torch.equal(masters[n], loaded.weights[n]) for n in loaded.weights),
        "moments_equal": all(torch.equal(moments[n], loaded.moments[n]) for n in loaded.moments),
        "moments_nonzero": any(bool(t.abs().sum() > 0) for t in loaded.moments.values()),
    }


def assert_weights_close(
    reference: dict[str, torch.Tensor], got: dict[str, torch.Tensor], tol: float
) -> None:
    """Every tensor of `got` within a relative `tol` of `reference` (max abs difference over the reference's
    max abs value); runs on other worker counts sum gradients in another order, so not bitwise."""
    worst = 0.0
    for name, value in reference.items():
        diff = float((value - got[name]).abs().max())
        if name.endswith("k_proj.bias"):
            # Softmax ignores a bias added to every key, so these get a zero gradient in exact arithmetic:
            # their updates are summation-order noise that Adam normalises up to the learning rate.
            # They stay at ~1e-6 in both runs; bound them absolutely.
            assert diff <= tol, name
            continue
        worst = max(worst, diff / float(value.abs().max().clamp_min(1e-12)))
    assert worst <= tol, f"relative difference {worst:.2e} (tolerance {tol:.0e})"


def wandb_history(wandb_dir: str | Path) -> list[dict[str, str]]:
    """The history rows W&B wrote in offline mode under `wandb_dir`, values as W&B's JSON strings.

    wandb 0.31 reads its own `.wandb` files only in its Go core, so this reads the format directly:
    a 7-byte header, then LevelDB-log records (32 KiB blocks; each record a 7-byte header: crc32,
    length, kind, where kind 1 is a whole record and 2-4 the first, middle and last piece of one) that
    hold `wandb_internal_pb2.Record` protobufs.
    """
    from wandb.proto import wandb_internal_pb2

    rows = []
    for path in sorted(Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, block, piece = path.read_bytes(), 7, 32768, b""
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # a block's tail too short for a header is padding
                pos += block - pos % block
                continue
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            piece += data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):
                record = wandb_internal_pb2.Record()
                record.ParseFromString(piece)
                piece = b""
                if record.WhichOneof("record_type") == "history":
                    # a key stands in `key`, or split into `nested_key` (the W&B core writes either)
                    rows.append({i.key or ".".join(i.nested_key): i.value_json for i in record.history.item})
    return rows


def tensorboard_scalars(logdir: str | Path) -> dict[str, dict[int, float]]:
    """The scalars of the TensorBoard event files under `logdir`: {tag: {step: value}}.

    Read without the tensorboard package: TFRecord framing (8-byte length, 4-byte CRC, the record, 4-byte
    CRC) around tensorboardX's `Event` protobufs.
    """
    from tensorboardX.proto import event_pb2

    scalars: dict[str, dict[int, float]] = {}
    for path in sorted(Path(logdir).glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def labelled_runs(labels) -> list[tuple[int, int]]:
    """(start, end) of each run of labelled positions in one row of labels (a list or a 1-D tensor)."""
    from raylora.data.labels import IGNORE_INDEX

    values = labels.tolist() if hasattr(labels, "tolist") else list(labels)
    runs, start = [], None
    for i, label in enumerate([*values, IGNORE_INDEX]):
        if label != IGNORE_INDEX and start is None:
            start = i
        elif label == IGNORE_INDEX and start is not None:
            runs.append((start, i))
            start = None
    return runs


def final_checkpoint(result):
    """The final checkpoint of a finished run (a `ray.train.Result`), read with raylora.checkpoint."""
    from raylora import checkpoint

    with result.checkpoint.as_directory() as folder:
        return checkpoint.load(folder)


REMOTE_MODELING = '''"""A vision-language model that brings its own code, as Phi-3-vision's Hub folder
does (auto_map in config.json): loaded only through transformers' remote-code path. Its model type is
one that neither transformers nor raylora knows; the classes are Llava's under other names."""

from transformers import LlavaConfig, LlavaForConditionalGeneration


class RemoteVlmConfig(LlavaConfig):
    model_type = "raylora_remote_vlm"


class RemoteVlmForConditionalGeneration(LlavaForConditionalGeneration):
    config_class = RemoteVlmConfig
'''
# What a run on REMOTE_MODELING names, since raylora's registry has no entry for its model type.
REMOTE_PARTS = (
    "model.trust_remote_code=true",
    "model.language_model=model.language_model",
    "model.vision_tower=model.vision_tower",
    "model.aligner=model.multi_modal_projector",
)


def make_remote_code_model(llava_dir: str | Path, out: Path, legacy_names: bool = False) -> Path:
    """A copy of a tiny Llava folder (same weights) that carries its own modeling file, as a Hub folder
    with remote code does: `modeling_remote_vlm.py` and config.json's `auto_map` naming its classes.

    Its weights are saved under the names of its modules, as a remote-code model's files are. With
    `legacy_names` they keep the names transformers writes for Llava (`language_model.lm_head.weight`),
    which only Llava's own model type maps back: the remote class then lacks its lm_head.

    A folder whose code behaves like Phi-3-vision's (written for transformers 4) is
    `tests.phi3v_fixture.make_phi3v_model`."""
    from safetensors.torch import save_file
    from transformers import AutoModelForImageTextToText

    shutil.copytree(llava_dir, out)
    if not legacy_names:
        state = AutoModelForImageTextToText.from_pretrained(llava_dir).state_dict()
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    (out / "modeling_remote_vlm.py").write_text(REMOTE_MODELING)
    config = json.loads((out / "config.json").read_text())
    config.update(
        model_type="raylora_remote_vlm",
        architectures=["RemoteVlmForConditionalGeneration"],
        auto_map={
            "AutoConfig": "modeling_remote_vlm.RemoteVlmConfig",
            "AutoModelForImageTextToText": "modeling_remote_vlm.RemoteVlmForConditionalGeneration",
        },
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
