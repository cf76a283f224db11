"""Multi-process integration: a real ``lmcache_controller`` and instance processes running the real
cache engine, worker and P2P transfer (NIXL over UCX, and TCP) on 127.0.0.1, each with a CPU
stand-in for an engine's KV pages of Llama-3.1-8B's page shape (chunks of 32 tokens = 4 MiB)."""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import pytest
from instances import InstanceProcess, instance_config, tokens
from protocol_client import ControllerProcess, wait_for

from lmcache_p2p.testing.processes import freeze
from lmcache_p2p.vocab import WAITING_OFFER_TIMEOUT_S

CHUNK = 32
CPU = "LocalCPUBackend"
DISK = "LocalDiskBackend"
CHANNELS = ["nixl", "tcp"]


def two_instances(controller, spawn, channel: str) -> tuple[InstanceProcess, InstanceProcess]:
    """lmcache_instance_1 and lmcache_instance_2, as in the seeds, on free ports."""
    return tuple(spawn(instance_config(f"lmcache_instance_{i}", controller, channel, chunk_size=CHUNK)) for i in (1, 2))


def keys_at(controller, instance_id: str) -> int:
    return controller.http.get("/controller/key-stats").json()["instances"].get(instance_id, {}).get(CPU, 0)


@pytest.mark.parametrize("channel", CHANNELS)
def test_ports_of_zero_are_chosen_at_bind_and_registered(controller, spawn, channel):
    """Replicas that share one config (Ray Serve's num_replicas) cannot share fixed ports or, across
    hosts, one p2p_host: with ports of 0 each rank binds free ports and registers those, with no
    p2p_host it registers the address that routes to the controller, and peers reach it there."""
    zero = {"lmcache_worker_ports": [0], "p2p_init_ports": [0], "p2p_lookup_ports": [0], "p2p_host": None}
    a, b = (
        spawn(instance_config(f"lmcache_instance_{i}", controller, channel, chunk_size=CHUNK, **zero)) for i in (1, 2)
    )
    wait_for(lambda: len(controller.http.get("/controller/workers").json()["workers"]) == 2, what="two ranks")
    workers = controller.http.get("/controller/workers").json()["workers"]
    ports = [(w["worker_port"], w["p2p_init_port"], w["p2p_lookup_port"]) for w in workers]
    assert len(ports) == 2 and all(0 not in p for p in ports) and len({*ports[0], *ports[1]}) == 6, ports
    assert {w["host"] for w in workers} == {"127.0.0.1"}  # the controller is on 127.0.0.1
    assert re.search(r"worker_port 0 in the config: bound \d+", a.log())
    prompt = tokens(4 * CHUNK)
    assert a.prefill(prompt) == 4 * CHUNK
    wait_for(lambda: controller.holders(prompt).get("lmcache_instance_1") == [CPU, 4 * CHUNK], what="A's keys")
    assert b.lookup(prompt) == 4 * CHUNK
    assert b.retrieve(prompt)["exact"]


