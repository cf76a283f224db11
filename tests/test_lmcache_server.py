"""``lmcache_server`` (the console script, as users start it) and its client ``LmServerStore``,
over real loopback sockets: byte-exact round trips, LRU under the size cap, many clients at once,
bad frames, bind failures, a server that stalls, dies and comes back, and its door (issue 61):
strangers closed at the handshake deadline, a trickled upload closed, an engine served through an
idle flood at a low descriptor limit."""

from __future__ import annotations

import array
import os
import random
import resource
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from protocol_client import wait_for
from remote_stores import SCRIPT as SERVER
from remote_stores import LmServer, raw_frame

from lmcache_p2p.remote import wire
from lmcache_p2p.remote.lm_store import LmServerStore, RemoteRefused
from lmcache_p2p.remote.store import RemoteUnavailable
from lmcache_p2p.testing.measure import closed_by_server, idle_connections
from lmcache_p2p.testing.ports import free_ports
from lmcache_p2p.testing.processes import freeze

MiB = 1 << 20


@pytest.fixture
def servers(tmp_path):
    started: list[LmServer] = []

    def start(
        *extra: str,
        port: int | None = None,
        argv: list[str] | None = None,
        wait: bool = True,
        mesh_secret: str | None = None,
    ):
        server = LmServer(
            *extra, port=port, max_size_gb=None, argv=argv, log_dir=tmp_path, mesh_secret=mesh_secret
        ).start(wait)
        started.append(server)
        return server

    yield start
    for server in started:
        server.kill()


