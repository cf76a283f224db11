"""The engine's prefix pulls from one holder as one pipeline (worker/pull_pump.py).

In-process first: the real pump, pages and store over a scripted holder that answers each batch
when the test says, so what is asserted is the order of batches and results, never wall time.
Then real processes (the stand-in engine, the controller, tcp between them): four prompts pulled
at once from one holder, bit-exact; a holder that dies with pulls in flight; a stalled holder
beside a live one.
"""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import time

import numpy as np
import pytest
from instances import instance_config, tokens
from protocol_client import layout, wait_for

from lmcache_p2p.config import LMCacheConfig
from lmcache_p2p.miss_reasons import EVICTED, HOLDER_GONE, Miss
from lmcache_p2p.storage.manager import StorageManager
from lmcache_p2p.vocab import PULL_REQUEST_TIMEOUT_S
from lmcache_p2p.worker import pull_pump
from lmcache_p2p.worker.identity import WorkerIdentity
from lmcache_p2p.worker.peer_links import Peer
from lmcache_p2p.worker.pull_batch import Batch, PullPages
from lmcache_p2p.worker.pull_job import PullRoute, PullSetup
from lmcache_p2p.worker.pull_pump import PullOverlap, PullPump
from lmcache_p2p.worker.pull_stats import PullStats

HOLDER = Peer("holder", 0, "127.0.0.1", 1, 2)
OTHER = Peer("other", 0, "127.0.0.2", 1, 2)


class ScriptedHolder:
    """A holder's answers to batches, one at a time when the test says (:meth:`answer`). Pages
    are reserved as BatchFetch reserves them; a batch stops at the first chunk in ``lacks``."""

    def __init__(self, pages: PullPages):
        self.pages = pages
        self.sent: list[list[int]] = []  # each batch's chunks, in the order they went out
        self.waiting: list[tuple[Batch, asyncio.Future]] = []
        self.lacks: set[int] = set()
        self.most_out = 0

    async def fetch(self, hashes: list[int]) -> Batch:
        batch = Batch(list(hashes))
        self.pages.reserve(batch)
        self.sent.append(list(batch.hashes))
        answered = asyncio.get_running_loop().create_future()
        self.waiting.append((batch, answered))
        self.most_out = max(self.most_out, len(self.waiting))
        how = await answered
        if how == "dead":  # no answer at all: the request timed out
            self.pages.give_back(batch.pages)
            batch.pages = []
            batch.error, batch.peer_failed, batch.unanswered = "timed out", True, True
            batch.miss = Miss(HOLDER_GONE, "did not answer (dead or stalled)")
            return batch
        served = next((i for i, h in enumerate(batch.hashes) if h in self.lacks), len(batch.hashes))
        batch.good = served
        batch.checksums = np.array(batch.hashes, dtype=np.uint64)
        if served < len(batch.hashes):
            batch.error = f"does not hold chunk {batch.hashes[served]:x}"
            batch.miss = Miss(EVICTED, "by the holder since its offer")
            batch.skippable = True
        return batch

    def answer(self, how: str = "serve") -> list[int]:
        """Answer the oldest batch still out; its chunks."""
        batch, answered = self.waiting.pop(0)
        answered.set_result(how)
        return batch.hashes


class FakeConnection:
    def __init__(self):
        self.closed = asyncio.Event()


class FakeConnections:
    def __init__(self):
        self.dropped: list[Peer] = []

    def drop(self, peer, conn=None):
        self.dropped.append(peer)
        if conn is not None:
            conn.closed.set()


def _setup(batch_chunks: int = 4, depth: int = 3) -> tuple[PullSetup, StorageManager]:
    config = LMCacheConfig.from_dict({"chunk_size": 16, "max_local_cpu_size": 0.001})
    storage = StorageManager(config, layout(), pin_memory=False)
    stats = PullStats()
    me = WorkerIdentity("requester", 0, "127.0.0.1", 0, layout(), 16)
    pages = PullPages(storage, storage, stats)  # the store is its own PullLanding
    setup = PullSetup(me, FakeConnections(), {}, pages, stats, batch_chunks, depth)  # type: ignore[arg-type]
    return setup, storage


