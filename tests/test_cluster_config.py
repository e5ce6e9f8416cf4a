"""cluster.yaml is a valid Ray cluster-launcher config, checked offline against Ray's own schema and
against what raylora asks of it: SSH open only to the user's addresses, pinned models, loud setup, the
CUDA torch of the image it names, EFA on every GPU node, one zone. jobs/kuberay-rayjob.yaml runs the same
job on Kubernetes."""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
# What the top of cluster.yaml tells the user to set, with values of the right shape.
PLACEHOLDERS = {
    "SET_SECURITY_GROUP_ID": "sg-0123456789abcdef0",
    "SET_HEAD_SUBNET_ID": "subnet-0123456789abcdef0",
    "SET_GPU_SUBNET_ID": "subnet-0fedcba9876543210",
    "SET_AMI_ID": "ami-0123456789abcdef0",
}
# Network cards per instance type (AWS's instance type specifications): one EFA interface on each.
NETWORK_CARDS = {"p4d.24xlarge": 4, "p4de.24xlarge": 4, "p5.48xlarge": 32}
EFA_TYPES = {"efa", "efa-only"}


def _raw() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


def _header() -> str:
    return (ROOT / "cluster.yaml").read_text().split("cluster_name:")[0]


def _gpu_types(raw: dict) -> dict:
    return {n: t for n, t in raw["available_node_types"].items() if t["resources"].get("GPU", 0) > 0}


def _image() -> dict:
    """The driver and CUDA that the top of cluster.yaml states for its image."""
    m = re.search(r"NVIDIA driver (\d+)\.[\d.]+, CUDA (\d+)\.(\d+) \((/usr/local/cuda-[\d.]+)", _header())
    assert m, "cluster.yaml's header names its image's NVIDIA driver and CUDA"
    return {"driver": int(m[1]), "cuda": (int(m[2]), int(m[3])), "cuda_home": m[4]}


def _one(commands: list[str], needle: str) -> str:
    found = [c for c in commands if needle in c]
    assert len(found) == 1, f"one command with {needle!r}, got {found}"
    return found[0]


def _groups_and_subnets(node_config: dict) -> tuple[list, list]:
    interfaces = node_config.get("NetworkInterfaces") or []
    groups = node_config.get("SecurityGroupIds") or [g for ni in interfaces for g in ni.get("Groups", [])]
    subnets = node_config.get("SubnetIds") or [ni.get("SubnetId") for ni in interfaces]
    return groups, subnets


def check_cluster(raw: dict) -> None:
    """Ray's schema check, then raylora's: every node in a security group of the user's own, in subnets
    and an image that are real ids.

    A group that Ray's AWS provider creates (`provider.security_group`) always gets Ray's default rule,
    SSH from 0.0.0.0/0, beside the rules the config gives; only a group made outside Ray and named in
    each node type's SecurityGroupIds (or its network interfaces' Groups) keeps SSH to the user's CIDR.
    """
    from ray.autoscaler._private.aws.config import _configure_subnets_and_groups_from_network_interfaces
    from ray.autoscaler._private.commands import prepare_config
    from ray.autoscaler._private.util import validate_config

    validate_config(prepare_config(copy.deepcopy(raw)))  # raises jsonschema.ValidationError
    if "security_group" in raw["provider"]:
        raise ValueError("provider.security_group: a group Ray creates also opens SSH to 0.0.0.0/0")
    for name, node_type in raw["available_node_types"].items():
        node_config = node_type["node_config"]
        if "NetworkInterfaces" in node_config:
            # what Ray's AWS bootstrap does offline: refuses subnets or groups beside the interfaces
            _configure_subnets_and_groups_from_network_interfaces(node_config)
        groups, subnets = _groups_and_subnets(node_config)
        for kind, values, pattern in (
            ("security group", groups or [None], r"sg-[0-9a-f]{8,17}"),
            ("subnet", subnets or [None], r"subnet-[0-9a-f]{8,17}"),
            ("image", [node_config.get("ImageId")], r"ami-[0-9a-f]{8,17}"),
        ):
            for value in values:
                if not re.fullmatch(pattern, str(value)):
                    raise ValueError(
                        f"available_node_types.{name}.node_config: {value} is not a {kind} id; make it "
                        "and set it as the top of cluster.yaml says"
                    )


