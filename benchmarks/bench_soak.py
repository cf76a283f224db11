"""A churn soak: a mesh under a steady client load while a chaos loop kills and restarts its
processes, for a bounded time. Prints one JSON object.

    .venv/bin/python benchmarks/bench_soak.py [--minutes 30] [--seed 0] [--model DIR] [--engines 2]

What runs, all on 127.0.0.1 (nothing binds every interface: vLLM gets ``--host 127.0.0.1``,
checked at the end from /proc/net/tcp):

* two ``lmcache_controller`` processes, the high-availability pair (README, "High availability"):
  every engine is given both, paired by position;
* ``--engines`` vLLM CPU OpenAI servers with the connector on the tiny test model, P2P over TCP,
  each pinned to a core in turn, vLLM's own prefix cache off (``--no-enable-prefix-caching``:
  a repeat is then the connector's to serve; ``--vllm-prefix-caching`` keeps it); odd engines
  write behind to a Redis (Debian's ``redis-server``, ``--maxmemory`` with LRU eviction), even
  ones to an ``lmcache_server``;
* one client thread: greedy completions of ``--max-tokens`` tokens of token-id prompts, a random
  live engine each, a random one of ``--recurring`` recurring prompts, or (``--new-fraction``)
  the next never-sent prompt, or (``--recent-fraction``) one of the last ``--recent-window`` new
  prompts again (held by the engine that answered it, or by no live one since a kill);
* a chaos loop (``--seed``): after a random pause (``--fault-min-s`` to ``--fault-max-s``) it
  ``kill -9``s one process group (an engine, one of the controllers, the Redis or the
  ``lmcache_server``: each kind once a round, the rounds' orders and the targets random),
  waits 1-5 s and restarts it on the same ports, waits until it answers, then pauses again;
  one fault at a time, so one controller at most is ever down and one engine at least is up.
  No fault starts in the last ``--quiet-end-s``; the soak ends when the time is up and the last
  restart is back.

The reference outputs come from a vLLM engine without the connector (the offline driver,
``--no-connector``), started before the fleet: every prompt the client may send is computed
there once, cold; every answer the fleet gives is compared with it (``outputs_differed`` must
be 0).

Hits by tier per minute come from each engine's ``/metrics`` (the connector's ``lmcache:``
counters), read every ``--sample-s``: peer tokens are pulled chunks, remote tokens are the remote
store's bytes read over a chunk's bytes, CPU tokens the rest of the tokens loaded. A killed
engine's counts since its last read are lost. Recomputes caused by faults: missed chunks whose
reason is a fault's (``timeout``, ``holder_gone``, ``refused``, ``checksum_failed``), failed
pulls and remote store errors.

Every long-lived process is measured at the start (after a warm-up) and at the end (load stopped,
``--settle-s`` later), a restarted one from its restart (after its warm-up): pinned CPU pages
(engine status through a controller's ``/status``), descriptors, threads and resident memory
summed over its process group (/proc). Each has a stated growth bound; ``within_bounds`` says
whether it kept it.

Progress goes to stderr, one line a minute. Every process is stopped on exit, on Ctrl-C and on
errors.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import socket
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from instances import InstanceProcess  # noqa: E402

from lmcache_p2p.integration.vllm.launcher import vllm_server_command  # noqa: E402
from lmcache_p2p.testing import offline_driver  # noqa: E402
from lmcache_p2p.testing.measure import footprint, process_group  # noqa: E402
from lmcache_p2p.testing.ports import free_ports  # noqa: E402
from lmcache_p2p.testing.processes import CPU_ENGINE_ARGS, CPU_ENGINE_ENV, ServedProcess, http_status  # noqa: E402
from lmcache_p2p.testing.served_fleet import controller_command, venv_bin  # noqa: E402
from lmcache_p2p.testing.tiny_model import build, sample_prompts  # noqa: E402

CHUNK = 256
# One chunk of the tiny model: 2 layers x (K, V) x 256 tokens x 2 heads x 64 x 4 bytes.
PAGE_BYTES = 2 * 2 * CHUNK * 2 * 64 * 4
FAULT_REASONS = ("timeout", "holder_gone", "refused", "checksum_failed")
ENGINE_ENV = {**CPU_ENGINE_ENV, "VLLM_LOGGING_LEVEL": "INFO"}
REDIS_MAXMEMORY_MIB = 256
LMSERVER_GB = 0.25

# Growth bounds, end minus start (a restarted process: minus its restart). Engines: descriptors
# and threads for reconnections that must not pile up; memory: their CPU pool filling (pages are
# touched as chunks land) and vLLM's own caches settling, plus slack. Stores fill up to their
# capacity. No page may stay pinned once no request is in flight.
BOUNDS: dict[str, dict[str, float]] = {
    "engine": {"fds": 32, "threads": 16, "rss_mib_extra": 256},
    "controller": {"fds": 32, "threads": 8, "rss_mib": 64},
    "redis": {"fds": 16, "threads": 4, "rss_mib": REDIS_MAXMEMORY_MIB + 64},
    "lmcache_server": {"fds": 16, "threads": 8, "rss_mib": LMSERVER_GB * 1024 + 64},
}


def log(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def tcp_up(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def redis_up(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def http_ready(url: str) -> Callable[[], bool]:
    return lambda: http_status(url, 2) == 200


def summed(buckets) -> dict[str, float]:
    """Per-minute buckets added up, key by key."""
    total: dict[str, float] = defaultdict(float)
    for bucket in buckets:
        for key, value in bucket.items():
            total[key] += value
    return total


class Member:
    """One long-lived process group of the soak, restartable on the same ports and measured per
    incarnation (from its last start)."""

    def __init__(
        self,
        name: str,
        kind: str,
        command: list[str],
        workdir: Path,
        ready: Callable[[], bool],
        env: dict | None = None,
    ):
        self.name, self.kind, self.command, self.workdir = name, kind, command, workdir
        self.ready, self.env = ready, env
        self.incarnation = 0
        self.served: ServedProcess | None = None
        self.up = False  # answering and warmed up: the client may use it
        self.started_at = 0.0
        self.baseline: dict = {}
        self.mid: dict = {}

    def start(self) -> None:
        self.incarnation += 1
        log_path = self.workdir / f"{self.name}-{self.incarnation}.log"
        self.served = ServedProcess(self.name, self.command, log_path, self.env).start()
        self.started_at = time.monotonic()

    def wait_ready(self, timeout: float) -> None:
        assert self.served is not None
        deadline = time.monotonic() + timeout
        while not self.ready():
            if self.served.exited():
                raise RuntimeError(
                    f"{self.name} exited; its log ({self.served.log_path}) ends:\n{self.served.log()[-3000:]}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready in {timeout:.0f} s; log {self.served.log_path}")
            time.sleep(0.3)

    def pids(self) -> list[int]:
        if self.served is None or self.served.proc is None or self.served.exited():
            return []
        return process_group(self.served.proc.pid)

    def kill9(self) -> None:
        """SIGKILL to the whole process group (an engine's API server and engine core alike)."""
        self.up = False
        if self.served is None or self.served.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.served.proc.pid, signal.SIGKILL)
        self.served.stop()

    def stop(self) -> None:
        self.up = False
        if self.served is not None:
            self.served.terminate()

    def finish(self) -> None:
        if self.served is not None:
            with contextlib.suppress(Exception):
                self.served.stop(timeout=15)


