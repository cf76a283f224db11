"""When a load beside the steps (vLLM's asynchronous loads) starts, when it is reported, and the
line that says where its time went (integration/vllm/load_executor.py).

* It starts on the load stream after the point of vLLM's stream its blocks wait for (the step that
  granted it: GrantFences) and after the store copies reading those blocks, not after everything
  vLLM queued since (the granting step's forward pass, later steps') nor every store in flight.
* A step that computes nothing waits briefly for any pull or copy to end; a step that computes
  waits at most 2 ms, and only for a copy about to end.
* A pull's chunks are copied as they land (peer_service.Landed), in pieces, reported once.

CPU tests drive the executor with stand-in copies where timing is the point; tests marked ``gpu``
check the ordering on the device (run on the GPU host)."""

from __future__ import annotations

import concurrent.futures
import logging
import re
import time
import uuid
from types import SimpleNamespace

import pytest
import torch
from instances import tokens

from lmcache_p2p.cache_engine import _PendingStore, _ReservedChunk
from lmcache_p2p.config import GB, LMCacheConfig
from lmcache_p2p.integration.vllm import async_loads
from lmcache_p2p.integration.vllm.async_loads import BUSY_STEP_COPY_WAIT_S, IDLE_STEP_WAIT_S
from lmcache_p2p.integration.vllm.load_executor import GrantFences, LoadExecutor
from lmcache_p2p.integration.vllm.load_jobs import LoadTimeline, by_outcome
from lmcache_p2p.integration.vllm.metadata import LoadSpec, P2PConnectorMetadata
from lmcache_p2p.keys import chunk_hash_array
from lmcache_p2p.layerwise import LayerwiseLoad
from lmcache_p2p.miss_reasons import PulledChunks
from lmcache_p2p.testing.standin import MODEL_SHAPES, StandInKV
from lmcache_p2p.testing.sync_engine import retrieve, store
from lmcache_p2p.worker import build_engine

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA (runs on the GPU host)")
CHUNK = 32
SHAPE = MODEL_SHAPES["qwen2.5-0.5b"]
# What sleeps of a fraction of a millisecond may overshoot by, summed, on a loaded 2-core CI host.
SLACK_S = 0.02


