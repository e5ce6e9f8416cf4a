"""The driver's checks before a run starts, the cheap ones first: the config against the model folder, the
data, a resumed run's checkpoint, the processor and a sample of the rows (`preflight`); then the cluster
probes that need Ray: flash_attn where the workers run, and one storage seen alike by every node.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import posixpath
import secrets
from pathlib import Path

import pyarrow as pa
import ray
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raylora import hub, storage
from raylora.arch import Architecture, for_model
from raylora.config import Config, ConfigError
from raylora.data import packing
from raylora.data.batches import check_max_length
from raylora.data.formats import check_source, open_rows
from raylora.data.preflight import check_sample, check_unread_fields, checked_processor
from raylora.data.processor import check_image_caps
from raylora.ray_runtime import init_ray
from raylora.resume import check_resume, expected_trainable

log = logging.getLogger("raylora")


def preflight(cfg: Config) -> Architecture:
    """Everything that can be checked before Ray starts, the cheap checks first: model folder, architecture,
    data files, checkpoint; then the processor and chat template, and a sample of data.train read, decoded,
    rendered and tokenised as a step would (`check_sample`)."""
    model_dir = Path(hub.resolve(cfg.model.path, cfg.model.revision, config_only=True))
    if not (model_dir / "config.json").is_file():
        raise ConfigError(
            f"model.path: {cfg.model.path} has no config.json (not a Hugging Face model folder)"
        )
    arch = for_model(model_dir, cfg.model)
    why = packing.refusal(arch.model_type) if cfg.train.packing else None
    if why:
        raise ConfigError(f"train.packing is not available for {arch.model_type}: {why}; train it padded")
    check_image_caps(model_dir, cfg.data.max_pixels, cfg.data.min_pixels)
    _, num_rows = check_source(cfg.data.train, "data.train", cfg.data.format, cfg.data.image_root)
    if num_rows < cfg.train.global_batch_size:
        raise ConfigError(
            f"data.train: {num_rows} rows, fewer than train.global_batch_size ({cfg.train.global_batch_size})"
        )
    if cfg.data.eval:
        check_source(cfg.data.eval, "data.eval", cfg.data.format, cfg.data.image_root)
    if (
        cfg.fault.kill_at_steps or cfg.fault.kill_checkpoint_steps
    ) and not 0 <= cfg.fault.kill_rank < cfg.world_sizes[0]:
        raise ConfigError(
            f"fault.kill_rank {cfg.fault.kill_rank} is not a rank of {cfg.world_sizes[0]} workers"
        )
    # The run's model with LoRA on the meta device: a lora.target_modules or modules_to_save name that matches
    # nothing, or a LoRA option that the model's experts do not take, fails here; it logs what LoRA adapts.
    expected_trainable(cfg)
    check_resume(cfg)
    # The dearer checks last (a second or a few): what every rank would otherwise meet only after loading
    # the model and setting up DeepSpeed on every node.
    processor = checked_processor(cfg, model_dir)
    if cfg.data.max_length is not None:
        check_max_length(processor, cfg.data.max_length)
    if cfg.train.max_tokens_per_micro_batch is not None:
        check_max_length(processor, cfg.train.max_tokens_per_micro_batch, "train.max_tokens_per_micro_batch")
    rows = open_rows(cfg.data.train, cfg.data.format, cfg.data.image_root)
    check_unread_fields(rows)
    check_sample(cfg, rows, processor)
    # Last: on a cluster whose GPU nodes are yet to start, it waits for the first one to boot.
    check_flash_attention(cfg)
    return arch


FLASH_ATTENTION_WAIT_S = 1800.0  # an autoscaled GPU node boots and runs cluster.yaml's setup first


def flash_attn_status() -> tuple[str, str]:
    """This node's address, and why flash_attn does not import here ("" when it does)."""
    node = ray.util.get_node_ip_address()
    if importlib.util.find_spec("flash_attn") is None:
        return node, "the flash_attn package is not installed"
    try:
        import flash_attn  # noqa: F401
    except Exception as err:  # a build for another torch or CUDA fails here, not in find_spec
        return node, f"import flash_attn failed: {type(err).__name__}: {err}"
    return node, ""


# num_gpus=1 places it on a GPU node, where the workers will run, and makes an autoscaler start one
# when none is up yet (training would wait for that node anyway).
_flash_attn_on_gpu_node = ray.remote(num_cpus=0, num_gpus=1, max_retries=0)(flash_attn_status)


def flash_attention_site(attn_implementation: str, use_gpu: bool, cluster_gpus: float) -> str | None:
    """Where flash_attn must import: None for another attention kernel; "gpu_node" when training runs on
    GPUs of a cluster that has GPUs or can add them (its driver may be a CPU head); "here" otherwise,
    where the workers run in a Ray on this machine or no GPU can be asked."""
    if attn_implementation != "flash_attention_2":
        return None
    return "gpu_node" if use_gpu and cluster_gpus > 0 else "here"


