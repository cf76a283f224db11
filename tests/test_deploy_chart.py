"""The Helm chart (deploy/helm/lmcache-p2p) renders with Helm itself, every object it renders is
valid against the Kubernetes API schemas, and what it hands each process is what that process
accepts: the controller's, router's and lmcache_server's arguments go through their own parsers
and checks, and an engine's environment (the ConfigMap, the pod's IP, the mesh Secret) loads with
LMCacheConfig.load and `lmcache-p2p config`. By default nothing binds 0.0.0.0 and every listener
is behind the mesh secret or the API token.

`make test` installs helm into the venv (the Makefile's $(HELM) target) and passes it as HELM_BIN;
kubernetes-validate (a test dependency) carries the API schemas of each Kubernetes release.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from lmcache_p2p.config import ConfigError, LMCacheConfig
from lmcache_p2p.controller.settings import build_parser as controller_parser
from lmcache_p2p.controller.settings import load_settings
from lmcache_p2p.mesh_security import check_secret
from lmcache_p2p.remote.server import build_parser as server_parser
from lmcache_p2p.remote.server import resolve_mesh_secret
from lmcache_p2p.router.cli import build_parser as router_parser
from lmcache_p2p.router.cli import config_from_args

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "lmcache-p2p"
NAMESPACE = "llm"
# A documentation address (TEST-NET-1) standing in for status.podIP: nothing connects to it.
POD_IP = "192.0.2.10"
# The chart's floor (Chart.yaml's kubeVersion) and the newest release kubernetes-validate knows.
K8S_VERSIONS = ("1.29", kubernetes_validate.latest_version())
# Objects of custom resources are not in Kubernetes' schemas; test_service_monitor checks them.
CUSTOM_KINDS = {"ServiceMonitor"}

# Every optional part on: two controllers, the router, lmcache_server, the example engine
# Deployment with TP 2 and a GPU tier, persistence, monitoring.
FULL = {
    "controller": {"replicas": 2, "persistence": {"enabled": True}},
    "router": {"enabled": True, "model": "meta-llama/Llama-3.1-8B-Instruct"},
    "store": {"enabled": True, "maxSizeGb": 8},
    "engine": {
        "tensorParallelSize": 2,
        "localGpu": True,
        "maxLocalGpuSize": 4,
        "maxLocalCpuSize": 20,
        "extraEnv": {"LMCACHE_P2P_MAX_WARM_PEERS": "16"},
        "deployment": {"enabled": True, "model": "meta-llama/Llama-3.1-8B-Instruct"},
    },
    "metrics": {"serviceMonitor": {"enabled": True}},
    "grafanaDashboards": {"enabled": True},
}
SCENARIOS = {"defaults": {}, "full": FULL, "full-all-interfaces": {**FULL, "listenAddress": "all"}}


def helm_binary() -> str:
    for candidate in (os.environ.get("HELM_BIN"), str(ROOT / ".venv" / "bin" / "helm"), shutil.which("helm")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise RuntimeError(
        "helm not found: `make test` installs it into .venv/bin (the Makefile's $(HELM) target), "
        "or set HELM_BIN to a helm 3 or 4 binary"
    )


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=60)


def render(tmp_path: Path, values: dict[str, Any], release: str = "lmcache-p2p") -> list[dict[str, Any]]:
    values_file = tmp_path / f"values-{len(list(tmp_path.iterdir()))}.yaml"
    values_file.write_text(yaml.safe_dump(values))
    done = helm("template", release, str(CHART), "--namespace", NAMESPACE, "-f", str(values_file))
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("chart")
    return {name: render(tmp, values) for name, values in SCENARIOS.items()}


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in of_kind(objects, kind) if o["metadata"]["name"] == name]
    return found


def workloads(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def container(workload: dict[str, Any]) -> dict[str, Any]:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


def secret_values(objects: list[dict[str, Any]]) -> dict[tuple[str, str], str]:
    return {
        (s["metadata"]["name"], key): base64.b64decode(value).decode()
        for s in of_kind(objects, "Secret")
        for key, value in s["data"].items()
    }


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of a container's args (VAR from the container's env)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], text)


def container_env(objects: list[dict[str, Any]], c: dict[str, Any]) -> dict[str, str]:
    """The environment Kubernetes gives container ``c``: envFrom ConfigMaps, then env, with the
    pod's IP for status.podIP and the rendered Secrets' values for secretKeyRef."""
    secrets = secret_values(objects)
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        env.update(named(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in c.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif "fieldRef" in var["valueFrom"]:
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            env[var["name"]] = POD_IP
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = secrets[(ref["name"], ref["key"])]
    return env


def secret_files(objects: list[dict[str, Any]], workload: dict[str, Any], tmp_path: Path) -> dict[str, str]:
    """Where the container reads each projected secret file -> a file here holding its value."""
    secrets = secret_values(objects)
    pod = workload["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in container(workload)["volumeMounts"]}
    out = {}
    for volume in pod["volumes"]:
        for source in volume.get("projected", {}).get("sources", []):
            for item in source["secret"]["items"]:
                here = tmp_path / f"{volume['name']}-{item['path']}"
                here.write_text(secrets[(source["secret"]["name"], item["key"])])
                out[f"{mounts[volume['name']]}/{item['path']}"] = str(here)
    return out


def process_args(objects: list[dict[str, Any]], workload: dict[str, Any], tmp_path: Path) -> list[str]:
    """The container's arguments as the process gets them, secret file paths pointing here."""
    c = container(workload)
    env = container_env(objects, c)
    files = secret_files(objects, workload, tmp_path)
    args = []
    for arg in c["args"]:
        arg = expand(arg, env)
        for there, here in files.items():
            arg = arg.replace(there, here)
        args.append(arg)
    return args