def stored_prompt(device: str, chunks: int = 4, num_blocks: int = 64, shape=SHAPE):
    """An engine holding a prompt's chunks, its KV wiped: (engine, kv, hashes, blocks)."""
    config = LMCacheConfig.from_dict({"chunk_size": CHUNK, "max_local_cpu_size": 256 * 2**20 / GB})
    kv = StandInKV(shape, num_blocks, device=device)
    engine = build_engine(config, kv.layout(), pin_memory=device != "cpu", device=kv.layers[0].device)
    hashes = chunk_hash_array(tokens(chunks * CHUNK, seed=4), CHUNK)
    blocks = list(range(chunks * CHUNK // kv.layout().block_size))
    kv.prefill(hashes, blocks, CHUNK)
    assert store(engine, hashes, kv.layers, blocks) == chunks * CHUNK
    kv.wipe()
    return engine, kv, hashes, blocks


# -- where a load starts: GrantFences (the choice; the device's order is tested on the GPU) -------


def test_a_step_marks_vllms_stream_before_its_forward_for_loads_its_preparation_cannot_touch(monkeypatch):
    """vLLM >= 0.32 queues a step's forward pass before start_load_kv when the step loads nothing
    in it. A load beside the steps then waits for the mark made before the forward (handle_preemptions)
    where the step's block preparation cannot touch its blocks; otherwise for a mark made in
    start_load_kv, one per step, as before."""
    marks = iter(range(100))
    monkeypatch.setattr(GrantFences, "_record", lambda self: f"event {next(marks)}")
    fences = GrantFences(torch.device("cuda", 0), block_size=16, zeroes_new_blocks=False)
    aligned = LoadSpec("a", chunk_hash_array(tokens(64), 32), 64, [0, 1, 2, 3], start=32, end=64, beside_steps=True)
    partial = LoadSpec("b", aligned.chunk_hashes, 64, [4, 5, 6, 7], start=37, end=64, beside_steps=True)

    after_forward = P2PConnectorMetadata(loads=[aligned, partial], load_after_forward=True)
    fences.before_forward(after_forward)
    assert fences.for_load(after_forward, aligned) == "event 0"  # made before the forward
    # A local hit ending inside a block: vLLM copies the cached block into a new one in the step.
    assert fences.for_load(after_forward, partial) == "event 1"
    assert fences.for_load(after_forward, partial) == "event 1"  # one mark per step

    before_forward = P2PConnectorMetadata(loads=[aligned], load_after_forward=False)
    fences.before_forward(before_forward)  # start_load_kv runs before the forward: its mark is it
    assert fences.for_load(before_forward, aligned) == "event 3"

    unmarked = P2PConnectorMetadata(loads=[aligned], load_after_forward=True)  # no handle_preemptions
    assert fences.for_load(unmarked, aligned) == "event 4"

    steps_in_step = P2PConnectorMetadata(loads=[], load_after_forward=True)
    fences.before_forward(steps_in_step)  # no load beside the steps: nothing recorded
    zeroing = GrantFences(torch.device("cuda", 0), block_size=16, zeroes_new_blocks=True)
    zeroing.before_forward(after_forward)
    assert zeroing.for_load(after_forward, aligned) == "event 6"  # new blocks may be zeroed in the step

    assert GrantFences(None, 16, False).for_load(after_forward, aligned) is None  # CPU: copied at once


def test_a_load_waits_only_for_the_store_copies_reading_the_blocks_it_writes():
    engine, kv, hashes, blocks = stored_prompt("cpu", chunks=2)
    try:
        ordered: list[str] = []

        def pending(name: str, block_lists: list[list[int]]) -> _PendingStore:
            copy = SimpleNamespace(order_before=lambda stream: ordered.append(name), done=lambda: False)
            chunks = [_ReservedChunk(i, b, 0, torch.empty(0)) for i, b in enumerate(block_lists)]
            return _PendingStore(copy, chunks, name, 0, 0.0)  # type: ignore[arg-type]

        engine._pending.extend([pending("reads 0-1", [[0, 1]]), pending("reads 6-9", [[6, 7], [8, 9]])])
        with engine.pin_prefix(hashes) as prefix:
            plan = engine.plan_load(prefix, [5, 6, 7, 8], start=16)  # the engine computed block 5
        assert plan.written_blocks() == {6, 7, 8}
        engine.order_stores_before(object(), blocks=plan.written_blocks())  # type: ignore[arg-type]
        assert ordered == ["reads 6-9"]
        ordered.clear()
        engine.order_stores_before(object())  # type: ignore[arg-type]  # no blocks named: every store
        assert ordered == ["reads 0-1", "reads 6-9"]
        engine._pending.clear()
    finally:
        engine.close()


# -- when it is reported: stand-in copies on a stand-in device ------------------------------------


class TimedCopy:
    """A load's copy that runs on a device from ``started_at`` for ``seconds`` (host clock)."""

    staged = False
    on_device = True

    next_seconds = 0.003  # how long the next copy made runs
    # and how long it waits behind other work first; None: it starts when the host first looks at
    # it (so that a loaded host's late step cannot find a short copy already over)
    next_delay: float | None = 0.0

    def __init__(self, plans, planes, layer_planes, fence=None, staging=None, after=None):
        self.plans = plans
        self.queued_at = time.monotonic()
        delay = TimedCopy.next_delay
        self._started_at = None if delay is None else self.queued_at + delay
        self.seconds = TimedCopy.next_seconds

    @property
    def started_at(self) -> float:
        if self._started_at is None:
            self._started_at = time.monotonic()
        return self._started_at

    def started(self) -> bool:
        return time.monotonic() >= self.started_at

    def done(self) -> bool:
        return time.monotonic() >= self.started_at + self.seconds

    def device_window(self):
        return (self.started_at, self.started_at + self.seconds) if self.done() else None

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.started_at + self.seconds - time.monotonic()))