def cluster_gpus() -> float:
    """The GPUs of the Ray this process is connected to, or that its autoscaler can add; 0 with no Ray."""
    if not ray.is_initialized():
        return 0.0
    gpus = ray.cluster_resources().get("GPU", 0.0)
    try:  # the autoscaler's node types, as Ray Train's own resource check reads them (a private API)
        from ray._private.state import state

        gpus = max(gpus, (state.get_max_resources_from_cluster_config() or {}).get("GPU", 0))
    except Exception:  # moved in another Ray: the GPUs that are up still count
        pass
    return gpus


def check_flash_attention(cfg: Config, timeout_s: float = FLASH_ATTENTION_WAIT_S) -> None:
    """`ConfigError` when model.attn_implementation=flash_attention_2 and flash_attn does not import where
    the workers run: on a GPU node of the cluster, by a Ray task, not on the driver (a cluster's CPU head),
    and here when the cluster has no GPUs. Joins the cluster in RAY_ADDRESS first when flash is asked for."""
    if cfg.model.attn_implementation != "flash_attention_2":
        return
    if os.environ.get("RAY_ADDRESS"):
        init_ray()  # the cluster the run trains on; run() and tune join it next anyway
    site = flash_attention_site(cfg.model.attn_implementation, cfg.scaling.use_gpu, cluster_gpus())
    if site == "here":
        if importlib.util.find_spec("flash_attn") is None:
            raise ConfigError(
                "model.attn_implementation=flash_attention_2 needs the flash_attn package (pip install "
                "flash-attn) on every node; it is not importable here. sdpa is PyTorch's own fused attention."
            )
        return
    log.info("checking flash_attn on a GPU node (an autoscaler may start one first)")
    answer = _ask_a_gpu_node(timeout_s)
    if answer is None:
        log.warning("no GPU node answered the flash_attn check within %.0f s; not checked", timeout_s)
        return
    node, why = answer
    if why:
        raise ConfigError(
            f"model.attn_implementation=flash_attention_2 needs the flash_attn package on every GPU node; "
            f"on {node}: {why}. cluster.yaml builds it on its GPU nodes with FLASH_ATTN=1 "
            f"(worker_setup_commands). sdpa is PyTorch's own fused attention."
        )


def _ask_a_gpu_node(timeout_s: float) -> tuple[str, str] | None:
    """`flash_attn_status` from a task on a GPU node; None when none answered within `timeout_s`."""
    ref = _flash_attn_on_gpu_node.remote()
    done, _ = ray.wait([ref], timeout=timeout_s)
    if not done:
        ray.cancel(ref, force=True)
        return None
    try:
        return ray.get(ref)
    except RayError:  # the node left while the check ran
        return None


STORAGE_MARKER = ".raylora-storage-check-"  # + a random token: a file the driver writes, every node reads


@ray.remote(num_cpus=0, max_retries=0)
def _read_marker(uri: str) -> tuple[str | None, str]:
    """The marker's contents as this node sees them (None if it cannot read it), and why not."""
    fs, path = storage.filesystem(uri)
    try:
        with fs.open_input_stream(path) as f:
            return f.read().decode(), ""
    except (OSError, pa.ArrowException) as err:
        return None, f"{type(err).__name__}: {err}"


def check_shared_storage(storage_path: str, timeout_s: float = 120.0) -> None:
    """`ConfigError` naming the nodes that do not see `run.storage_path` as the driver sees it.

    A local path that is not shared storage is each node's own disk: every rank would then upload its
    checkpoint files to its own node, and a restarted worker would resume from whatever its node holds.
    Ray finds that out only at the first checkpoint upload, then retries it run.max_failures times, so
    the driver writes a marker there and a task pinned to each alive node reads it back before training.
    Nodes that join later (autoscaling) are not checked. One node: nothing to compare, nothing written.
    """
    nodes = [n for n in ray.nodes() if n["Alive"]]
    if len(nodes) < 2:
        return
    token = secrets.token_hex(16)
    marker = posixpath.join(storage_path, STORAGE_MARKER + token)
    fs, path = storage.filesystem(marker)
    fs.create_dir(posixpath.dirname(path), recursive=True)
    with fs.open_output_stream(path) as f:
        f.write(token.encode())
    try:
        reads = {
            _read_marker.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
            ).remote(marker): node
            for node in nodes
        }
        done, late = ray.wait(list(reads), num_returns=len(reads), timeout=timeout_s)
        blind = []
        for ref in done:
            try:
                seen, why = ray.get(ref)
            except RayError:  # the node left while the check ran: it runs no workers either
                continue
            if seen != token:
                node = reads[ref]
                blind.append(f"{node['NodeID']} ({node['NodeManagerAddress']}: {why or 'other contents'})")
        for ref in late:
            ray.cancel(ref, force=True)
            log.warning(
                "node %s did not answer the shared-storage check within %.0f s; not checked",
                reads[ref]["NodeID"],
                timeout_s,
            )
    finally:
        fs.delete_file(path)
    if blind:
        raise ConfigError(
            f"run.storage_path: {storage_path} is not the same storage on every node of the cluster: "
            f"node(s) {', '.join(blind)} do not see the file the driver wrote there. Each node would keep "
            f"its own checkpoints and a restarted worker would resume from its node's copy. Use shared "
            f"storage that every node mounts at this path (NFS) or a URI (s3://, gs://)."
        )
