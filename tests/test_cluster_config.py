"""cluster.yaml is a valid Ray cluster-launcher config, checked offline against Ray's own schema."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


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
    opened = [p["FromPort"] for p in raw["provider"]["security_group"]["IpPermissions"]]
    assert opened == [22]