@pytest.mark.parametrize("channel", CHANNELS)
def test_peer_pull_is_bit_exact_and_logged(controller, spawn, channel):
    a, b = two_instances(controller, spawn, channel)
    prompt = tokens(8 * CHUNK + 5)  # 8 full chunks and a partial tail, which is never a chunk
    assert a.prefill(prompt) == 8 * CHUNK
    wait_for(lambda: controller.holders(prompt).get("lmcache_instance_1") == [CPU, 8 * CHUNK], what="A's keys")

    assert b.lookup(prompt, peers=False) == 0
    assert b.lookup(prompt) == 8 * CHUNK
    got = b.retrieve(prompt)
    assert got["retrieved"] == 8 * CHUNK and got["exact"], got

    pulled = b.status()["p2p_client"]
    assert pulled["chunks_pulled"] == 8 and pulled["bytes_pulled"] == 8 * a.page_bytes
    assert pulled["checksum_mismatches"] == 0 and pulled["pages_quarantined"] == 0
    assert a.status()["p2p_server"]["chunks_served"] == 8
    # The holder released what it served: its server lets the pins go once the reply (and any
    # zero-copy frames) left, on its own event loop, which can be a moment after B has the bytes.
    wait_for(lambda: a.status()["storage"]["cpu"]["pins_held"] == 0, 10, "A's pins released after serving")
    assert f"over {channel}, to rank 0)" in b.log() or f"over {channel} via GPU staging, to rank 0)" in b.log()
    assert "Retrieved 256 out of total 256 tokens. size: 0.0336 gb, cost " in b.log()
    # ... and where the pull's time went, the holder's part as the holder measured it
    phases = re.search(
        r"\[1 batches, ms summed: slots [\d.]+, holder ([\d.]+) \(its write ([\d.]+)\), queue\+wire [\d.]+, "
        r"land [\d.]+, verify [\d.]+\]",
        b.log(),
    )
    assert phases and float(phases[1]) > 0, b.log()[-2000:]
    assert float(phases[2]) <= float(phases[1]), phases[0]  # the write is part of the holder's time
    # The pulled chunks are B's now too: the controller hears B's admits.
    wait_for(lambda: controller.holders(prompt).get("lmcache_instance_2") == [CPU, 8 * CHUNK], what="B's admits")


def _three_prefix_pulls_asked_together(controller, spawn, seeds, **extra):
    """A holds three 24-chunk prompts; B asks for all three at once, as vLLM's scheduler does with
    requests that arrive together. B, and when each of its pulls ended (s from the ask).
    Batches of 2 chunks, 3 in flight: each pull is 12 batches, longer than its window, so pulls
    sharing the link interleave theirs."""
    a, b = (
        spawn(
            instance_config(
                f"lmcache_instance_{i}", controller, "tcp", chunk_size=CHUNK, cpu_gb=0.5, p2p_batch_chunks=2, **extra
            )
        )
        for i in (1, 2)
    )
    prompts = [tokens(24 * CHUNK, seed=s) for s in seeds]  # 3 x 96 MiB
    for prompt in prompts:
        assert a.prefill(prompt) == 24 * CHUNK
    wait_for(
        lambda: all(controller.holders(p).get("lmcache_instance_1") == [CPU, 24 * CHUNK] for p in prompts),
        what="A's keys",
    )
    return b, b.request("lookup_together", prompts=[list(p) for p in prompts])["done_s"]


def test_prefix_pulls_asked_together_end_in_the_order_asked(controller, spawn):
    """Requests arriving together are pulled first asked first done, each at the full rate:
    the first is ready after about a third of the time, not when all three are."""
    b, done = _three_prefix_pulls_asked_together(controller, spawn, seeds=(1, 2, 3))
    assert done[0] < done[1] < done[2], done
    assert done[0] < 0.6 * done[2], done  # sharing the link, all three would end together
    assert b.status()["p2p_client"]["chunks_pulled"] == 72


def test_prefix_pulls_from_one_holder_run_back_to_back_in_one_pipeline(controller, spawn):
    """The holder's pull pump (the default): each later pull's first batch goes out while the
    one ahead still has batches out, none waiting for another's whole pull; pulls that shared the
    link in doing so say nothing about its rate alone, so the pull policy learned none."""
    b, _ = _three_prefix_pulls_asked_together(controller, spawn, seeds=(4, 5, 6))
    assert b.status()["p2p_client"]["chunks_pulled"] == 72
    beside = [
        (int(chunks), int(pulls))
        for chunks, pulls in re.findall(r"(\d+) chunk\(s\) of (\d+) earlier pull\(s\) in flight", b.log())
    ]
    assert len(beside) == 3 and beside[0] == (0, 0), b.log()[-2000:]
    assert all(chunks > 0 and pulls == 1 for chunks, pulls in beside[1:]), beside
    links = b.status()["p2p_client"]["pull_policy"]["links"]
    assert sum(link["pulls_measured"] for link in links.values()) == 0, links