def listening_addresses(port: int) -> set[str]:
    """Local addresses with a socket listening on ``port`` (IPv4 and IPv6, from /proc/net)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            next(f)
            for line in f:
                local, state = line.split()[1], line.split()[3]
                address, port_hex = local.split(":")
                if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                    # 32-bit words in host (little-endian) order
                    raw = b"".join(bytes.fromhex(address[i : i + 8])[::-1] for i in range(0, len(address), 8))
                    found.add(socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw))
    return found


def payload(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def test_round_trip_of_multi_mib_values_is_byte_exact_and_batches_keep_their_order(servers):
    server = servers()
    assert listening_addresses(server.port) == {"127.0.0.1"}  # the host given, nothing else
    store = server.client()
    ints = array.array("I", range(300_000))  # a memoryview of another format goes as its bytes
    values = {b"a": payload(1, 3 * MiB + 5), b"b": payload(2, 9 * MiB), b"c": b"x", b"empty": b""}
    store.put([(b"a", values[b"a"]), (b"b", memoryview(values[b"b"])), (b"c", b"x"), (b"empty", b"")])
    store.put([(b"ints", memoryview(ints))])
    assert store.exists([b"b", b"nope", b"a", b"gone", b"ints", b"empty"]) == [True, False, True, False, True, True]
    got = store.get([b"nope", b"a", b"b", b"c", b"empty", b"ints", b"gone"])
    assert got == [None, values[b"a"], values[b"b"], b"x", b"", ints.tobytes(), None]
    assert store.get([]) == [] and store.exists([]) == []
    store.put([])
    store.put([(b"a", b"replaced")])
    assert store.get([b"a"]) == [b"replaced"]
    # More keys than one frame carries: split into several round trips, still in order.
    many = [b"k%d" % i for i in range(wire.MAX_BATCH + 10)]
    many[wire.MAX_BATCH + 3] = b"c"
    assert store.exists(many) == [k == b"c" for k in many]
    with pytest.raises(ValueError, match="1-1024"):
        store.exists([b"x" * 1025])

    stats = store.health()
    held = {b"a": b"replaced", b"b": values[b"b"], b"c": b"x", b"empty": b"", b"ints": ints.tobytes()}
    assert stats["chunks"] == 5 and stats["bytes"] == sum(len(k) + len(v) for k, v in held.items())
    assert (stats["hits"], stats["misses"], stats["puts"]) == (6, 2, 6)
    assert stats["capacity"] == 4 << 30 and stats["evictions"] == 0 and stats["clients"] == 1
    assert store.ping() > 0
    assert store.clear() == 5 and store.health()["chunks"] == 0
    store.close()
    wait_for(lambda: "disconnected 127.0.0.1:" in server.log(), what="the disconnect line")
    assert "connection from 127.0.0.1:" in server.log()
    assert server.stop() == 0
    assert "SIGTERM: shutting down" in server.log()


def test_lru_evicts_the_least_recently_used_under_the_cap_and_refuses_what_cannot_fit(servers):
    server = servers("--max-size-gb", str(3.5 / 1024))  # 3.5 MiB: three 1 MiB values fit, not four
    store = server.client()
    v = {i: payload(10 + i, MiB) for i in range(1, 6)}
    for i in (1, 2, 3):
        store.put([(b"k%d" % i, v[i])])
    assert store.get([b"k1"]) == [v[1]]  # k1 is now more recent than k2 and k3
    store.put([(b"k4", v[4])])  # evicts k2, the least recently used
    assert store.exists([b"k2"]) == [False]
    assert store.exists([b"k3"]) == [True]  # EXISTS refreshes too: k1 is now the oldest
    store.put([(b"k5", v[5])])
    assert store.get([b"k1", b"k2", b"k3", b"k4", b"k5"]) == [None, None, v[3], v[4], v[5]]
    stats = store.health()
    assert (stats["chunks"], stats["evictions"], stats["bytes"]) == (3, 2, 3 * (MiB + 2))
    assert stats["capacity"] == int(3.5 * MiB)

    with pytest.raises(RemoteRefused, match="larger than the server's whole capacity") as refused:
        store.put([(b"small", b"s" * 1024), (b"huge", payload(6, 4 * MiB)), (b"small2", b"t")])
    assert isinstance(refused.value, RemoteUnavailable)
    assert f"127.0.0.1:{server.port}" in str(refused.value)
    assert store.exists([b"small", b"huge", b"small2", b"k5"]) == [True, False, True, True]
    stats = store.health()
    assert (stats["refused"], stats["evictions"], stats["clients"]) == (1, 2, 1)  # same connection kept


def test_many_clients_at_once_each_get_their_own_values(servers):
    server = servers()
    shared = server.client()  # one store shared by threads: its connections are pooled
    errors: list[BaseException] = []

    def work(worker: int, store: LmServerStore) -> None:
        try:
            rng = random.Random(worker)
            for i in range(12):
                key = b"w%d-%d" % (worker, i)
                value = rng.randbytes(rng.randrange(1, 300_000))
                store.put([(key, value), (key + b"-twin", value[::-1])])
                assert store.exists([key + b"-none", key, key + b"-twin"]) == [False, True, True]
                assert store.get([key + b"-twin", key]) == [value[::-1], value]
        except BaseException as e:
            errors.append(e)

    own = [server.client() for _ in range(6)]
    threads = [threading.Thread(target=work, args=(w, own[w])) for w in range(6)]
    threads += [threading.Thread(target=work, args=(w, shared)) for w in range(6, 12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    stats = shared.health()
    assert stats["chunks"] == stats["puts"] == 12 * 12 * 2 and stats["misses"] == 0
    assert 7 <= stats["clients"] <= 6 + 4  # each own store kept one connection, the shared one 1-4


def test_bind_failures_and_a_device_other_than_cpu_exit_2_with_one_line(servers):
    running = servers()
    port = running.port
    cases = [
        (["127.0.0.1", str(port)], [f"127.0.0.1:{port}", "in use"]),
        (["no-such-host.invalid", str(port)], [f"no-such-host.invalid:{port}", "cannot resolve"]),
        (["127.0.0.1", str(port), "cuda"], ["'cuda' is not supported", "cpu"]),
    ]
    for args, expected in cases:
        done = subprocess.run([SERVER, *args], capture_output=True, text=True, timeout=20)
        assert done.returncode == 2, (args, done.stderr)
        line = done.stderr.strip()
        assert "\n" not in line and all(e in line for e in expected), (args, line)
    assert running.client().exists([b"x"]) == [False]  # the one on the port is unharmed


def test_malformed_frames_close_only_their_connection(servers):
    server = servers()
    good = server.client()
    good.put([(b"k", b"v")])
    H = wire.HEADER
    magic = wire.MAGIC
    bad = {
        "bad magic": b"GET / HTTP/1.1\r\nHost: lmcache\r\n\r\n"[: H.size],
        "protocol version 7": H.pack(magic, 7, wire.Op.GET, 0, 1, 4, 0),
        "unknown op 99": H.pack(magic, 1, 99, 0, 0, 0, 0),
        "more than 4096": H.pack(magic, 1, wire.Op.GET, 0, 5000, 5000 * 3, 0),
        "meta section of 2147483648": H.pack(magic, 1, wire.Op.EXISTS, 0, 1, 1 << 31, 0),
        "data section of 1099511627776": H.pack(magic, 1, wire.Op.PUT, 0, 1, 11, 1 << 40),
        "GET with a data section": H.pack(magic, 1, wire.Op.GET, 0, 1, 3, 10),
        # Key lengths past 1 KiB inside a meta section whose total is in bounds
        "key length outside 1-1024": H.pack(magic, 1, wire.Op.PUT, 0, 2, 20 + 1500, 2)
        + struct.pack("!2H2Q", 1400, 100, 1, 1)
        + b"k" * 1500,
        "a value of 2147483648 bytes": H.pack(magic, 1, wire.Op.PUT, 0, 1, 11, 1 << 31)
        + struct.pack("!HQ", 1, 1 << 31)
        + b"k",
        "values of 10 bytes in all in a data section of 5": H.pack(magic, 1, wire.Op.PUT, 0, 1, 11, 5)
        + struct.pack("!HQ", 1, 10)
        + b"k",
    }
    for reason, frame in bad.items():
        data, closed = raw_frame(frame, server.port)
        assert closed, reason
        reply = wire.unpack_header(data[: H.size])
        assert reply.kind == wire.Status.ERROR, reason
        assert reason in wire.decode_message(data[H.size : H.size + reply.meta_len]), (reason, data)
    # Half a header, then gone; and a PUT that stops in the middle of its value.
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(magic + b"\x01")
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        meta = struct.pack("!HQ", 4, 10 * MiB) + b"half"
        s.sendall(H.pack(magic, 1, wire.Op.PUT, 0, 1, len(meta), 10 * MiB) + meta + b"\0" * MiB)
    wait_for(
        lambda: (h := good.health())["malformed"] == len(bad) + 1 and h["clients"] == 1,
        what="the bad frames counted and their connections gone",
    )
    assert good.get([b"k", b"half"]) == [b"v", None]  # on the same connection as before
    assert server.proc.poll() is None
    log = server.log()
    assert "closing the connection from 127.0.0.1:" in log and "bad magic" in log
    assert "Traceback" not in log


def test_a_stalled_or_dead_server_is_unavailable_within_the_timeout_and_a_restart_is_picked_up(servers):
    first = servers()
    port = first.port
    store = first.client(timeout_s=1.0)
    store.put([(b"k", b"v1")])

    freeze(first.proc.pid)  # the kernel still takes the request; no reply comes
    t0 = time.monotonic()
    stalled_says = f"127.0.0.1:{port}: GET failed: timed out: nothing moved for 1 s"  # our words, not the socket's
    with pytest.raises(RemoteUnavailable, match=stalled_says) as stalled:
        store.get([b"k"])
    assert 0.9 <= time.monotonic() - t0 < 2.5, stalled.value
    first.proc.send_signal(signal.SIGCONT)
    assert store.get([b"k"]) == [b"v1"]  # the same store, on a new connection

    first.kill()
    t0 = time.monotonic()
    with pytest.raises(RemoteUnavailable, match=f"127.0.0.1:{port}") as dead:
        store.exists([b"k"])
    assert time.monotonic() - t0 < 1.0, dead.value
    with pytest.raises(RemoteUnavailable, match=f"127.0.0.1:{port}: cannot connect") as refused:
        store.ping()
    assert isinstance(refused.value.__cause__, ConnectionRefusedError), refused.value  # nothing listens there

    servers(port=port)
    assert store.get([b"k"]) == [None]  # a new, empty server on the same port
    store.put([(b"k", b"v2")])
    assert store.get([b"k"]) == [b"v2"]


_BLOCKER = """
import sys

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "numpy", "vllm"):
            print("BLOCKED IMPORT", name, flush=True)
            raise ImportError(name + " is blocked")
        return None

