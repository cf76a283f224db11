"""Seed 000 under Ray Serve LLM: a real local Ray cluster of two nodes (``ray start`` on 127.0.0.1),
our connector reached by the seed's unedited ``kv_connector: LMCacheConnectorV1``.

The cluster is registered once with ``lmcache-p2p ray-register`` (Ray Serve LLM's own set-up step
for that name checks ``import lmcache``; see :mod:`lmcache_p2p.integration.ray`). Then:

* the seed's ``serve run config.yaml`` form, one replica: a repeated prompt is a CPU-tier hit;
* the seed's Python form (``LLMConfig`` + ``build_openai_app`` + ``serve.run``), made a fleet:
  two replicas of one deployment, one per Ray node, sharing KV through one ``lmcache_controller``
  started beside Ray: a prompt one replica served is a peer hit on the other.

What each config changes from the seed, and why, is in docs/ray_serve.md: the model (the tiny
Llama) and the pool size (``LMCACHE_MAX_LOCAL_CPU_SIZE``), ``accelerator_config: {kind: cpu}``
(CPU hosts), the CPU engine arguments, ``enable_prefix_caching: false`` (so vLLM's own prefix
cache cannot answer the repeat before our tier), and the fleet's ``LMCACHE_*`` variables (ports
0, no instance id: replicas share one environment).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml
from protocol_client import ControllerProcess, wait_for

from lmcache_p2p.testing.ports import free_ports

# Each test starts vLLM engines inside Ray on shared cores, and serve.run returns only once every
# replica is up: in a full `make test` the two-replica test outran pytest's default 300 s once.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.ray, pytest.mark.serial]

BIN = Path(sys.executable).parent
SEED_YAML = Path(__file__).resolve().parent.parent / "configs" / "ray_serve.yaml"
MODEL_ID = "qwen-0.5b"  # the seed's model id; the weights are the tiny Llama
PROMPT_WORDS = 700  # about 3.4k tokens with the tiny Llama's tokenizer: 13 chunks of 256
CHUNK = 256

# The seed's runtime_env.env_vars, the pool scaled from 100 GB, and the CPU engine's environment.
SEED_ENV = {"LMCACHE_LOCAL_CPU": "True", "LMCACHE_CHUNK_SIZE": str(CHUNK), "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.25"}
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
# The seed's engine_kwargs, and what a CPU engine with the tiny model needs.
SEED_ENGINE_KWARGS = {
    "tensor_parallel_size": 1,
    "kv_transfer_config": {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"},
}
CPU_ENGINE_KWARGS = {"dtype": "float32", "enforce_eager": True, "max_model_len": 4096, "enable_prefix_caching": False}


class RayCluster:
    """``ray start`` head and worker nodes on 127.0.0.1, logs under a temp dir of their own."""

    def __init__(self, nodes: int = 2, cpus_per_node: int = 4):
        self.dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's socket paths
        self.port, self.serve_port = free_ports(2)
        self.address = f"127.0.0.1:{self.port}"
        self.nodes, self.cpus = nodes, cpus_per_node

    def _ray(self, *args: str) -> None:
        # The marker goes to every process the nodes start (raylet, Ray workers, the replicas'
        # vLLM engines): ``ray stop`` stops Ray's own, but a replica's engine processes outlive it.
        # Not LMCACHE_*: the engines read that namespace as configuration and refuse unknown keys.
        env = {**os.environ, "LMC_P2P_TEST_RAY_CLUSTER": self.dir.name}
        done = subprocess.run([str(BIN / "ray"), *args], capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 0, f"ray {' '.join(args)}:\n{done.stderr[-3000:]}"

    def _kill_leftovers(self, engines_only: bool) -> None:
        """SIGKILL what this cluster started and outlived its stop (only vLLM's processes, with
        ``engines_only``). Seen: each run left two engines of 1.5 GB behind."""
        marker = f"LMC_P2P_TEST_RAY_CLUSTER={self.dir.name}".encode()
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                if marker not in (proc / "environ").read_bytes().split(b"\0"):
                    continue
                if engines_only and not (proc / "cmdline").read_bytes().startswith(b"VLLM::"):
                    continue
                os.kill(int(proc.name), signal.SIGKILL)
            except (OSError, ValueError):  # gone meanwhile, or not ours to read
                continue

    def start(self) -> RayCluster:
        # Each node offers one "lmcache_engine" slot and each replica asks for one: one per node.
        node = ["--node-ip-address", "127.0.0.1", "--num-cpus", str(self.cpus), "--disable-usage-stats"]
        # Worker ports from the OS: Ray's default range (10002-19999) overlaps free_ports' range,
        # and `ray start` refuses a head port that falls inside it.
        node += ["--min-worker-port", "0", "--max-worker-port", "0"]
        node += ["--resources", json.dumps({"lmcache_engine": 1})]
        head = ["--head", "--port", str(self.port), "--include-dashboard=false", "--temp-dir", str(self.dir)]
        self._ray("start", *head, *node)
        for _ in range(self.nodes - 1):
            self._ray("start", "--address", self.address, *node)
        return self

    def env(self) -> dict[str, str]:
        return {**os.environ, "RAY_ADDRESS": self.address}

    def serve_shutdown(self) -> None:
        """Delete every application and wait until Serve's proxy no longer routes to one: the
        next test deploys at the same route prefix, which Serve refuses while an application
        still holds it (seen under full runs). Through the Python API: `serve shutdown` and
        `serve status` ask the dashboard, which these nodes do not run; `serve shutdown` exits 0
        having done nothing, and only looked as if it worked while `serve run`'s own Ctrl-C
        clean-up deleted the application in time."""
        code = f"import ray; from ray import serve; ray.init(address={self.address!r}); serve.shutdown()"
        done = subprocess.run([sys.executable, "-c", code], env=self.env(), capture_output=True, text=True, timeout=180)
        self._kill_leftovers(engines_only=True)  # the next test needs the cores and memory
        deadline = time.monotonic() + 60
        while True:
            try:
                status = httpx.get(f"http://127.0.0.1:{self.serve_port}/v1/models", timeout=5).status_code
            except httpx.HTTPError:
                return  # the proxy is gone with the applications
            if status == 404:
                return  # the proxy answers, with no application at the prefix
            assert time.monotonic() < deadline, (
                f"an application still answers at / (HTTP {status}) after serve shutdown "
                f"(rc {done.returncode}: {done.stderr[-1500:]})"
            )
            time.sleep(2)

    def logs(self) -> str:
        """Every Ray worker's stderr: the replicas' vLLM and lmcache-p2p logs."""
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.dir.glob("session_*/logs/worker-*.err")))

    def stop(self) -> None:
        subprocess.run([str(BIN / "ray"), "stop", "--force"], capture_output=True, timeout=120)
        self._kill_leftovers(engines_only=False)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_cluster():
    cluster = RayCluster().start()
    try:
        registered = subprocess.run(
            [str(BIN / "lmcache-p2p"), "ray-register", "--address", cluster.address],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert registered.returncode == 0, registered.stderr[-3000:]
        assert json.loads(registered.stdout.splitlines()[-1]) == {
            "address": cluster.address,
            "LMCacheConnectorV1": "lmcache_p2p.integration.ray:P2PConnectorBackend",
        }
        yield cluster
    finally:
        cluster.stop()


def prompt(seed: int) -> str:
    return " ".join(f"w{seed}x{(i * 7919) % 97}" for i in range(PROMPT_WORDS))


def complete(cluster: RayCluster, text: str, max_tokens: int = 8) -> dict:
    body = {"model": MODEL_ID, "prompt": text, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"http://127.0.0.1:{cluster.serve_port}/v1/completions", json=body, timeout=180)
    assert response.status_code == 200, response.text[:2000]
    return response.json()


def wait_ready(cluster: RayCluster, process: subprocess.Popen | None = None, log: Path | None = None) -> None:
    """Until a completion answers (/v1/models answers before the engine is up); fails early if
    ``process`` (serve run) exits."""

    def answered() -> bool:
        if process is not None and log is not None:
            assert process.poll() is None, log.read_text()[-4000:]
        try:
            body = {"model": MODEL_ID, "prompt": "ready?", "max_tokens": 1}
            url = f"http://127.0.0.1:{cluster.serve_port}/v1/completions"
            return httpx.post(url, json=body, timeout=30).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(answered, timeout=420, what="a Ray Serve completion", interval=3)


def retrieved(logs: str) -> list[tuple[int, int, str]]:
    """Our connector's loads: (tokens retrieved, prompt tokens, holder or "" for local tiers)."""
    found = re.findall(r"Retrieved (\d+) out of total (\d+) tokens\..*?(?:\(from (\S+) rank \d+|$)", logs, re.M)
    return [(int(n), int(total), holder) for n, total, holder in found]