def component(objects: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [w for w in workloads(objects) if w["metadata"]["labels"]["app.kubernetes.io/component"] == name]


def test_the_chart_lints():
    done = helm("lint", "--strict", str(CHART))
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_is_valid_for_the_kubernetes_api(rendered, scenario, version):
    objects = rendered[scenario]
    assert {o["kind"] for o in objects} >= {"Secret", "StatefulSet", "Service", "ConfigMap"}
    for obj in objects:
        if obj["kind"] in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{obj['kind']} {obj['metadata']['name']} is invalid for Kubernetes {version}: {e.message}")


def test_the_full_render_has_every_part(rendered):
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in rendered["full"])
    names = {name for _, name in kinds}
    for name in (
        "lmcache-p2p-controller",
        "lmcache-p2p-controller-0",
        "lmcache-p2p-controller-1",
        "lmcache-p2p-controller-headless",
        "lmcache-p2p-router",
        "lmcache-p2p-store",
        "lmcache-p2p-engine",
        "lmcache-p2p-engine-env",
        "lmcache-p2p-mesh",
        "lmcache-p2p-api-token",
        "lmcache-p2p-dashboard-controller",
        "lmcache-p2p-dashboard-engines",
    ):
        assert name in names, kinds
    assert ("PodDisruptionBudget", "lmcache-p2p-controller") in kinds
    assert ("ServiceMonitor", "lmcache-p2p-controller") in kinds
    (sts,) = of_kind(rendered["full"], "StatefulSet")
    assert sts["spec"]["replicas"] == 2


def test_services_select_the_chart_pods_and_name_their_ports(rendered):
    """What the schemas cannot see: each Service selects pods the chart runs, and each targetPort
    is a port those pods name (names of 15 characters at most, as Kubernetes requires)."""
    for scenario, objects in rendered.items():
        pods = []
        for w in workloads(objects):
            labels = dict(w["spec"]["template"]["metadata"]["labels"])
            assert all(labels.get(k) == v for k, v in w["spec"]["selector"]["matchLabels"].items())
            port_names = {p["name"] for p in container(w)["ports"]}
            assert all(len(name) <= 15 for name in port_names), port_names
            replicas = w["spec"]["replicas"] if w["kind"] == "StatefulSet" else 1
            for i in range(replicas):
                pod_labels = dict(labels)
                if w["kind"] == "StatefulSet":
                    pod_labels["statefulset.kubernetes.io/pod-name"] = f"{w['metadata']['name']}-{i}"
                pods.append((pod_labels, port_names))
        for svc in of_kind(objects, "Service"):
            selector = svc["spec"]["selector"]
            matched = [names for labels, names in pods if all(labels.get(k) == v for k, v in selector.items())]
            assert matched, f"{scenario}: Service {svc['metadata']['name']} selects no pod"
            # a controller's own Service selects exactly its pod
            if re.fullmatch(r".*-controller-\d+", svc["metadata"]["name"]):
                assert len(matched) == 1, svc["metadata"]["name"]
            for port in svc["spec"]["ports"]:
                assert all(port["targetPort"] in names for names in matched), (svc["metadata"]["name"], port)


