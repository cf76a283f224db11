"""A fleet on this host as users run one: ``lmcache_controller``, N vLLM OpenAI servers with our
connector (P2P on, each registering the URL it serves on), and ``lmcache_router`` in front.
The router tests and ``benchmarks/bench_routing.py`` start it; every process logs to a file in
``workdir`` and is stopped with its process group.

Engines are configured the way an operator configures a fleet from one template: ports 0, an
instance id per engine (``engine1``...), ``serve_url: http://{host}:PORT``. With ``tp`` > 1 each
engine runs ``--tensor-parallel-size tp`` with its ranks pinned (:func:`tp_engine_env`) and, with
``ports_per_rank``, seed 004's explicit port lists (one port per rank in each list).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from lmcache_p2p.integration.vllm.launcher import vllm_server_command
from lmcache_p2p.testing.ports import free_ports
from lmcache_p2p.testing.processes import CPU_ENGINE_ARGS, CPU_ENGINE_ENV, ServedProcess, stream_completion
from lmcache_p2p.testing.tiny_model import sample_text

# On CUDA: eager (no graph capture, which costs each engine's start-up a minute), float32 like
# the CPU engines (greedy outputs compared across engines and TP sizes stay equal), and vLLM's
# PyTorch sampler (the GPU host has no flashinfer).
GPU_ENGINE_ARGS = ("--dtype", "float32", "--enforce-eager", "--max-model-len", "8192")
GPU_ENGINE_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "TOKENIZERS_PARALLELISM": "false"}


def venv_bin(name: str) -> str:
    """``name`` from this interpreter's environment (where the project's scripts are installed),
    else from PATH (a system server: ``redis-server``), else as given."""
    return shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name) or name


def controller_command(http: int, pull: int, reply: int, heartbeat: int, *extra: str) -> list[str]:
    """``lmcache_controller`` on 127.0.0.1: its HTTP API on port ``http``, its ZMQ monitor on
    ``pull``, ``reply`` and ``heartbeat``; ``extra``: more of its arguments."""
    monitor = f'{{"pull": {pull}, "reply": {reply}, "heartbeat": {heartbeat}}}'
    return [
        venv_bin("lmcache_controller"),
        "--host",
        "127.0.0.1",
        "--port",
        str(http),
        "--monitor-ports",
        monitor,
        *extra,
    ]


def tp_engine_env(tp: int) -> dict[str, str]:
    """What a vLLM CPU engine with ``tp`` ranks needs on a small host (docs/tensor-parallelism.md,
    "Small CPU hosts"): rank r's OpenMP thread on core r (vLLM's automatic binding wants a NUMA node per
    rank and refuses to start on a one-node host), and no torch.compile: vLLM compiles its vocab
    mask with inductor at the first forward pass of a TP engine, a C++ build (each engine's first
    request 4-6 s instead of 0.2-1.3 s in bench_tp.py on a 2-vCPU host), while the other rank
    spins in the all-reduce (its Python threads, lookups and pulls included, held up with it)."""
    cores = os.cpu_count() or 1
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(rank % cores) for rank in range(tp)), "TORCHDYNAMO_DISABLE": "1"}


@dataclass
class ServedFleet:
    workdir: Path
    model: str
    engines: int = 2
    cpu_gb: float = 0.5  # each engine's CPU pool
    heartbeat_s: float = 1.0  # the load /route weighs is this fresh
    engine_env: dict[str, str] = field(default_factory=dict)
    engine_extra: dict = field(default_factory=dict)  # more LMCache config keys for every engine
    engine_extras: dict[int, dict] = field(default_factory=dict)  # ... and for engine i (from 1) alone
    engine_args: tuple[str, ...] = ()  # more vLLM arguments for every engine
    controller_args: tuple[str, ...] = ()  # more lmcache_controller arguments
    tp: int = 1  # --tensor-parallel-size of every engine
    engine_tps: tuple[int, ...] = ()  # per engine, when they differ (else ``tp`` for each)
    # Engines on CUDA with this --gpu-memory-utilization each (they share the host's GPUs: every
    # rank of every engine sees them all); None: vLLM's CPU build (CPU_ENGINE_ARGS, CPU_ENGINE_ENV).
    gpu_memory_utilization: float | None = None
    ports_per_rank: bool = False  # seed 004's port lists, a free port per rank, instead of 0
    # Each engine's processes (API server, engine core, workers) on cores of their own: engine i
    # (from 0) on core i mod the host's cores, its OpenMP thread bound there too. Engines that share
    # cores slow each other down (vLLM's processes spin for a second after every step), which on a
    # small host makes one engine doing everything beat any spreading; a fleet's engines do not
    # share cores. TP > 1 keeps tp_engine_env's binding.
    pin_engines: bool = False
    # Each engine publishes vLLM's KV cache events (--kv-events-config) on an endpoint of its own.
    kv_events: bool = False
    kv_event_endpoints: list[str] = field(default_factory=list)
    controller_url: str = ""
    engine_urls: list[str] = field(default_factory=list)
    instance_ids: list[str] = field(default_factory=list)
    processes: dict[str, ServedProcess] = field(default_factory=dict)

    def engine_tp(self, index: int) -> int:
        """Engine ``index``'s (from 1) --tensor-parallel-size."""
        return self.engine_tps[index - 1] if self.engine_tps else self.tp

    def engine_config(self, index: int, pull: int, reply: int, port: int) -> dict:
        tp = self.engine_tp(index)
        return {
            "chunk_size": 256,
            "local_cpu": True,
            "max_local_cpu_size": self.cpu_gb,
            "enable_p2p": True,
            "p2p_host": "127.0.0.1",
            "p2p_init_ports": self._rank_ports(tp),
            "p2p_lookup_ports": self._rank_ports(tp),
            "transfer_channel": "tcp",
            "enable_controller": True,
            "lmcache_instance_id": f"engine{index}",
            "controller_pull_url": f"127.0.0.1:{pull}",
            "controller_reply_url": f"127.0.0.1:{reply}",
            "lmcache_worker_ports": self._rank_ports(tp),
            "lmcache_worker_heartbeat_time": self.heartbeat_s,
            "serve_url": f"http://{{host}}:{port}",
            **self.engine_extra,
            **self.engine_extras.get(index, {}),
        }

    def _rank_ports(self, tp: int) -> list[int] | int:
        return free_ports(tp) if self.ports_per_rank else 0

    def start(self, timeout: float = 300.0) -> ServedFleet:
        """Start the controller and the engines and wait for them; if any fails to come up, what
        did start is stopped before the error goes on (callers stop a fleet only once it is up)."""
        try:
            return self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> ServedFleet:
        self.workdir.mkdir(parents=True, exist_ok=True)
        http, pull, reply, heartbeat = free_ports(4)
        controller = ServedProcess(
            "controller",
            controller_command(http, pull, reply, heartbeat, *self.controller_args),
            self.workdir / "controller.log",
        ).start()
        self.processes["controller"] = controller
        self.controller_url = f"http://127.0.0.1:{http}"
        controller.wait_http(f"{self.controller_url}/controller/workers", 30)
        for i in range(1, self.engines + 1):
            port = free_ports(1)[0]
            path = self.workdir / f"engine{i}.yaml"
            path.write_text(yaml.safe_dump(self.engine_config(i, pull, reply, port)))
            tp = self.engine_tp(i)
            on_gpu = self.gpu_memory_utilization is not None
            env = {
                **(GPU_ENGINE_ENV if on_gpu else CPU_ENGINE_ENV),
                **self.engine_env,
                "LMCACHE_CONFIG_FILE": str(path),
            }
            extra: list[str] = list(self.engine_args)
            if on_gpu:
                extra += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
            if tp > 1:
                if not on_gpu:
                    env = {**tp_engine_env(tp), **env}
                extra += ["--tensor-parallel-size", str(tp)]
            if self.kv_events:
                # ipc: vLLM's publisher binds only wildcard tcp (all interfaces) or ipc addresses,
                # and connects to any other; a local socket file keeps it off the network.
                endpoint = f"ipc://{self.workdir.resolve()}/engine{i}-kv-events.sock"
                self.kv_event_endpoints.append(endpoint)
                events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
                extra += ["--kv-events-config", json.dumps(events)]
            base: tuple[str, ...] = GPU_ENGINE_ARGS if on_gpu else CPU_ENGINE_ARGS
            if "--dtype" in self.engine_args:  # the caller's replaces ours (vLLM warns of a duplicate)
                at = base.index("--dtype")
                base = base[:at] + base[at + 2 :]
            command = vllm_server_command(self.model, port, *base, *extra)
            if self.pin_engines and tp == 1 and not on_gpu:
                core = str((i - 1) % (os.cpu_count() or 1))
                env["VLLM_CPU_OMP_THREADS_BIND"] = core
                command = ["taskset", "--cpu-list", core, *command]
            self.processes[f"engine{i}"] = ServedProcess(
                f"engine{i}", command, self.workdir / f"engine{i}.log", env
            ).start()
            self.engine_urls.append(f"http://127.0.0.1:{port}")
            self.instance_ids.append(f"engine{i}")
            if on_gpu:  # one at a time: each engine profiles the GPU memory the others left it
                self.processes[f"engine{i}"].wait_http(f"{self.engine_urls[-1]}/health", timeout)
        for name, url in zip(self.instance_ids, self.engine_urls, strict=True):
            self.processes[name].wait_http(f"{url}/health", timeout)
        return self

    def first_forward(self, words: int) -> list[float]:
        """Send each engine a document of ``words`` words that no later prompt shares, so that
        vLLM's first forward pass at that size (where a TP engine builds its kernels) stays out of
        what a test or benchmark measures; each engine's time to first token, in seconds."""
        return [
            stream_completion(url, self.model, sample_text(words, seed=10_000 + i), max_tokens=2)["ttft_s"]
            for i, url in enumerate(self.engine_urls)
        ]

    def start_server(self, name: str, command: list[str], health_path: str = "/health") -> tuple[ServedProcess, str]:
        """Another HTTP server beside the fleet (a router): ``command`` with its ``"{port}"``
        argument replaced by a free port; (its process, its URL) once ``health_path`` answers.
        Stopped with the rest."""
        port = free_ports(1)[0]
        command = [str(port) if arg == "{port}" else arg for arg in command]
        server = ServedProcess(name, command, self.workdir / f"{name}.log").start()
        self.processes[name] = server
        url = f"http://127.0.0.1:{port}"
        server.wait_http(f"{url}{health_path}", 120)
        return server, url

    def start_router(self, policy: str, name: str | None = None, *extra: str) -> tuple[ServedProcess, str]:
        """``lmcache_router`` with ``policy``; (its process, its URL) once healthy."""
        command = [venv_bin("lmcache_router"), "--controller-url", self.controller_url, "--port", "{port}"]
        return self.start_server(name or f"router-{policy}", [*command, "--policy", policy, *extra])

    def stop(self) -> None:
        for process in self.processes.values():
            process.terminate()
        for process in self.processes.values():
            with contextlib.suppress(Exception):
                process.stop()
