"""cluster.yaml is a valid Ray cluster-launcher config, checked offline against Ray's own schema and
against what raylora asks of it: SSH open only to the user's addresses, pinned models, loud setup."""

from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SECURITY_GROUP_PLACEHOLDER = "SET_SECURITY_GROUP_ID"


def check_cluster(raw: dict) -> None:
    """Ray's schema check, then raylora's: every node in a security group of the user's own.

    A group that Ray's AWS provider creates (`provider.security_group`) always gets Ray's default rule,
    SSH from 0.0.0.0/0, beside the rules the config gives; only a group made outside Ray and named in
    each node type's SecurityGroupIds keeps SSH to the user's CIDR.
    """
    from ray.autoscaler._private.commands import prepare_config
    from ray.autoscaler._private.util import validate_config

    validate_config(prepare_config(copy.deepcopy(raw)))  # raises jsonschema.ValidationError
    if "security_group" in raw["provider"]:
        raise ValueError("provider.security_group: a group Ray creates also opens SSH to 0.0.0.0/0")
    for name, node_type in raw["available_node_types"].items():
        for group in node_type["node_config"].get("SecurityGroupIds") or [None]:
            if not re.fullmatch(r"sg-[0-9a-f]{8,17}", str(group)):
                raise ValueError(
                    f"available_node_types.{name}.node_config.SecurityGroupIds: {group} is not a security "
                    "group id; make the group and set it as the top of cluster.yaml says"
                )


def test_cluster_yaml_passes_rays_schema():
    from ray.autoscaler._private.commands import prepare_config
    from ray.autoscaler._private.util import validate_config

    raw = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    validate_config(prepare_config(raw))  # raises jsonschema.ValidationError when it is not


def test_cluster_yaml_shape():
    raw = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    types = raw["available_node_types"]
    head = types[raw["head_node_type"]]
    gpu_types = [t for t in types.values() if t.get("resources", {}).get("GPU", 0) > 0]
    assert head["resources"].get("GPU", 0) == 0 and gpu_types
    assert any("pip install" in c and "raylora" in c for c in raw["setup_commands"])
    # the dashboard is not exposed: it binds to loopback and only SSH is open to the world
    assert "--dashboard-host=127.0.0.1" in " ".join(raw["head_start_ray_commands"])
    assert "security_group" not in raw["provider"]


def test_cluster_yaml_fails_until_its_security_group_is_set():
    text = (ROOT / "cluster.yaml").read_text()
    with pytest.raises(ValueError, match=SECURITY_GROUP_PLACEHOLDER):
        check_cluster(yaml.safe_load(text))
    check_cluster(yaml.safe_load(text.replace(SECURITY_GROUP_PLACEHOLDER, "sg-0123456789abcdef0")))
    # the group the header makes opens SSH to the user's CIDR only, and nothing in the file to everyone
    assert '--protocol tcp --port 22 --cidr "$SSH_CIDR"' in text
    assert "0.0.0.0/0" not in text


def test_setup_downloads_pinned_models_or_fails():
    raw = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    commands = raw["setup_commands"]
    assert not any("|| true" in c for c in commands)  # a failed setup command fails `ray up`
    downloads = [c for c in commands if " download " in c]
    assert downloads and all(c.startswith("~/raylora-env/bin/hf download ") for c in downloads)
    local_dirs = set()
    for command in downloads:
        assert re.search(r" --revision [0-9a-f]{40}( |$)", command), command
        local_dirs.add(re.search(r" --local-dir (\S+)", command).group(1))
    assert any("mkdir -p /mnt/models" in c and "chown" in c for c in commands)  # the ubuntu user writes there
    for job in ("llava-1.5-7b.yaml", "qwen2-vl-7b.yaml"):  # the shipped 7B jobs train what setup downloads
        assert yaml.safe_load((ROOT / "jobs" / job).read_text())["model"]["path"] in local_dirs


def test_spot_gpu_type_beside_the_on_demand_one():
    raw = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    types = raw["available_node_types"]
    spot = {n: t for n, t in types.items() if t["node_config"].get("InstanceMarketOptions")}
    on_demand = {n: t for n, t in types.items() if n not in spot and t["resources"].get("GPU", 0) > 0}
    assert len(spot) == 1 and on_demand
    (name, spot_type), gpu = next(iter(spot.items())), next(iter(on_demand.values()))
    assert spot_type["node_config"].pop("InstanceMarketOptions") == {"MarketType": "spot"}
    # the same machine, image, disks and role: only the market differs
    assert spot_type["node_config"] == gpu["node_config"] and spot_type["resources"] == gpu["resources"]
    assert spot_type["min_workers"] == 0
    # AWS's interruption notice reaches Ray Train only as a drain: every worker node starts the watcher
    script = ROOT / "jobs" / "spot_drain.sh"
    starts = " ".join(raw["worker_start_ray_commands"])
    assert f"jobs/{script.name} $RAY_HEAD_IP:6379" in starts and "< /dev/null" in starts
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "--reason DRAIN_NODE_REASON_PREEMPTION" in text and "spot/instance-action" in text
    assert name in (ROOT / "cluster.yaml").read_text().split("cluster_name:")[0]  # the header explains it