def test_seed_serve_run_yaml_answers_and_a_repeat_is_a_cpu_tier_hit(ray_cluster, tiny_model, tmp_path):
    config = yaml.safe_load(SEED_YAML.read_text())  # the seed's file as configs/ ships it
    app = config["applications"][0]
    assert app["import_path"] == "ray.serve.llm:build_openai_app"
    app["runtime_env"]["env_vars"] |= {**SEED_ENV, **CPU_ENV}  # the pool scaled from 100 GB
    llm = app["args"]["llm_configs"][0]
    assert llm["engine_kwargs"] == SEED_ENGINE_KWARGS  # no kv_connector_module_path needed
    llm["model_loading_config"]["model_source"] = tiny_model
    llm["accelerator_config"] = {"kind": "cpu"}
    llm["engine_kwargs"] |= CPU_ENGINE_KWARGS
    # The Serve proxy's address: a harness choice (a free port), not part of the seed.
    config["http_options"] = {"host": "127.0.0.1", "port": ray_cluster.serve_port}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    log = tmp_path / "serve-run.log"
    with open(log, "w") as out:
        serve = subprocess.Popen(
            [str(BIN / "serve"), "run", str(path)], env=ray_cluster.env(), stdout=out, stderr=subprocess.STDOUT
        )
    try:
        wait_ready(ray_cluster, serve, log)
        text = prompt(1)
        first, second = complete(ray_cluster, text), complete(ray_cluster, text)
        assert first["choices"][0]["text"] == second["choices"][0]["text"]
        prompt_tokens = first["usage"]["prompt_tokens"]
        logs = ray_cluster.logs()
        assert "Ray Serve replica: LMCacheConnectorV1 is lmcache-p2p" in logs
        assert "LMCacheConnectorV1 resolves to lmcache-p2p" in logs
        # The repeat loaded every full chunk of the prompt from this replica's CPU tier.
        assert (prompt_tokens // CHUNK * CHUNK, prompt_tokens, "") in retrieved(logs), retrieved(logs)
    finally:
        serve.send_signal(signal.SIGINT)  # serve run deletes its application on Ctrl-C
        try:
            serve.wait(timeout=30)  # serve_shutdown below deletes what it leaves
        except subprocess.TimeoutExpired:
            serve.kill()
        ray_cluster.serve_shutdown()


# The seed's Python form; what it adds for a fleet is marked. {...} are filled in by the test.
PYTHON_FORM = """\
from ray.serve.llm import LLMConfig, build_openai_app
import ray.serve as serve

# Added for Ray Serve LLM's own LMCacheConnectorV1 check (docs/ray_serve.md): a Python driver
# that imports ray.serve.llm before Ray connects writes Ray's entry back, so it registers ours.
from lmcache_p2p.integration.ray import register

register()
serve.start(http_options={{"host": "127.0.0.1", "port": {serve_port}}})  # harness: a free port

llm_config = LLMConfig(
    model_loading_config={{"model_id": "{model_id}", "model_source": "{model}"}},
    accelerator_config={{"kind": "cpu"}},
    deployment_config={{"num_replicas": 2}},  # added: the fleet
    placement_group_config={{"bundles": [{{"CPU": 1, "lmcache_engine": 1}}]}},  # one per node
    engine_kwargs={engine_kwargs},
    runtime_env={{"env_vars": {env_vars}}},
)
app = build_openai_app({{"llm_configs": [llm_config]}})
serve.run(app)
"""


def test_seed_python_form_as_two_replicas_on_two_nodes_share_kv_through_one_controller(
    ray_cluster, tiny_model, tmp_path
):
    controller = ControllerProcess().start()
    # The fleet's variables (docs/ray_serve.md, "A fleet"): every replica gets the same environment, so
    # ports are 0 (each rank binds free ones and registers them), no instance id is set (each
    # engine registers as {hostname}-{engine_id}) and no p2p_host (each rank registers the address
    # that routes to the controller: 127.0.0.1 here, its node's address in a real cluster).
    fleet_env = {
        "LMCACHE_ENABLE_CONTROLLER": "True",
        "LMCACHE_CONTROLLER_PULL_URL": f"127.0.0.1:{controller.pull}",
        "LMCACHE_CONTROLLER_REPLY_URL": f"127.0.0.1:{controller.reply}",
        "LMCACHE_LMCACHE_WORKER_PORTS": "0",
        "LMCACHE_ENABLE_P2P": "True",
        "LMCACHE_P2P_INIT_PORTS": "0",
        "LMCACHE_P2P_LOOKUP_PORTS": "0",
        "LMCACHE_TRANSFER_CHANNEL": "tcp",
    }
    driver = tmp_path / "seed_python_form.py"
    driver.write_text(
        PYTHON_FORM.format(
            serve_port=ray_cluster.serve_port,
            model_id=MODEL_ID,
            model=tiny_model,
            engine_kwargs=repr({**SEED_ENGINE_KWARGS, **CPU_ENGINE_KWARGS}),
            env_vars=repr({**SEED_ENV, **CPU_ENV, **fleet_env}),
        )
    )
    log = tmp_path / "driver.log"
    try:
        with open(log, "w") as out:
            deployed = subprocess.run(
                [sys.executable, str(driver)], env=ray_cluster.env(), stdout=out, stderr=subprocess.STDOUT, timeout=600
            )
        assert deployed.returncode == 0, log.read_text()[-4000:]

        def instances() -> list[str]:
            return sorted({w["instance_id"] for w in controller.http.get("/controller/workers").json()["workers"]})

        wait_for(lambda: len(instances()) == 2, timeout=420, what="both replicas registered", interval=2)
        ids = instances()
        # Ray needs a little longer than registration to route to both replicas.
        wait_ready(ray_cluster)

        text = prompt(2)
        outputs = [complete(ray_cluster, text)["choices"][0]["text"]]
        # Serve's router sends two requests at once to different replicas when both are idle (it
        # prefers the shorter queue): one of them lands on the replica that does not hold it.
        with ThreadPoolExecutor(2) as pool:
            for _ in range(4):
                outputs += [r["choices"][0]["text"] for r in pool.map(lambda t: complete(ray_cluster, t), [text] * 2)]
                if any(holder for _, _, holder in retrieved(ray_cluster.logs())):
                    break
        assert len(set(outputs)) == 1, outputs
        loads = retrieved(ray_cluster.logs())
        peer = [(n, holder) for n, _, holder in loads if holder]
        assert peer and peer[0][0] >= 12 * CHUNK and peer[0][1] in ids, loads
        assert any(n >= 12 * CHUNK and not holder for n, _, holder in loads), loads  # and a CPU-tier hit
    finally:
        try:
            ray_cluster.serve_shutdown()
        finally:
            controller.stop()  # also when the shutdown failed: two runs left a controller behind
