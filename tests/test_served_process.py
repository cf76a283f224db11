"""``ServedProcess.stop`` cleans up after a vLLM CPU engine's TP workers: their shared-memory
segments, named after the engine's init port, outlive workers stopped by a signal, and a later
engine drawing the same port then cannot start (``create shm in SHMManager failed. errno: 17``)."""

from __future__ import annotations

import sys
from pathlib import Path

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
