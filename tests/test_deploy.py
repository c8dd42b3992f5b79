"""The deployment files: they validate offline against their schemas, agree with the CLI, and the shapes they
describe work as processes on loopback (no Docker engine or cluster runs here).

- Compose files: the compose-specification schema (vendored by check-jsonschema).
- Kubernetes: every base manifest and both rendered overlays (``kubectl kustomize``) against the Kubernetes
  schemas kubernetes-validate ships, strictly (unknown fields fail).
- Commands, ports, probes, health checks and environment variables are read from the files and checked against
  ``splitserve``'s own argument parser and the services' names.
- Three frontends and two cores started with the manifests' arguments: frontends find the cores through a name
  with two addresses, as through a headless Service; a client spreads calls over the frontends; the answers
  equal the in-process engine's; both cores take load; SIGTERM drains a core while the other takes new calls.
  The frontends run with torch unimportable, as in their image.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

from splitserve.base import envs
from splitserve.entrypoints import stack
from splitserve.entrypoints.cli import build_parser
from splitserve.stubs.frontend.v1 import generation_pb2 as api
from splitserve.stubs.frontend.v1 import generation_pb2_grpc as api_grpc
from tests.metrics_helpers import sample, scrape

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
COMPOSE_FILES = [ROOT / "docker-compose.yml", ROOT / "docker-compose.gpu.yml", ROOT / "docker-compose.tls.yml"]
ENGINE_CORE_GRPC_SERVICE, GENERATION_GRPC_SERVICE = stack.ENGINE_CORE_GRPC_SERVICE, stack.GENERATION_GRPC_SERVICE
K8S_VERSION = "1.33.0"
# Variables the deployment files may set: ours (splitserve/base/envs.py), the standard OpenTelemetry ones, and the
# Hugging Face hub's.
ENV_PATTERN = re.compile(r"^(SPLITSERVE_[A-Z_]+|OTEL_[A-Z_]+|HF_[A-Z_]+)$")


def splitserve_envs() -> set[str]:
    return set(re.findall(r"SPLITSERVE_[A-Z_]+", Path(envs.__file__).read_text()))


def load_yaml_docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def base_manifests() -> list[dict]:
    kustomization = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    return [doc for name in kustomization["resources"] for doc in load_yaml_docs(K8S / "base" / name)]


def rendered(overlay: str) -> list[dict]:
    return kustomize(K8S / "overlays" / overlay)


def kustomize(directory: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (for `kubectl kustomize`) is not installed")
    out = subprocess.run([kubectl, "kustomize", str(directory)], check=True, capture_output=True)
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def rendered_with_tls(overlay: str, tmp_path: Path) -> list[dict]:
    """An overlay with the TLS component, as a user's own kustomization would combine them (kustomize takes
    relative paths only)."""
    relative = Path(os.path.relpath(K8S, tmp_path))
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [str(relative / "overlays" / overlay)],
        "components": [str(relative / "components" / "tls")],
    }
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return kustomize(tmp_path)


def by_kind(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def container(docs: list[dict], kind: str, name: str) -> dict:
    (c,) = by_kind(docs, kind, name)["spec"]["template"]["spec"]["containers"]
    return c


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def parse(args: list[str]):
    """``splitserve``'s parser on ``args`` (SystemExit on an unknown flag fails the test)."""
    return build_parser().parse_args(args)


# --- schemas ------------------------------------------------------------------------------------------------


def test_compose_files_match_the_compose_specification():
    result = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", *map(str, COMPOSE_FILES)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_compose_check_can_fail(tmp_path):
    broken = yaml.safe_load(COMPOSE_FILES[0].read_text())
    broken["services"]["core"]["healthcheck"]["interval"] = ["5s"]  # must be a string
    path = tmp_path / "compose.yml"
    path.write_text(yaml.safe_dump(broken))
    result = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
    )
    assert result.returncode != 0


@pytest.mark.parametrize("source", ["base", "cpu", "gpu"])
def test_kubernetes_manifests_validate(source):
    import kubernetes_validate

    docs = base_manifests() if source == "base" else rendered(source)
    assert {d["kind"] for d in docs} >= {
        "ConfigMap",
        "Service",
        "StatefulSet",
        "Deployment",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "NetworkPolicy",
    }
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises on any schema error


