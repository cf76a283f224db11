"""Every missed chunk gets a reason (lmcache_p2p/miss_reasons.py), across real processes: a real
``lmcache_controller`` and stand-in instances (the real cache engine, worker and TCP transfer).
A rank counts its missed chunks by reason (``status()["engine"]["missed_chunks"]``, the engine's
``lmcache:num_missed_chunks{reason}``) and logs each reason with the numbers behind it."""

from __future__ import annotations

import sys

from instances import instance_config, tokens
from protocol_client import wait_for

CHUNK = 32
PAGE_BYTES = CHUNK * 32 * 2 * 8 * 128 * 2  # a Llama-3.1-8B chunk, bf16: 4 MiB
FAST = 1e9  # tokens/s: no pull beats recomputing at this prefill rate


def standin(*extra: str) -> list[str]:
    return [sys.executable, "-m", "lmcache_p2p.testing.standin", "--num-blocks", "64", *extra]


def missed(engine) -> dict[str, int]:
    return {reason: n for reason, n in engine.status()["engine"]["missed_chunks"].items() if n}


def registered(*engines) -> None:
    for engine in engines:
        wait_for(lambda engine=engine: engine.status()["registered"], what=f"{engine.name} registered")


def held_by(controller, instance_id: str, prompt: list[int]) -> None:
    wait_for(
        lambda: (controller.holders(prompt).get(instance_id) or [None, 0])[1] == len(prompt),
        what=f"{instance_id}'s keys",
    )


def test_each_miss_names_its_reason_and_a_healthy_pull_misses_nothing(controller, spawn):
    holder = spawn(instance_config("lmcache_instance_1", controller, "tcp", chunk_size=CHUNK))
    # A pool of 6 pages: a third prompt of 4 chunks evicts the first one's.
    small = spawn(
        instance_config("lmcache_instance_2", controller, "tcp", chunk_size=CHUNK, cpu_gb=6 * PAGE_BYTES / 2**30)
    )
    registered(holder, small)

    # Never stored anywhere: the whole prompt is a never_stored miss.
    fresh = tokens(4 * CHUNK, seed=21)
    assert small.lookup(fresh) == 0
    assert missed(small) == {"never_stored": 4}
    assert "missed 4 of 4 chunk(s) after a hit of 0: never_stored" in small.log()

    # Held by a healthy peer: pulled whole, no miss.
    shared = tokens(4 * CHUNK, seed=22)
    assert holder.prefill(shared) == 4 * CHUNK
    held_by(controller, "lmcache_instance_1", shared)
    assert small.lookup(shared) == 4 * CHUNK
    assert missed(small) == {"never_stored": 4}

    # Stored here, then evicted by newer prompts, held by no one else: evicted, from which tier.
    own = tokens(4 * CHUNK, seed=23)
    assert small.prefill(own) == 4 * CHUNK
    assert small.prefill(tokens(4 * CHUNK, seed=24)) == 4 * CHUNK
    assert small.status()["storage"]["cpu"]["evictions"] > 0
    before = missed(small).get("evicted", 0)
    assert small.lookup(own) < 4 * CHUNK
    assert missed(small)["evicted"] > before
    assert "evicted (from LocalCPUBackend " in small.log()


def test_a_peer_with_another_layout_is_a_layout_mismatch_naming_the_field(controller, spawn):
    # Rank 0 of a TP=2 instance of the same model: its pages hold half the KV heads.
    tp2 = spawn(
        instance_config("lmcache_instance_3", controller, "tcp", tp=2, chunk_size=CHUNK),
        command=standin("--tp-size", "2", "--rank", "0"),
    )
    one = spawn(instance_config("lmcache_instance_4", controller, "tcp", chunk_size=CHUNK))
    registered(tp2, one)
    prompt = tokens(4 * CHUNK, seed=31)
    assert tp2.prefill(prompt) == 4 * CHUNK
    # (/lookup names instances holding a prompt on every rank; /explain shows any holder)
    wait_for(
        lambda: controller.api("/explain", {"tokens": prompt})["runs"][0]["status"] == "held",
        what="the TP=2 rank's keys",
    )

    assert one.lookup(prompt) == 0
    assert missed(one) == {"layout_mismatch": 4}
    assert "layout_mismatch (held by lmcache_instance_3: " in one.log()
    assert "tp_size 1 vs 2" in one.log()


def test_a_pull_judged_slower_than_recomputing_is_below_break_even_with_both_estimates(controller, spawn):
    holder = spawn(instance_config("lmcache_instance_5", controller, "tcp", chunk_size=CHUNK))
    fast = spawn(instance_config("lmcache_instance_6", controller, "tcp", chunk_size=CHUNK, prefill_tokens_per_s=FAST))
    registered(holder, fast)
    first, second = tokens(8 * CHUNK, seed=41), tokens(8 * CHUNK, seed=42)
    for prompt in (first, second):
        assert holder.prefill(prompt) == 8 * CHUNK
        held_by(controller, "lmcache_instance_5", prompt)

    assert fast.lookup(first) == 8 * CHUNK  # the link's first pull measures it
    assert fast.lookup(second) == 0
    assert missed(fast) == {"below_break_even": 8}
    line = next(line for line in fast.log().splitlines() if "below_break_even (" in line)
    assert "est pull " in line and "est recompute " in line, line


def test_a_holder_that_died_after_its_offer_is_holder_gone(controllers, spawn):
    # Reaped only after 30 s of silence: with the 3 s of the shared fast controller, a lookup that
    # came late on a busy host found the dead holder already dropped (a never_stored miss).
    controller = controllers("--worker-timeout", "30", "--health-check-interval", "0.5")
    holder = spawn(instance_config("lmcache_instance_7", controller, "tcp", chunk_size=CHUNK))
    asker = spawn(instance_config("lmcache_instance_8", controller, "tcp", chunk_size=CHUNK))
    registered(holder, asker)
    prompt = tokens(4 * CHUNK, seed=51)
    assert holder.prefill(prompt) == 4 * CHUNK
    held_by(controller, "lmcache_instance_7", prompt)
    holder.kill()  # the controller still lists it until its heartbeats stop

    assert asker.lookup(prompt) == 0
    assert missed(asker) == {"holder_gone": 4}
    assert "holder_gone (" in asker.log()