@pytest.fixture
def timed_loads(monkeypatch):
    """A rank's executor whose loads beside the steps are TimedCopy copies "on a device"."""
    engine, kv, hashes, blocks = stored_prompt("cpu", chunks=2)
    monkeypatch.setattr(async_loads, "LayerwiseLoad", TimedCopy)
    device_planes = [SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))]
    loads = LoadExecutor(engine, device_planes, {})  # type: ignore[arg-type]

    def queue(req_id: str, seconds: float, delay: float | None = 0.0) -> None:
        TimedCopy.next_seconds, TimedCopy.next_delay = seconds, delay
        spec = LoadSpec(req_id, hashes, 64, blocks, 0, 64, beside_steps=True)
        assert loads.load(spec, engine.pin_prefix(hashes)) is None
        assert loads.jobs.job_of(req_id) is not None

    yield loads, queue
    loads.close()
    engine.close()


def step(loads: LoadExecutor, computing: bool) -> tuple[set[str], float]:
    """One get_finished: what it reported, and how long it took."""
    loads.begin_step(P2PConnectorMetadata(step_tokens=512 if computing else 0))
    t0 = time.monotonic()
    received, failed = by_outcome(loads.finished())
    assert not failed
    return received, time.monotonic() - t0


def test_a_step_computing_nothing_reports_a_copy_that_ends_while_it_waits(timed_loads):
    loads, queue = timed_loads
    queue("short", 0.002)
    received, took = step(loads, computing=False)
    assert received == {"short"}  # not left for the next step
    assert took < IDLE_STEP_WAIT_S + SLACK_S

    queue("long", 0.5)
    # The step right after a report does not wait: vLLM handles that report only once this step
    # is done, and the reported requests' first tokens would wait with it.
    waits = []
    wait = loads.jobs._wait_in_idle_step
    loads.jobs._wait_in_idle_step = lambda: waits.append(1) or wait()  # type: ignore[method-assign]
    received, _ = step(loads, computing=False)
    assert received == set() and waits == []
    received, took = step(loads, computing=False)
    assert waits == [1]
    assert received == set()
    assert IDLE_STEP_WAIT_S * 0.8 <= took < IDLE_STEP_WAIT_S + SLACK_S  # bounded, as for pulls
    received, _ = step(loads, computing=False)
    assert received == set()


def test_a_computing_step_waits_at_most_2_ms_and_only_for_a_copy_about_to_end(timed_loads, caplog):
    loads, queue = timed_loads
    queue("measured", 0.001)  # the first of its kind: nothing to say when it ends
    time.sleep(0.002)
    assert step(loads, computing=True)[0] == {"measured"}  # (done already: reported, no wait)

    queue("nearly done", 0.0015, delay=None)  # running when the step looks, ending 1.5 ms later
    with caplog.at_level(logging.DEBUG):
        received, took = step(loads, computing=True)
    assert received == {"nearly done"}
    assert took <= BUSY_STEP_COPY_WAIT_S + SLACK_S
    assert re.search(
        r"a computing step waited [\d.]+ ms for 1 load\(s\) beside the steps about to end; 1 ended", caplog.text
    )

    queue("behind", 0.001, delay=0.2)  # not running yet (behind other work): its end is unknown
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        received, took = step(loads, computing=True)
    assert received == set() and "a computing step waited" not in caplog.text

    queue("late", 0.2)  # due by the measured rate, but runs long: the wait ends at its bound
    received, took = step(loads, computing=True)
    assert received == set()
    assert BUSY_STEP_COPY_WAIT_S <= took < BUSY_STEP_COPY_WAIT_S + SLACK_S


# -- a pull's chunks copied as they land, and the timeline line ------------------------------------


def _cpu_worker_side():
    from lmcache_p2p.integration.vllm.worker_side import WorkerSide

    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=16),
        model_config=SimpleNamespace(model="tiny"),
        kv_transfer_config=SimpleNamespace(engine_id=uuid.uuid4().hex),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_rank=0),
    )
    side = WorkerSide(vllm_config, LMCacheConfig.from_dict({"chunk_size": 32, "max_local_cpu_size": 0.01}))
    side.register_kv_caches({f"layer.{i}": torch.randn(16, 2, 16, 2, 4) for i in range(2)})
    return side