sys.meta_path.insert(0, Blocker())
from lmcache_p2p.remote.server import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_server_runs_without_torch_numpy_or_vllm(servers):
    port = free_ports(1)[0]
    blocked = servers(argv=[sys.executable, "-c", _BLOCKER, "127.0.0.1", str(port)], port=port)
    store = blocked.client()
    store.put([(b"k", payload(3, 2 * MiB))])
    assert store.get([b"k"]) == [payload(3, 2 * MiB)] and store.health()["chunks"] == 1
    assert blocked.stop() == 0
    assert "BLOCKED IMPORT" not in blocked.log() and "shutting down" in blocked.log()

    script = servers()  # the console script itself: none of them mapped into the process
    script.client().put([(b"k", b"v")])
    maps = Path(f"/proc/{script.proc.pid}/maps").read_text()
    assert not [line for line in maps.splitlines() if any(m in line for m in ("torch", "numpy", "vllm"))]


# -- the door (issue 61) ---------------------------------------------------------------------------

SECRET = "the door tests' mesh secret"


def test_strangers_who_say_nothing_are_closed_at_the_handshake_deadline_and_an_engine_gets_in_meanwhile(servers):
    """Issue 61, case 4, at a cap of 16: 15 strangers that connect and say nothing and one that
    stalls after the handshake's hello fill the cap. An engine with the secret is served at once
    (it displaces the oldest stranger), well before any deadline; the other 15 are closed at the
    handshake deadline (2 s here), not at the idle timeout (60 s), and the engine stays."""
    server = servers("--max-connections", "16", "--handshake-timeout", "2", mesh_secret=SECRET)
    flood_at = time.monotonic()
    strangers = idle_connections(server.port, 15)
    stalled = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    nonce = os.urandom(32)
    stalled.sendall(wire.pack_header(wire.Op.AUTH, wire.AUTH_HELLO, len(nonce)) + nonce)
    answer = stalled.recv(wire.HEADER.size)  # the hello is answered: all 16 are in, the last one too
    assert wire.unpack_header(answer).kind == wire.Status.OK
    stalled.recv(64)  # the server's nonce; the stranger never sends its proof
    try:
        engine = server.client(timeout_s=2.0)
        engine.put([(b"k", b"v")])
        assert engine.get([b"k"]) == [b"v"]
        served_after = time.monotonic() - flood_at
        assert served_after < 2.0, f"the engine was served {served_after:.2f} s into the flood: by the deadline"
        assert closed_by_server(strangers) == 1  # the oldest stranger made room; the rest are still held

        wait_for(lambda: closed_by_server(strangers) == 15, 10, "the strangers closed at their deadline")
        closed_after = time.monotonic() - flood_at
        assert 1.9 <= closed_after < 5.0, f"the strangers were closed {closed_after:.2f} s after connecting"
        stalled.settimeout(2.0)
        assert stalled.recv(1) == b"", "the stranger stalled mid-handshake is still held"
        assert engine.get([b"k"]) == [b"v"]
        health = engine.health()
        assert (health["connections_evicted"], health["handshake_timeouts"]) == (1, 15), health
        assert health["clients"] == 1 and health["auth_refused"] == 0, health
    finally:
        for sock in [*strangers, stalled]:
            sock.close()
    log = server.log()
    assert "no mesh-secret handshake within 2 s (--handshake-timeout" in log
    assert "closed the oldest connection without a handshake or request" in log
    assert "--max-connections 16" in log and "Traceback" not in log


