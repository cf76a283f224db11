"""``ServedProcess.stop`` cleans up after a vLLM CPU engine's TP workers: their shared-memory
segments, named after the engine's init port, outlive workers stopped by a signal, and a later
engine drawing the same port then cannot start (``create shm in SHMManager failed. errno: 17``).
And a start that lost vLLM's own port race is tried once more."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from protocol_client import wait_for

from lmcache_p2p.testing.ports import free_ports
from lmcache_p2p.testing.processes import ServedProcess

# What a TP=2 worker does: log its init method, create its segment, serve until stopped.
_FAKE_TP_WORKER = """
import sys, time
from pathlib import Path
port = sys.argv[1]
Path(f"/dev/shm/{port}-tp:0-[0-1]-cpushm_0").write_bytes(b"x")
print(f"world_size=2 rank=0 distributed_init_method=tcp://127.0.0.1:{port} backend=gloo", flush=True)
time.sleep(600)
"""


def test_stop_removes_its_engines_shm_segments_and_no_others(tmp_path):
    mine, other = free_ports(2)
    stranger = Path(f"/dev/shm/{other}-tp:0-[0-1]-cpushm_0")
    stranger.write_bytes(b"y")
    segment = Path(f"/dev/shm/{mine}-tp:0-[0-1]-cpushm_0")
    process = ServedProcess("engine", [sys.executable, "-c", _FAKE_TP_WORKER, str(mine)], tmp_path / "e.log")
    try:
        process.start()
        wait_for(lambda: "distributed_init_method" in process.log(), what="the worker's start-up line")
        assert segment.exists()
        process.stop()
        assert not segment.exists()
        assert stranger.exists()
    finally:
        process.stop()
        segment.unlink(missing_ok=True)
        stranger.unlink(missing_ok=True)


def _port_race_script(tmp_path: Path, port: int, races: int) -> list[str]:
    """A server that, its first ``races`` starts, dies as vLLM does when its rendezvous port was
    taken, then serves HTTP on ``port``."""
    script = tmp_path / "server.py"
    script.write_text(
        f"""
import http.server, sys
from pathlib import Path
count = Path({str(tmp_path / "starts")!r})
starts = int(count.read_text()) + 1 if count.exists() else 1
count.write_text(str(starts))
if starts <= {races}:
    print("torch.distributed.DistNetworkError: ... code: -98, name: EADDRINUSE, message: address already in use")
    sys.exit(1)
http.server.HTTPServer(("127.0.0.1", {port}), http.server.SimpleHTTPRequestHandler).serve_forever()
"""
    )
    return [sys.executable, str(script)]


def test_a_server_that_lost_its_port_race_at_start_up_is_started_once_more(tmp_path):
    (port,) = free_ports(1)
    server = ServedProcess("server", _port_race_script(tmp_path, port, races=1), tmp_path / "server.log").start()
    try:
        server.wait_http(f"http://127.0.0.1:{port}/", timeout=30)
        assert (tmp_path / "starts").read_text() == "2"
        assert "EADDRINUSE" in server.log() and "started again" in server.log()  # the first start's log is kept
    finally:
        server.stop()


def test_a_server_that_loses_the_race_twice_is_reported_with_its_log(tmp_path):
    (port,) = free_ports(1)
    server = ServedProcess("server", _port_race_script(tmp_path, port, races=2), tmp_path / "server.log").start()
    try:
        with pytest.raises(RuntimeError) as failed:  # a second lost race is not retried
            server.wait_http(f"http://127.0.0.1:{port}/", timeout=30)
        assert "server exited with code 1" in str(failed.value) and "EADDRINUSE" in str(failed.value)
        assert (tmp_path / "starts").read_text() == "2"
    finally:
        server.stop()