def _filled(text: str, keep: str | None = None) -> dict:
    for placeholder, value in PLACEHOLDERS.items():
        if placeholder != keep:
            text = text.replace(placeholder, value)
    return yaml.safe_load(text)


def test_cluster_yaml_passes_rays_schema():
    from ray.autoscaler._private.commands import prepare_config
    from ray.autoscaler._private.util import validate_config

    validate_config(prepare_config(_raw()))  # raises jsonschema.ValidationError when it is not


def test_cluster_yaml_shape():
    raw = _raw()
    types = raw["available_node_types"]
    head = types[raw["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0 and _gpu_types(raw)
    assert set(types) - {raw["head_node_type"]} == set(_gpu_types(raw))  # worker_setup_commands: GPU only
    assert any("pip install" in c and "raylora" in c for c in raw["setup_commands"])
    # the dashboard is not exposed: it binds to loopback and only SSH is open to the world
    assert "--dashboard-host=127.0.0.1" in " ".join(raw["head_start_ray_commands"])
    assert "security_group" not in raw["provider"]


def test_cluster_yaml_fails_until_its_placeholders_are_set():
    text = (ROOT / "cluster.yaml").read_text()
    for placeholder in PLACEHOLDERS:
        assert placeholder in _header(), f"the top of cluster.yaml says how to set {placeholder}"
        with pytest.raises(ValueError, match=placeholder):
            check_cluster(_filled(text, keep=placeholder))
    check_cluster(_filled(text))
    # the group the header makes opens SSH to the user's CIDR only, and nothing in the file to everyone:
    # the one route to anywhere is the GPU subnet's way out, through its NAT gateway
    assert '--protocol tcp --port 22 --cidr "$SSH_CIDR"' in text
    ingress = [line for line in text.splitlines() if re.search(r"--cidr\s", line)]
    assert ingress == [line for line in ingress if '--cidr "$SSH_CIDR"' in line]
    for line in text.splitlines():
        if "0.0.0.0/0" in line:
            assert "create-route" in line and "--nat-gateway-id" in line, line


def test_setup_downloads_pinned_models_or_fails():
    raw = _raw()
    commands = raw["setup_commands"]
    every = commands + raw["worker_setup_commands"] + raw["worker_start_ray_commands"]
    assert not any("|| true" in c for c in every)  # a failed setup command fails `ray up`
    downloads = [c for c in commands if " download " in c]
    assert downloads and all(c.startswith("~/raylora-env/bin/hf download ") for c in downloads)
    local_dirs = set()
    for command in downloads:
        assert re.search(r" --revision [0-9a-f]{40}( |$)", command), command
        local_dirs.add(re.search(r" --local-dir (\S+)", command).group(1))
    assert any("mkdir -p /mnt/models" in c and "chown" in c for c in commands)  # the ubuntu user writes there
    # the shipped GPU jobs train what setup downloads
    for job in ("llava-1.5-7b.yaml", "qwen2-vl-7b.yaml", "qwen3-vl-8b.yaml", "qwen3-vl-30b-a3b.yaml"):
        assert yaml.safe_load((ROOT / "jobs" / job).read_text())["model"]["path"] in local_dirs


def test_torch_is_the_cuda_build_of_the_image_it_names():
    raw, image = _raw(), _image()
    pin = re.search(r'"torch==([^"]+)"', (ROOT / "pyproject.toml").read_text())[1]
    vision_pin = re.search(r'"torchvision==([^"]+)"', (ROOT / "pyproject.toml").read_text())[1]
    commands = raw["setup_commands"]
    torch_installs = [c for c in commands if "pip install" in c and re.search(r"\btorch\b", c)]
    assert len(torch_installs) == 1, torch_installs
    install = torch_installs[0]
    major, minor = image["cuda"]
    # exactly raylora's version, from PyTorch's index for the image's CUDA: never PyPI's default build
    assert re.search(rf"\btorch=={re.escape(pin)}(\s|$)", install), install
    # torchvision from the same index: its C++ ops load only beside the torch build they were made for
    assert re.search(rf"\btorchvision=={re.escape(vision_pin)}(\s|$)", install), install
    assert f"--index-url https://download.pytorch.org/whl/cu{major}{minor}" in install, install
    # before raylora's own install, which would otherwise take torch from PyPI
    assert commands.index(install) < commands.index(
        _one(commands, 'pip install -q -e "$HOME/raylora[qlora]"')
    )
    assert image["driver"] >= (580 if major >= 13 else 525)  # CUDA 13 builds need an R580+ driver
    # the toolkit that DeepSpeed's JIT ops and flash-attn's build use is the same CUDA
    assert image["cuda_home"] == f"/usr/local/cuda-{major}.{minor}"
    for command in (_one(raw["worker_setup_commands"], "raylora-efa.env"), _flash_command(raw)):
        assert f"CUDA_HOME={image['cuda_home']} " in command, command


def test_every_gpu_node_type_has_efa_on_every_network_card():
    raw = _raw()
    gpu_types = _gpu_types(raw)
    instance_types = {t["node_config"]["InstanceType"] for t in gpu_types.values()}
    assert "p5.48xlarge" in instance_types  # H100 80 GB
    assert {"p4d.24xlarge", "p4de.24xlarge"} <= instance_types  # A100 40 GB and 80 GB
    for name, node_type in gpu_types.items():
        node_config = node_type["node_config"]
        cards = NETWORK_CARDS[node_config["InstanceType"]]
        interfaces = node_config["NetworkInterfaces"]
        assert not {"SubnetIds", "SubnetId", "SecurityGroupIds"} & set(node_config), name
        # one ENA interface, the primary (its IP address), and one EFA interface on every card
        ena = [ni for ni in interfaces if ni["InterfaceType"] == "interface"]
        assert [(ni["NetworkCardIndex"], ni["DeviceIndex"]) for ni in ena] == [(0, 0)], name
        efa = [ni for ni in interfaces if ni["InterfaceType"] in EFA_TYPES]
        assert len(efa) + len(ena) == len(interfaces), name
        assert sorted(ni["NetworkCardIndex"] for ni in efa) == list(range(cards)), name
        assert len({(ni["NetworkCardIndex"], ni["DeviceIndex"]) for ni in interfaces}) == len(interfaces)
        assert len({ni["SubnetId"] for ni in interfaces}) == 1, name
    # the nodes start Ray with the EFA environment that worker setup wrote
    start = _one(raw["worker_start_ray_commands"], "ray start")
    assert start.index(". ~/raylora-efa.env") < start.index("ray start") and "set -a" in start


def _efa_setup_in(tmp_path: Path, plugin: bool, efa_device: bool) -> subprocess.CompletedProcess:
    """Worker setup's EFA command, run with /opt and ~ moved under tmp_path."""
    command = _one(_raw()["worker_setup_commands"], "raylora-efa.env")
    command = command.replace("/opt/", f"{tmp_path}/opt/").replace("~/", f"{tmp_path}/home/")
    (tmp_path / "home").mkdir(parents=True, exist_ok=True)
    if plugin:
        lib = tmp_path / "opt/amazon/ofi-nccl/lib"
        lib.mkdir(parents=True, exist_ok=True)
        (lib / "libnccl-net-ofi.so").touch()
    fi_info = tmp_path / "opt/amazon/efa/bin/fi_info"
    fi_info.parent.mkdir(parents=True, exist_ok=True)
    fi_info.write_text(f"#!/bin/sh\nexit {0 if efa_device else 1}\n")
    fi_info.chmod(0o755)
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, env={"PATH": os.defpath})


def test_efa_setup_fails_without_the_plugin_or_the_device(tmp_path):
    no_plugin = _efa_setup_in(tmp_path / "a", plugin=False, efa_device=True)
    assert no_plugin.returncode != 0 and "aws-ofi-nccl" in no_plugin.stderr
    no_device = _efa_setup_in(tmp_path / "b", plugin=True, efa_device=False)
    assert no_device.returncode != 0 and "EFA" in no_device.stderr
    ok = _efa_setup_in(tmp_path / "c", plugin=True, efa_device=True)
    assert ok.returncode == 0, ok.stderr
    # what `ray start` then passes to every Ray worker
    env_file = tmp_path / "c/home/raylora-efa.env"
    shown = subprocess.run(
        ["bash", "-c", f"set -a && . {env_file} && set +a && env"], capture_output=True, text=True, env={}
    ).stdout.splitlines()
    env = dict(line.split("=", 1) for line in shown)
    assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert env["NCCL_SOCKET_IFNAME"] == "^lo,docker"
    assert env["LD_LIBRARY_PATH"].split(":")[0] == str(tmp_path / "c/opt/amazon/ofi-nccl/lib")


def test_one_zone_and_a_cluster_placement_group():
    raw = _raw()
    provider = raw["provider"]
    zones = [z.strip() for z in str(provider["availability_zone"]).split(",")]
    assert len(zones) == 1 and zones[0].startswith(provider["region"]), zones
    groups = {t["node_config"]["Placement"]["GroupName"] for t in _gpu_types(raw).values()}
    assert len(groups) == 1, groups
    (group,) = groups
    assert re.search(rf"create-placement-group .*--group-name {group} --strategy cluster", _header())
    # the GPU nodes have private addresses (several interfaces get no public one); the head is reached
    # on its public address, in the one subnet it is given
    assert provider["use_internal_ips"] is True and provider["use_external_head_ip"] is True
    head = raw["available_node_types"][raw["head_node_type"]]["node_config"]
    assert len(head["SubnetIds"]) == 1


def test_one_gpu_node_type_enabled_at_a_time():
    """The autoscaler may launch any type that fits a demand: two enabled could mix A100s and H100s."""
    enabled = [n for n, t in _gpu_types(_raw()).items() if t["max_workers"] > 0]
    assert len(enabled) == 1, enabled
    assert all(n in _header() for n in _gpu_types(_raw())), "the header explains each GPU type"


def test_checkpoints_stage_on_the_nvme_instance_store():
    raw, header = _raw(), _header()
    nvme = re.search(r"NVMe instance store mounted at (\S+?)[.,]?\s", header)[1]
    staging = re.search(r"run\.local_dir=(\S+)", header)[1]
    assert staging.startswith(nvme + "/")
    setup = _one(raw["worker_setup_commands"], f"mkdir -p {staging}")
    # on the mounted instance store (not the root volume under it), writable by the ubuntu user
    assert setup.startswith(f"mountpoint -q {nvme} &&") and f'chown "$(id -u):$(id -g)" {staging}' in setup
    from raylora import config

    if "local_dir" in {f.name for f in dataclasses.fields(config.RunConfig)}:  # the key jobs are told to set
        cfg = config.load(ROOT / "jobs" / "llava-1.5-7b.yaml", [f"run.local_dir={staging}"])
        assert str(cfg.run.local_dir) == staging


def _flash_command(raw: dict) -> str:
    return _one(raw["worker_setup_commands"], "flash-attn")


def _run_flash_setup(tmp_path: Path, command: str) -> list[str]:
    """The flash-attn command with a stand-in pip and python; the calls they got."""
    env_bin = tmp_path / "raylora-env/bin"
    env_bin.mkdir(parents=True)
    calls = tmp_path / "calls"
    for tool in ("pip", "python"):
        (env_bin / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> {calls}\n')
        (env_bin / tool).chmod(0o755)
    command = command.replace("~/raylora-env/", f"{tmp_path}/raylora-env/")
    subprocess.run(["bash", "-c", command], check=True, env={"PATH": os.defpath})
    return calls.read_text().splitlines() if calls.exists() else []


def test_flash_attn_is_installed_on_the_gpu_nodes_only_when_asked(tmp_path):
    raw = _raw()
    command = _flash_command(raw)
    assert command.startswith("FLASH_ATTN=0;")  # off until the user asks
    assert _run_flash_setup(tmp_path / "off", command) == []
    calls = _run_flash_setup(tmp_path / "on", command.replace("FLASH_ATTN=0;", "FLASH_ATTN=1;", 1))
    build = [c for c in calls if "flash-attn" in c]
    assert len(build) == 1, calls
    # pinned, built against the torch already there (no build isolation, and pip must not touch torch)
    assert re.search(r"flash-attn==\d+\.\d+\.\d+", build[0]) and "--no-build-isolation" in build[0]
    assert "--no-deps" in build[0] and calls[-1] == "python -c import flash_attn"
    archs = re.search(r"FLASH_ATTN_CUDA_ARCHS='([\d;]+)'", command)[1].split(";")
    assert {"80", "90"} <= set(archs)  # A100 and H100, the GPU node types' cards
    assert "flash-attn" not in " ".join(raw["setup_commands"] + raw["head_setup_commands"])  # not on the head


def test_spot_gpu_type_beside_the_on_demand_one():
    raw = _raw()
    types = raw["available_node_types"]
    spot = {n: t for n, t in types.items() if t["node_config"].get("InstanceMarketOptions")}
    assert len(spot) == 1
    ((name, spot_type),) = spot.items()
    on_demand = [
        t
        for n, t in types.items()
        if n not in spot and t["node_config"]["InstanceType"] == spot_type["node_config"]["InstanceType"]
    ]
    assert len(on_demand) == 1
    gpu = on_demand[0]
    spot_config = dict(spot_type["node_config"])
    assert spot_config.pop("InstanceMarketOptions") == {"MarketType": "spot"}
    # the same machine, image, disks, network and role: only the market differs
    assert spot_config == gpu["node_config"] and spot_type["resources"] == gpu["resources"]
    assert spot_type["min_workers"] == 0
    # AWS's interruption notice reaches Ray Train only as a drain: every worker node starts the watcher
    script = ROOT / "jobs" / "spot_drain.sh"
    starts = " ".join(raw["worker_start_ray_commands"])
    assert f"jobs/{script.name} $RAY_HEAD_IP:6379" in starts and "< /dev/null" in starts
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "--reason DRAIN_NODE_REASON_PREEMPTION" in text and "spot/instance-action" in text
    assert name in _header()  # the header explains it


# jobs/kuberay-rayjob.yaml


def _rayjob() -> dict:
    return yaml.safe_load((ROOT / "jobs" / "kuberay-rayjob.yaml").read_text())


def _comment_above(text: str, line_start: str) -> str:
    """The comment lines right above the line that starts with `line_start`."""
    lines = text.splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.startswith(line_start)]
    comment = []
    while at > 0 and lines[at - 1].lstrip().startswith("#"):
        at -= 1
        comment.insert(0, lines[at].lstrip("# "))
    return " ".join(comment)


def _containers(group: dict) -> list[dict]:
    return group["template"]["spec"]["containers"]


def test_kuberay_rayjob_structure():
    job = _rayjob()
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    assert spec["submissionMode"] in {"K8sJobMode", "HTTPMode"}  # KubeRay submits the entrypoint
    assert spec["shutdownAfterJobFinishes"] is True
    # the runtime env `ray job submit --runtime-env jobs/runtime_env.yaml` uses, the same
    runtime_env = yaml.safe_load((ROOT / "jobs" / "runtime_env.yaml").read_text())
    assert yaml.safe_load(spec["runtimeEnvYAML"]) == runtime_env
    # retries of the whole job are documented: each is a new cluster that resumes from object storage
    assert isinstance(spec["backoffLimit"], int) and spec["backoffLimit"] >= 1
    comment = _comment_above((ROOT / "jobs" / "kuberay-rayjob.yaml").read_text(), "  backoffLimit:")
    assert "NEW RayCluster" in comment and "resumes from the latest" in comment and "run.name" in comment
    cluster = spec["rayClusterSpec"]
    head, workers = cluster["headGroupSpec"], cluster["workerGroupSpecs"]
    assert all("nvidia.com/gpu" not in str(c.get("resources")) for c in _containers(head))
    gpu_groups = [
        g for g in workers if any("nvidia.com/gpu" in c["resources"]["limits"] for c in _containers(g))
    ]
    assert len(gpu_groups) == 1
    for container in _containers(gpu_groups[0]):
        resources = container["resources"]
        assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] > 0