@pytest.mark.parametrize("channel", CHANNELS)
def test_partial_prefix_pulls_only_the_missing_middle(controller, spawn, channel):
    a, b = two_instances(controller, spawn, channel)
    prompt = tokens(8 * CHUNK, seed=1)
    a.prefill(prompt[: 5 * CHUNK])  # A holds chunks 0-4
    b.prefill(prompt[: 2 * CHUNK])  # B holds chunks 0-1 itself
    wait_for(lambda: controller.holders(prompt).get("lmcache_instance_1") == [CPU, 5 * CHUNK], what="A's keys")
    assert b.lookup(prompt) == 5 * CHUNK  # 2 local + 3 from A; chunks 5-7 nobody has
    assert b.status()["p2p_client"]["chunks_pulled"] == 3
    got = b.retrieve(prompt)
    assert got["retrieved"] == 5 * CHUNK and got["exact"], got
    # A prompt that diverges after chunk 1 shares only those chunks with A.
    other = prompt[: 2 * CHUNK] + tokens(6 * CHUNK, seed=2)
    assert b.lookup(other) == 2 * CHUNK


@pytest.mark.parametrize("channel", CHANNELS)
def test_seed_003_move_flow(controller, spawn, channel):
    a, b = two_instances(controller, spawn, channel)
    prompt = tokens(6 * CHUNK + 7, seed=3)
    a.prefill(prompt)
    wait_for(lambda: keys_at(controller, "lmcache_instance_1") == 6, what="A's keys")
    answer = controller.api(
        "/move",
        {
            "old_position": ["lmcache_instance_1", CPU],
            "new_position": ["lmcache_instance_2", CPU],
            "tokens": prompt,
            "copy": False,
        },
    )
    assert answer["num_tokens"] == 6 * CHUNK
    state = controller.finish(answer["event_id"])
    assert state["status"] == "done" and state["num_tokens"] == 6 * CHUNK, state
    # A sent its removals before its done, on the same socket: once done, the index never
    # lists the source. (B's additions come on B's socket, sent before its reply to A.)
    assert "lmcache_instance_1" not in controller.holders(prompt)
    wait_for(lambda: controller.holders(prompt) == {"lmcache_instance_2": [CPU, 6 * CHUNK]}, what="index after move")
    # B has them locally (no peer needed); A evicted them.
    assert b.lookup(prompt, peers=False) == 6 * CHUNK
    assert b.retrieve(prompt)["exact"]
    assert a.lookup(prompt, peers=False) == 0
    assert a.status()["storage"]["cpu"]["pins_held"] == 0


@pytest.mark.parametrize("channel", CHANNELS)
def test_a_move_from_disk_leaves_no_promoted_copy_at_the_source(controller, spawn, channel, tmp_path):
    """Serving a disk chunk promotes it into the holder's CPU tier (NIXL reads the pool); a move
    must not leave that copy behind, nor drop a CPU copy the source held before it."""
    a = spawn(
        instance_config(
            "lmcache_instance_1",
            controller,
            channel,
            chunk_size=CHUNK,
            local_disk=f"file://{tmp_path}/disk-a/",
            max_local_disk_size=0.1,
        )
    )
    b = spawn(instance_config("lmcache_instance_2", controller, channel, chunk_size=CHUNK))
    kept, moved = tokens(2 * CHUNK, seed=8), tokens(3 * CHUNK, seed=9)
    a.prefill(moved)
    wait_for(lambda: a.status()["storage"]["disk"]["chunks"] == 3, what="A's disk writes")
    controller.api("/clear", {"instance_id": "lmcache_instance_1", "location": CPU})  # only on disk now
    a.prefill(kept)  # CPU and disk: its CPU copy predates the move
    wait_for(lambda: a.status()["storage"]["disk"]["chunks"] == 5, what="A's disk writes")

    def on_disk_at_the_controller(prompt) -> bool:
        # A move plans from the controller's index: A's disk admits reach it batched, after the
        # writes (a move racing them moved 2 of 3 chunks in 1 run of 4).
        runs = controller.api("/explain", {"tokens": prompt, "chunk_size": CHUNK})["runs"]
        on_disk = [
            r["chunks"]
            for r in runs
            if any(h["instance_id"] == "lmcache_instance_1" and DISK in h["locations"] for h in r["holders"])
        ]
        return sum(on_disk) == len(prompt) // CHUNK

    for prompt in (moved, kept):
        wait_for(lambda prompt=prompt: on_disk_at_the_controller(prompt), what="A's disk copies indexed")
    answer = controller.api(
        "/move",
        {"old_position": ["lmcache_instance_1", DISK], "new_position": ["lmcache_instance_2", CPU], "tokens": moved},
    )
    assert controller.finish(answer["event_id"])["num_tokens"] == 3 * CHUNK
    assert b.lookup(moved, peers=False) == 3 * CHUNK
    assert a.lookup(moved, peers=False) == 0  # neither on disk nor promoted into its CPU tier
    storage = a.status()["storage"]
    assert storage["cpu"]["chunks"] == 2 and storage["disk"]["chunks"] == 2, storage
    wait_for(lambda: "lmcache_instance_1" not in controller.holders(moved), what="index after move")
    # A disk move of a chunk the CPU tier held before keeps that copy: only the disk's goes.
    answer = controller.api(
        "/move",
        {"old_position": ["lmcache_instance_1", DISK], "new_position": ["lmcache_instance_2", CPU], "tokens": kept},
    )
    assert controller.finish(answer["event_id"])["num_tokens"] == 2 * CHUNK
    storage = a.status()["storage"]
    assert storage["cpu"]["chunks"] == 2 and storage["disk"]["chunks"] == 0, storage