def test_the_kubernetes_check_can_fail():
    import kubernetes_validate

    statefulset = by_kind(base_manifests(), "StatefulSet", "splitserve-core")
    statefulset["spec"]["replica"] = 2  # a typo: strict validation rejects unknown fields
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(statefulset, K8S_VERSION, strict=True)


# --- agreement with the CLI ---------------------------------------------------------------------------------


def check_server(args: list[str], ports: dict[str, int], service: str, probes: dict | None = None) -> None:
    """A server's arguments parse, and its gRPC, metrics and (a frontend's) HTTP ports are the ones declared (and
    probed)."""
    parsed = parse(args)
    assert args[0] in ("core", "frontend")
    http = {"http": parsed.http_port} if args[0] == "frontend" else {}
    assert ports == {"grpc": parsed.port, "metrics": parsed.metrics_port, **http}
    if probes is not None:
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = probes[kind]["grpc"]
            assert probe["port"] == parsed.port, kind
            # Liveness and startup ask for "" (the server runs); readiness for the service (loaded, not draining).
            assert probe.get("service", "") == (service if kind == "readinessProbe" else ""), kind


@pytest.mark.parametrize("source", ["base", "cpu", "gpu"])
def test_kubernetes_commands_ports_and_probes_agree_with_the_cli(source):
    docs = base_manifests() if source == "base" else rendered(source)
    core_service = by_kind(docs, "Service", "splitserve-core")
    assert core_service["spec"]["clusterIP"] == "None"  # headless: DNS lists every core pod
    core_set = by_kind(docs, "StatefulSet", "splitserve-core")
    assert core_set["spec"]["serviceName"] == "splitserve-core"
    for name, kind, service in (
        ("splitserve-core", "StatefulSet", ENGINE_CORE_GRPC_SERVICE),
        ("splitserve-frontend", "Deployment", GENERATION_GRPC_SERVICE),
    ):
        c = container(docs, kind, name)
        image = f"splitserve/{name.removeprefix('splitserve-')}"
        assert c["image"].split(":")[0] == image  # base: untagged; kustomize's `images` sets the tag
        kustomization = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
        assert image in {i["name"] for i in kustomization["images"]}
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        check_server(c["args"], ports, service, c)
        # The drain fits the grace period: preStop sleep, then --shutdown-timeout, with room to exit.
        pod = by_kind(docs, kind, name)["spec"]["template"]["spec"]
        pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
        drain = float(flag(c["args"], "--shutdown-timeout"))
        assert pre_stop + drain + 5 <= pod["terminationGracePeriodSeconds"]
        for env_from in c["envFrom"]:
            config = by_kind(docs, "ConfigMap", env_from["configMapRef"]["name"])
            for variable in config["data"]:
                assert ENV_PATTERN.match(variable), variable
                if variable.startswith("SPLITSERVE_"):
                    assert variable in splitserve_envs(), variable
    frontend_args = container(docs, "Deployment", "splitserve-frontend")["args"]
    target = flag(frontend_args, "--core")
    assert target == f"dns:///splitserve-core:{core_service['spec']['ports'][0]['port']}"
    core_args = container(docs, "StatefulSet", "splitserve-core")["args"]
    assert core_service["spec"]["ports"][0]["port"] == parse(core_args).port
    for service in docs:
        if service["kind"] == "Service":
            selector = service["spec"]["selector"]["app.kubernetes.io/name"]
            pod_kind = "StatefulSet" if selector == "splitserve-core" else "Deployment"
            port_names = {p["name"] for p in container(docs, pod_kind, selector)["ports"]}
            assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names
    hpa = by_kind(docs, "HorizontalPodAutoscaler", "splitserve-frontend")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "splitserve-frontend"
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    if source == "gpu":
        core = container(docs, "StatefulSet", "splitserve-core")
        assert core["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert parse(core["args"]).device == "cuda"


def selects(selector: dict, labels: dict) -> bool:
    """A label selector with only ``matchLabels`` (what the manifests use) against a pod's labels."""
    assert set(selector) == {"matchLabels"}, selector
    return selector["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize("source", ["base", "cpu", "gpu"])
def test_only_frontends_reach_the_cores_grpc_port(source):
    """The NetworkPolicy isolates core pods (ingress only): their gRPC port from frontend pods, their metrics port
    from Prometheus, nothing else; frontend pods stay unselected (reachable as before)."""
    docs = base_manifests() if source == "base" else rendered(source)
    core_pod = by_kind(docs, "StatefulSet", "splitserve-core")["spec"]["template"]
    frontend_pod = by_kind(docs, "Deployment", "splitserve-frontend")["spec"]["template"]
    core_labels, frontend_labels = core_pod["metadata"]["labels"], frontend_pod["metadata"]["labels"]
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    (policy,) = policies
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    assert selects(spec["podSelector"], core_labels) and not selects(spec["podSelector"], frontend_labels)
    core_ports = {p["name"]: p["containerPort"] for p in container(docs, "StatefulSet", "splitserve-core")["ports"]}
    allowed: dict[str, list[dict]] = {}
    for rule in spec["ingress"]:
        assert rule["from"] and rule["ports"], rule  # an empty list would allow every source or every port
        for port in rule["ports"]:
            assert port["protocol"] == "TCP" and port["port"] in core_ports, port
            allowed.setdefault(port["port"], []).extend(rule["from"])
    assert set(allowed) == {"grpc", "metrics"} == set(core_ports)
    (grpc_peer,) = allowed["grpc"]
    assert set(grpc_peer) == {"podSelector"}  # pods of this namespace only
    assert selects(grpc_peer["podSelector"], frontend_labels) and not selects(grpc_peer["podSelector"], core_labels)
    (metrics_peer,) = allowed["metrics"]
    assert set(metrics_peer) == {"namespaceSelector", "podSelector"}  # both: Prometheus pods in that namespace
    assert not selects(metrics_peer["podSelector"], frontend_labels)
    # The headless Service's gRPC port is the one the policy opens to frontends.
    core_service = by_kind(docs, "Service", "splitserve-core")
    assert {p["targetPort"] for p in core_service["spec"]["ports"]} == set(allowed)


TLS_DIR = "/etc/splitserve/tls"


@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_the_tls_component_mounts_one_secret_and_agrees_with_the_cli(overlay, tmp_path):
    from splitserve.entrypoints.cli import core_tls_from_args, server_options_from_args
    from splitserve.entrypoints.health import health_tls_from_args

    docs = rendered_with_tls(overlay, tmp_path)
    plain = rendered(overlay)
    for doc in docs:
        kubernetes_validate_strict(doc)
    files = {"key": f"{TLS_DIR}/tls.key", "cert": f"{TLS_DIR}/tls.crt", "ca": f"{TLS_DIR}/ca.crt"}
    for name, kind, service, port in (
        ("splitserve-core", "StatefulSet", ENGINE_CORE_GRPC_SERVICE, 50061),
        ("splitserve-frontend", "Deployment", GENERATION_GRPC_SERVICE, 50051),
    ):
        pod = by_kind(docs, kind, name)["spec"]["template"]["spec"]
        c = container(docs, kind, name)
        # The Secret cert-manager writes, mounted read-only where the flags point, readable by the pod's user.
        (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
        assert volume["secret"]["secretName"] == "splitserve-tls"
        assert {"name": "tls", "mountPath": TLS_DIR, "readOnly": True} in c["volumeMounts"]
        assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"]
        # The overlay's own flags are kept; the TLS flags come after them.
        plain_args = container(plain, kind, name)["args"]
        assert c["args"][: len(plain_args)] == plain_args
        options = server_options_from_args(parse(c["args"]))
        assert (options.tls.keyfile, options.tls.certfile) == (files["key"], files["cert"])
        # kubelet gRPC probes speak plaintext only: the probes run `splitserve health` over TLS instead.
        for probe_kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = c[probe_kind]
            assert set(probe) >= {"exec"} and "grpc" not in probe, probe_kind
            command = probe["exec"]["command"]
            assert command[0] == "splitserve"
            check = parse(command[1:])
            assert check.func.__name__ == "cmd_health" and check.address == f"127.0.0.1:{port}"
            assert check.service == (service if probe_kind == "readinessProbe" else ""), probe_kind
            tls = health_tls_from_args(check)
            assert tls.ca_certs == files["ca"]
            assert probe["timeoutSeconds"] >= 5  # a Python process starts per probe
            # The probe checks the certificate for the name clients use: the core's headless Service, which
            # frontends dial (dns:///NAME), and the frontends' Service.
            service_name = "splitserve-core" if kind == "StatefulSet" else "splitserve"
            assert tls.server_name == service_name and by_kind(docs, "Service", service_name)
            if kind == "StatefulSet":  # the core requires a client certificate: the probe presents one
                assert (tls.certfile, tls.keyfile) == (files["cert"], files["key"])
        if kind == "StatefulSet":
            assert options.tls.ca_certs == files["ca"]  # mTLS: frontends must present a certificate
        else:
            assert options.tls.ca_certs is None  # public clients need none; they send the API key
            core_tls = core_tls_from_args(parse(c["args"]))
            assert (core_tls.ca_certs, core_tls.certfile, core_tls.keyfile) == (
                files["ca"],
                files["cert"],
                files["key"],
            )
            assert core_tls.server_name is None  # dns:///splitserve-core: checked against splitserve-core
            assert flag(c["args"], "--core").startswith("dns:///splitserve-core:")
            (env,) = [e for e in c["env"] if e["name"] == "SPLITSERVE_API_KEY"]
            assert env["valueFrom"]["secretKeyRef"] == {"name": "splitserve-api-key", "key": "api-key"}
            assert "SPLITSERVE_API_KEY" in splitserve_envs() and "--api-key" not in c["args"]
    if overlay == "gpu":
        assert parse(container(docs, "StatefulSet", "splitserve-core")["args"]).device == "cuda"


def kubernetes_validate_strict(doc: dict) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_compose_tls_override_adds_tls_to_the_same_commands():
    from splitserve.entrypoints.cli import core_tls_from_args, server_options_from_args
    from splitserve.entrypoints.health import health_tls_from_args

    base = yaml.safe_load(COMPOSE_FILES[0].read_text())["services"]
    override = yaml.safe_load(COMPOSE_FILES[2].read_text())["services"]
    assert set(override) == {"core", "frontend"}
    certs = {"key": "/certs/tls.key", "cert": "/certs/tls.crt", "ca": "/certs/ca.crt"}
    for name in ("core", "frontend"):
        entry = override[name]
        assert entry["volumes"] == ["./certs:/certs:ro"]
        command = entry["command"]
        assert command[: len(base[name]["command"])] == base[name]["command"]  # the base's flags, then TLS's
        options = server_options_from_args(parse(command))
        assert (options.tls.keyfile, options.tls.certfile) == (certs["key"], certs["cert"])
        health = entry["healthcheck"]["test"]
        assert health[:2] == ["CMD", "splitserve"]
        check = parse(health[2:])
        assert health[1:7] == base[name]["healthcheck"]["test"][1:]  # same address and service, then TLS flags
        tls = health_tls_from_args(check)
        assert tls.ca_certs == certs["ca"]
        if name == "core":
            assert options.tls.ca_certs == certs["ca"]  # mTLS
            assert (tls.certfile, tls.keyfile, tls.server_name) == (certs["cert"], certs["key"], "core")
        else:
            assert options.tls.ca_certs is None and tls.server_name == "localhost"
            core_tls = core_tls_from_args(parse(command))
            assert (core_tls.ca_certs, core_tls.certfile, core_tls.keyfile) == (
                certs["ca"],
                certs["cert"],
                certs["key"],
            )
            assert flag(command, "--core") == "dns:///core:50061"  # checked against the name "core"
            assert set(entry["environment"]) == {"SPLITSERVE_API_KEY"}
            assert "SPLITSERVE_API_KEY" in splitserve_envs()
    ignored = (ROOT / ".gitignore").read_text().splitlines() + (ROOT / ".dockerignore").read_text().splitlines()
    assert "/certs/" in ignored and "certs" in ignored  # keys stay out of git and out of images


def dockerfile_instructions(path: Path) -> dict[str, list[str]]:
    text = path.read_text().replace("\\\n", " ")
    instructions: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            keyword, _, rest = line.strip().partition(" ")
            instructions.setdefault(keyword, []).append(rest.strip())
    return instructions


def json_array(text: str) -> list[str]:
    return yaml.safe_load(text)  # a JSON array is YAML


@pytest.mark.parametrize("name", ["core", "frontend"])
def test_images_and_compose_agree_with_the_cli(name):
    service = ENGINE_CORE_GRPC_SERVICE if name == "core" else GENERATION_GRPC_SERVICE
    dockerfile = dockerfile_instructions(ROOT / "docker" / f"{name}.Dockerfile")
    assert json_array(dockerfile["ENTRYPOINT"][0]) == ["splitserve"]
    cmd = json_array(dockerfile["CMD"][0])
    parsed = parse(cmd)
    exposed = {int(p) for p in dockerfile["EXPOSE"][0].split()}
    http_ports = {parsed.http_port} if name == "frontend" else set()
    assert exposed == {parsed.port, parsed.metrics_port, *http_ports}
    assert dockerfile["USER"] == ["splitserve"]  # not root
    health = json_array(dockerfile["HEALTHCHECK"][0].split("CMD", 1)[1])
    check = parse(health[1:])
    assert health[0] == "splitserve" and check.func.__name__ == "cmd_health"
    assert (check.address, check.service) == (f"127.0.0.1:{parsed.port}", service)
    for env in dockerfile["ENV"]:
        for variable in re.findall(r"([A-Z_]+)=", env):
            assert variable.startswith(("PYTHON", "PIP_", "TORCH_")) or ENV_PATTERN.match(variable), variable

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    entry = compose["services"][name]
    assert entry["build"]["dockerfile"] == f"docker/{name}.Dockerfile"
    assert entry["command"] == cmd  # the compose stack runs what the image runs
    assert parse(entry["healthcheck"]["test"][2:]).address == check.address
    assert entry["healthcheck"]["test"][1:] == health
    published = [p for p in entry.get("ports", [])]
    exposed_compose = {int(p) for p in entry.get("expose", [])}
    if name == "frontend":
        # One host port per replica under --scale, for each API.
        assert published == [f"50051-50059:{parsed.port}", f"8000-8008:{parsed.http_port}"]
        assert compose["services"]["frontend"]["depends_on"]["core"]["condition"] == "service_healthy"
        core_cmd = compose["services"]["core"]["command"]
        assert flag(cmd, "--core") == f"dns:///core:{parse(core_cmd).port}"
        assert exposed_compose == {parsed.metrics_port}
    else:
        assert exposed_compose == {parsed.port, parsed.metrics_port}
    for variable in entry["environment"]:
        assert ENV_PATTERN.match(variable), variable
        if variable.startswith("SPLITSERVE_"):
            assert variable in splitserve_envs(), variable
    assert "models:/models" in entry["volumes"][0]
    # Prometheus scrapes the metrics port of every replica.
    prometheus = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())
    (job,) = [j for j in prometheus["scrape_configs"] if j["job_name"] == f"splitserve-{name}"]
    assert job["dns_sd_configs"][0] == {**job["dns_sd_configs"][0], "names": [name], "port": parsed.metrics_port}


def dockerfile_args(instructions: dict[str, list[str]]) -> dict[str, str | None]:
    """The ``ARG`` names of a Dockerfile, with their defaults (None: none)."""
    args: dict[str, str | None] = {}
    for arg in instructions["ARG"]:
        name, _, default = arg.partition("=")
        args[name] = yaml.safe_load(default) if default else None
    return args


def test_the_cuda_image_runs_the_core_on_a_gpu_with_its_kernels_kept():
    """docker/core-cuda.Dockerfile: PyTorch's CUDA runtime image (its -devel twin only for flash-attn, off by
    default), the core on cuda in bfloat16 with vLLM's memory share, Triton's cache on the models volume, and the
    CPU image's ports, user and health check."""
    cuda = dockerfile_instructions(ROOT / "docker" / "core-cuda.Dockerfile")
    cpu = dockerfile_instructions(ROOT / "docker" / "core.Dockerfile")
    for key in ("ENTRYPOINT", "EXPOSE", "USER", "HEALTHCHECK", "VOLUME"):
        assert cuda[key] == cpu[key], key
    cmd = parse(json_array(cuda["CMD"][0]))
    assert (cmd.device, cmd.dtype, cmd.gpu_memory_utilization) == ("cuda", "bfloat16", 0.9)
    differ = ("device", "dtype", "gpu_memory_utilization")
    assert {k: v for k, v in vars(cmd).items() if k not in differ} == {
        k: v for k, v in vars(parse(json_array(cpu["CMD"][0]))).items() if k not in differ
    }
    args = dockerfile_args(cuda)
    base, devel = args["BASE_IMAGE"], args["DEVEL_IMAGE"]
    assert isinstance(base, str) and isinstance(devel, str)
    assert re.fullmatch(r"pytorch/pytorch:[0-9.]+-cuda[0-9.]+-cudnn[0-9]+-runtime", base), base
    assert devel == base.removesuffix("-runtime") + "-devel"  # the same torch, CUDA and Python
    assert args["FLASH_ATTN"] == 0
    stages = dict(line.split(" AS ")[::-1] for line in cuda["FROM"] if " AS " in line)
    assert stages == {
        "flash-attn-1": "${DEVEL_IMAGE}",
        "flash-attn-0": "${BASE_IMAGE}",
        "wheels": "flash-attn-${FLASH_ATTN}",
    }
    assert cuda["FROM"][-1] == "${BASE_IMAGE}"  # the image itself: no compilers' image under it
    env = dict(re.findall(r"([A-Z_]+)=(\S+)", " ".join(cuda["ENV"])))
    volume = json_array(cuda["VOLUME"][0])[0]
    assert env["TRITON_CACHE_DIR"].startswith(volume + "/") and env["SPLITSERVE_CACHE_DIR"] == volume
    for variable in env:
        assert variable.startswith(("PYTHON", "PIP_", "TRITON_")) or ENV_PATTERN.match(variable), variable


def test_gpu_override_runs_the_core_on_cuda():
    override = yaml.safe_load(COMPOSE_FILES[1].read_text())["services"]["core"]
    assert override["build"]["dockerfile"] == "docker/core-cuda.Dockerfile"
    cuda = dockerfile_instructions(ROOT / "docker" / "core-cuda.Dockerfile")
    assert override["command"] == json_array(cuda["CMD"][0])  # what the CUDA image runs
    assert set(override["build"]["args"]) <= set(dockerfile_args(cuda))
    assert override["build"]["args"]["FLASH_ATTN"] == "${FLASH_ATTN:-0}"  # off unless asked for
    assert override["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert override["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 1
    base = yaml.safe_load(COMPOSE_FILES[0].read_text())["services"]["core"]["command"]
    differ = ("device", "dtype", "gpu_memory_utilization")
    assert {k: v for k, v in vars(parse(override["command"])).items() if k not in differ} == {
        k: v for k, v in vars(parse(base)).items() if k not in differ
    }


def test_the_kubernetes_gpu_overlay_runs_the_cuda_image_as_it_is_built():
    docs = rendered("gpu")
    core = container(docs, "StatefulSet", "splitserve-core")
    assert core["image"] == "splitserve/core:0.1.0-cuda"
    cuda = dockerfile_instructions(ROOT / "docker" / "core-cuda.Dockerfile")
    assert core["args"] == json_array(cuda["CMD"][0])
    assert core["resources"]["limits"] == {"nvidia.com/gpu": 1}
    tolerations = by_kind(docs, "StatefulSet", "splitserve-core")["spec"]["template"]["spec"]["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations


# --- the shapes as processes --------------------------------------------------------------------------------


def server_args(args: list[str], replace: dict[str, str]) -> list[str]:
    """A manifest's arguments without --host / --port (stack.start_service adds its own), other values
    replaced by ``replace``."""
    out: list[str] = []
    i = 0
    while i < len(args):
        if args[i] in ("--host", "--port"):
            i += 2
            continue
        out.append(args[i])
        if args[i] in replace:
            out.append(replace[args[i]])
            i += 1
        i += 1
    return out


def scrape_one(address: str, name: str) -> float:
    return sample(scrape(address), name)


FINISHED = "splitserve:core_request_finished_total"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Hello", "1, 2, 3,", "Dear Sir"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from splitserve.entrypoints.test_model import make_test_model
    from tests.conftest import real_or_builtin

    return str(
        make_test_model(tmp_path_factory.mktemp("deploy-model"), "llama", "tiny", tokenizer=real_or_builtin("llama2"))
    )


@pytest.fixture(scope="module")
def reference(model):
    from frontend_svc import LLM, SamplingParams

    with LLM(model) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        greedy = {o.prompt: list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)}
        long = llm.generate(["Long story:"], SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
        return greedy, list(long[0].outputs[0].token_ids)


async def generate(address: str, prompt: str, max_tokens: int, first_token: asyncio.Event | None = None) -> list[int]:
    params = api.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    async with grpc.aio.insecure_channel(address) as channel:
        call = api_grpc.GenerationStub(channel).Generate(api.GenerateRequest(prompt=prompt, sampling_params=params))
        token_ids: list[int] = []
        async for response in call:
            token_ids += response.outputs[0].token_ids
            if first_token is not None:
                first_token.set()
        return token_ids


@pytest.mark.slow
def test_three_frontends_two_cores_as_the_manifests_start_them(model, reference, tmp_path):
    greedy, long_reference = reference
    docs = base_manifests()
    core_args = container(docs, "StatefulSet", "splitserve-core")["args"]
    frontend_args = container(docs, "Deployment", "splitserve-frontend")["args"]
    core_port, metrics_port = stack.free_port(), stack.free_port()
    core_ips = ["127.0.0.2", "127.0.0.3"]  # two pods: one address each, the same ports
    hosts = tmp_path / "hosts"  # what the headless Service's DNS answers: the first core only, for now
    hosts.write_text(f"{core_ips[0]} splitserve-core\n")
    env = {"SPLITSERVE_MODEL": model, "SPLITSERVE_HOSTS_FILE": str(hosts), "SPLITSERVE_LOG_STATS_INTERVAL": "0"}
    logs = tmp_path / "logs"
    processes: list[stack.ServiceProcess] = []
    try:
        replace = {"--metrics-port": str(metrics_port)}
        for ip in core_ips:
            processes.append(
                stack.start_service(
                    f"core-{ip}", server_args(core_args, replace), core_port, logs, ENGINE_CORE_GRPC_SERVICE, ip, env
                )
            )
        frontends = []
        http_ports = []
        for i in range(3):
            http_ports.append(stack.free_port())  # one host here; each pod has its own 8000
            frontend_replace = {
                "--metrics-port": str(stack.free_port()),
                "--core": f"dns:///splitserve-core:{core_port}",
                "--http-port": str(http_ports[-1]),
            }
            frontends.append(
                stack.start_service(
                    f"frontend-{i}",
                    server_args(frontend_args, frontend_replace),
                    stack.free_port(),
                    logs,
                    env=env,
                    launcher=[sys.executable, str(ROOT / "tests" / "torchless.py")],
                )
            )
        processes += frontends
        for process in processes:
            process.wait_serving()
        cores = processes[:2]
        # The second core's pod becomes ready: DNS lists it, and the frontends pick it up at their next lookup.
        hosts.write_text("".join(f"{ip} splitserve-core\n" for ip in core_ips))
        time.sleep(6)  # the frontends resolve again every 5 s
        core_metrics = [f"{ip}:{metrics_port}" for ip in core_ips]

        async def spread() -> list[list[int]]:
            calls = [generate(frontends[i % 3].address, PROMPTS[i % len(PROMPTS)], 24) for i in range(12)]
            return await asyncio.gather(*calls)

        answers = asyncio.run(spread())
        for i, token_ids in enumerate(answers):
            assert token_ids == greedy[PROMPTS[i % len(PROMPTS)]], i
        for port in http_ports:  # each replica's OpenAI-compatible API is up beside its gRPC API
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as response:
                assert response.status == 200
        finished = [scrape_one(address, FINISHED) for address in core_metrics]
        assert sum(finished) == 12 and min(finished) > 0, finished  # both cores took load

        async def drain() -> int:
            first_token = asyncio.Event()
            long_call = asyncio.create_task(generate(frontends[0].address, "Long story:", 400, first_token))
            await first_token.wait()
            running = [scrape_one(address, "splitserve:num_requests_running") for address in core_metrics]
            draining = running.index(1)
            other = 1 - draining
            before = scrape_one(core_metrics[other], FINISHED)
            cores[draining].process.send_signal(15)  # SIGTERM, as the kubelet sends it
            assert not long_call.done()
            await asyncio.sleep(0.5)  # the frontends see NOT_SERVING (health watch)
            new_calls = [generate(f.address, PROMPTS[i], 24) for i, f in enumerate(frontends)]
            new_answers = await asyncio.gather(*new_calls)
            assert [a == greedy[PROMPTS[i]] for i, a in enumerate(new_answers)] == [True] * 3
            assert await long_call == long_reference  # the request in flight finished on the draining core
            assert scrape_one(core_metrics[other], FINISHED) == before + 3  # new calls: the other core
            return draining

        draining = asyncio.run(drain())
        assert cores[draining].process.wait(60) == 0  # the drained core exited cleanly
        assert cores[1 - draining].process.poll() is None
    finally:
        for process in reversed(processes):
            process.stop()


def test_core_targets_and_hosts_files(tmp_path):
    from frontend_svc.core_discovery import CoreTarget, format_address, hosts_file_addresses

    assert CoreTarget.parse("dns:///splitserve-core:50061") == CoreTarget("splitserve-core", 50061, True)
    assert CoreTarget.parse("10.0.0.7:50061") == CoreTarget("10.0.0.7", 50061, False)
    assert CoreTarget.parse("[::1]:50061").address == "[::1]:50061"
    for bad in ("splitserve-core", "dns:///core", "host:port", "host:0", "host:70000", ":50061"):
        with pytest.raises(ValueError, match="core address"):
            CoreTarget.parse(bad)
    assert format_address("fd00::5", 1) == "[fd00::5]:1" and format_address("core", 2) == "core:2"
    hosts = tmp_path / "hosts"
    hosts.write_text("# pods\n10.1.0.4 splitserve-core other\n10.1.0.5   splitserve-core # ready\n10.1.0.6 core-x\n")
    assert hosts_file_addresses(hosts, "splitserve-core") == ["10.1.0.4", "10.1.0.5"]
    assert hosts_file_addresses(hosts, "missing") == [] and hosts_file_addresses(tmp_path / "none", "x") == []


def test_the_frontend_refuses_a_bad_core_address(capsys):
    from splitserve.entrypoints.cli import main

    assert main(["frontend", "--model", "m", "--core", "dns:///splitserve-core"]) == 2
    assert "core address 'dns:///splitserve-core'" in capsys.readouterr().err


def test_free_port_never_hands_out_a_port_twice(monkeypatch):
    """A caller that takes an HTTP port, then a frontend's gRPC port, before binding either, must not get the same
    one twice (a frontend then failed with "Address already in use"): not from the random draw, nor from the
    kernel, which may offer a released port again. A port another process holds is passed over."""
    offered_by_kernel = iter([41000, 41000, 41001])
    taken_elsewhere = {41002}

    class FakeSocket:
        def __init__(self, *args: object) -> None:
            self.port = 0

        def bind(self, address: tuple[str, int]) -> None:
            host, port = address
            assert host == "127.0.0.1"
            if port in taken_elsewhere:
                raise OSError(98, "Address already in use")
            self.port = port or next(offered_by_kernel)

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

        def close(self) -> None:
            pass

    draws = iter([41002, 41000] + [41000] * 200)  # taken elsewhere, then one port drawn again and again
    monkeypatch.setattr(stack, "_HANDED_OUT", set())
    monkeypatch.setattr(stack.socket, "socket", FakeSocket)
    monkeypatch.setattr(stack.random, "randrange", lambda low, high: next(draws))
    assert [stack.free_port(), stack.free_port()] == [41000, 41001]


def test_free_port_is_below_the_kernels_ephemeral_range():
    """Outgoing connections and binds to port 0 draw from the ephemeral range: a port chosen below it is not taken
    by them before the caller binds it."""
    low = stack._ephemeral_low()
    if low <= stack._LOWEST_PORT:
        pytest.skip(f"the ephemeral range starts at {low}: no room below it")
    ports = [stack.free_port() for _ in range(20)]
    assert len(set(ports)) == 20 and all(stack._LOWEST_PORT <= port < low for port in ports)