def test_kuberay_rayjob_runs_the_shipped_job_on_object_storage():
    """The entrypoint is the README's `ray job submit` job, and its run resumes across retries."""
    from raylora import config

    spec = _rayjob()["spec"]
    argv = shlex.split(spec["entrypoint"])
    assert argv[0] == "python"
    # the image's copy of the repository (the build recipe at the top of the file puts it there)
    text = (ROOT / "jobs" / "kuberay-rayjob.yaml").read_text()
    repo = re.search(r"COPY --chown=ray jobs (\S+)/jobs", text)[1]
    assert f"COPY --chown=ray raylora {repo}/raylora" in text
    script, job = (Path(a).relative_to(repo) for a in argv[1:3])
    assert script == Path("jobs/train.py") and (ROOT / job).is_file()
    cfg = config.load(ROOT / job, argv[3:])
    assert cfg.run.storage_path.startswith("s3://")
    # a fixed run name: a retry on a new cluster finds this run's checkpoints and resumes
    assert cfg.run.name == yaml.safe_load((ROOT / job).read_text())["run"]["name"]
    # the model at the commit cluster.yaml downloads for that job
    download = _one(
        _raw()["setup_commands"], f"--local-dir {yaml.safe_load((ROOT / job).read_text())['model']['path']}"
    )
    assert f"hf download {cfg.model.path} --revision {cfg.model.revision} " in download
    # one Ray Train worker per GPU of the worker group
    (group,) = spec["rayClusterSpec"]["workerGroupSpecs"]
    gpus = sum(c["resources"]["limits"]["nvidia.com/gpu"] for c in _containers(group))
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"]
    assert cfg.scaling.use_gpu and cfg.scaling.num_workers == group["replicas"] * gpus
    cpus = min(float(c["resources"]["limits"]["cpu"]) for c in _containers(group))
    assert cpus >= gpus * cfg.scaling.cpus_per_worker


def test_kuberay_image_is_rays_own_at_raylora_ray_version():
    import ray

    job, text = _rayjob(), (ROOT / "jobs" / "kuberay-rayjob.yaml").read_text()
    cluster = job["spec"]["rayClusterSpec"]
    base = re.search(r"FROM rayproject/ray:(\d+\.\d+\.\d+)-py(\d)(\d+)-gpu", text)
    assert base and cluster["rayVersion"] == base[1] == ray.__version__
    pin = re.search(r'"ray\[[^]]*\]>=([\d.]+),<([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert pin[1] <= base[1] < pin[2]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    images = {c["image"] for g in groups for c in _containers(g)}
    assert len(images) == 1  # one image: the driver and the workers unpickle the same code
    torch_pin = re.search(r'"torch==([^"]+)"', (ROOT / "pyproject.toml").read_text())[1]
    vision_pin = re.search(r'"torchvision==([^"]+)"', (ROOT / "pyproject.toml").read_text())[1]
    assert re.search(
        rf"torch=={re.escape(torch_pin)} torchvision=={re.escape(vision_pin)} \\\n#\s+"
        rf"--index-url https://download\.pytorch\.org/whl/cu\d+",
        text,
    )