@pytest.mark.parametrize("channel", CHANNELS)
def test_copy_of_everything_and_partial_copy(controller, spawn, channel):
    a, b = two_instances(controller, spawn, channel)
    one, two = tokens(3 * CHUNK, seed=4), tokens(2 * CHUNK, seed=5)
    a.prefill(one)
    a.prefill(two)
    b.prefill(two[:CHUNK])  # B already holds one of the chunks
    wait_for(lambda: keys_at(controller, "lmcache_instance_1") == 5, what="A's keys")
    # tokens omitted: every chunk A holds at that location.
    answer = controller.api(
        "/copy", {"old_position": ["lmcache_instance_1", CPU], "new_position": ["lmcache_instance_2", CPU]}
    )
    state = controller.finish(answer["event_id"])
    assert state["status"] == "done" and state["num_tokens"] == 5 * CHUNK, state
    for prompt in (one, two):
        assert a.lookup(prompt, peers=False) == len(prompt)  # copy keeps the source
        assert b.lookup(prompt, peers=False) == len(prompt)
        assert b.retrieve(prompt)["exact"]
    # /move with copy: true is a copy too; a prompt A holds only partly copies that part.
    longer = one + tokens(CHUNK, seed=6)
    answer = controller.api(
        "/move",
        {
            "old_position": ["lmcache_instance_1", CPU],
            "new_position": ["lmcache_instance_2", CPU],
            "tokens": longer,
            "copy": True,
        },
    )
    assert answer["num_tokens"] == 3 * CHUNK
    assert controller.finish(answer["event_id"])["status"] == "done"
    assert a.lookup(one, peers=False) == 3 * CHUNK


def test_move_to_an_instance_without_p2p_fails_cleanly(controller, spawn):
    a = spawn(instance_config("lmcache_instance_1", controller, "tcp", chunk_size=CHUNK))
    plain = instance_config("lmcache_instance_3", controller, "tcp", chunk_size=CHUNK)
    for key in ("enable_p2p", "p2p_host", "p2p_init_ports", "p2p_lookup_ports", "transfer_channel"):
        plain.pop(key)
    c = spawn(plain)
    prompt = tokens(2 * CHUNK, seed=7)
    a.prefill(prompt)
    wait_for(lambda: keys_at(controller, "lmcache_instance_1") == 2, what="A's keys")
    response = controller.http.post(
        "/move",
        json={
            "old_position": ["lmcache_instance_1", CPU],
            "new_position": ["lmcache_instance_3", CPU],
            "tokens": prompt,
        },
    )
    assert response.status_code == 409
    assert "no p2p_lookup port" in response.json()["error"]
    assert a.lookup(prompt, peers=False) == 2 * CHUNK  # nothing lost
    assert c.lookup(prompt) == 0


