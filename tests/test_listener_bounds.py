"""Every listener bounded (issue 47, items 2 and 4): idle-connection floods against a real
``lmcache_controller`` and ``lmcache_server``, with and without a low descriptor limit. Idle
connections are closed, connections past the cap are refused and counted, a legitimate client
is answered meanwhile, and registered ranks keep heartbeating."""

from __future__ import annotations

import os
import socket
import time

import httpx
from protocol_client import CONTROLLER_SCRIPT, ControllerProcess, FakeWorker, wait_for
from remote_stores import SCRIPT as SERVER
from remote_stores import LmServer

from lmcache_p2p.testing.measure import closed_by_server, cpu_seconds, idle_connections
from lmcache_p2p.testing.ports import free_ports


def health_answers(url: str, within: float) -> float:
    """Seconds until GET /controller/workers answers 200 on a new connection."""
    t0 = time.monotonic()
    while True:
        try:
            if httpx.get(url + "/controller/workers", timeout=1.0).status_code == 200:
                return time.monotonic() - t0
        except httpx.TransportError:
            pass
        assert time.monotonic() - t0 < within, f"no answer within {within} s"
        time.sleep(0.1)


def test_controller_closes_idle_connections_refuses_past_its_cap_and_ranks_keep_heartbeating():
    controller = ControllerProcess("--http-max-connections", "64", "--http-header-timeout", "1").start()
    worker = FakeWorker(controller, "inst-flood")
    socks: list[socket.socket] = []
    try:
        assert worker.register().ok
        cpu0 = cpu_seconds(controller.proc.pid)
        socks = idle_connections(controller.http_port, 200)
        t0 = time.monotonic()
        worst_beat = 0.0
        while time.monotonic() - t0 < 3.0:
            started = time.monotonic()
            assert worker.heartbeat().status == "ok"
            worst_beat = max(worst_beat, time.monotonic() - started)
            time.sleep(0.1)
        # The flood is still open on our side; the controller let go of all of it.
        # Each idle one is closed 1 s (--http-header-timeout) after its accept; waited for
        # generously, as the controller shares the cores with the rest of the suite.
        wait_for(lambda: closed_by_server(socks) == len(socks), 15, "the controller closes all 200 idle connections")
        assert health_answers(controller.url, 5.0) < 5.0
        busy = cpu_seconds(controller.proc.pid) - cpu0
        assert busy < 2.0, f"{busy:.2f} CPU seconds in {time.monotonic() - t0:.1f} s: spinning"
        # Well inside the shortest heartbeat timeout a worker uses (1 s: link.py), with room for
        # a loaded host (0.5 s left little room with two xdist workers busy on two cores).
        assert worst_beat < 1.0, f"a heartbeat took {worst_beat:.2f} s during the flood"
        assert controller.metric("lmcache_controller_http_connections_refused_total", reason="at_cap") > 0
        assert controller.metric("lmcache_controller_http_connections_closed_total", reason="header_timeout") >= 64
    finally:
        for s in socks:
            s.close()
        worker.close()
        log = controller.stop()
    assert "Traceback" not in log
    assert "refused a connection: 64 open, the cap" in log


def test_controller_under_a_low_descriptor_limit_refuses_what_it_cannot_hold_without_a_traceback():
    http, pull, reply, heartbeat = free_ports(4)
    argv = ["prlimit", "--nofile=256:256", CONTROLLER_SCRIPT, "--host", "127.0.0.1", "--port", str(http)]
    argv += ["--monitor-ports", f'{{"pull": {pull}, "reply": {reply}, "heartbeat": {heartbeat}}}']
    controller = ControllerProcess(ports=[http, pull, reply, heartbeat], argv=[*argv, "--http-header-timeout", "1"])
    controller.start()
    socks: list[socket.socket] = []
    try:
        socks = idle_connections(http, 400)
        time.sleep(0.5)
        # Answered while the flood is still held open by its sender.
        assert health_answers(controller.url, 5.0) < 5.0
        assert controller.metric("lmcache_controller_http_connections_refused_total", reason="at_cap") > 0
    finally:
        for s in socks:
            s.close()
        log = controller.stop()
    assert "Traceback" not in log and "Too many open files" not in log, log[-2000:]
    assert "descriptor limit 256" in log


def test_lmcache_server_health_answers_through_an_idle_flood_at_its_descriptor_limit(tmp_path):
    port = free_ports(1)[0]
    argv = ["prlimit", "--nofile=256:256", SERVER, "127.0.0.1", str(port), "--idle-timeout", "1"]
    server = LmServer(port=port, argv=argv, log_dir=tmp_path).start()
    socks: list[socket.socket] = []
    try:
        socks = idle_connections(port, 300)  # past the 256 descriptors the server may hold
        time.sleep(0.5)
        client = server.client(timeout_s=1.0)
        t0 = time.monotonic()
        while True:
            try:
                health = client.health()
                break
            except Exception:
                assert time.monotonic() - t0 < 5.0, "no health answer within 5 s"
                time.sleep(0.1)
        assert health["capacity"] > 0
        wait_for(lambda: closed_by_server(socks) == len(socks), 15, "the server closes every idle connection")
    finally:
        for s in socks:
            s.close()
        server.stop()
    log = server.log()
    assert "Traceback" not in log and "Too many open files" not in log, log[-2000:]
    assert "closed the oldest connection without a handshake or request" in log


def test_router_closes_idle_connections_and_refuses_past_its_cap(tmp_path):
    import subprocess
    import sys

    port, nobody = free_ports(2)
    router = os.path.join(os.path.dirname(sys.executable), "lmcache_router")
    argv = [router, "--controller-url", f"http://127.0.0.1:{nobody}", "--port", str(port)]
    log_path = tmp_path / "router.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*argv, "--max-connections", "16", "--header-timeout", "1"], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    socks: list[socket.socket] = []
    try:
        wait_for(lambda: b"serving on" in log_path.read_bytes(), 15, "lmcache_router")
        socks = idle_connections(port, 100)
        wait_for(lambda: closed_by_server(socks) == len(socks), 15, "the router closes all 100 idle connections")
        assert httpx.get(url + "/router/stats", timeout=3).status_code == 200
    finally:
        for s in socks:
            s.close()
        proc.terminate()
        proc.wait(10)
    text = log_path.read_text()
    assert "Traceback" not in text
    assert "refused a connection: 16 open, the cap" in text
