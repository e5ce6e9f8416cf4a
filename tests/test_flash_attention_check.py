"""Where the driver checks flash_attn: on a GPU node of the cluster (a Ray task), since on a cluster the
driver runs on the CPU head; on this machine when no GPU can be asked. No GPU here: the decision, the
fallback and the task's placement are checked; the task's answer is stood in for."""

from __future__ import annotations

import importlib.util

import pytest

from raylora import preflight
from raylora.config import ConfigError
from tests.support import tiny_run_config

needs_no_flash_attn = pytest.mark.skipif(
    importlib.util.find_spec("flash_attn") is not None, reason="flash_attn is installed here"
)


def _flash_cfg(tmp_path):
    flash = ["model.attn_implementation=flash_attention_2", "scaling.use_gpu=true"]
    return tiny_run_config(tmp_path, tmp_path / "t.parquet", tmp_path, "flash", *flash)


@pytest.mark.parametrize(
    "attn, use_gpu, cluster_gpus, site",
    [
        ("sdpa", True, 16, None),  # nothing to check
        ("eager", False, 0, None),
        ("flash_attention_2", True, 16, "gpu_node"),  # a cluster with GPU nodes: ask one of them
        ("flash_attention_2", True, 0.5, "gpu_node"),
        ("flash_attention_2", True, 0, "here"),  # no GPU in the cluster (or no Ray yet): this machine
        ("flash_attention_2", False, 16, "here"),  # (config refuses it; the workers would be CPU ones)
    ],
)
def test_where_flash_attn_is_checked(attn, use_gpu, cluster_gpus, site):
    assert preflight.flash_attention_site(attn, use_gpu, cluster_gpus) == site


def test_no_ray_means_no_cluster_gpus(monkeypatch):
    # a process not connected to any Ray (whether or not an earlier test module left the shared one up)
    monkeypatch.setattr(preflight.ray, "is_initialized", lambda: False)
    assert preflight.cluster_gpus() == 0


def test_the_task_asks_for_a_gpu_and_no_retry():
    """num_gpus=1 is what puts it on a GPU node (the head has none) and makes an autoscaler start one."""
    options = preflight._flash_attn_on_gpu_node._default_options
    assert options["num_gpus"] == 1 and options["num_cpus"] == 0 and options["max_retries"] == 0


@needs_no_flash_attn
def test_the_task_body_reports_a_missing_package():
    node, why = preflight.flash_attn_status()  # what the task returns, run here
    assert node and why == "the flash_attn package is not installed"


@needs_no_flash_attn
def test_without_gpus_the_check_is_local(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    asked = []
    monkeypatch.setattr(preflight, "_ask_a_gpu_node", lambda timeout_s: asked.append(timeout_s))
    with pytest.raises(ConfigError, match="needs the flash_attn package"):
        preflight.check_flash_attention(_flash_cfg(tmp_path))
    assert asked == []  # no Ray task without GPUs to run it on


def test_with_gpus_the_answer_of_a_gpu_node_decides(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(preflight, "cluster_gpus", lambda: 16.0)
    cfg = _flash_cfg(tmp_path)
    answers = {"missing": ("10.0.3.7", "the flash_attn package is not installed"), "ok": ("10.0.3.7", "")}
    monkeypatch.setattr(preflight, "_ask_a_gpu_node", lambda timeout_s: answers["missing"])
    with pytest.raises(
        ConfigError, match=r"on every GPU node; on 10\.0\.3\.7: the flash_attn package is not"
    ):
        preflight.check_flash_attention(cfg)
    # installed on the GPU nodes: passes, whatever the driver's own machine has
    monkeypatch.setattr(preflight, "_ask_a_gpu_node", lambda timeout_s: answers["ok"])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    preflight.check_flash_attention(cfg)
    # no GPU node came up in time: not checked, said so, training goes on to wait for the nodes itself
    monkeypatch.setattr(preflight, "_ask_a_gpu_node", lambda timeout_s: None)
    with caplog.at_level("WARNING", logger="raylora"):
        preflight.check_flash_attention(cfg, timeout_s=5)
    assert "no GPU node answered the flash_attn check within 5 s" in caplog.text


def test_other_attention_kernels_ask_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")  # would fail to connect if it tried
    monkeypatch.setattr(preflight, "_ask_a_gpu_node", lambda timeout_s: pytest.fail("asked a GPU node"))
    cfg = tiny_run_config(tmp_path, tmp_path / "t.parquet", tmp_path, "sdpa", "scaling.use_gpu=true")
    preflight.check_flash_attention(cfg)


def test_a_job_joins_its_cluster_before_counting_gpus(tmp_path, monkeypatch):
    """Inside `ray job submit`, RAY_ADDRESS names the cluster: with no Ray joined yet, the driver (the CPU
    head) would count no GPUs and check its own, GPU-less, Python instead."""
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    events = []
    monkeypatch.setattr(preflight, "init_ray", lambda: events.append("joined"))
    monkeypatch.setattr(preflight, "cluster_gpus", lambda: events.append("counted") or 16.0)
    monkeypatch.setattr(preflight, "_ask_a_gpu_node", lambda timeout_s: events.append("asked") or ("n", ""))
    preflight.check_flash_attention(_flash_cfg(tmp_path))
    assert events == ["joined", "counted", "asked"]