@pytest.mark.parametrize("channel", CHANNELS)
def test_holder_dying_mid_transfer_is_a_miss_without_leaks(controller, spawn, channel):
    a, b = two_instances(controller, spawn, channel)
    # Three requests of 8 chunks in flight: one times out, and the others fail with its socket.
    prompt, warm = tokens(25 * CHUNK, seed=8), tokens(CHUNK, seed=20)
    a.prefill(prompt)
    a.prefill(warm)
    b.prefill(prompt[:CHUNK])
    wait_for(lambda: keys_at(controller, "lmcache_instance_1") == 26, what="A's keys")
    assert b.lookup(warm) == CHUNK  # B's session with A is open: the next pull starts with its requests
    free_before = b.status()["storage"]["cpu"]["free_pages"]

    a.signal(signal.SIGSTOP)  # the holder freezes with B's request in flight...
    t0 = time.monotonic()
    threading.Timer(1.0, a.kill).start()  # ...and dies during it
    assert b.lookup(prompt, timeout=30) == CHUNK  # only B's own chunk: the rest is a miss
    assert time.monotonic() - t0 < 15
    assert "the rest is a miss" in b.log()
    # Pages reserved for the transfer all come back (after the grace period under NIXL).
    wait_for(lambda: b.status()["storage"]["cpu"]["free_pages"] == free_before, 15, "B's pages back")
    status = b.status()
    assert status["p2p_client"]["pages_quarantined"] == 0 and status["storage"]["cpu"]["pins_held"] == 0
    # B's engine is unharmed: it stores and loads as before.
    assert b.prefill(tokens(2 * CHUNK, seed=9)) == 2 * CHUNK
    assert b.retrieve(prompt)["retrieved"] == CHUNK


def test_requester_dying_mid_transfer_releases_the_holders_pins(controller, spawn):
    a, b = two_instances(controller, spawn, "tcp")
    prompt = tokens(48 * CHUNK, seed=10)  # 192 MiB: long enough to catch the holder sending
    a.request("fill", tokens=prompt)  # more chunks than the stand-in's KV blocks: store payloads directly
    wait_for(lambda: keys_at(controller, "lmcache_instance_1") == 48, what="A's keys")
    caught = False
    for attempt in range(3):
        # On a loaded machine B can read all 192 MiB between "A is serving" and the stop: then
        # the pull simply finished, and B (with a fresh process) asks again.
        b.proc.stdin.write(json.dumps({"op": "lookup", "tokens": prompt}) + "\n")
        b.proc.stdin.flush()
        wait_for(lambda: a.status()["storage"]["cpu"]["pins_held"] > 0, 15, "A serving B")
        b.signal(signal.SIGSTOP)  # B stops reading: A's send cannot finish...
        time.sleep(0.5)
        if a.status()["storage"]["cpu"]["pins_held"] > 0:
            caught = True
            break
        b.kill()
        b = spawn(b.config, name=f"lmcache_instance_2-again-{attempt}")
        wait_for(lambda b=b: b.status()["registered"], 15, "B registered")
    assert caught, "A was never caught mid-send to a frozen B in 3 tries"
    b.kill()  # ...and B dies with it unfinished
    wait_for(lambda: a.status()["storage"]["cpu"]["pins_held"] == 0, 15, "A's pins released")
    assert a.lookup(prompt, peers=False) == 48 * CHUNK