def _route_to(holders: dict[Peer, ScriptedHolder], monkeypatch) -> None:
    async def open_route(setup, peer, into_gpu_tier):
        return PullRoute(FakeConnection(), holders[peer], setup.batch_chunks, "scripted")  # type: ignore[arg-type]

    monkeypatch.setattr(pull_pump, "open_route", open_route)


async def _settle() -> None:
    """Let the pump take every step it can without a new answer."""
    for _ in range(20):
        await asyncio.sleep(0)


def _chunks(pull: int, n: int) -> list[int]:
    return [1000 * (pull + 1) + i for i in range(n)]


def _run(main) -> None:
    asyncio.run(asyncio.wait_for(main(), 30))


def _answer_all(holder: ScriptedHolder, pulls) -> list[int]:
    """Answer batches one at a time, oldest first; after which answer each pull was done. The
    pipeline must stay full while any pull has chunks not yet out."""

    async def main() -> list[int]:
        done_after: list[int] = []
        answers = 0
        while holder.waiting:
            holder.answer()
            answers += 1
            await _settle()
            for i, p in enumerate(pulls):
                if p.finished and len(done_after) == i:
                    done_after.append(answers)
            if any(not p.finished and p.uncut for p in pulls):
                assert len(holder.waiting) == 3, "the pipeline ran dry between pulls"
        return done_after

    return main()