def test_a_pulls_chunks_are_loaded_as_they_land_and_the_request_is_reported_once_with_its_timeline(monkeypatch, caplog):
    """Chunk 0 is the rank's own; a peer offered chunks 1-3. Each landing is copied into the
    request's blocks at the next get_finished while the rest are still pulled; the request is
    reported once the pull ended and its last piece is copied, with one load line for all of it
    and one DEBUG line of when it passed each point."""
    from lmcache_p2p.cache_engine import PrefixLookup
    from lmcache_p2p.integration.vllm.lookup_channel import LookupRequest
    from lmcache_p2p.protocol import pack_hashes

    side = _cpu_worker_side()
    engine = side.engine
    hashes = chunk_hash_array(list(range(130)), 32)  # four full chunks (two blocks each) and a tail
    source = [0, 1, 2, 3, 4, 5, 6, 7]  # where the chunks' KV is made (the "peer" stores from there)
    target = [15, 14, 13, 12, 11, 10, 9, 8]
    try:
        assert store(engine, hashes[:1], side.planes, source[:2]) == 32

        class ThreeChunks:
            chunks = 3

            def first(self, chunks):
                return self

        hooks: list = []
        pull_done: concurrent.futures.Future = concurrent.futures.Future()

        def pull(offer, on_landed=None):
            hooks.append(on_landed)
            return pull_done

        def land(chunks: int) -> None:  # the peer's batch committed in our store
            store(engine, hashes[: 1 + chunks], side.planes, source[: 2 * (1 + chunks)])
            hooks[0](chunks)

        monkeypatch.setattr(engine, "lookup_async", lambda _: PrefixLookup(["host"], offer=ThreeChunks()))
        monkeypatch.setattr(engine, "pull_offer_async", pull)
        side.lookups.answer(
            LookupRequest(seq=1, req_id="p", fetch_missing=True, hashes=pack_hashes(hashes), num_tokens=130)
        )

        def loaded(chunk: int) -> bool:
            blocks = [2 * chunk, 2 * chunk + 1]
            return all(torch.equal(p[[target[b] for b in blocks]], p[blocks]) for p in side.planes)

        with caplog.at_level(logging.DEBUG):
            side.start_load_kv(
                P2PConnectorMetadata(loads=[LoadSpec("p", hashes, 130, target, 0, 128, beside_steps=True)])
            )
            computing = P2PConnectorMetadata(step_tokens=256)
            side._loads.begin_step(computing)
            land(1)
            assert by_outcome(side.finished_loads()) == (set(), set())
            assert loaded(0) and loaded(1) and not loaded(2)  # while the pull goes on
            land(2)
            assert by_outcome(side.finished_loads()) == (set(), set())
            assert loaded(2) and not loaded(3)
            land(3)
            pull_done.set_result(PulledChunks(3))
            assert by_outcome(side.finished_loads()) == ({"p"}, set())
        assert all(loaded(c) for c in range(4))
        assert engine.counters.retrieved_tokens == 128
        (line,) = re.findall(
            r"Retrieved (\d+) out of total 130 tokens.*\(beside the steps, in (\d) pieces", caplog.text
        )
        assert line == ("128", "3")
        (timeline,) = re.findall(r"request p timeline, ms from first seen: (.*?) \(first seen at", caplog.text)
        parts = [part.rsplit(" ", 1) for part in timeline.split(", ")]
        assert [name for name, _ in parts] == list(LoadTimeline.NAMES.values())
        at = {name: float(ms) for name, ms in parts}
        assert 0 <= at["offer"] <= at["granted"] <= at["pull start"] <= at["load queued"]
        assert at["load queued"] <= at["pull end"]  # copying began while the pull went on
        assert at["load start"] <= at["load end"] <= at["reported"] and at["pull end"] <= at["reported"]
    finally:
        side.close()