def test_a_hung_controller_turns_peer_lookups_into_fast_misses(spawn, request):
    """Before, each peer lookup waited its full timeout until a heartbeat failed (~16 s of
    stalled requests); now only the first does (the 3 s a lookup that waits for the bytes gives
    the controller to name holders: WAITING_OFFER_TIMEOUT_S), and the rest are misses at once
    until a heartbeat hears the controller again. The default 5 s heartbeats: one goes
    unanswered only after 10 s, so fast misses cannot come from the heartbeat alone. Each is a
    ``timeout`` miss."""
    controller = ControllerProcess().start()
    request.addfinalizer(controller.stop)
    a, b = two_instances(controller, spawn, "tcp")
    held = tokens(4 * CHUNK, seed=13)
    a.prefill(held)
    wait_for(lambda: keys_at(controller, "lmcache_instance_1") == 4, what="A's keys")
    freeze(controller.proc.pid)  # alive, its ports open, answering nothing
    try:
        took = []
        for seed in range(5):
            t0 = time.monotonic()
            assert b.lookup(tokens(4 * CHUNK, seed=20 + seed)) == 0  # a miss, not an error
            took.append(time.monotonic() - t0)
        assert took[0] >= 0.9 * WAITING_OFFER_TIMEOUT_S, took  # the first waits for its answer...
        assert max(took[1:]) < 0.5 * took[0], took  # ...the next ones do not
        assert b.status()["engine"]["missed_chunks"]["timeout"] == 5 * 4
        # (Skipped as failing lookups, or, once the early heartbeat has timed out too, as a
        # controller away: either way no request waits.)
        assert "lookups are misses until a heartbeat hears the controller" in b.log()
    finally:
        controller.proc.send_signal(signal.SIGCONT)
    # Back: the next heartbeat clears it, and B pulls A's chunks again.
    wait_for(lambda: b.lookup(held) == 4 * CHUNK, 30, "B to pull from A again")


def test_controller_restart_converges_without_admin_action(controller, spawn):
    a, b = two_instances(controller, spawn, "nixl")
    first, second = tokens(4 * CHUNK, seed=11), tokens(3 * CHUNK, seed=12)
    a.prefill(first)
    wait_for(lambda: keys_at(controller, "lmcache_instance_1") == 4, what="A's keys")

    controller.kill()
    # The controller is away: engines keep serving from their own tiers.
    assert a.prefill(second) == 3 * CHUNK
    assert a.lookup(second) == 3 * CHUNK
    assert b.lookup(first) == 0  # no controller, no peers: a miss, not an error
    controller.start()  # a new process, empty index, same ports
    wait_for(
        lambda: controller.holders(first).get("lmcache_instance_1") == [CPU, 4 * CHUNK],
        15,
        "A's keys after the restart",
    )
    assert controller.holders(second)["lmcache_instance_1"] == [CPU, 3 * CHUNK]  # stored while it was away
    wait_for(lambda: len(controller.http.get("/controller/workers").json()["workers"]) == 2, 15, "B registered")
    assert b.lookup(first) == 4 * CHUNK
    assert b.retrieve(first)["exact"]
    assert "registered again" in a.log()


def test_a_move_into_a_full_pool_stops_there_and_says_so(controller, spawn):
    """A destination whose pool has fewer free pages than the move has chunks pulls what fits and
    stops, reporting a full pool: the chunks after that are not skipped as if the source lacked
    them (the move would then evict chunks nobody holds any more)."""
    a = spawn(instance_config("lmcache_instance_1", controller, "tcp", chunk_size=CHUNK))
    b = spawn(instance_config("lmcache_instance_2", controller, "tcp", chunk_size=CHUNK, cpu_gb=7 * 4 / 1024))
    resident = tokens(7 * CHUNK, seed=18)  # B's 7 pages of 4 MiB, all of them pinned
    assert b.prefill(resident) == 7 * CHUNK
    wait_for(lambda: keys_at(controller, "lmcache_instance_2") == 7, what="B's keys")
    assert (
        controller.api("/pin", {"instance_id": "lmcache_instance_2", "location": CPU, "tokens": resident})["num_tokens"]
        == 7 * CHUNK
    )
    moving = tokens(5 * CHUNK, seed=19)
    a.prefill(moving)
    wait_for(lambda: keys_at(controller, "lmcache_instance_1") == 5, what="A's keys")
    move = {"old_position": ["lmcache_instance_1", CPU], "new_position": ["lmcache_instance_2", CPU], "tokens": moving}

    # No page free: nothing moves, the event fails with the reason, and A keeps every chunk.
    state = controller.finish(controller.api("/move", move)["event_id"])
    assert state["status"] == "failed" and "CPU pool full: reserved 0 of 5 pages" in state["error"], state
    assert a.lookup(moving, peers=False) == 5 * CHUNK

    # Two pages free (B's first two chunks unpinned): two chunks move; the other three stay at A.
    controller.api(
        "/pin", {"instance_id": "lmcache_instance_2", "location": CPU, "tokens": resident[: 2 * CHUNK], "unpin": True}
    )
    state = controller.finish(controller.api("/move", move)["event_id"])
    assert state["status"] == "done" and state["num_tokens"] == 2 * CHUNK, state
    assert "CPU pool full: reserved 2 of 5 pages" in a.log()  # the CommandDone's error, as the source logs it
    assert "does not hold" not in b.log()
    assert b.lookup(moving, peers=False) == 2 * CHUNK and b.retrieve(moving)["exact"]
    wait_for(lambda: keys_at(controller, "lmcache_instance_1") == 3, what="A's evictions")
    assert a.status()["storage"]["cpu"]["pins_held"] == 0