def test_names_fit_kubernetes_limits_for_a_long_release_name(tmp_path):
    objects = render(tmp_path, FULL, release="a-rather-long-release-name-for-a-fleet-of-engines")
    for obj in objects:
        name = obj["metadata"]["name"]
        assert len(name) <= 63 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name), name
    # the StatefulSet's pods get controller-revision-hash=<name>-<10 characters>, a label value
    (sts,) = of_kind(objects, "StatefulSet")
    assert len(sts["metadata"]["name"]) + 11 <= 63


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_controllers_arguments_pass_the_controllers_own_checks(rendered, scenario, tmp_path):
    objects = rendered[scenario]
    (sts,) = of_kind(objects, "StatefulSet")
    args = process_args(objects, sts, tmp_path)
    settings = load_settings(controller_parser().parse_args(args), env={})
    secrets = secret_values(objects)
    assert settings.mesh_secret == secrets[("lmcache-p2p-mesh", "mesh-secret")]
    assert settings.api_token == secrets[("lmcache-p2p-api-token", "api-token")]
    assert settings.protect_reads
    assert settings.host == ("0.0.0.0" if scenario == "full-all-interfaces" else POD_IP)
    assert settings.monitor_host == settings.host
    ports = {p["name"]: p["containerPort"] for p in container(sts)["ports"]}
    assert ports == {
        "http": settings.port,
        "zmq-pull": settings.monitor_ports["pull"],
        "zmq-reply": settings.monitor_ports["reply"],
        "zmq-heartbeat": settings.monitor_ports["heartbeat"],
    }
    assert (settings.events_file is not None) == (scenario != "defaults")


def test_the_router_and_stores_arguments_pass_their_own_checks(rendered, tmp_path):
    objects = rendered["full"]
    (router,) = component(objects, "router")
    config = config_from_args(router_parser().parse_args(process_args(objects, router, tmp_path)), env={})
    urls = config.controller_url.split(",")
    assert urls == [f"http://lmcache-p2p-controller-{i}.{NAMESPACE}.svc:9000" for i in range(2)]
    assert config.api_token == secret_values(objects)[("lmcache-p2p-api-token", "api-token")]
    assert config.model == "meta-llama/Llama-3.1-8B-Instruct"

    (store,) = component(objects, "store")
    args = server_parser().parse_intermixed_args(process_args(objects, store, tmp_path))
    assert (args.host, args.port, args.device, args.max_size_gb) == (POD_IP, 65432, "cpu", 8.0)
    assert args.insecure is False
    secret = resolve_mesh_secret(args.mesh_secret_file, {})
    assert secret == secret_values(objects)[("lmcache-p2p-mesh", "mesh-secret")]


def engine_env_as_documented(objects: list[dict[str, Any]]) -> dict[str, str]:
    """The env block docs/kubernetes.md and the chart's NOTES give a user's own vLLM container."""
    block = {
        "envFrom": [{"configMapRef": {"name": "lmcache-p2p-engine-env"}}],
        "env": [
            {"name": "LMCACHE_P2P_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {
                "name": "LMCACHE_MESH_SECRET",
                "valueFrom": {"secretKeyRef": {"name": "lmcache-p2p-mesh", "key": "mesh-secret"}},
            },
        ],
    }
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    for needle in ("name: lmcache-p2p-engine-env", "fieldPath: status.podIP", "name: lmcache-p2p-mesh"):
        assert needle in text, needle
    return container_env(objects, block)