def test_pulls_from_one_holder_share_one_pipeline_across_their_boundaries(monkeypatch):
    """Four pulls asked together: the next pull's batches go out while the one ahead still has
    batches out, the pipeline stays full across pulls, each batch carries one pull's chunks,
    each pull is done right after the batch with its last chunk (the first before any later
    one), and the landed hook sees each batch's progress."""
    setup, storage = _setup(batch_chunks=4, depth=3)
    holder = ScriptedHolder(setup.pages)
    _route_to({HOLDER: holder}, monkeypatch)
    free = storage.cpu.pool.free_pages

    async def main():
        pump = PullPump(setup, HOLDER, PullOverlap())
        landed: list[list[int]] = [[] for _ in range(4)]
        pulls = [
            pump.join(_chunks(i, 5), on_landed=lambda n, i=i: landed[i].append(n))  # type: ignore[misc]
            for i in range(4)
        ]
        await _settle()
        # Three batches out at once: pull 2's first is on the wire while pull 1 is not done.
        assert holder.sent == [_chunks(0, 4), _chunks(0, 5)[4:], _chunks(1, 4)]
        assert not any(p.finished for p in pulls)
        assert await _answer_all(holder, pulls) == [2, 4, 6, 8]
        assert holder.most_out == 3
        assert [len(b) for b in holder.sent] == [4, 1] * 4
        assert all(len({c // 1000 for c in b}) == 1 for b in holder.sent)  # one pull's chunks a batch
        for i, p in enumerate(pulls):
            result = p.done.result()
            assert result.held == _chunks(i, 5) and result.error is None
            assert landed[i] == [4, 5]
        assert all(storage.holds(h, "LocalCPUBackend") for i in range(4) for h in _chunks(i, 5))
        assert setup.stats.pulls == 4
        assert pulls[0].alone is False  # pull 2's batches were out beside its own

    _run(main)
    assert storage.cpu.pool.free_pages == free - 20  # the committed chunks' pages, nothing else
    storage.close()


def test_spanning_pulls_a_batch_carries_one_pulls_tail_and_the_next_ones_head(monkeypatch):
    """span_pulls: the same chunks in full batches; a pull is still done right after the batch
    with its last chunk, which may be the next pull's first."""
    setup, storage = _setup(batch_chunks=4, depth=3)
    holder = ScriptedHolder(setup.pages)
    _route_to({HOLDER: holder}, monkeypatch)

    async def main():
        pump = PullPump(setup, HOLDER, PullOverlap(), span_pulls=True)
        landed: list[list[int]] = [[] for _ in range(4)]
        pulls = [
            pump.join(_chunks(i, 5), on_landed=lambda n, i=i: landed[i].append(n))  # type: ignore[misc]
            for i in range(4)
        ]
        await _settle()
        assert holder.sent == [_chunks(0, 4), _chunks(0, 5)[4:] + _chunks(1, 3), _chunks(1, 5)[3:] + _chunks(2, 2)]
        assert await _answer_all(holder, pulls) == [2, 3, 4, 5]
        assert [len(b) for b in holder.sent] == [4] * 5
        assert [p.done.result().held for p in pulls] == [_chunks(i, 5) for i in range(4)]
        assert landed[0] == [4, 5] and landed[1] == [3, 5]

    _run(main)
    storage.close()


def test_one_at_a_time_a_pull_goes_out_only_once_the_one_ahead_is_done(monkeypatch):
    """p2p_prefix_pull_turns: the former turns, per holder; each pull then has the link to
    itself and may measure it."""
    setup, storage = _setup(batch_chunks=4, depth=3)
    holder = ScriptedHolder(setup.pages)
    _route_to({HOLDER: holder}, monkeypatch)

    async def main():
        pump = PullPump(setup, HOLDER, PullOverlap(), one_at_a_time=True)
        pulls = [pump.join(_chunks(i, 5)) for i in range(2)]
        await _settle()
        assert holder.sent == [_chunks(0, 4), _chunks(0, 5)[4:]]  # pull 1 only, in two batches
        holder.answer()
        await _settle()
        assert len(holder.sent) == 2
        holder.answer()
        await _settle()
        assert pulls[0].finished and holder.sent[2] == _chunks(1, 4)
        while holder.waiting:
            holder.answer()
            await _settle()
        assert [p.done.result().held for p in pulls] == [_chunks(0, 5), _chunks(1, 5)]
        assert pulls[0].alone and pulls[1].alone

    _run(main)
    storage.close()


@pytest.mark.parametrize("span_pulls", [False, True], ids=["one-pull-batches", "spanning"])
def test_a_batch_stopped_at_one_pulls_chunk_fails_only_that_pull(monkeypatch, span_pulls):
    """The holder lacks a chunk of pull 1: pull 1 is a miss from that chunk on (as a pull alone),
    pull 2 comes whole; where the stopped batch also carried pull 2's head, those chunks are
    asked again (and copies of its later chunks already out are given back)."""
    setup, storage = _setup(batch_chunks=4, depth=3)
    holder = ScriptedHolder(setup.pages)
    _route_to({HOLDER: holder}, monkeypatch)
    free = storage.cpu.pool.free_pages
    first, second = _chunks(0, 6), _chunks(1, 6)
    holder.lacks.add(first[4])

    async def main():
        pump = PullPump(setup, HOLDER, PullOverlap(), span_pulls=span_pulls)
        pulls = [pump.join(first), pump.join(second)]
        await _settle()
        while holder.waiting:
            holder.answer()
            await _settle()
        one, two = (p.done.result() for p in pulls)
        assert one.held == first[:4] and one.miss is not None and one.miss.reason == EVICTED, one
        assert two.held == second and two.error is None, two
        if span_pulls:  # the batch [first 4-5, second 0-1] stopped at first[4]
            assert holder.sent[1] == first[4:] + second[:2]
            assert sum(b.count(second[0]) for b in holder.sent) == 2
        else:
            assert holder.sent[1] == first[4:] and sum(b.count(second[0]) for b in holder.sent) == 1
        assert setup.connections.dropped == []  # a chunk the holder lacks is no reason to drop it

    _run(main)
    assert storage.cpu.pool.free_pages == free - 10
    storage.close()


def test_a_holder_that_stops_answering_fails_its_queue_and_only_what_was_not_done(monkeypatch):
    """Pulls done before the holder went silent stay done; the one it stopped in keeps its
    committed chunks; every pull queued behind it fails at once (holder_gone), not each after a
    timeout of its own; no page is lost."""
    setup, storage = _setup(batch_chunks=4, depth=3)
    holder = ScriptedHolder(setup.pages)
    _route_to({HOLDER: holder}, monkeypatch)
    free = storage.cpu.pool.free_pages

    async def main():
        pump = PullPump(setup, HOLDER, PullOverlap())
        pulls = [pump.join(_chunks(i, 4)) for i in range(4)]
        await _settle()
        holder.answer()  # pull 1 whole
        await _settle()
        holder.answer()  # pull 2 whole
        await _settle()
        assert [p.finished for p in pulls] == [True, True, False, False]
        holder.answer("dead")  # pull 3's batch: no answer
        await _settle()
        assert all(p.finished for p in pulls)
        results = [p.done.result() for p in pulls]
        assert [len(r.held) for r in results] == [4, 4, 0, 0]
        assert all(r.miss.reason == HOLDER_GONE for r in results[2:]), results
        assert setup.connections.dropped == [HOLDER]
        while holder.waiting:  # the batch still out ends (its socket failed too): nothing commits it
            holder.answer("dead")
            await _settle()
        assert pump.idle

    _run(main)
    assert storage.cpu.pool.free_pages == free - 8
    storage.close()


def test_a_pull_given_up_leaves_the_queue_and_the_others_go_on(monkeypatch):
    setup, storage = _setup(batch_chunks=4, depth=2)
    holder = ScriptedHolder(setup.pages)
    _route_to({HOLDER: holder}, monkeypatch)
    free = storage.cpu.pool.free_pages

    async def main():
        pump = PullPump(setup, HOLDER, PullOverlap())
        pulls = [pump.join(_chunks(i, 8)) for i in range(3)]
        await _settle()
        pump.leave(pulls[1])  # its caller's deadline passed before any of it went out
        while holder.waiting:
            holder.answer()
            await _settle()
        assert pulls[1].done.result().held == []
        assert all(c not in b for b in holder.sent for c in _chunks(1, 8))
        assert [p.done.result().held for p in (pulls[0], pulls[2])] == [_chunks(0, 8), _chunks(2, 8)]

    _run(main)
    assert storage.cpu.pool.free_pages == free - 16
    storage.close()


def test_a_silent_holder_holds_up_no_pull_from_another(monkeypatch):
    setup, storage = _setup(batch_chunks=4, depth=3)
    silent, live = ScriptedHolder(setup.pages), ScriptedHolder(setup.pages)
    _route_to({HOLDER: silent, OTHER: live}, monkeypatch)

    async def main():
        overlap = PullOverlap()
        stuck = PullPump(setup, HOLDER, overlap).join(_chunks(0, 4))
        other = PullPump(setup, OTHER, overlap).join(_chunks(1, 8))
        await _settle()
        while live.waiting:
            live.answer()
            await _settle()
        assert other.done.result().held == _chunks(1, 8) and not stuck.finished
        silent.answer("dead")
        await _settle()
        assert stuck.done.result().held == []

    _run(main)
    storage.close()


# -- real processes ---------------------------------------------------------------------------------

CHUNK = 32
CPU = "LocalCPUBackend"
PULLING = re.compile(
    r"pulling (\d+) chunk\(s\) from .*?waited ([\d.]+) ms in the holder's queue; "
    r"(\d+) chunk\(s\) of (\d+) earlier pull\(s\) in flight\)"
)


def _holder_and_requester(controller, spawn, **extra):
    return tuple(
        spawn(instance_config(f"lmcache_instance_{i}", controller, "tcp", chunk_size=CHUNK, cpu_gb=0.5, **extra))
        for i in (1, 2)
    )


def _held_by(controller, prompts, instance="lmcache_instance_1"):
    wait_for(
        lambda: all(controller.holders(p).get(instance) == [CPU, len(p) // CHUNK * CHUNK] for p in prompts),
        what=f"{instance}'s keys",
    )


@pytest.mark.slow
@pytest.mark.parametrize("turns", [False, True], ids=["pump", "turns"])
def test_four_prefixes_pulled_together_from_one_holder(controller, spawn, turns):
    """Four prompts asked together, as vLLM's scheduler asks requests that arrive together: the
    pump has later pulls' first batches out beside the ones ahead of them (turns: none), in the
    order asked, the first done before the fourth; every chunk bit-exact. Timings are printed,
    not asserted (benchmarks/bench_p2p.py --concurrent measures them)."""
    a, b = _holder_and_requester(controller, spawn, p2p_batch_chunks=3, p2p_prefix_pull_turns=turns)
    sizes = [7, 8, 10, 11]  # chunks, in batches of 3
    prompts = [tokens(n * CHUNK, seed=40 + i) for i, n in enumerate(sizes)]
    for prompt in prompts:
        a.request("fill", tokens=prompt)  # the chunks' payloads as a prefill makes them, without the KV
    _held_by(controller, prompts)
    together = b.request("lookup_together", prompts=[list(p) for p in prompts])
    print("done_s", together["done_s"])
    assert together["pulled"] == sizes, together
    done = together["done_s"]
    assert done[0] < done[3], done
    lines = [tuple(int(float(x)) for x in m.groups()) for m in PULLING.finditer(b.log())]
    assert [n for n, *_ in lines] == sizes, lines  # in the order asked
    beside = [(chunks, pulls) for _, _, chunks, pulls in lines]
    if turns:
        assert beside == [(0, 0)] * 4, lines
    else:
        # Whether a given pull's first batch goes out while the one ahead still has batches out
        # depends on when their answers settle (all of one pull's can settle in one pass): at
        # least one later pull must have gone out beside an earlier one, which turns never do.
        assert beside[0] == (0, 0) and any(chunks > 0 and pulls >= 1 for chunks, pulls in beside[1:]), lines
    status = b.status()["p2p_client"]
    assert status["chunks_pulled"] == sum(sizes) and status["checksum_mismatches"] == 0
    for prompt, n in zip(prompts, sizes, strict=True):
        got = b.retrieve(prompt)
        assert got["retrieved"] == n * CHUNK and got["exact"], got
    wait_for(lambda: a.status()["storage"]["cpu"]["pins_held"] == 0, 10, "A's pins released")


@pytest.mark.slow
def test_a_holder_dying_with_pulls_in_flight_fails_only_what_had_not_come(controller, spawn):
    """The holder stops (then dies) while four pulls from it are queued and in flight: what B
    got is exactly the leading run of the chunks in the order asked (whole pulls, then one cut
    short, then none); the rest recompute; the queue fails within one batch timeout of the
    stop, not a timeout per pull; B's pages all come back."""
    a, b = _holder_and_requester(controller, spawn, p2p_batch_chunks=2)
    sizes = [24, 24, 24, 24]  # 96 chunks of 4 MiB in 48 batches: stopped well before the end
    prompts = [tokens(n * CHUNK, seed=60 + i) for i, n in enumerate(sizes)]
    for prompt in prompts:
        a.request("fill", tokens=prompt)
    warm = tokens(CHUNK, seed=59)
    a.prefill(warm)
    _held_by(controller, [*prompts, warm])
    assert b.lookup(warm) == CHUNK  # B's session with A is open
    free_before = b.status()["storage"]["cpu"]["free_pages"]
    served_before = a.status()["p2p_server"]["pulls_served"]

    answer: dict = {}

    def ask():
        answer.update(b.request("lookup_together", prompts=[list(p) for p in prompts], timeout=90))

    asking = threading.Thread(target=ask)
    asking.start()
    wait_for(lambda: a.status()["p2p_server"]["pulls_served"] >= served_before + 3, 30, "A serving B")
    a.signal(signal.SIGSTOP)
    stopped = time.monotonic()
    threading.Timer(1.0, a.kill).start()
    asking.join(60)
    elapsed = time.monotonic() - stopped
    assert answer, "B's pulls never ended"
    pulled, offered = answer["pulled"], answer["offered"]
    assert offered == sizes and sum(pulled) < sum(sizes), answer
    # Commits in the order asked: whole pulls, at most one cut short, then nothing.
    cut = next(i for i, (got, n) in enumerate(zip(pulled, sizes, strict=True)) if got < n)
    assert all(got == 0 for got in pulled[cut + 1 :]), pulled
    assert all(m == HOLDER_GONE for m in answer["miss"][cut:]), answer
    # One batch timeout (and the socket's reset) fails the whole queue.
    assert elapsed < 4 * PULL_REQUEST_TIMEOUT_S, elapsed
    assert "the rest is a miss" in b.log()
    for prompt, got in zip(prompts, pulled, strict=True):
        assert b.lookup(prompt, peers=False) == got * CHUNK
    wait_for(lambda: b.status()["storage"]["cpu"]["free_pages"] == free_before - sum(pulled), 15, "B's pages back")
    status = b.status()
    assert status["p2p_client"]["pages_quarantined"] == 0 and status["storage"]["cpu"]["pins_held"] == 0
    assert b.prefill(tokens(2 * CHUNK, seed=9)) == 2 * CHUNK  # B's engine goes on


@pytest.mark.slow
def test_a_stalled_holder_does_not_hold_up_a_pull_from_another(controller, spawn):
    """A is stopped (SIGSTOP) with B's pull from it out; B's pull from C, asked after it, is
    not queued behind it: it ends first, whole, and A's ends as a miss once it times out."""
    a, b, c = (
        spawn(instance_config(f"lmcache_instance_{i}", controller, "tcp", chunk_size=CHUNK, cpu_gb=0.25))
        for i in (1, 2, 3)
    )
    from_a, from_c = tokens(4 * CHUNK, seed=70), tokens(4 * CHUNK, seed=71)
    a.prefill(from_a)
    c.prefill(from_c)
    warm_a, warm_c = tokens(CHUNK, seed=72), tokens(CHUNK, seed=73)
    a.prefill(warm_a)
    c.prefill(warm_c)
    _held_by(controller, [from_a, warm_a])
    _held_by(controller, [from_c, warm_c], "lmcache_instance_3")
    assert b.lookup(warm_a) == CHUNK and b.lookup(warm_c) == CHUNK  # both sessions open
    a.signal(signal.SIGSTOP)
    try:
        together = b.request("lookup_together", prompts=[list(from_a), list(from_c)], timeout=60)
    finally:
        a.signal(signal.SIGCONT)
    print("done_s", together["done_s"])
    assert together["pulled"] == [0, 4], together
    assert together["miss"][0] == HOLDER_GONE
    done_a, done_c = together["done_s"]
    assert done_c < done_a, together
    assert b.retrieve(from_c)["exact"]


@pytest.mark.slow
def test_a_stalled_holder_is_waited_for_as_long_as_p2p_pull_timeout_s(controller, spawn):
    """With ``p2p_pull_timeout_s: 5`` a pull from a stopped holder ends as a miss after 5 s (plus
    its bytes' allowance), not at the default 2 s: a user on a slow or busy link can give pulls
    longer before the engine recomputes."""
    a, b = _holder_and_requester(controller, spawn, p2p_pull_timeout_s=5)
    prompt, warm = tokens(2 * CHUNK, seed=80), tokens(CHUNK, seed=81)
    a.prefill(prompt)
    a.prefill(warm)
    _held_by(controller, [prompt, warm])
    assert b.lookup(warm) == CHUNK  # B's session with A is open
    a.signal(signal.SIGSTOP)
    try:
        together = b.request("lookup_together", prompts=[list(prompt)], timeout=60)
    finally:
        a.signal(signal.SIGCONT)
    assert together["pulled"] == [0] and together["miss"][0] == HOLDER_GONE, together
    assert 5 <= together["done_s"][0] < 15, together