def test_a_load_whose_piece_fails_to_queue_loads_the_pieces_before_it_and_vllm_recomputes_the_rest(
    monkeypatch,
):
    engine, kv, hashes, blocks = stored_prompt("cpu", chunks=4)
    loads = LoadExecutor(engine, kv.layers, {})
    try:
        held = engine.pin_prefix(hashes[:1])
        pull_done: concurrent.futures.Future = concurrent.futures.Future()
        hooks: list = []
        monkeypatch.setattr(
            engine, "pull_offer_async", lambda offer, on_landed=None: hooks.append(on_landed) or pull_done
        )
        offer = SimpleNamespace(chunks=3, first=lambda n: offer)
        spec = LoadSpec("q", hashes, 128, blocks, 0, 128, beside_steps=True)
        assert loads.jobs.pull_then_load(spec, offer, held)  # type: ignore[arg-type]
        loads.begin_step(P2PConnectorMetadata(step_tokens=256))
        hooks[0](1)
        assert by_outcome(loads.finished()) == (set(), set())
        real = async_loads.LayerwiseLoad
        monkeypatch.setattr(async_loads, "LayerwiseLoad", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no")))
        hooks[0](2)
        assert by_outcome(loads.finished()) == (set(), set())
        monkeypatch.setattr(async_loads, "LayerwiseLoad", real)
        hooks[0](3)
        pull_done.set_result(PulledChunks(3))
        assert by_outcome(loads.finished()) == (set(), {"q"})
        assert kv.matches(hashes, blocks, CHUNK, 2 * CHUNK)  # chunks 0-1: the first piece
        assert engine.counters.retrieved_tokens == 2 * CHUNK
        assert loads.jobs.jobs == {}  # each job reported once
    finally:
        loads.close()
        engine.close()


# -- on the GPU: the device's order -----------------------------------------------------------------


def _sleep_on(stream: torch.cuda.Stream, seconds: float) -> None:
    """Keep ``stream`` busy for roughly ``seconds`` (a kernel spinning that many cycles at 2 GHz;
    the tests need it far longer than a copy, not exact)."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(seconds * 2e9))


@pytest.mark.gpu
@gpu
def test_on_a_gpu_a_load_beside_the_steps_starts_after_its_grant_not_after_the_forward_queued_since():
    engine, kv, hashes, blocks = stored_prompt("cuda", chunks=8)
    current = torch.cuda.current_stream()
    try:
        with engine.pin_prefix(hashes) as prefix:  # the kernels built, the cache's block table made
            LayerwiseLoad([engine.plan_load(prefix, blocks)], kv.layers, {"all": range(len(kv.layers))}).synchronize()
        for after_grant in (True, False):
            kv.wipe()
            for layer in kv.layers:  # the blocks' former owner's last write, before the grant
                layer.fill_(7)
            grant = torch.cuda.Event()
            grant.record(current)
            _sleep_on(current, 0.2)  # the granting step's forward pass, queued before start_load_kv
            forward_end = torch.cuda.Event()
            forward_end.record(current)
            with engine.pin_prefix(hashes) as prefix:
                plan = engine.plan_load(prefix, blocks)
                load = LayerwiseLoad(
                    [plan], kv.layers, {"all": range(len(kv.layers))}, after=grant if after_grant else None
                )
                load.synchronize()
                assert forward_end.query() is not after_grant  # the load did not wait for the forward pass
                torch.cuda.synchronize()
            assert kv.matches(hashes, blocks, CHUNK, 8 * CHUNK)  # after the former owner's write
            start, end = load.device_window()
            assert load.queued_at <= start <= end <= time.monotonic()
            assert abs((end - start) - load.seconds) < 1e-3
    finally:
        engine.close()


@pytest.mark.gpu
@gpu
def test_on_a_gpu_a_load_waits_for_the_store_reading_its_blocks_and_not_for_the_others():
    engine, kv, hashes, blocks = stored_prompt("cuda", chunks=4, num_blocks=64)
    try:
        other = chunk_hash_array(tokens(8 * CHUNK, seed=9), CHUNK)
        per = 4 * CHUNK // kv.layout().block_size
        a, b = list(range(16, 16 + per)), list(range(16 + per, 16 + 2 * per))  # two preempted requests' blocks
        kv.prefill(other[:4], a, CHUNK)
        from lmcache_p2p import gpu_ops

        _sleep_on(gpu_ops.side_stream("store", kv.layers[0].device), 0.2)  # a store copy still to run
        assert engine.store_async(other[:4], kv.layers, a, owner="first") == 4  # reads blocks a
        with engine.pin_prefix(hashes) as prefix:
            into_b = engine.plan_load(prefix, b)  # a preempted request's blocks b, reallocated
            load_b = LayerwiseLoad(
                [into_b],
                kv.layers,
                {"all": range(len(kv.layers))},
                fence=lambda s: engine.order_stores_before(s, into_b.written_blocks()),
            )
            load_b.synchronize()
            assert not engine._pending[0].copy.done()  # b's load did not wait for the store reading a
            into_a = engine.plan_load(prefix, a)
            load_a = LayerwiseLoad(
                [into_a],
                kv.layers,
                {"all": range(len(kv.layers))},
                fence=lambda s: engine.order_stores_before(s, into_a.written_blocks()),
            )
            load_a.synchronize()
            torch.cuda.synchronize()
        engine.poll_stores(wait=True)
        kv.wipe()  # the store read blocks a before the load overwrote them
        assert retrieve(engine, other[:4], kv.layers, a) == 4 * CHUNK
        assert kv.matches(other[:4], a, CHUNK, 4 * CHUNK)
    finally:
        engine.close()


@pytest.mark.gpu
@gpu
def test_on_a_gpu_a_step_computing_nothing_reports_the_copy_it_queued_in_the_same_call():
    engine, kv, hashes, blocks = stored_prompt("cuda", chunks=8)
    loads = LoadExecutor(engine, kv.layers, {})
    try:
        loads.begin_step(P2PConnectorMetadata(step_tokens=0))
        spec = LoadSpec("r", hashes, 8 * CHUNK, blocks, 0, 8 * CHUNK, beside_steps=True)
        grant = torch.cuda.Event()
        grant.record(torch.cuda.current_stream())
        assert loads.load(spec, engine.pin_prefix(hashes), after=grant) is None
        assert by_outcome(loads.finished()) == ({"r"}, set())
        assert kv.matches(hashes, blocks, CHUNK, 8 * CHUNK)
    finally:
        loads.close()
        engine.close()


@pytest.mark.gpu
@gpu
def test_on_a_gpu_a_pull_landed_in_batches_is_copied_through_the_staging_ring_piece_by_piece(caplog):
    engine, kv, hashes, blocks = stored_prompt("cuda", chunks=8)
    staging = torch.empty((2, engine.storage.page_bytes), dtype=torch.uint8, device=kv.layers[0].device)
    loads = LoadExecutor(engine, kv.layers, {}, staging=staging)
    try:
        pull_done: concurrent.futures.Future = concurrent.futures.Future()
        hooks: list = []

        def pull(offer, on_landed=None):
            hooks.append(on_landed)
            return pull_done

        engine.pull_offer_async = pull  # type: ignore[method-assign]
        offer = SimpleNamespace(chunks=6, first=lambda n: offer)
        spec = LoadSpec("g", hashes, 8 * CHUNK, blocks, 0, 8 * CHUNK, beside_steps=True)
        grant = torch.cuda.Event()
        grant.record(torch.cuda.current_stream())
        assert loads.jobs.pull_then_load(spec, offer, engine.pin_prefix(hashes[:2]), after=grant)  # type: ignore[arg-type]
        loads.begin_step(P2PConnectorMetadata(step_tokens=256))
        with caplog.at_level(logging.DEBUG):
            for landed in (3, 5):  # chunks 0-1 are the rank's own; each landing is a piece
                hooks[0](landed)
                assert by_outcome(loads.finished()) == (set(), set())
            hooks[0](6)
            pull_done.set_result(PulledChunks(6))
            received: set[str] = set()
            deadline = time.monotonic() + 5
            while not received and time.monotonic() < deadline:
                received, failed = by_outcome(loads.finished())
                assert not failed
        assert received == {"g"}
        assert kv.matches(hashes, blocks, CHUNK, 8 * CHUNK)
        assert re.search(r"Retrieved 256 out of total 256 tokens.*through the copy engine, in 3 pieces", caplog.text)
        (timeline,) = re.findall(r"request g timeline, ms from first seen: (.*?) \(first seen at", caplog.text)
        at = {name: float(ms) for name, ms in (part.rsplit(" ", 1) for part in timeline.split(", ") if "-" not in part)}
        assert at["load queued"] <= at["load start"] <= at["load end"] <= at["reported"]
    finally:
        loads.close()
        engine.close()