class Soak:
    def __init__(self, args, workdir: Path, model: str):
        self.args, self.workdir, self.model = args, workdir, model
        self.lock = threading.Lock()
        self.stop_load = threading.Event()
        self.stop_chaos = threading.Event()
        self.members: list[Member] = []
        self.engines: list[Member] = []
        self.controllers: list[Member] = []
        self.engine_urls: dict[str, str] = {}
        self.controller_urls: list[str] = []
        self.prompts: list[list[int]] = []
        self.reference: list[list[int]] = []
        self.requests: list[dict] = []
        self.faults: list[dict] = []
        self.minutes: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.last_metrics: dict[tuple[str, int], dict[str, float]] = {}
        self.t0 = 0.0
        self.next_new = 0
        self.errors: list[str] = []

    # -- the fleet ---------------------------------------------------------------------------

    def build_fleet(self) -> None:
        a = self.args
        redis_port, lm_port = free_ports(2)
        redis_dir = self.workdir / "redis"
        redis_dir.mkdir()
        redis = Member(
            "redis",
            "redis",
            [
                venv_bin("redis-server"),
                *("--port", str(redis_port), "--bind", "127.0.0.1", "--dir", str(redis_dir)),
                *("--save", "", "--appendonly", "no", "--daemonize", "no"),
                *("--maxmemory", f"{REDIS_MAXMEMORY_MIB}mb", "--maxmemory-policy", "allkeys-lru"),
            ],
            self.workdir,
            lambda: redis_up(redis_port),
        )
        lmserver = Member(
            "lmcache_server",
            "lmcache_server",
            [venv_bin("lmcache_server"), "127.0.0.1", str(lm_port), "--max-size-gb", str(LMSERVER_GB)],
            self.workdir,
            lambda: tcp_up(lm_port),
        )
        pulls, replies = [], []
        for name in ("controller_a", "controller_b"):
            http, pull, reply, heartbeat = free_ports(4)
            url = f"http://127.0.0.1:{http}"
            controller = Member(
                name,
                "controller",
                controller_command(http, pull, reply, heartbeat),
                self.workdir,
                http_ready(f"{url}/controller/workers"),
            )
            self.controllers.append(controller)
            self.controller_urls.append(url)
            pulls.append(f"127.0.0.1:{pull}")
            replies.append(f"127.0.0.1:{reply}")
        self.members += [redis, lmserver, *self.controllers]
        cores = os.cpu_count() or 1
        prefix_caching = () if a.vllm_prefix_caching else ("--no-enable-prefix-caching",)
        for i in range(1, a.engines + 1):
            port = free_ports(1)[0]
            store = f"redis://127.0.0.1:{redis_port}" if i % 2 else f"lm://127.0.0.1:{lm_port}"
            config = {
                "chunk_size": CHUNK,
                "local_cpu": True,
                "max_local_cpu_size": a.cpu_gb,
                "enable_p2p": True,
                "p2p_host": "127.0.0.1",
                "p2p_init_ports": 0,
                "p2p_lookup_ports": 0,
                "transfer_channel": "tcp",
                "enable_controller": True,
                "lmcache_instance_id": f"engine{i}",
                "controller_pull_url": ",".join(pulls),
                "controller_reply_url": ",".join(replies),
                "lmcache_worker_ports": 0,
                "lmcache_worker_heartbeat_time": 1.0,
                "serve_url": f"http://{{host}}:{port}",
                "remote_url": store,
            }
            path = self.workdir / f"engine{i}.yaml"
            path.write_text(yaml.safe_dump(config))
            core = str((i - 1) % cores)
            env = {**ENGINE_ENV, "LMCACHE_CONFIG_FILE": str(path), "VLLM_CPU_OMP_THREADS_BIND": core}
            command = [
                "taskset",
                "--cpu-list",
                core,
                *vllm_server_command(self.model, port, "--host", "127.0.0.1", *CPU_ENGINE_ARGS, *prefix_caching),
            ]
            url = f"http://127.0.0.1:{port}"
            engine = Member(f"engine{i}", "engine", command, self.workdir, http_ready(f"{url}/health"), env)
            self.engine_urls[engine.name] = url
            self.engines.append(engine)
        self.members += self.engines

    def start_fleet(self) -> None:
        for member in self.members:
            member.start()
            if member.kind != "engine":
                member.wait_ready(60)
        for engine in self.engines:
            engine.wait_ready(600)
            log(f"{engine.name} is up")
        for i, engine in enumerate(self.engines):
            self.warm(engine, 90_000 + i)
        # A pass over the recurring prompts on each engine: vLLM's and the connector's first
        # allocations out of the baseline (and the recurring prompts stored in the mesh).
        for engine in self.engines:
            for index in range(self.args.recurring):
                self.ask(engine, index, record=False)
        for member in self.members:
            self.take_baseline(member)
            member.up = True

    def warm(self, engine: Member, seed: int) -> None:
        """A throwaway prompt (vLLM's first forward pass), not counted."""
        prompt = sample_prompts(self.model, self.args.prompt_tokens, [seed])[0]
        body = {"model": self.model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
        httpx.post(f"{self.engine_urls[engine.name]}/v1/completions", json=body, timeout=300).raise_for_status()

    def take_baseline(self, member: Member) -> None:
        member.baseline = {"at_s": round(self.now(), 1), **footprint(member.pids())}
        if member.kind == "engine":
            member.baseline["pinned_pages"] = self.pinned_pages(member.name)

    def now(self) -> float:
        return time.monotonic() - self.t0 if self.t0 else 0.0

    def pinned_pages(self, instance_id: str) -> int | None:
        """CPU pages pinned on the engine's ranks (lookups' and commands' pins), from the first
        controller that answers its ``/status``; None when none did."""
        for url in self.controller_urls:
            try:
                answer = httpx.post(f"{url}/status", json={"instance_id": instance_id}, timeout=10).json()
                workers = answer["workers"]
                return sum(
                    int(w["storage"].get("cpu", {}).get("pins_held", 0)) + int(w.get("command_pins", 0))
                    for w in workers.values()
                )
            except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
                continue
        return None

    # -- the client ----------------------------------------------------------------------------

    def ask(self, engine: Member, index: int, record: bool = True, kind: str = "recurring") -> None:
        url = self.engine_urls[engine.name]
        incarnation = engine.incarnation
        body = {
            "model": self.model,
            "prompt": self.prompts[index],
            "max_tokens": self.args.max_tokens,
            "temperature": 0.0,
            "return_token_ids": True,
        }
        at = self.now()
        entry: dict = {"at_s": at, "engine": engine.name, "prompt": index, "kind": kind}
        try:
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=self.args.request_timeout_s)
            response.raise_for_status()
            tokens = response.json()["choices"][0]["token_ids"]
            entry["outcome"] = "answered"
            entry["same"] = tokens == self.reference[index]
            if not entry["same"]:
                entry["got"], entry["want"] = tokens, self.reference[index]
        except (httpx.HTTPError, KeyError, ValueError, TypeError) as e:
            # A request to an engine killed meanwhile is the fault's; any other failure is not.
            killed = engine.incarnation != incarnation or not engine.up
            entry["outcome"] = "failed_by_fault" if killed else "failed"
            entry["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        entry["seconds"] = round(self.now() - at, 3)
        if not record:
            if entry["outcome"] != "answered" or not entry["same"]:
                raise RuntimeError(f"warm-up request failed or differed: {entry}")
            return
        with self.lock:
            self.requests.append(entry)

    def choose_prompt(self, rng: random.Random) -> tuple[int, str]:
        """The next prompt's index and kind: a never-sent one (``--new-fraction``), one of the
        last ``--recent-window`` new ones again (``--recent-fraction``: held by whichever engine
        answered it, maybe one killed since), else a recurring one."""
        a = self.args
        draw = rng.random()
        if draw < a.new_fraction and self.next_new < len(self.prompts) - a.recurring:
            self.next_new += 1
            return a.recurring + self.next_new - 1, "new"
        if draw < a.new_fraction + a.recent_fraction and self.next_new > 0:
            return a.recurring + rng.randrange(max(0, self.next_new - a.recent_window), self.next_new), "recent"
        return rng.randrange(a.recurring), "recurring"

    def client_loop(self) -> None:
        rng = random.Random(self.args.seed * 1000 + 1)
        while not self.stop_load.is_set():
            live = [e for e in self.engines if e.up]
            if not live:
                time.sleep(0.2)
                continue
            engine = rng.choice(live)
            index, kind = self.choose_prompt(rng)
            self.ask(engine, index, kind=kind)
            self.stop_load.wait(self.args.pause_s)

    # -- metrics -------------------------------------------------------------------------------

    def sample_metrics(self) -> None:
        """Each live engine's ``lmcache:`` counters; their growth since the last read of the same
        incarnation into the current minute."""
        minute = int(self.now() // 60)
        for engine in self.engines:
            if engine.served is None or engine.served.exited():
                continue
            try:
                text = httpx.get(f"{self.engine_urls[engine.name]}/metrics", timeout=5).text
            except httpx.HTTPError:
                continue
            values: dict[str, float] = defaultdict(float)
            for name, labels, value in re.findall(r"^(lmcache:\w+_total)(\{[^}]*\})? (\S+)$", text, re.M):
                reason = re.search(r'reason="([^"]+)"', labels or "")
                values[f"{name}|{reason[1]}" if reason else name] += float(value)
            key = (engine.name, engine.incarnation)
            last = self.last_metrics.get(key, {})
            self.last_metrics[key] = dict(values)
            grown = {name: value - last.get(name, 0.0) for name, value in values.items()}
            bucket = self.minutes[minute]
            hit = grown.get("lmcache:num_hit_tokens_total", 0.0)
            peer = grown.get("lmcache:p2p_chunks_pulled_total", 0.0) * CHUNK
            remote = grown.get("lmcache:num_remote_read_bytes_total", 0.0) / PAGE_BYTES * CHUNK
            bucket["lookup_tokens"] += grown.get("lmcache:num_lookup_tokens_total", 0.0)
            bucket["hit_tokens"] += hit
            bucket["peer_tokens"] += peer
            bucket["remote_tokens"] += remote
            bucket["cpu_tokens"] += max(0.0, hit - peer - remote)
            bucket["pull_failures"] += grown.get("lmcache:p2p_pull_failures_total", 0.0)
            bucket["remote_errors"] += grown.get("lmcache:remote_errors_total", 0.0)
            for name, delta in grown.items():
                if name.startswith("lmcache:num_missed_chunks_total|"):
                    bucket[f"missed:{name.split('|', 1)[1]}"] += delta

    def sampler_loop(self, done: threading.Event) -> None:
        last_line = 0
        while not done.wait(self.args.sample_s):
            try:
                self.sample_metrics()
            except Exception as e:  # noqa: BLE001 -- a sampler hiccup must not end the soak
                self.errors.append(f"sampler: {type(e).__name__}: {e}")
            minute = int(self.now() // 60)
            if minute > last_line:
                last_line = minute
                self.progress(minute)

    def progress(self, minute: int | str) -> None:
        with self.lock:
            requests = list(self.requests)
        outcome = Counter(r["outcome"] for r in requests)
        differed = sum(1 for r in requests if r.get("same") is False)
        hits = summed(self.minutes.values())
        log(
            f"minute {minute}: sent {len(requests)} answered {outcome['answered']} "
            f"failed_by_fault {outcome['failed_by_fault']} failed {outcome['failed']} differed {differed} "
            f"faults {len(self.faults)} hit tokens cpu {hits['cpu_tokens']:.0f} peer {hits['peer_tokens']:.0f} "
            f"remote {hits['remote_tokens']:.0f} of {hits['lookup_tokens']:.0f} looked up; "
            f"up: {','.join(m.name for m in self.members if m.up)}"
        )

    # -- chaos ---------------------------------------------------------------------------------

    def chaos_loop(self, deadline: float) -> None:
        rng = random.Random(self.args.seed)
        kinds: list[str] = []
        while True:
            pause = rng.uniform(self.args.fault_min_s, self.args.fault_max_s)
            if self.stop_chaos.wait(pause) or self.now() + self.args.quiet_end_s > deadline:
                return
            if not kinds:  # each kind once a round, in a random order: a short soak meets them all
                kinds = ["engine", "controller", "redis", "lmcache_server"]
                rng.shuffle(kinds)
            kind = kinds.pop()
            targets = [m for m in self.members if m.kind == kind]
            member = rng.choice(targets)
            down_s = rng.uniform(1.0, 5.0)
            fault = {"kind": kind, "target": member.name, "at_s": round(self.now(), 1), "down_s": round(down_s, 1)}
            self.faults.append(fault)
            log(f"fault: kill -9 {member.name}, restart in {down_s:.1f} s")
            try:
                member.kill9()
                time.sleep(down_s)
                member.start()
                restarted = time.monotonic()
                member.wait_ready(600 if kind == "engine" else 60)
                if kind == "engine":
                    self.warm(member, 91_000 + len(self.faults))
                fault["back_after_s"] = round(time.monotonic() - restarted, 1)
                self.take_baseline(member)
                member.up = True
                log(f"{member.name} is back ({fault['back_after_s']} s)")
            except Exception as e:  # noqa: BLE001 -- recorded; the soak goes on without it
                fault["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                self.errors.append(f"restart of {member.name}: {fault['error']}")
                log(f"{member.name} did not come back: {fault['error']}")

    # -- the run -------------------------------------------------------------------------------

    def run(self) -> dict:
        a = self.args
        t_setup = time.monotonic()
        recurring_seeds = range(a.recurring)
        new_count = max(10, int(a.minutes * 60 / max(a.pause_s, 0.05) * a.new_fraction))
        new_count = min(new_count, a.max_new_prompts)
        self.prompts = sample_prompts(
            self.model, a.prompt_tokens, [*recurring_seeds, *range(10_000, 10_000 + new_count)]
        )
        log(f"reference: {len(self.prompts)} prompts, cold, on a vLLM engine without the connector")
        self.reference = self.reference_outputs()
        log(f"reference done in {time.monotonic() - t_setup:.0f} s; starting the fleet in {self.workdir}")
        self.build_fleet()
        self.start_fleet()
        setup_s = time.monotonic() - t_setup
        self.t0 = time.monotonic()
        for member in self.members:
            member.baseline["at_s"] = 0.0
        deadline = a.minutes * 60
        log(f"fleet up in {setup_s:.0f} s; soaking {a.minutes} min")
        sampler_done = threading.Event()
        threads = [
            threading.Thread(target=self.client_loop, daemon=True),
            threading.Thread(target=self.chaos_loop, args=(deadline,), daemon=True),
            threading.Thread(target=self.sampler_loop, args=(sampler_done,), daemon=True),
        ]
        for thread in threads:
            thread.start()
        mid_taken = False
        while self.now() < deadline:
            time.sleep(1.0)
            if not mid_taken and self.now() >= deadline / 2:
                mid_taken = True
                for member in self.members:
                    member.mid = {"at_s": round(self.now(), 1), **footprint(member.pids())}
        self.stop_chaos.set()
        threads[1].join()  # the last restart back
        self.stop_load.set()
        threads[0].join(a.request_timeout_s + 10)
        time.sleep(a.settle_s)
        sampler_done.set()
        threads[2].join(30)
        self.sample_metrics()
        end_s = self.now()
        self.progress("end")
        return self.report(setup_s, end_s)

    def reference_outputs(self) -> list[list[int]]:
        command = offline_driver.command(
            self.model, "--max-model-len", "8192", "--kv-cache-mib", "256", connector=False
        )
        engine = InstanceProcess({}, self.workdir, name="reference", command=command, env=ENGINE_ENV).start(timeout=600)
        try:
            return [
                engine.request("generate", prompt_ids=p, max_tokens=self.args.max_tokens, timeout=300)["token_ids"]
                for p in self.prompts
            ]
        finally:
            engine.stop(timeout=60)

    def report(self, setup_s: float, end_s: float) -> dict:
        a = self.args
        requests = self.requests
        outcome = Counter(r["outcome"] for r in requests)
        differed = [r for r in requests if r.get("same") is False]
        totals = summed(self.minutes.values())
        per_minute = []
        for minute in sorted(self.minutes):
            bucket = self.minutes[minute]
            per_minute.append(
                {
                    "minute": minute,
                    **{
                        k: round(bucket[k])
                        for k in ("cpu_tokens", "peer_tokens", "remote_tokens", "hit_tokens", "lookup_tokens")
                    },
                    "missed_chunks": {
                        k.split(":", 1)[1]: round(v) for k, v in bucket.items() if k.startswith("missed:") and v
                    },
                }
            )
        fault_misses = {r: round(totals[f"missed:{r}"]) for r in FAULT_REASONS if totals[f"missed:{r}"]}
        processes = {}
        for member in self.members:
            end = {"at_s": round(self.now(), 1), **footprint(member.pids())}
            if member.kind == "engine":
                end["pinned_pages"] = self.pinned_pages(member.name)
            processes[member.name] = self.judge(member, end)
        return {
            "bench": "soak",
            "args": vars(a),
            "command": " ".join(sys.argv),
            "setup_s": round(setup_s, 1),
            "soak_s": round(end_s, 1),
            "engines": len(self.engines),
            "prompts": {
                "recurring": a.recurring,
                "new_sent": self.next_new,
                "new_available": len(self.prompts) - a.recurring,
            },
            "reference": "every prompt's output computed once, cold, by a vLLM engine without the connector "
            "(the offline driver, --no-connector) before the fleet started; every answer compared with it "
            "token for token",
            "requests_sent": len(requests),
            "requests_answered": outcome["answered"],
            "requests_failed_by_fault": outcome["failed_by_fault"],
            "requests_failed_otherwise": outcome["failed"],
            "answered_by_prompt_kind": Counter(r["kind"] for r in requests if r["outcome"] == "answered"),
            "failures": Counter(r["error"].split(":")[0] for r in requests if "error" in r),
            "outputs_differed": len(differed),
            "differed_examples": differed[:5],
            "hits_by_tier_per_minute": per_minute,
            "hits_by_tier_total_tokens": {
                k: round(totals[k])
                for k in ("cpu_tokens", "peer_tokens", "remote_tokens", "hit_tokens", "lookup_tokens")
            },
            "recomputes_by_faults": {
                "missed_chunks_by_fault_reason": fault_misses,
                "missed_chunks_by_fault_reason_total": sum(fault_misses.values()),
                "pull_failures": round(totals["pull_failures"]),
                "remote_errors": round(totals["remote_errors"]),
            },
            "missed_chunks_all_reasons": {
                k.split(":", 1)[1]: round(v) for k, v in totals.items() if k.startswith("missed:") and v
            },
            "faults_injected": len(self.faults),
            "faults": self.faults,
            "processes": processes,
            "within_bounds": all(p["within_bound"] for p in processes.values()),
            "bounds": {
                **BOUNDS,
                "engine_pinned_pages_at_end": 0,
                "note": "growth = end - start (a restarted process: from its restart, after its warm-up); "
                f"engine rss bound: its CPU pool ({a.cpu_gb * 1024:.0f} MiB) + rss_mib_extra",
            },
            "listening_on_every_interface": self.wildcard_listeners(),
            "errors": self.errors,
            "workdir": str(self.workdir),
            "metrics_note": "per-minute tiers from each engine's /metrics every "
            f"{a.sample_s} s; a killed engine's counts since its last read are lost",
        }

    def judge(self, member: Member, end: dict) -> dict:
        start = member.baseline
        bound = BOUNDS[member.kind]
        growth = {k: round(end.get(k, 0) - start.get(k, 0), 1) for k in ("fds", "threads", "rss_mib")}
        rss_bound = bound.get("rss_mib", self.args.cpu_gb * 1024 + bound.get("rss_mib_extra", 0))
        ok = growth["fds"] <= bound["fds"] and growth["threads"] <= bound["threads"] and growth["rss_mib"] <= rss_bound
        if member.kind == "engine":
            ok = ok and end.get("pinned_pages") == 0
        alive = bool(end.get("processes"))
        out = {
            "incarnation": member.incarnation,
            "start": start,
            "mid": member.mid if member.mid.get("at_s", -1) >= start.get("at_s", 0) else None,
            "end": end,
            "growth": growth,
            "bound": {"fds": bound["fds"], "threads": bound["threads"], "rss_mib": rss_bound},
            "within_bound": ok and alive,
        }
        return out

    def wildcard_listeners(self) -> list[str]:
        """Our processes' listening TCP sockets bound to every interface (0.0.0.0 or ::)."""
        inodes: dict[str, str] = {}
        for member in self.members:
            for pid in member.pids():
                with contextlib.suppress(OSError):
                    for fd in os.listdir(f"/proc/{pid}/fd"):
                        with contextlib.suppress(OSError):
                            target = os.readlink(f"/proc/{pid}/fd/{fd}")
                            if target.startswith("socket:["):
                                inodes[target[8:-1]] = member.name
        found = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with contextlib.suppress(OSError), open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    address, port = fields[1].split(":")
                    if fields[3] == "0A" and fields[9] in inodes and set(address) == {"0"}:
                        found.append(f"{inodes[fields[9]]}: port {int(port, 16)} ({table})")
        return found

    def cleanup(self) -> None:
        self.stop_load.set()
        self.stop_chaos.set()
        for member in self.members:
            member.stop()
        for member in self.members:
            member.finish()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0, help="how long the soak runs (after set-up)")
    ap.add_argument("--seed", type=int, default=0, help="the chaos loop's and the client's choices")
    ap.add_argument("--model", help="a model directory (default: the tests' tiny model, built in the work dir)")
    ap.add_argument("--workdir", help="logs and configs (default: a new temporary directory, kept)")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--cpu-gb", type=float, default=0.0625, help="each engine's CPU pool (small: it evicts)")
    ap.add_argument(
        "--vllm-prefix-caching",
        action="store_true",
        help="keep vLLM's own prefix cache on (it then answers most repeats before the connector is asked)",
    )
    ap.add_argument("--recurring", type=int, default=8, help="recurring prompts")
    ap.add_argument("--new-fraction", type=float, default=0.3, help="share of requests with a never-sent prompt")
    ap.add_argument(
        "--recent-fraction", type=float, default=0.2, help="share of requests repeating a recent new prompt"
    )
    ap.add_argument("--recent-window", type=int, default=20, help="how many of the last new prompts count as recent")
    ap.add_argument("--max-new-prompts", type=int, default=600, help="new prompts computed for the reference at most")
    ap.add_argument("--prompt-tokens", type=int, default=700)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--pause-s", type=float, default=1.0, help="the client's pause between requests")
    ap.add_argument("--request-timeout-s", type=float, default=120.0)
    ap.add_argument("--fault-min-s", type=float, default=15.0)
    ap.add_argument("--fault-max-s", type=float, default=45.0)
    ap.add_argument("--quiet-end-s", type=float, default=20.0, help="no fault starts this close to the end")
    ap.add_argument("--sample-s", type=float, default=5.0, help="how often engines' /metrics are read")
    ap.add_argument("--settle-s", type=float, default=5.0, help="after the load stops, before the end measurement")
    args = ap.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_soak_"))
    workdir.mkdir(parents=True, exist_ok=True)
    model = args.model or build(str(workdir / "model"))
    soak = Soak(args, workdir, model)

    def terminated(signum, frame):  # SIGTERM as Ctrl-C: the finally below stops everything
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminated)
    try:
        result = soak.run()
    finally:
        log("stopping every process")
        soak.cleanup()
    print(json.dumps(result, indent=1))
    return 0 if result["outputs_differed"] == 0 and result["within_bounds"] else 1


if __name__ == "__main__":
    sys.exit(main())
