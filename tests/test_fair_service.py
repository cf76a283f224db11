"""Fair service (issue 18): a flood on one of the controller's sockets leaves the others their turn.

Before, 400k tiny frames on the pull socket stalled HTTP for 13.9 s and heartbeats for 12.5 s: an
``await recv`` with a message already queued returns without yielding, so the pull loop kept the
event loop until the flood ended. A real controller, a flood of 1M frames from another process,
and a member heartbeating and looking up while it lasts.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import textwrap
import time

import httpx
import pytest
from protocol_client import CHUNK, ControllerProcess, FakeWorker, chunk_hashes

FLOOD_FRAMES = 1_000_000

FLOODER = textwrap.dedent(
    """
    import sys, zmq
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.connect(f"tcp://127.0.0.1:{sys.argv[1]}")
    frame = b"\\x00"  # undecodable: each is counted and dropped
    for _ in range(int(sys.argv[2])):
        push.send(frame)
    push.close(linger=-1)  # until every frame is on the wire
    ctx.term()
    """
)


# Its bounds (every heartbeat under 0.5 s, the lookups' p99 under 100 ms) are latencies of a
# controller that shares the cores with the flooder: the other xdist worker's engines would add
# their own load to what they measure, so it runs alone (make test's serial pass).
@pytest.mark.serial
def test_a_million_frame_flood_on_the_pull_socket_leaves_heartbeats_and_lookups_their_turn():
    controller = ControllerProcess("--worker-timeout", "3", "--health-check-interval", "0.5").start()
    try:
        member = FakeWorker(controller, "inst-a")
        member.register()
        member.resync("LocalCPUBackend", [])
        tokens = list(range(8 * CHUNK))
        member.events(admitted=chunk_hashes(tokens, CHUNK))
        http = httpx.Client(base_url=controller.url, timeout=30)
        bad_before = _bad_frames(http)

        flooder = subprocess.Popen([sys.executable, "-c", FLOODER, str(controller.pull), str(FLOOD_FRAMES)])
        heartbeat_ms, lookup_ms = [], []
        try:
            # Until the controller has dropped the whole flood: measured while it lasts.
            deadline = time.monotonic() + 120
            while _bad_frames(http) - bad_before < FLOOD_FRAMES and time.monotonic() < deadline:
                t0 = time.perf_counter()
                reply = member.heartbeat()
                heartbeat_ms.append((time.perf_counter() - t0) * 1e3)
                assert reply.status == "ok"
                for _ in range(10):
                    t0 = time.perf_counter()
                    answer = http.post("/lookup", json={"tokens": tokens})
                    lookup_ms.append((time.perf_counter() - t0) * 1e3)
                    assert answer.status_code == 200 and answer.json()["layout_info"] == {
                        "inst-a": ["LocalCPUBackend", 8 * CHUNK]
                    }
            flood_s = time.monotonic() - (deadline - 120)
        finally:
            flooder.wait(60)
        assert _bad_frames(http) - bad_before >= FLOOD_FRAMES, "the flood did not all arrive"
        # Enough samples taken during the flood to speak of a p99.
        assert len(lookup_ms) >= 100, (len(lookup_ms), flood_s)
        lookup_ms.sort()
        p99 = lookup_ms[int(len(lookup_ms) * 0.99) - 1]
        interval_ms = 0.5 * 1e3  # what this controller asks of its workers (worker timeout 3 s / 6)
        summary = {
            "flood_s": round(flood_s, 1),
            "heartbeat_max_ms": round(max(heartbeat_ms), 1),
            "lookup_p50_ms": round(statistics.median(lookup_ms), 1),
            "lookup_p99_ms": round(p99, 1),
            "lookups": len(lookup_ms),
        }
        print(json.dumps({"fair_service_flood": summary}))  # the figures BENCHMARKS.md quotes (pytest -s)
        assert max(heartbeat_ms) < interval_ms, summary
        assert p99 < 100, summary
        member.close()
    finally:
        controller.stop()


def _bad_frames(http: httpx.Client) -> float:
    total = 0.0
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("lmcache_controller_bad_frames_total") and 'socket="pull"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total