def test_an_upload_trickling_below_the_minimum_rate_is_closed_and_a_fast_one_is_not(servers):
    """A PUT whose value arrives a byte at a time (5 bytes/s) is closed once an upload window
    (1 s here) has passed under --min-upload-rate, and its value is not stored; the stall rule
    alone (30 s without a byte) never closes it. A 4 MiB value on another connection meanwhile
    goes through."""
    server = servers("--min-upload-rate", "64", "--upload-window", "1")
    store = server.client()
    meta = struct.pack("!HQ", 1, MiB) + b"t"
    trickler = socket.create_connection(("127.0.0.1", server.port), timeout=0.2)
    trickler.sendall(wire.HEADER.pack(wire.MAGIC, 1, wire.Op.PUT, 0, 1, len(meta), MiB) + meta)
    started = time.monotonic()
    big = payload(7, 4 * MiB)
    store.put([(b"big", big)])
    closed_after = None
    try:
        while closed_after is None and time.monotonic() - started < 6.0:
            try:
                if trickler.recv(1) == b"":
                    closed_after = time.monotonic() - started
                    break
            except TimeoutError:
                pass
            except OSError:  # reset
                closed_after = time.monotonic() - started
                break
            try:
                trickler.send(b"x")
            except OSError:
                closed_after = time.monotonic() - started
    finally:
        trickler.close()
    assert closed_after is not None, "a 5 bytes/s upload was held for 6 s"
    assert closed_after < 3.0, f"closed after {closed_after:.2f} s: the window is 1 s"
    assert store.get([b"big", b"t"]) == [big, None]
    health = store.health()
    assert health["slow_uploads"] == 1 and health["malformed"] == 0, health
    assert "under --min-upload-rate 64 KiB/s" in server.log() and "Traceback" not in server.log()