def test_controller_urls_written_as_tcp_urls(controller, spawn):
    """``tcp://host:port`` is read as ``host:port``: the worker registers, with the address
    that routes to the controller, and its events arrive."""
    config = instance_config(
        "lmcache_instance_1",
        controller,
        "tcp",
        chunk_size=CHUNK,
        controller_pull_url=f"tcp://127.0.0.1:{controller.pull}",
        controller_reply_url=f"tcp://127.0.0.1:{controller.reply}",
    )
    for key in ("enable_p2p", "p2p_host", "p2p_init_ports", "p2p_lookup_ports", "transfer_channel"):
        config.pop(key)  # without p2p_host the worker takes its address from the controller's URL
    a = spawn(config)
    prompt = tokens(3 * CHUNK, seed=17)
    assert a.prefill(prompt) == 3 * CHUNK
    wait_for(lambda: keys_at(controller, "lmcache_instance_1") == 3, what="A's events")
    (worker,) = controller.http.get("/controller/workers").json()["workers"]
    assert worker["host"] == "127.0.0.1"
    assert "no local address routes" not in a.log()


def test_tp_ranks_never_receive_each_others_chunks(controller, spawn):
    def instance(name):
        config = instance_config(name, controller, "nixl", tp=2, chunk_size=CHUNK)
        return [spawn(config, rank=r, tp=2, name=f"{name}-r{r}") for r in range(2)]

    a_ranks, b_ranks = instance("lmcache_instance_1"), instance("lmcache_instance_2")
    prompt = tokens(4 * CHUNK, seed=13)
    for rank in a_ranks:  # each rank holds its own half of the heads: different bytes per rank
        rank.prefill(prompt)
    wait_for(lambda: controller.holders(prompt).get("lmcache_instance_1") == [CPU, 4 * CHUNK], what="A's keys")
    for rank in b_ranks:
        assert rank.lookup(prompt) == 4 * CHUNK
        got = rank.retrieve(prompt)
        assert got["exact"], f"rank got bytes that are not its own: {got}"
    for r, rank in enumerate(b_ranks):
        assert rank.status()["p2p_client"]["chunks_pulled"] == 4
        assert f"from lmcache_instance_1 rank {r} " in rank.log()
        assert f"from lmcache_instance_1 rank {1 - r} " not in rank.log()


def test_clear_pin_health_and_status_reach_the_worker(controller, spawn):
    a = spawn(instance_config("lmcache_instance_1", controller, "tcp", chunk_size=CHUNK))
    prompt = tokens(3 * CHUNK, seed=14)
    a.prefill(prompt)
    wait_for(lambda: keys_at(controller, "lmcache_instance_1") == 3, what="A's keys")

    assert controller.api("/health", {"instance_id": "lmcache_instance_1"})["error_codes"] == {"0": 0}
    status = controller.api("/status", {"instance_id": "lmcache_instance_1"})["workers"]["0"]
    assert status["registered"] and status["storage"]["cpu"]["chunks"] == 3 and status["channels"] == ["tcp"]

    pinned = controller.api("/pin", {"instance_id": "lmcache_instance_1", "location": CPU, "tokens": prompt})
    assert pinned["num_tokens"] == 3 * CHUNK
    assert a.status()["command_pins"] == 3
    unpinned = controller.api(
        "/pin", {"instance_id": "lmcache_instance_1", "location": CPU, "tokens": prompt, "unpin": True}
    )
    assert unpinned["num_tokens"] == 3 * CHUNK and a.status()["storage"]["cpu"]["pins_held"] == 0

    cleared = controller.api("/clear", {"instance_id": "lmcache_instance_1", "location": CPU})
    assert cleared["num_tokens"] == 3 * CHUNK
    assert a.lookup(prompt) == 0
    wait_for(lambda: keys_at(controller, "lmcache_instance_1") == 0, what="index after clear")


