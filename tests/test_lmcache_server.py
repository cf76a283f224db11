"""``lmcache_server`` (the console script, as users start it) and its client ``LmServerStore``,
over real loopback sockets: byte-exact round trips, LRU under the size cap, many clients at once,
bad frames, bind failures, a server that stalls, dies and comes back."""

from __future__ import annotations

import array
import os
import random
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
from lmcache_p2p.testing.ports import free_ports

MiB = 1 << 20


@pytest.fixture
def servers(tmp_path):
    started: list[LmServer] = []

    def start(*extra: str, port: int | None = None, argv: list[str] | None = None, wait: bool = True):
        server = LmServer(*extra, port=port, max_size_gb=None, argv=argv, log_dir=tmp_path).start(wait)
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

    first.proc.send_signal(signal.SIGSTOP)  # the kernel still takes the request; no reply comes
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