class LimitedLmServer(LmServer):
    """``lmcache_server`` started with a descriptor limit of its own (set in the child before it
    runs the server), as under ``ulimit -n``."""

    def __init__(self, nofile: int, *extra: str, **kwargs):
        super().__init__(*extra, **kwargs)
        self.nofile = nofile

    def start(self, wait: bool = True) -> LimitedLmServer:
        nofile = self.nofile

        def limit() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=limit)
        wait_for(lambda: "listening on" in self.log() or self.proc.poll() is not None, what="lmcache_server")
        assert self.proc.poll() is None, self.log()
        return self


def test_at_a_low_descriptor_limit_an_idle_flood_leaves_an_authenticated_engine_served_within_two_seconds(tmp_path):
    """Issue 61, case 5, scaled: 300 idle connections against a server at ``ulimit -n 128`` (it may
    hold about 100). An engine with the secret is answered within 2 s, before the flood's
    handshake deadline (5 s, the default) or idle timeout (60 s) could have freed anything: its
    connection displaces the oldest stranger. Before, it was refused for the idle timeout."""
    server = LimitedLmServer(128, log_dir=tmp_path, mesh_secret=SECRET, max_size_gb=0.1).start()
    socks: list[socket.socket] = []
    try:
        flood_at = time.monotonic()
        socks = idle_connections(server.port, 300)
        time.sleep(0.3)  # the server takes in what it can hold
        client = server.client(timeout_s=1.0)
        asked_at = time.monotonic()
        while True:
            try:
                health = client.health()
                break
            except RemoteUnavailable:
                assert time.monotonic() - asked_at < 2.0, "no answer to an engine within 2 s"
                time.sleep(0.05)
        assert time.monotonic() - flood_at < 5.0  # served before any stranger's deadline
        assert health["connections_evicted"] > 0 and health["clients"] >= 1, health
        client.put([(b"k", b"v")])
        assert client.get([b"k"]) == [b"v"]
    finally:
        for s in socks:
            s.close()
        server.kill()
    log = server.log()
    assert "descriptor limit of 128" in log
    assert "Traceback" not in log and "Too many open files" not in log, log[-2000:]


def test_door_settings_out_of_range_exit_2_naming_the_setting():
    cases = [
        (["--handshake-timeout", "0"], "--handshake-timeout 0.0: expected seconds > 0"),
        (["--upload-window", "nan"], "--upload-window nan: expected seconds > 0"),
        (["--min-upload-rate", "-1"], "--min-upload-rate -1.0: expected KiB/s >= 0"),
        (["--max-connections-per-address", "0"], "--max-connections-per-address 0: expected a number >= 1"),
    ]
    for flags, says in cases:
        done = subprocess.run([SERVER, "127.0.0.1", "0", *flags], capture_output=True, text=True, timeout=20)
        assert done.returncode == 2 and says in done.stderr, (flags, done.stderr)
        assert "Traceback" not in done.stderr