def test_bad_frames_and_foreign_layouts_do_not_hurt_a_holder(controller, spawn):
    import zmq

    from lmcache_p2p.protocol import ChannelHello, encode, peer_reply_decoder

    config = instance_config("lmcache_instance_1", controller, "tcp", chunk_size=CHUNK)
    a = spawn(config)
    b = spawn(instance_config("lmcache_instance_2", controller, "tcp", chunk_size=CHUNK))
    ctx = zmq.Context()
    try:
        for port in (config["p2p_init_ports"][0], config["p2p_lookup_ports"][0], config["lmcache_worker_ports"][0]):
            sock = ctx.socket(zmq.DEALER)
            sock.connect(f"tcp://127.0.0.1:{port}")
            sock.send_multipart([b"1", b"\xc1 not msgpack"])
            sock.send_multipart([b"only one frame"])
            sock.close(linger=500)
        hello = ctx.socket(zmq.DEALER)
        hello.connect(f"tcp://127.0.0.1:{config['p2p_init_ports'][0]}")
        hello.send_multipart(
            [b"7", encode(ChannelHello(instance_id="other", rank=0, fingerprint=12345, channel="tcp", session="s"))]
        )
        assert hello.poll(5000)
        request_id, payload = hello.recv_multipart()
        reply = peer_reply_decoder.decode(payload)
        assert request_id == b"7" and not reply.ok and "layout mismatch" in reply.error
        hello.close(linger=0)
    finally:
        ctx.term()
    prompt = tokens(2 * CHUNK, seed=15)
    a.prefill(prompt)
    wait_for(lambda: keys_at(controller, "lmcache_instance_1") == 2, what="A's keys")
    assert b.lookup(prompt) == 2 * CHUNK and b.retrieve(prompt)["exact"]
    assert a.status()["p2p_server"]["bad_frames"] >= 2


@pytest.mark.parametrize("channel", CHANNELS)
def test_a_checksum_mismatch_is_a_miss_from_that_chunk_on(controller, spawn, channel):
    a, b = two_instances(controller, spawn, channel)
    prompt = tokens(6 * CHUNK, seed=16)
    a.prefill(prompt)
    a.request("corrupt", tokens=prompt, chunk=3)  # A's copy of chunk 3 rots in memory
    wait_for(lambda: keys_at(controller, "lmcache_instance_1") == 6, what="A's keys")
    assert b.lookup(prompt) == 3 * CHUNK  # chunks 0-2 verified; 3 and after are a miss
    status = b.status()
    assert status["p2p_client"]["checksum_mismatches"] == 1 and status["storage"]["cpu"]["chunks"] == 3
    assert "checksum mismatch" in b.log()
    got = b.retrieve(prompt)
    assert got["retrieved"] == 3 * CHUNK and got["exact"]


def test_a_port_in_use_stops_the_engine_with_a_message_naming_it(controller, tmp_path):
    import socket

    config = instance_config("lmcache_instance_1", controller, "tcp", chunk_size=CHUNK)
    taken = socket.socket()
    taken.bind(("0.0.0.0", config["p2p_lookup_ports"][0]))
    taken.listen()
    try:
        proc = InstanceProcess(config, tmp_path)
        with pytest.raises(AssertionError, match="exited"):
            proc.start(timeout=30)
        assert f"cannot bind p2p_lookup port {config['p2p_lookup_ports'][0]}" in proc.log()
    finally:
        taken.close()