def test_the_default_engine_env_loads_with_our_config(rendered, tmp_path):
    objects = rendered["defaults"]
    env = engine_env_as_documented(objects)
    config = LMCacheConfig.load(env=env)
    config.validate_for_tp(1)
    assert config.enable_controller and config.enable_p2p and config.local_cpu
    assert config.p2p_host == POD_IP
    assert config.controller_urls() == (
        [f"lmcache-p2p-controller-0.{NAMESPACE}.svc:8300"],
        [f"lmcache-p2p-controller-0.{NAMESPACE}.svc:8400"],
    )
    assert config.resolved_mesh_secret() == secret_values(objects)[("lmcache-p2p-mesh", "mesh-secret")]
    assert config.remote_url is None
    assert config.serve_url == "http://{host}:8000"
    # the operator's own check, as docs/kubernetes.md shows it
    done = subprocess.run(
        [str(Path(sys.executable).parent / "lmcache-p2p"), "config"],
        env={"PATH": os.environ.get("PATH", ""), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "p2p_host" in done.stdout and POD_IP in done.stdout
    assert env["LMCACHE_MESH_SECRET"] not in done.stdout


def test_the_engine_deployments_env_loads_with_our_config(rendered):
    objects = rendered["full"]
    (engine,) = component(objects, "engine")
    c = container(engine)
    env = container_env(objects, c)
    lmcache_env = {k: v for k, v in env.items() if k.startswith("LMCACHE_")}
    config = LMCacheConfig.load(env=lmcache_env)
    config.validate_for_tp(2)
    pulls, replies = config.controller_urls()
    assert pulls == [f"lmcache-p2p-controller-{i}.{NAMESPACE}.svc:8300" for i in range(2)]
    assert replies == [f"lmcache-p2p-controller-{i}.{NAMESPACE}.svc:8400" for i in range(2)]
    assert config.p2p_init_ports == [8200, 8202] and config.p2p_lookup_ports == [8201, 8203]
    assert config.lmcache_worker_ports == [8500, 8501]
    assert config.local_gpu and config.max_local_gpu_size == 4 and config.max_local_cpu_size == 20
    assert config.p2p_max_warm_peers == 16
    assert config.remote_url == f"lm://lmcache-p2p-store.{NAMESPACE}.svc:65432"
    # each rank's ports are the container's, and vLLM gets the connector and TP size
    declared = {p["containerPort"] for p in c["ports"]}
    assert {8000, 8200, 8201, 8202, 8203, 8500, 8501} == declared
    args = [expand(a, env) for a in c["args"]]
    assert "--tensor-parallel-size=2" in args and f"--host={POD_IP}" in args
    (kv,) = [a for a in args if a.startswith("--kv-transfer-config=")]
    assert json.loads(kv.partition("=")[2]) == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    limits = c["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 2


def test_pods_get_no_service_links(rendered, tmp_path):
    """Kubernetes gives every container <SERVICE>_SERVICE_HOST, _PORT, ... for each Service of its
    namespace unless enableServiceLinks is false. With a release named lmcache* those are
    LMCACHE_* variables, which an engine reads as settings and refuses: every pod turns them off,
    and docs/kubernetes.md tells users to do the same in their engine pods."""
    objects = render(tmp_path, FULL, release="lmcache")
    links = {}
    for svc in of_kind(objects, "Service"):
        name = svc["metadata"]["name"].upper().replace("-", "_")
        links[f"{name}_SERVICE_HOST"] = POD_IP
        links[f"{name}_PORT"] = f"tcp://{POD_IP}:{svc['spec']['ports'][0]['port']}"
    (engine,) = component(objects, "engine")
    env = {k: v for k, v in container_env(objects, container(engine)).items() if k.startswith("LMCACHE_")}
    LMCacheConfig.load(env=env)
    with pytest.raises(ConfigError):
        LMCacheConfig.load(env={**env, **links})
    for scenario_objects in (*rendered.values(), objects):
        for w in workloads(scenario_objects):
            assert w["spec"]["template"]["spec"]["enableServiceLinks"] is False, w["metadata"]["name"]
    assert "enableServiceLinks: false" in (ROOT / "docs" / "kubernetes.md").read_text()


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_nothing_binds_every_interface_unless_asked_and_every_listener_needs_a_secret(rendered, scenario):
    objects = rendered[scenario]
    everywhere = scenario == "full-all-interfaces"
    for w in workloads(objects):
        c = container(w)
        args = " ".join(c["args"])
        role = w["metadata"]["labels"]["app.kubernetes.io/component"]
        assert ("0.0.0.0" in args) == everywhere, (role, args)
        assert "::" not in args and "--insecure" not in args
        if not everywhere:
            assert "$(POD_IP)" in args, role
        env_names = {v["name"] for v in c.get("env", [])}
        if role == "controller":
            assert "--mesh-secret-file=/etc/lmcache/secrets/mesh-secret" in c["args"]
            assert "--api-token-file=/etc/lmcache/secrets/api-token" in c["args"]
            assert "--protect-reads" in c["args"]
        elif role == "router":
            assert "--api-token-file=/etc/lmcache/secrets/api-token" in c["args"]
        elif role == "store":
            assert "--mesh-secret-file=/etc/lmcache/secrets/mesh-secret" in c["args"]
        else:
            assert role == "engine" and {"LMCACHE_P2P_HOST", "LMCACHE_MESH_SECRET"} <= env_names
    # the control side runs as a non-root user on a read-only root filesystem
    for w in workloads(objects):
        if w["metadata"]["labels"]["app.kubernetes.io/component"] != "engine":
            assert w["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
            assert container(w)["securityContext"]["readOnlyRootFilesystem"] is True


def test_generated_secrets_are_strong_and_given_ones_are_used(rendered, tmp_path):
    for (name, key), value in secret_values(rendered["defaults"]).items():
        assert len(value) >= 40 and check_secret(value) == value, (name, key)
    assert len(set(secret_values(rendered["defaults"]).values())) == 2
    given = {"meshSecret": {"value": "m" * 20}, "apiToken": {"value": "a" * 20}}
    assert set(secret_values(render(tmp_path, given)).values()) == {"m" * 20, "a" * 20}
    # a Secret the user manages: none rendered, every reference names it
    mine = {
        "meshSecret": {"existingSecret": "my-mesh", "key": "secret"},
        "apiToken": {"existingSecret": "my-token", "key": "token"},
        **{k: v for k, v in FULL.items() if k in ("router", "store", "engine", "metrics")},
    }
    objects = render(tmp_path, mine)
    assert of_kind(objects, "Secret") == []
    refs = set()
    for w in workloads(objects):
        for volume in w["spec"]["template"]["spec"].get("volumes", []):
            for source in volume.get("projected", {}).get("sources", []):
                refs |= {(source["secret"]["name"], item["key"]) for item in source["secret"]["items"]}
        for var in container(w).get("env", []):
            if "secretKeyRef" in var.get("valueFrom", {}):
                refs.add((var["valueFrom"]["secretKeyRef"]["name"], var["valueFrom"]["secretKeyRef"]["key"]))
    assert refs == {("my-mesh", "secret"), ("my-token", "token")}
    (monitor,) = of_kind(objects, "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["authorization"]["credentials"] == {"name": "my-token", "key": "token"}


@pytest.mark.parametrize(
    "values, error",
    [
        ({"listenAddress": "0.0.0.0"}, "listenAddress"),
        ({"meshSecret": {"value": "too-short"}}, "meshSecret"),
        ({"apiToken": {"value": "too-short"}}, "apiToken"),
        ({"controller": {"replicas": 0}}, "replicas"),
        ({"controller": {"replica": 2}}, "replica"),
        ({"engine": {"extraEnv": {"LMCACHE_P2P_HOST": "10.0.0.1"}}}, "LMCACHE_P2P_HOST"),
        ({"engine": {"extraEnv": {"CHUNK_SIZE": "512"}}}, "CHUNK_SIZE"),
        ({"engine": {"deployment": {"enabled": True}}}, "engine.deployment.model"),
    ],
)
def test_values_that_would_deploy_something_wrong_are_refused(tmp_path, values, error):
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    done = helm("template", "lmcache-p2p", str(CHART), "-f", str(values_file))
    assert done.returncode != 0 and error in done.stderr, done.stderr


def test_service_monitor_scrapes_each_controller_once_with_the_token(rendered):
    objects = rendered["full"]
    (monitor,) = of_kind(objects, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    selected = [s for s in of_kind(objects, "Service") if selector.items() <= s["metadata"]["labels"].items()]
    assert [s["metadata"]["name"] for s in selected] == ["lmcache-p2p-controller-headless"]
    assert selected[0]["spec"]["clusterIP"] == "None"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in selected[0]["spec"]["ports"]} and endpoint["path"] == "/metrics"
    assert endpoint["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": "lmcache-p2p-api-token", "key": "api-token"},
    }


def test_the_charts_dashboards_are_the_projects(rendered):
    for path in sorted((ROOT / "dashboards").glob("*.json")):
        assert (CHART / "dashboards" / path.name).read_bytes() == path.read_bytes(), path.name
    for cm in of_kind(rendered["full"], "ConfigMap"):
        if cm["metadata"]["labels"].get("grafana_dashboard") == "1":
            ((name, text),) = cm["data"].items()
            assert json.loads(text) == json.loads((ROOT / "dashboards" / name).read_text())
