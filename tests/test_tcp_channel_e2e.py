"""The tcp channel's data streams between two instance processes (real controller, cache engine,
worker and P2P on 127.0.0.1): pulls land over the streams the hello opened, and a holder that
dies mid-pull is a miss whose pages all come back. (tests/test_p2p.py runs the rest of the tcp
suite, which takes the same path.)"""

from __future__ import annotations

import signal
import threading
import time

from instances import instance_config, tokens
from protocol_client import wait_for

from lmcache_p2p.transfer.tcp_transport import STREAMS

CHUNK = 32
CPU = "LocalCPUBackend"


def test_tcp_pulls_ride_the_data_streams_opened_at_hello(controller, spawn):
    a, b = (spawn(instance_config(f"lmcache_instance_{i}", controller, "tcp", chunk_size=CHUNK)) for i in (1, 2))
    prompt = tokens(12 * CHUNK, seed=21)
    assert a.prefill(prompt) == 12 * CHUNK
    wait_for(lambda: controller.holders(prompt).get("lmcache_instance_1") == [CPU, 12 * CHUNK], what="A's keys")
    assert b.lookup(prompt) == 12 * CHUNK
    got = b.retrieve(prompt)
    assert got["exact"] and got["retrieved"] == 12 * CHUNK, got
    log = b.log()
    assert f"{STREAMS} streams in" in log and "tcp data link to 127.0.0.1:" in log, log[-2000:]
    assert "payloads from it ride the replies" not in log
    assert "tcp data port 127.0.0.1:" in a.log()  # bound on p2p_host, not on every interface
    status = b.status()["p2p_client"]
    assert status["chunks_pulled"] == 12 and status["checksum_mismatches"] == 0
    # Released by A's server once its reply has left (on its event loop): a moment after B has it.
    wait_for(lambda: a.status()["storage"]["cpu"]["pins_held"] == 0, 10, "A's pins released after serving")


def test_a_holder_frozen_then_killed_mid_stream_is_a_miss_and_every_page_comes_back(controller, spawn):
    a, b = (spawn(instance_config(f"lmcache_instance_{i}", controller, "tcp", chunk_size=CHUNK)) for i in (1, 2))
    prompt, warm = tokens(40 * CHUNK, seed=22), tokens(CHUNK, seed=23)
    a.request("fill", tokens=prompt)
    a.prefill(warm)
    wait_for(lambda: controller.holders(prompt).get("lmcache_instance_1") == [CPU, 40 * CHUNK], what="A's keys")
    wait_for(lambda: controller.holders(warm).get("lmcache_instance_1") == [CPU, CHUNK], what="A's warm-up chunk")
    assert b.lookup(warm) == CHUNK  # the session and its data streams are open
    free_before = b.status()["storage"]["cpu"]["free_pages"]
    a.signal(signal.SIGSTOP)  # frozen with B's requests in flight, its streams open but silent
    threading.Timer(1.0, a.kill).start()
    t0 = time.monotonic()
    assert b.lookup(prompt, timeout=30) == 0
    assert time.monotonic() - t0 < 15
    assert "the rest is a miss" in b.log()
    wait_for(lambda: b.status()["storage"]["cpu"]["free_pages"] == free_before, 15, "B's pages back")
    assert b.status()["p2p_client"]["pages_quarantined"] == 0
