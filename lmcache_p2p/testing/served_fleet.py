"""A fleet on this host as users run one: ``lmcache_controller``, N vLLM OpenAI servers with our
connector (P2P on, each registering the URL it serves on), and ``lmcache_router`` in front.
The router tests and ``benchmarks/bench_routing.py`` start it; every process logs to a file in
``workdir`` and is stopped with its process group.

Engines are configured the way an operator configures a fleet from one template: ports 0, an
instance id per engine (``engine1``...), ``serve_url: http://{host}:PORT``.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from lmcache_p2p.demo import CPU_ENGINE_ARGS, CPU_ENGINE_ENV, ServedProcess, http_status
from lmcache_p2p.integration.vllm.launcher import vllm_server_command


def _bin(name: str) -> str:
    return shutil.which(name, path=str(Path(sys.executable).parent)) or name


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServedFleet:
    workdir: Path
    model: str
    engines: int = 2
    cpu_gb: float = 0.5  # each engine's CPU pool
    channel: str = "tcp"
    heartbeat_s: float = 1.0  # the load /route weighs is this fresh
    controller_args: tuple[str, ...] = ()
    engine_args: tuple[str, ...] = ()  # more vLLM arguments (e.g. --kv-events-config)
    engine_env: dict[str, str] = field(default_factory=dict)
    engine_extra: dict = field(default_factory=dict)  # more LMCache config keys for every engine
    # Each engine publishes vLLM's KV cache events (--kv-events-config) on an endpoint of its own.
    kv_events: bool = False
    kv_event_endpoints: list[str] = field(default_factory=list)
    controller_url: str = ""
    engine_urls: list[str] = field(default_factory=list)
    instance_ids: list[str] = field(default_factory=list)
    processes: dict[str, ServedProcess] = field(default_factory=dict)

    def engine_config(self, index: int, pull: int, reply: int, port: int) -> dict:
        return {
            "chunk_size": 256,
            "local_cpu": True,
            "max_local_cpu_size": self.cpu_gb,
            "enable_p2p": True,
            "p2p_host": "127.0.0.1",
            "p2p_init_ports": 0,
            "p2p_lookup_ports": 0,
            "transfer_channel": self.channel,
            "enable_controller": True,
            "lmcache_instance_id": f"engine{index}",
            "controller_pull_url": f"127.0.0.1:{pull}",
            "controller_reply_url": f"127.0.0.1:{reply}",
            "lmcache_worker_ports": 0,
            "lmcache_worker_heartbeat_time": self.heartbeat_s,
            "serve_url": f"http://{{host}}:{port}",
            **self.engine_extra,
        }

    def start(self, timeout: float = 300.0) -> ServedFleet:
        self.workdir.mkdir(parents=True, exist_ok=True)
        http, pull, reply, heartbeat = (free_port() for _ in range(4))
        controller = ServedProcess(
            "controller",
            [
                _bin("lmcache_controller"),
                "--host",
                "127.0.0.1",
                "--port",
                str(http),
                "--monitor-ports",
                f'{{"pull": {pull}, "reply": {reply}, "heartbeat": {heartbeat}}}',
                *self.controller_args,
            ],
            self.workdir / "controller.log",
        ).start()
        self.processes["controller"] = controller
        self.controller_url = f"http://127.0.0.1:{http}"
        controller.wait_http(f"{self.controller_url}/controller/workers", 30)
        for i in range(1, self.engines + 1):
            port = free_port()
            path = self.workdir / f"engine{i}.yaml"
            path.write_text(yaml.safe_dump(self.engine_config(i, pull, reply, port)))
            env = {**CPU_ENGINE_ENV, **self.engine_env, "LMCACHE_CONFIG_FILE": str(path)}
            extra = list(self.engine_args)
            if self.kv_events:
                # ipc: vLLM's publisher binds only wildcard tcp (all interfaces) or ipc addresses,
                # and connects to any other; a local socket file keeps it off the network.
                endpoint = f"ipc://{self.workdir.resolve()}/engine{i}-kv-events.sock"
                self.kv_event_endpoints.append(endpoint)
                events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
                extra += ["--kv-events-config", json.dumps(events)]
            command = vllm_server_command(self.model, port, *CPU_ENGINE_ARGS, *extra)
            self.processes[f"engine{i}"] = ServedProcess(
                f"engine{i}", command, self.workdir / f"engine{i}.log", env
            ).start()
            self.engine_urls.append(f"http://127.0.0.1:{port}")
            self.instance_ids.append(f"engine{i}")
        for name, url in zip(self.instance_ids, self.engine_urls, strict=True):
            self.processes[name].wait_http(f"{url}/health", timeout)
        return self

    def start_router(self, policy: str, name: str | None = None, *extra: str) -> tuple[ServedProcess, str]:
        """``lmcache_router`` with ``policy`` on a free port; (its process, its URL) once healthy."""
        port = free_port()
        name = name or f"router-{policy}"
        router = ServedProcess(
            name,
            [
                _bin("lmcache_router"),
                "--controller-url",
                self.controller_url,
                "--port",
                str(port),
                "--policy",
                policy,
                *extra,
            ],
            self.workdir / f"{name}.log",
        ).start()
        self.processes[name] = router
        url = f"http://127.0.0.1:{port}"
        router.wait_http(f"{url}/health", 60)
        return router, url

    def engines_up(self) -> list[str]:
        return [i for i, u in zip(self.instance_ids, self.engine_urls, strict=True) if http_status(f"{u}/health", 2)]

    def stop(self) -> None:
        for process in self.processes.values():
            process.terminate()
        for process in self.processes.values():
            with contextlib.suppress(Exception):
                process.stop()
