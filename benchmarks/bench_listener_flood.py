"""Listener bounds: idle-connection floods past the descriptor limit, against each real listener.

    .venv/bin/python benchmarks/bench_listener_flood.py [--rounds 3] [--listeners controller router server]
        [--floods 1100 5000] [--nofile 1024] [--idle-timeout 10] [--requests 200]

For each listener (``lmcache_controller``'s HTTP API, ``lmcache_router``, ``lmcache_server``),
each round and each flood size, a fresh process on 127.0.0.1 started under ``prlimit
--nofile=N:N`` (1,024 by default), with the idle timeout ``--idle-timeout`` (the HTTP listeners'
header timeout, whose default is 10 s; ``lmcache_server``'s ``--idle-timeout``, whose default is
60 s). Then:

* **idle**: ``--requests`` legitimate requests one after the other, each on a new connection
  (controller: ``GET /controller/workers``; router: ``GET /router/stats``; ``lmcache_server``: a
  HEALTH frame), p50 / p99 / max; for the controller also ``--ranks`` registered stand-in ranks'
  heartbeat round trips (real ZMQ, tests/protocol_client.py's FakeWorker);
* **flood**: another process opens ``--floods`` connections that never send a byte and holds
  them (its side never closes them). Meanwhile a legitimate request every ``--gap-ms`` on a new
  connection (2 s timeout): the share answered, when the first one was, the latency of those
  answered; for the controller the ranks heartbeat back to back and one new rank registers 1 s
  in (again every 0.5 s while it is refused). The flooding process counts every 0.25 s how many
  of its connections the server has closed or refused (an EOF or a reset), until all are or
  ``--idle-timeout`` + 10 s pass; requests go on ``--after-s`` more. Times are from the flood's
  first connect. The listener's CPU over that window, then over 2 s with nothing sent (a
  spinning loop would show there), from /proc;
* **after**: the counters it exposes (the controller's /metrics; ``lmcache_server``'s shutdown
  line; the router's rate-limited log lines, a lower bound), and its log's "Traceback", "Too
  many open files" and ERROR lines.

One JSON document on stdout: every phase, and per listener and flood size each figure over the
rounds as [min, median, max]. Progress lines on stderr. Nothing is asserted: the figures are for
BENCHMARKS.md ("Listener bounds").
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from protocol_client import FakeWorker  # noqa: E402

from lmcache_p2p.remote import wire  # noqa: E402
from lmcache_p2p.testing.measure import closed_by_server, cpu_seconds, idle_connections, spread_ms  # noqa: E402
from lmcache_p2p.testing.ports import free_ports  # noqa: E402

BIN = Path(sys.executable).parent
LISTENERS = ("controller", "router", "server")
REQUEST_TIMEOUT_S = 2.0
WATCH_EXTRA_S = 10.0  # the flood is watched this long past the idle timeout
QUIET_S = 2.0


def progress(started: float, what: str) -> None:
    print(f"[{time.monotonic() - started:6.1f} s] {what}", file=sys.stderr, flush=True)


# -- legitimate clients: one request on a new connection ---------------------------------------


def http_get(port: int, path: str) -> str:
    """'ok' for a 200; 'refused' (reset, or closed unanswered), 'timeout', or 'http_NNN'."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=REQUEST_TIMEOUT_S) as s:
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
            data = b""
            while chunk := s.recv(65536):
                data += chunk
    except TimeoutError:
        return "timeout"
    except OSError:
        return "refused"
    if not data:
        return "refused"
    status = data.split(b" ", 2)[1].decode(errors="replace") if b" " in data else "?"
    return "ok" if status == "200" else f"http_{status}"


