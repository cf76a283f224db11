"""The pull policy across processes: a real ``lmcache_controller`` and stand-in instances (the real
cache engine, worker and TCP transfer). A requester whose prefill rate makes any pull slower than
recomputing skips the peer once the link is measured, says so with the numbers, and counts it
per peer in ``POST /status`` and in the dashboard's totals; with ``p2p_pull_policy: always`` it pulls.
"""

from __future__ import annotations

import re
import sys

from instances import instance_config, tokens
from protocol_client import wait_for

CHUNK = 32
CPU = "LocalCPUBackend"
FAST = 1e9  # tokens/s: no pull can beat recomputing at this prefill rate


def standin_command(*extra: str) -> list[str]:
    return [sys.executable, "-m", "lmcache_p2p.testing.standin", "--num-blocks", "64", *extra]


def registered(*engines) -> None:
    """Until each has registered: a worker's peer lookups go through the controller."""
    for engine in engines:
        wait_for(lambda engine=engine: engine.status()["registered"], what=f"{engine.name} registered")


def holder_with(controller, spawn, *prompts) -> None:
    a = spawn(instance_config("lmcache_instance_1", controller, "tcp", chunk_size=CHUNK))
    for prompt in prompts:
        assert a.prefill(prompt) == len(prompt) // CHUNK * CHUNK
    wait_for(
        lambda: all(controller.holders(p).get("lmcache_instance_1") == [CPU, len(p)] for p in prompts),
        what="A's keys",
    )


def test_a_peer_slower_than_recomputing_is_skipped_logged_and_counted(controller, spawn):
    first, second = tokens(8 * CHUNK, seed=1), tokens(8 * CHUNK, seed=2)
    holder_with(controller, spawn, first, second)
    b = spawn(instance_config("lmcache_instance_2", controller, "tcp", chunk_size=CHUNK, prefill_tokens_per_s=FAST))
    registered(b)

    # Never pulled from A: the pull is made, and it measures the link.
    assert b.lookup(first) == 8 * CHUNK
    assert ": link not measured yet; est recompute 0.0 ms (256 tokens at 1,000,000,000 tok/s" in b.log()
    # Now the estimate says recomputing 256 tokens (0.3 us at 1e9 tokens/s) beats any pull.
    assert b.lookup(second) == 0
    skip = re.search(
        r"peer pull decision: skip 8 chunks \(256 tokens\) at (lmcache_instance_1 rank 0 \(127\.0\.0\.1:\d+\)) "
        r"over tcp: est pull ([\d.]+) ms \(fixed ([\d.]+) ms \+ 0\.0336 gb at ([\d.]+) GB/s\) > 0\.8 x est "
        r"recompute 0\.0 ms \(256 tokens at 1,000,000,000 tok/s, configured prefill_tokens_per_s\); policy auto",
        b.log(),
    )
    assert skip, b.log()[-3000:]
    assert float(skip[2]) > 0 and float(skip[4]) > 0
    peer = skip[1]

    client = b.status()["p2p_client"]
    assert client["chunks_pulled"] == 8  # the first prompt only
    assert client["pulls_skipped"] == 1 and client["chunks_skipped"] == 8
    assert client["pulls_skipped_by_peer"] == {peer: 1}
    link = client["pull_policy"]["links"][f"{peer} over tcp"]
    assert link["pulls_measured"] == 1 and link["gb_per_s"] > 0
    assert client["pull_policy"]["prefill"]["tokens_per_s"] == FAST

    # Local hits are not the policy's business: the first prompt is a hit from B's own tier.
    decisions = b.log().count("peer pull decision:")
    assert b.lookup(first) == 8 * CHUNK
    assert b.log().count("peer pull decision:") == decisions

    # The controller's POST /status carries the per-peer skips, its dashboard the totals.
    workers = controller.api("/status", {"instance_id": "lmcache_instance_2"})["workers"]
    (detail,) = workers.values()
    assert detail["p2p_client"]["pulls_skipped_by_peer"] == {peer: 1}

    def totals():
        t = controller.http.get("/controller/dashboard").json()["overview"]["traffic_totals"]
        return t if t.get("pulls_skipped") else None

    got = wait_for(totals, timeout=10, what="B's skips in a heartbeat")
    assert got["pulls_skipped"] == 1 and got["skipped_tokens"] == 8 * CHUNK


def test_always_pulls_and_a_measured_prefill_rate_decides_like_a_configured_one(controller, spawn):
    prompts = [tokens(8 * CHUNK, seed=s) for s in (3, 4)]
    holder_with(controller, spawn, *prompts)
    # B measures its prefill rate (each prefill reported as computed at 1e9 tokens/s); C is told
    # the same rate and pulls anyway.
    b = spawn(
        instance_config("lmcache_instance_2", controller, "tcp", chunk_size=CHUNK),
        command=standin_command("--prefill-tokens-per-s", str(FAST)),
    )
    c = spawn(
        instance_config(
            "lmcache_instance_3",
            controller,
            "tcp",
            chunk_size=CHUNK,
            prefill_tokens_per_s=FAST,
            p2p_pull_policy="always",
        )
    )
    registered(b, c)
    assert b.prefill(tokens(4 * CHUNK, seed=5)) == 4 * CHUNK  # a prompt of its own: one measured step
    assert b.status()["prefill"]["steps_measured"] == 1

    for engine in (b, c):
        assert engine.lookup(prompts[0]) == 8 * CHUNK  # the link's first pull
    assert b.lookup(prompts[1]) == 0
    assert "tok/s, measured over 1 step(s)); policy auto: recomputing beats pulling" in b.log()
    assert c.lookup(prompts[1]) == 8 * CHUNK
    assert re.search(
        r"peer pull decision: pull 8 of 8 chunks \(256 tokens\) from lmcache_instance_1 rank 0 \(\S+\) over tcp: "
        r"est pull [\d.]+ ms .* > 0\.8 x est recompute 0\.0 ms .*; policy always: p2p_pull_policy always",
        c.log(),
    ), c.log()[-3000:]
    assert c.retrieve(prompts[1])["exact"]
    assert c.status()["p2p_client"]["pulls_skipped"] == 0
    assert b.status()["p2p_client"]["pulls_skipped"] == 1