def recv_exact(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed mid-reply")
        data += chunk
    return data


def lm_health(port: int) -> str:
    """A HEALTH frame to ``lmcache_server`` on a new connection: 'ok' once its counters are read."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=REQUEST_TIMEOUT_S) as s:
            s.sendall(wire.pack_header(wire.Op.HEALTH))
            h = wire.unpack_header(recv_exact(s, wire.HEADER.size))
            if h.kind != wire.Status.OK:
                return f"status_{h.kind}"
            health = wire.decode_health(recv_exact(s, h.meta_len), h.count)
    except TimeoutError:
        return "timeout"
    except OSError:
        return "refused"
    return "ok" if "capacity" in health else "bad_reply"


def timed(ask) -> tuple[str, float]:
    t0 = time.perf_counter()
    outcome = ask()
    return outcome, (time.perf_counter() - t0) * 1e3


# -- the flood, from a process of its own -------------------------------------------------------


TCP_STATES = {1: "established", 2: "syn_sent"}


def left_open(port: int, socks: list[socket.socket]) -> dict:
    """Where the connections not closed yet stand: their TCP state on this side, and how many
    connections the kernel has established on the server's side of the port (accepted or queued).
    A handshake completed by a SYN cookie while the accept queue was full leaves this side
    established and the server with nothing (the kernel drops the final ACK, and an idle client
    never sends again)."""
    states: dict[str, int] = {}
    for s in socks:
        try:
            if s.recv(1) == b"":
                continue
        except BlockingIOError:
            pass
        except OSError:
            continue
        state = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
        name = TCP_STATES.get(state, str(state))
        states[name] = states.get(name, 0) + 1
    try:
        out = subprocess.run(
            ["ss", "-Htn", "state", "established", f"( sport = :{port} )"], capture_output=True, text=True, timeout=10
        ).stdout
        server_side: int | None = len(out.splitlines())
    except (OSError, subprocess.SubprocessError):
        server_side = None
    return {"client_side": states, "server_side_established": server_side}


def tcp_ext() -> dict[str, int]:
    """The kernel's listen-queue and SYN-cookie counters (system-wide, /proc/net/netstat)."""
    lines = Path("/proc/net/netstat").read_text().splitlines()
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            table = dict(zip(names.split()[1:], map(int, values.split()[1:]), strict=True))
            return {k: table.get(k, 0) for k in ("ListenOverflows", "ListenDrops", "SyncookiesSent", "SyncookiesRecv")}
    return {}


def hold_flood(port: int, n: int, watch_s: float, go, events, release) -> None:
    """Open the flood when ``go`` is set; report how many the server closed over time; hold them
    (never closing one on this side) until ``release``. ``events`` gets ("ready",), ("opened",
    t0, seconds to issue them) and ("watched", {...})."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n + 256 <= hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    events.put(("ready",))
    go.wait()
    t0 = time.monotonic()
    socks = idle_connections(port, n)
    events.put(("opened", t0, round(time.monotonic() - t0, 3)))
    timeline: list[tuple[float, int]] = []
    all_closed_s = None
    while True:
        closed = closed_by_server(socks)
        now = time.monotonic() - t0
        timeline.append((round(now, 2), closed))
        if closed == n:
            all_closed_s = now
            break
        if now > watch_s:
            break
        time.sleep(0.25)
    within_1s = max((c for t, c in timeline if t <= 1.0), default=0)
    watched: dict[str, Any] = {
        "closed_within_1s": within_1s,
        "all_closed_s": None if all_closed_s is None else round(all_closed_s, 2),
        "closed_at_end": timeline[-1][1],
        "timeline": [(t, c) for i, (t, c) in enumerate(timeline) if i % 4 == 0 or i == len(timeline) - 1],
    }
    if all_closed_s is None:
        watched["left_open"] = left_open(port, socks)
    events.put(("watched", watched))
    release.wait()
    for s in socks:
        s.close()


# -- the listeners ------------------------------------------------------------------------------


class Listener:
    """One listener process under ``prlimit --nofile``, its log in a file."""

    def __init__(self, name: str, args: argparse.Namespace, workdir: Path):
        self.name = name
        limit = ["prlimit", f"--nofile={args.nofile}:{args.nofile}"]
        idle = str(args.idle_timeout)
        self.zmq = None
        if name == "controller":
            http, pull, reply, heartbeat = free_ports(4)
            self.port = http
            self.zmq = SimpleNamespace(pull=pull, reply=reply, heartbeat=heartbeat)
            monitor = json.dumps({"pull": pull, "reply": reply, "heartbeat": heartbeat})
            argv = [str(BIN / "lmcache_controller"), "--host", "127.0.0.1", "--port", str(http)]
            argv += ["--monitor-ports", monitor, "--http-header-timeout", idle]
            self.path = "/controller/workers"
        elif name == "router":
            self.port, nobody = free_ports(2)
            argv = [str(BIN / "lmcache_router"), "--controller-url", f"http://127.0.0.1:{nobody}"]
            argv += ["--host", "127.0.0.1", "--port", str(self.port), "--header-timeout", idle]
            self.path = "/router/stats"
        else:
            self.port = free_ports(1)[0]
            argv = [str(BIN / "lmcache_server"), "127.0.0.1", str(self.port), "--max-size-gb", "0.1"]
            argv += ["--idle-timeout", idle]
            self.path = None
        self.argv = limit + argv
        self.log_path = workdir / f"{name}-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def ask(self) -> str:
        return lm_health(self.port) if self.path is None else http_get(self.port, self.path)

    def start(self) -> Listener:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while self.ask() != "ok":
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start: {self.log()[-2000:]}")
            time.sleep(0.1)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def cap(self) -> dict:
        text = self.log()
        m = re.search(r"HTTP connections: at most (\d+) \(configured (\d+), descriptor limit (\d+)\)", text)
        if m is None:
            m = re.search(
                r"at most (\d+) connections of --max-connections (\d+) under a descriptor limit of (\d+)", text
            )
        if m is None:
            return {}
        return {"applied": int(m[1]), "configured": int(m[2]), "descriptor_limit": int(m[3])}


def controller_counters(port: int) -> dict:
    """The controller's connection counters from /metrics."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    out = {}
    for m in re.finditer(
        r'^lmcache_controller_http_connections_(refused|closed)_total\{reason="(\w+)"\} ([0-9.e+]+)$',
        data.decode(errors="replace"),
        re.M,
    ):
        out[f"{m[1]}_{m[2]}"] = int(float(m[3]))
    return out


def log_counters(name: str, text: str) -> dict:
    """What the log says: unhandled errors, and (router, lmcache_server) the refusal counters."""
    out: dict[str, Any] = {
        "traceback_lines": text.count("Traceback"),
        "too_many_open_files_lines": text.count("Too many open files"),
        "error_lines": sum(" ERROR" in line or "ERROR:" in line for line in text.splitlines()),
    }
    if name == "router":
        refused = [int(n) for n in re.findall(r"refused a connection: \d+ open, the cap \((\d+) refused so far", text)]
        closed = [int(n) for n in re.findall(r"no complete request header within [0-9.]+ s \((\d+) so far", text)]
        out["refused_at_cap_logged_at_least"] = max(refused, default=0)
        out["closed_header_timeout_logged_at_least"] = max(closed, default=0)
    elif name == "server":
        m = re.findall(
            r"shutting down with .* (\d+) refused at the cap of (\d+), "
            r"(\d+) for want of a descriptor, (\d+) closed idle",
            text,
        )
        if m:
            at_cap, _cap, no_fd, idle = m[-1]
            out.update(refused_at_cap=int(at_cap), refused_no_descriptors=int(no_fd), closed_idle=int(idle))
    return out


# -- one phase: a fresh listener, idle, then one flood ------------------------------------------


class Heartbeats(threading.Thread):
    """The registered ranks heartbeat back to back, round robin, until stopped."""

    def __init__(self, workers: list[FakeWorker]):
        super().__init__(daemon=True)
        self.workers = workers
        self.samples: list[float] = []
        self.unanswered = 0
        self.not_ok = 0
        self.halt = threading.Event()

    def run(self) -> None:
        i = 0
        while not self.halt.is_set():
            w = self.workers[i % len(self.workers)]
            i += 1
            t0 = time.perf_counter()
            try:
                reply = w.heartbeat(timeout=5.0)
            except AssertionError:
                self.unanswered += 1
                continue
            self.samples.append((time.perf_counter() - t0) * 1e3)
            self.not_ok += reply.status != "ok"
            time.sleep(0.01)


def run_phase(mp, name: str, n: int, args: argparse.Namespace, workdir: Path, started: float) -> dict:
    listener = Listener(name, args, workdir).start()
    workers: list[FakeWorker] = []
    newcomer: dict[str, Any] = {}
    result: dict[str, Any] = {"listener": name, "flood": n, "cap": listener.cap()}
    holder = None
    release = mp.Event()
    try:
        if listener.zmq is not None:
            for i in range(args.ranks):
                w = FakeWorker(listener.zmq, f"flood-{i}")
                assert w.register().ok
                workers.append(w)
        # idle
        for _ in range(10):
            listener.ask()
        idle = [timed(listener.ask) for _ in range(args.requests)]
        result["idle"] = {
            "requests": spread_ms([ms for o, ms in idle if o == "ok"]),
            "not_answered": sum(o != "ok" for o, _ in idle),
        }
        if workers:
            beats = []
            for k in range(args.requests):
                t0 = time.perf_counter()
                workers[k % len(workers)].heartbeat()
                beats.append((time.perf_counter() - t0) * 1e3)
            result["idle"]["heartbeat"] = spread_ms(beats)

        # the flood
        go, events = mp.Event(), mp.Queue()
        watch_s = args.idle_timeout + WATCH_EXTRA_S
        holder = mp.Process(target=hold_flood, args=(listener.port, n, watch_s, go, events, release), daemon=True)
        holder.start()
        assert events.get(timeout=60) == ("ready",)
        beating = Heartbeats(list(workers)) if workers else None
        arrival = None
        cpu0, go_at, kernel0 = cpu_seconds(listener.pid), time.monotonic(), tcp_ext()
        go.set()
        _, t0, opened_s = events.get(timeout=60)  # t0: the flood's first connect (the same clock)
        if beating is not None:
            beating.start()

            def register_newcomer() -> None:
                """A new rank registers 1 s in, and again every 0.5 s while it is refused."""
                time.sleep(max(0.0, t0 + 1.0 - time.monotonic()))
                w = FakeWorker(listener.zmq, "flood-newcomer")
                workers.append(w)
                newcomer["attempts"] = 0
                while not beating.halt.is_set():
                    newcomer["attempts"] += 1
                    r0 = time.perf_counter()
                    try:
                        reply = w.register()
                    except AssertionError:
                        newcomer.setdefault("first_error", "no reply within 5 s")
                        continue
                    ms = round((time.perf_counter() - r0) * 1e3, 2)
                    newcomer.setdefault("first_ms", ms)
                    if reply.ok:
                        newcomer["registered_after_s"] = round(time.monotonic() - t0, 2)
                        break
                    newcomer.setdefault("first_error", reply.error)
                    time.sleep(0.5)
                newcomer["first_ok"] = newcomer["attempts"] == 1 and "registered_after_s" in newcomer

            arrival = threading.Thread(target=register_newcomer, daemon=True)
            arrival.start()
        asked: list[tuple[float, str, float]] = []  # (seconds into the flood, outcome, ms)
        watched = None
        stop_at = t0 + watch_s + args.after_s + 5.0
        next_ask = time.monotonic()
        while time.monotonic() < stop_at:
            if watched is None and not events.empty():
                _, watched = events.get()
                stop_at = time.monotonic() + args.after_s
            at = time.monotonic()
            outcome, ms = timed(listener.ask)
            asked.append((at - t0, outcome, ms))
            next_ask += args.gap_ms / 1e3
            time.sleep(max(0.0, next_ask - time.monotonic()))
        if watched is None:
            _, watched = events.get(timeout=30)
        window = time.monotonic() - go_at
        cpu1 = cpu_seconds(listener.pid)
        if beating is not None:
            beating.halt.set()
            beating.join(10)
        if arrival is not None:
            arrival.join(10)
        time.sleep(QUIET_S)
        cpu2 = cpu_seconds(listener.pid)

        answered = [(t, ms) for t, o, ms in asked if o == "ok"]
        outcomes: dict[str, int] = {}
        for _, o, _ in asked:
            outcomes[o] = outcomes.get(o, 0) + 1
        held_until = watched["all_closed_s"] if watched["all_closed_s"] is not None else window
        while_held = [o for t, o, _ in asked if t < held_until]
        from_first = [o for t, o, _ in asked if answered and t >= answered[0][0]]
        result["flood_phase"] = {
            "window_s": round(window, 2),
            "requests": {
                "sent": len(asked),
                "outcomes": outcomes,
                "answered_frac": round(len(answered) / max(1, len(asked)), 3),
                "answered_frac_while_held": round(sum(o == "ok" for o in while_held) / max(1, len(while_held)), 3),
                "first_answer_s": round(answered[0][0], 2) if answered else None,
                "answered_frac_from_first": round(len(answered) / max(1, len(from_first)), 3),
                "latency": spread_ms([ms for _, ms in answered]),
                "not_answered_latency": spread_ms([ms for _, o, ms in asked if o != "ok"]),
            },
            "flood": {"opened_s": opened_s, **watched},
            "cpu_pct": round(100 * (cpu1 - cpu0) / window, 1),
            "cpu_pct_quiet_after": round(100 * (cpu2 - cpu1) / QUIET_S, 1),
            "kernel": {k: v - kernel0.get(k, 0) for k, v in tcp_ext().items()},
        }
        if beating is not None:
            result["flood_phase"]["heartbeat"] = {
                **spread_ms(beating.samples),
                "unanswered": beating.unanswered,
                "not_ok": beating.not_ok,
            }
            result["flood_phase"]["new_rank"] = dict(newcomer)
        release.set()
        holder.join(15)
        if name == "controller":
            result["counters"] = controller_counters(listener.port)
    finally:
        release.set()
        if holder is not None and holder.is_alive():
            holder.kill()
        for w in workers:
            w.close()
        listener.stop()
    result["log"] = log_counters(name, listener.log())
    fl, req = result["flood_phase"], result["flood_phase"]["requests"]
    progress(
        started,
        f"{name} flood {n}: answered {req['answered_frac']:.0%} (first at {req['first_answer_s']} s), "
        f"all closed at {fl['flood']['all_closed_s']} s, CPU {fl['cpu_pct']}% (quiet {fl['cpu_pct_quiet_after']}%), "
        f"tracebacks {result['log']['traceback_lines']}",
    )
    return result


FIGURES = {
    "idle_p50_ms": ("idle", "requests", "p50_ms"),
    "idle_p99_ms": ("idle", "requests", "p99_ms"),
    "idle_max_ms": ("idle", "requests", "max_ms"),
    "flood_answered_frac": ("flood_phase", "requests", "answered_frac"),
    "flood_answered_frac_while_held": ("flood_phase", "requests", "answered_frac_while_held"),
    "flood_first_answer_s": ("flood_phase", "requests", "first_answer_s"),
    "flood_answered_frac_from_first": ("flood_phase", "requests", "answered_frac_from_first"),
    "flood_p50_ms": ("flood_phase", "requests", "latency", "p50_ms"),
    "flood_p99_ms": ("flood_phase", "requests", "latency", "p99_ms"),
    "flood_max_ms": ("flood_phase", "requests", "latency", "max_ms"),
    "flood_refused_max_ms": ("flood_phase", "requests", "not_answered_latency", "max_ms"),
    "closed_within_1s": ("flood_phase", "flood", "closed_within_1s"),
    "all_closed_s": ("flood_phase", "flood", "all_closed_s"),
    "cpu_pct": ("flood_phase", "cpu_pct"),
    "cpu_pct_quiet_after": ("flood_phase", "cpu_pct_quiet_after"),
    "heartbeat_idle_p50_ms": ("idle", "heartbeat", "p50_ms"),
    "heartbeat_idle_p99_ms": ("idle", "heartbeat", "p99_ms"),
    "heartbeat_flood_p50_ms": ("flood_phase", "heartbeat", "p50_ms"),
    "heartbeat_flood_p99_ms": ("flood_phase", "heartbeat", "p99_ms"),
    "heartbeat_flood_max_ms": ("flood_phase", "heartbeat", "max_ms"),
    "heartbeat_flood_unanswered": ("flood_phase", "heartbeat", "unanswered"),
    "new_rank_first_ms": ("flood_phase", "new_rank", "first_ms"),
    "new_rank_registered_after_s": ("flood_phase", "new_rank", "registered_after_s"),
}


def dig(d: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def summarize(phases: list[dict]) -> dict:
    """Per listener and flood size: each figure over the rounds, [min, median, max]."""
    out: dict[str, dict] = {}
    for key in sorted({(p["listener"], p["flood"]) for p in phases}):
        mine = [p for p in phases if (p["listener"], p["flood"]) == key]
        figures: dict[str, Any] = {"rounds": len(mine), "cap": mine[0]["cap"]}
        for name, path in FIGURES.items():
            values = [dig(p, path) for p in mine]
            numbers = [v for v in values if isinstance(v, (int, float))]
            if numbers:
                figures[name] = [min(numbers), round(statistics.median(numbers), 3), max(numbers)]
            if numbers and len(numbers) < len(values):  # e.g. no answer, or not all closed, in a round
                figures[name + "_missing"] = len(values) - len(numbers)
        counters: dict[str, list] = {}
        for p in mine:
            for source in ("counters", "log"):
                for k, v in p.get(source, {}).items():
                    counters.setdefault(k, []).append(v)
        for p in mine:
            for k, v in p["flood_phase"].get("kernel", {}).items():
                counters.setdefault("kernel_" + k, []).append(v)
        figures["counters"] = counters
        left = [dig(p, ("flood_phase", "flood", "left_open")) for p in mine]
        if any(left):
            figures["left_open"] = left
        if mine[0]["listener"] == "controller":
            figures["new_rank_first_ok"] = [dig(p, ("flood_phase", "new_rank", "first_ok")) for p in mine]
            figures["new_rank_first_error"] = [dig(p, ("flood_phase", "new_rank", "first_error")) for p in mine]
        out[f"{key[0]} {key[1]}"] = figures
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listeners", nargs="+", choices=LISTENERS, default=list(LISTENERS))
    ap.add_argument("--floods", type=int, nargs="+", default=[1100, 5000], help="idle connections opened per flood")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nofile", type=int, default=1024, help="each listener's descriptor limit (soft and hard)")
    ap.add_argument("--idle-timeout", type=float, default=10.0, help="header / idle timeout given to each listener")
    ap.add_argument("--requests", type=int, default=200, help="idle: legitimate requests (and heartbeats)")
    ap.add_argument("--gap-ms", type=float, default=50.0, help="flood: one legitimate request this often")
    ap.add_argument("--after-s", type=float, default=2.0, help="flood: requests go on this long after it is cleared")
    ap.add_argument("--ranks", type=int, default=4, help="controller: registered stand-in ranks heartbeating")
    args = ap.parse_args()
    started = time.monotonic()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < max(args.floods) + 512 <= hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    mp = multiprocessing.get_context("spawn")
    workdir = Path(tempfile.mkdtemp(prefix="bench_listener_flood_"))
    phases = []
    for r in range(args.rounds):
        for name in args.listeners:
            for n in args.floods:
                phase = run_phase(mp, name, n, args, workdir, started)
                phase["round"] = r
                phases.append(phase)
    print(
        json.dumps(
            {
                "bench": "listener_flood",
                "args": vars(args),
                "logs": str(workdir),
                "summary": summarize(phases),
                "phases": phases,
                "seconds": round(time.monotonic() - started, 1),
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
