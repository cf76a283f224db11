"""The GPU tier (``local_gpu``): a VRAM copy of the hottest chunks, loaded device to device and
served to same-host peers over cuda_ipc; pulls land in it and are written back to the CPU tier.

Tests marked ``gpu`` run two stand-in engine processes whose KV lives on the GPU (real
controller, real NIXL over cuda_ipc, our kernels), on the H200 device. The others run the tier's
logic everywhere, with its pages in host memory (StorageManager's ``device`` set to the CPU)."""

from __future__ import annotations

import contextlib
import re
import signal
import threading
import time

import pytest
import torch
from instances import InstanceProcess, instance_config, tokens
from protocol_client import wait_for

from lmcache_p2p.config import GB, ConfigError, LMCacheConfig
from lmcache_p2p.device_checksum import device_checksums
from lmcache_p2p.keys import chunk_hash_array, payload_checksum
from lmcache_p2p.protocol import ChannelHello
from lmcache_p2p.testing.standin import MODEL_SHAPES, StandInKV
from lmcache_p2p.testing.sync_engine import retrieve, store
from lmcache_p2p.transfer.base import TransferError, check_hello_bounds
from lmcache_p2p.vocab import CPU, GPU
from lmcache_p2p.worker import build_engine

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA (runs on the H200 device)")
CHUNK = 32
SHAPE = MODEL_SHAPES["qwen2.5-0.5b"]
PAGE = CHUNK * 24 * 2 * 2 * 64 * 2  # 24 layers x K,V x 2 heads x 64 x bf16 per token


# -- everywhere: the tier's logic with its pages in host memory ------------------------------------


@pytest.fixture
def tiered():
    """``tiered(gpu_pages, cpu_pages=32)``: a rank's cache engine with a GPU tier of that many
    pages, and its stand-in KV; closed after the test."""
    engines = []

    def build(gpu_pages: int, cpu_pages: int = 32):
        config = LMCacheConfig.from_dict(
            {
                "chunk_size": CHUNK,
                "local_gpu": True,
                "max_local_gpu_size": (gpu_pages * PAGE + 1) / GB,
                "max_local_cpu_size": (cpu_pages * PAGE + 1) / GB,
            }
        )
        kv = StandInKV(SHAPE, 64)
        engines.append(build_engine(config, kv.layout(), pin_memory=False, device=torch.device("cpu")))
        return engines[-1], kv

    yield build
    for engine in engines:
        engine.close()


def land(storage, kv, chunk_hash: int, checksum: int | None = None) -> tuple[int, int, int, int]:
    """What a holder's NIXL write leaves: the chunk's bytes in a reserved GPU tier page, a CPU page
    reserved for its write-back; (hash, GPU page, CPU page, the checksum the holder sent)."""
    gpu_page, gpu_data = storage.reserve_gpu_page()
    cpu_page, _ = storage.reserve_page()
    payload = kv.chunk_payload(chunk_hash, CHUNK)
    gpu_data.copy_(payload)
    return chunk_hash, gpu_page, cpu_page, payload_checksum(payload.numpy()) if checksum is None else checksum


def commit(storage, landed) -> None:
    hashes, gpu_pages, cpu_pages, checksums = (list(x) for x in zip(*landed, strict=True))
    storage.landing.commit_landed(hashes, gpu_pages, cpu_pages, checksums)


@contextlib.contextmanager
def held(executor):
    """``executor``'s one thread (a job behind the caller) held until the block's ``release()``."""
    gate = threading.Event()
    executor.submit(gate.wait, 10)
    try:
        yield gate.set
    finally:
        gate.set()


def write_back_held(storage):
    return held(storage.landing._write_back_thread)


def test_a_store_copies_chunks_into_the_gpu_tier_and_a_load_reads_that_copy(tiered, caplog):
    engine, kv = tiered(gpu_pages=8)
    prompt = chunk_hash_array(tokens(4 * CHUNK, seed=1), CHUNK)
    blocks = list(range(len(kv.layers[0])))
    kv.prefill(prompt, blocks, CHUNK)
    assert store(engine, prompt, kv.layers, blocks) == 4 * CHUNK
    storage = engine.storage
    assert storage.stats()["gpu"]["chunks"] == 4 and len(storage.cpu) == 4
    for h in prompt.tolist():
        with storage.pin(h, gpu=True) as from_gpu, storage.pin(h) as from_cpu:
            assert from_gpu.data.data_ptr() != from_cpu.data.data_ptr()  # the GPU tier's own page
            assert torch.equal(from_gpu.data, from_cpu.data)
            assert from_gpu.checksum == from_cpu.checksum
    kv.wipe()
    with caplog.at_level("INFO", logger="lmcache_p2p.cache_engine"):
        assert retrieve(engine, prompt, kv.layers, blocks) == 4 * CHUNK
    assert kv.matches(prompt, blocks, CHUNK, 4 * CHUNK)
    assert "(4 of 4 chunks from the GPU tier)" in caplog.text


def test_with_peers_a_store_takes_its_gpu_copies_device_checksums_behind_it():
    """A holder computing the device checksums of GPU tier chunks at pull time added ~12 ms to a
    document's pull (issue 21); with peers on they are taken once, behind the store."""
    from lmcache_p2p.cache_engine import CacheEngine
    from lmcache_p2p.storage import StorageManager

    peers = {
        "enable_p2p": True,
        "enable_controller": True,
        "controller_pull_url": "localhost:8300",
        "controller_reply_url": "localhost:8400",
        "lmcache_worker_ports": [8500],
        "p2p_init_ports": [8200],
        "p2p_lookup_ports": [8201],
        "transfer_channel": "tcp",
    }
    for with_peers in (False, True):
        tier = {"chunk_size": CHUNK, "local_gpu": True, "max_local_gpu_size": (8 * PAGE + 1) / GB}
        config = LMCacheConfig.from_dict({**tier, **(peers if with_peers else {})})
        kv = StandInKV(SHAPE, 64)
        # No worker (no controller to talk to): the storage and the engine that stores into it.
        storage = StorageManager(config, kv.layout(), pin_memory=False, device=torch.device("cpu"))
        engine = CacheEngine(config, kv.layout(), storage)
        prompt = chunk_hash_array(tokens(4 * CHUNK, seed=2), CHUNK)
        blocks = list(range(len(kv.layers[0])))
        kv.prefill(prompt, blocks, CHUNK)
        assert store(engine, prompt, kv.layers, blocks) == 4 * CHUNK
        if storage.hasher is not None:
            storage.hasher._threads.shutdown(wait=True)  # the work behind the store, done
        for h in prompt.tolist():
            with storage.pin(h, gpu=True) as copy, storage.pin(h) as cpu_copy:
                assert copy.location == GPU
                assert copy.device_checksum == (device_checksums([copy.data])[0] if with_peers else None)
                assert cpu_copy.device_checksum is None  # the CPU tier's copy has none
        engine.close()


def test_the_gpu_tier_evicts_on_its_own_and_loses_what_the_cpu_tier_loses(tiered):
    engine, kv = tiered(gpu_pages=3, cpu_pages=6)
    queue = engine.storage.record_events()
    prompt = chunk_hash_array(tokens(5 * CHUNK, seed=2), CHUNK)
    hashes = prompt.tolist()
    blocks = list(range(len(kv.layers[0])))
    kv.prefill(prompt, blocks, CHUNK)
    storage = engine.storage
    store(engine, prompt[:3], kv.layers, blocks)
    store(engine, prompt, kv.layers, blocks)  # chunks 3 and 4 are new
    gpu_stats = storage.stats()["gpu"]
    events = [(e.kind, e.location) for e in queue.take_events()]
    # Three pages: the two new chunks took the least recently used ones, and nobody was told.
    assert gpu_stats["chunks"] == 3 and gpu_stats["evictions"] == 2
    assert all(loc == CPU for _, loc in events) and len(events) == 5
    assert [storage.gpu.contains(storage.key(h)) for h in hashes] == [False, False, True, True, True]
    # A chunk the CPU tier drops leaves the GPU tier too: the GPU tier is a copy, never the only one.
    storage.remove(hashes[4])
    assert not storage.gpu.contains(storage.key(hashes[4])) and storage.location_of(hashes[4]) is None
    # Loads still get every held chunk, from whichever tier has it.
    kv.wipe()
    assert retrieve(engine, prompt[:4], kv.layers, blocks) == 4 * CHUNK
    assert kv.matches(prompt, blocks, CHUNK, 4 * CHUNK)
    storage.clear()
    assert len(storage.gpu) == 0 and storage.stats()["gpu"]["free_pages"] == 3


def test_a_pull_landed_in_the_gpu_tier_is_loadable_at_once_and_written_back_checked(tiered):
    engine, kv = tiered(gpu_pages=8)
    storage = engine.storage
    good, bad = 777, 778
    with write_back_held(storage):
        commit(storage, [land(storage, kv, good), land(storage, kv, bad, checksum=12345)])  # damaged in flight
        assert storage.location_of(good) == GPU  # loadable now, before the write-back
    assert storage.flush(10)
    assert storage.location_of(good) == CPU
    with storage.pin(good) as chunk:
        assert torch.equal(chunk.data, kv.chunk_payload(good, CHUNK))
    assert storage.location_of(bad) is None  # dropped from both tiers
    stats = storage.stats()
    assert stats["gpu"]["write_back_mismatches"] == 1 and stats["gpu"]["pins_held"] == 0
    assert stats["cpu"]["free_pages"] == stats["cpu"]["capacity_chunks"] - 1
    assert stats["gpu"]["free_pages"] == stats["gpu"]["capacity_chunks"] - 1


def test_a_step_that_loaded_a_landed_chunk_learns_whether_its_checksum_held(tiered):
    engine, kv = tiered(gpu_pages=8)
    storage = engine.storage
    prompt = chunk_hash_array(tokens(2 * CHUNK, seed=3), CHUNK).tolist()
    blocks = list(range(len(kv.layers[0])))
    with write_back_held(storage) as release:
        commit(storage, [land(storage, kv, prompt[0]), land(storage, kv, prompt[1], checksum=99)])
        with engine.pin_prefix(prompt) as prefix:
            plan = engine.plan_load(prefix, blocks)
            assert plan.from_gpu == 2 and [start for start, _, _ in plan.unchecked] == [0, CHUNK]
            engine.run_load(plan, kv.layers)  # loadable before its check, as a step does
            release()
            assert engine.first_bad_chunk(plan, time.monotonic() + 10) == CHUNK  # the second: recomputed
    assert storage.location_of(prompt[0]) == CPU and storage.location_of(prompt[1]) is None
    with storage.pin(prompt[0], gpu=True) as chunk:
        assert chunk.location == GPU and chunk.check is None  # checked: nothing pending


def test_a_rank_holds_a_steps_output_for_its_landed_chunks_checks_and_fails_the_bad_ones(tiered, caplog):
    """What vLLM sees: the step's load errors name the blocks from the first bad chunk on, the
    retrieved count loses them, and the log says how long the step waited for the checks."""
    from lmcache_p2p.integration.vllm.load_executor import LoadExecutor
    from lmcache_p2p.integration.vllm.metadata import LoadSpec

    engine, kv = tiered(gpu_pages=8)
    storage = engine.storage
    loads = LoadExecutor(engine, kv.layers, {})
    prompt = chunk_hash_array(tokens(2 * CHUNK, seed=4), CHUNK)
    blocks = list(range(len(kv.layers[0])))
    with write_back_held(storage) as release:
        commit(storage, [land(storage, kv, int(prompt[0])), land(storage, kv, int(prompt[1]), checksum=99)])
        with engine.pin_prefix(prompt.tolist()) as prefix:
            spec = LoadSpec("r", prompt, 2 * CHUNK, blocks, 0, 2 * CHUNK)
            plan = engine.plan_load(prefix, blocks, 0, 2 * CHUNK, total_tokens=2 * CHUNK)
            engine.run_load(plan, kv.layers)  # counted as retrieved, as a step's load is
            loads._unchecked.append((spec, plan))  # as a step's load in start_load_kv does
            threading.Timer(0.05, release).start()  # the write-back finishes while the step waits
            with caplog.at_level("INFO"):
                errors = loads.take_errors()
    per_chunk = CHUNK // kv.layout().block_size
    assert errors == set(blocks[per_chunk : 2 * per_chunk])  # the second chunk's blocks: recomputed
    assert engine.counters.retrieved_tokens == CHUNK
    assert "for the checksum checks of 2 chunk(s) landed in VRAM (1 request(s))" in caplog.text
    waited = float(caplog.text.split("step waited ")[1].split(" ms")[0])
    assert waited >= 40, "the step's output waited for the write-back"


def test_a_chunk_landed_with_the_holders_device_checksum_is_checked_on_the_device_not_by_its_write_back(tiered):
    """The pull commits its landed pages at once; their readers wait for the device check, which
    runs behind the commit, not for the write-back to the CPU tier (held here throughout); once
    it matched, readers have nothing to wait for and a peer is sent the number."""
    engine, kv = tiered(gpu_pages=8)
    storage = engine.storage
    prompt = chunk_hash_array(tokens(CHUNK, seed=8), CHUNK).tolist()
    with write_back_held(storage):
        hashes, gpu_pages, cpu_pages, checksums = zip(land(storage, kv, prompt[0]), strict=True)
        on_device = device_checksums([storage.gpu.pool.page(gpu_pages[0])])  # what the holder sends
        with held(storage.landing._device_check_thread) as release_check:
            storage.landing.commit_landed(hashes, gpu_pages, cpu_pages, checksums, device_checksums=on_device)
            with engine.pin_prefix(prompt) as prefix:
                plan = engine.plan_load(prefix, list(range(len(kv.layers[0]))))
                assert plan.from_gpu == 1 and len(plan.unchecked) == 1
                (_, _, check) = plan.unchecked[0]
                assert not check.done() and prefix.chunks[0].device_checksum is None  # not vouched for yet
                release_check()
                assert engine.first_bad_chunk(plan, time.monotonic() + 10) is None  # while the write-back waits
        with storage.pin(prompt[0], gpu=True) as chunk:
            assert chunk.location == GPU and chunk.check is None  # matched: nothing to wait for
            assert [chunk.device_checksum] == on_device  # kept: a peer pulling it is sent it
    assert storage.flush(10) and storage.location_of(prompt[0]) == CPU  # still written back, host-checked
    with storage.pin(prompt[0], gpu=True) as chunk:
        assert chunk.location == GPU and chunk.check is None  # checked: nothing pending
    assert storage.stats()["gpu"]["device_check_mismatches"] == 0


def test_a_landed_chunk_whose_device_checksum_differs_fails_its_loads_and_is_dropped(tiered, caplog):
    """Right bytes, wrong number from the holder (its host checksum holds): the device check
    decides, so the load that used it is recomputed and neither tier keeps it."""
    engine, kv = tiered(gpu_pages=8)
    storage = engine.storage
    prompt = chunk_hash_array(tokens(2 * CHUNK, seed=9), CHUNK).tolist()
    with write_back_held(storage):
        landed = [land(storage, kv, prompt[0]), land(storage, kv, prompt[1])]
        hashes, gpu_pages, cpu_pages, checksums = (list(x) for x in zip(*landed, strict=True))
        good_sum = device_checksums([storage.gpu.pool.page(gpu_pages[0])])[0]
        with caplog.at_level("INFO"):
            storage.landing.commit_landed(hashes, gpu_pages, cpu_pages, checksums, device_checksums=[good_sum, 99])
            with engine.pin_prefix(prompt) as prefix:
                plan = engine.plan_load(prefix, list(range(len(kv.layers[0]))))
                assert engine.first_bad_chunk(plan, time.monotonic() + 10) == CHUNK  # the second: recomputed
    assert storage.flush(10)
    assert storage.location_of(prompt[0]) == CPU and storage.location_of(prompt[1]) is None
    stats = storage.stats()
    assert stats["gpu"]["device_check_mismatches"] == 1 and stats["gpu"]["write_back_mismatches"] == 0
    assert stats["cpu"]["free_pages"] == stats["cpu"]["capacity_chunks"] - 1
    assert stats["gpu"]["free_pages"] == stats["gpu"]["capacity_chunks"] - 1 and stats["gpu"]["pins_held"] == 0
    assert f"chunk {prompt[1]:016x} landed in VRAM with device checksum" in caplog.text
    assert "checked 2 landed chunk(s) on the device in" in caplog.text and "1 differ" in caplog.text


def test_a_device_check_that_cannot_run_fails_the_loads_and_leaves_the_host_check_to_decide(tiered, monkeypatch):
    """A CUDA error, say: the step that loaded the chunk recomputes it, the write-back's host
    check keeps it (its bytes are right), and no unchecked number is kept for a peer."""
    from lmcache_p2p import device_checksum

    engine, kv = tiered(gpu_pages=8)
    storage = engine.storage
    prompt = chunk_hash_array(tokens(CHUNK, seed=10), CHUNK).tolist()
    hashes, gpu_pages, cpu_pages, checksums = zip(land(storage, kv, prompt[0]), strict=True)
    holders = device_checksums([storage.gpu.pool.page(gpu_pages[0])])

    def broken(pages, timing=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(device_checksum, "device_checksums", broken)
    with write_back_held(storage):
        storage.landing.commit_landed(hashes, gpu_pages, cpu_pages, checksums, device_checksums=holders)
        with engine.pin_prefix(prompt) as prefix:
            plan = engine.plan_load(prefix, list(range(len(kv.layers[0]))))
            (_, _, check) = plan.unchecked[0]
            with pytest.raises(RuntimeError, match="CUDA error"):  # the device check's, not the write-back's
                check.result(10)
            assert engine.first_bad_chunk(plan, time.monotonic() + 10) == 0  # recomputed
    assert storage.flush(10) and storage.location_of(prompt[0]) == CPU  # host-checked, kept
    with storage.pin(prompt[0], gpu=True) as chunk:
        assert chunk.location == GPU and chunk.check is None and chunk.device_checksum is None


def test_a_chunk_landed_twice_is_waited_for_when_the_checked_page_is_not_the_one_kept(tiered):
    """A prefix pulled twice at once: the first landing (not checked on the device) is kept, the
    second's page, which the device check would have read, is freed; readers wait for the first's
    write-back."""
    engine, kv = tiered(gpu_pages=8)
    storage = engine.storage
    chunk_hash = 4242
    with write_back_held(storage):
        first = land(storage, kv, chunk_hash)
        storage.landing.commit_landed([first[0]], [first[1]], [first[2]], [first[3]])
        second = land(storage, kv, chunk_hash)
        storage.landing.commit_landed([second[0]], [second[1]], [second[2]], [second[3]], device_checksums=[99])
        with storage.pin(chunk_hash, gpu=True) as chunk:
            assert chunk.check is not None  # the held copy is the first landing's: not checked yet
            assert chunk.device_checksum is None  # nor is the second page's number the held copy's
    assert storage.flush(10) and storage.location_of(chunk_hash) == CPU
    stats = storage.stats()["gpu"]
    assert stats["free_pages"] == stats["capacity_chunks"] - 1
    assert stats["device_check_mismatches"] == 0  # the freed page and its wrong number: never compared


def test_a_chunk_cleared_while_landing_stays_cleared(tiered):
    engine, kv = tiered(gpu_pages=8)
    storage = engine.storage
    with write_back_held(storage):
        commit(storage, [land(storage, kv, 41), land(storage, kv, 42)])
        storage.remove(41)
        storage.clear()
    assert storage.flush(10)
    assert storage.location_of(41) is None and storage.location_of(42) is None
    stats = storage.stats()
    assert stats["cpu"]["free_pages"] == stats["cpu"]["capacity_chunks"]
    assert stats["gpu"]["free_pages"] == stats["gpu"]["capacity_chunks"]


def test_the_gpu_tier_never_holds_a_stored_chunk_the_cpu_tier_lost(tiered):
    engine, _ = tiered(gpu_pages=4)
    storage = engine.storage
    page, _ = storage.reserve_gpu_page()
    assert not storage.commit_gpu_page(12345, page)  # the CPU tier does not hold it (evicted)
    assert storage.stats()["gpu"]["free_pages"] == 4 and storage.location_of(12345) is None


def test_gpu_tier_settings_name_the_key():
    with pytest.raises(ConfigError, match="local_gpu.*needs local_cpu"):
        LMCacheConfig.from_dict({"local_gpu": True, "local_cpu": False}).validate()
    with pytest.raises(ConfigError, match="max_local_gpu_size"):
        LMCacheConfig.from_dict({"max_local_gpu_size": -1}).validate()


def test_a_hello_claiming_an_impossible_gpu_tier_is_refused():
    hello = ChannelHello(
        instance_id="x", rank=0, fingerprint=1, channel="nixl", session="s", page_bytes=2**20, num_pages=4
    )
    hello.gpu_tier_pages = 2**23
    with pytest.raises(TransferError, match="gpu_tier_pages=8388608"):
        check_hello_bounds(hello)


def test_without_a_gpu_the_tier_is_off_and_says_so(caplog):
    config = LMCacheConfig.from_dict({"chunk_size": CHUNK, "local_gpu": True, "max_local_cpu_size": 0.01})
    with caplog.at_level("WARNING"):
        engine = build_engine(config, StandInKV(SHAPE, 8).layout(), pin_memory=False)
    try:
        assert engine.storage.gpu is None and "gpu" not in engine.storage.stats()
        assert "local_gpu is on but the engine's KV is not on a GPU; the GPU tier is off" in caplog.text
    finally:
        engine.close()


# -- on the GPU ----------------------------------------------------------------------------------


@pytest.fixture
def controller(controllers):
    return controllers()


def on_gpu(spawn, controller, instance_id: str, gpu_pages: int = 64, **extra) -> InstanceProcess:
    """A nixl instance whose KV lives on the GPU, with a GPU tier of ``gpu_pages`` chunk pages."""
    config = instance_config(
        instance_id,
        controller,
        "nixl",
        chunk_size=CHUNK,
        local_gpu=True,
        max_local_gpu_size=(gpu_pages * PAGE + 1) / GB,
        **extra,
    )
    return spawn(config, num_blocks=256, device="cuda", model="qwen2.5-0.5b")


def test_a_slow_first_kernel_build_does_not_fail_the_workers_start(controller, monkeypatch):
    """The device checksum's kernels build (nvcc, about a minute on a fresh machine) before the
    worker starts, not within its start-up window: built inside it, every GPU engine's first
    start on a machine failed ('worker did not start within 30s')."""
    from lmcache_p2p import device_checksum
    from lmcache_p2p.worker import worker as worker_module

    calls = []
    prepare = device_checksum.prepare

    def slow_prepare(page_bytes, device):
        time.sleep(2.5)  # longer than the window below
        calls.append(page_bytes)
        prepare(page_bytes, device)

    monkeypatch.setattr(worker_module, "START_TIMEOUT_S", 2.0)
    monkeypatch.setattr(device_checksum, "prepare", slow_prepare)
    config = instance_config(
        "lmcache_instance_1",
        controller,
        "tcp",
        chunk_size=CHUNK,
        local_gpu=True,
        max_local_gpu_size=(8 * PAGE + 1) / GB,
    )
    engine = build_engine(
        LMCacheConfig.from_dict(config), StandInKV(SHAPE, 8).layout(), pin_memory=False, device=torch.device("cpu")
    )
    try:
        assert calls == [PAGE]
        wait_for(
            lambda: "lmcache_instance_1" in controller.http.get("/controller/workers").text,
            what="the worker registered at the controller",
        )
    finally:
        engine.close()


def holders_ready(controller, proc: InstanceProcess, prompt, tokens_held: int) -> None:
    wait_for(
        lambda: controller.holders(prompt).get(proc.config["lmcache_instance_id"]) == [CPU, tokens_held],
        what=f"{proc.config['lmcache_instance_id']}'s keys",
        timeout=30,
    )


@pytest.mark.gpu
@gpu
def test_a_pull_from_gpu_tier_to_gpu_tier_is_bit_exact_and_written_back(controller, spawn):
    a, b = (on_gpu(spawn, controller, f"lmcache_instance_{i}") for i in (1, 2))
    prompt = tokens(16 * CHUNK, seed=5)
    assert a.prefill(prompt) == 16 * CHUNK
    holders_ready(controller, a, prompt, 16 * CHUNK)
    assert b.lookup(prompt) == 16 * CHUNK
    got = b.retrieve(prompt)  # wipes B's GPU KV, scatters the pulled pages back, compares
    assert got["retrieved"] == 16 * CHUNK and got["exact"], got
    assert "16 chunk(s) landed in the GPU tier (16 checked on the device)" in b.log()
    assert "(16 of 16 chunks from the GPU tier)" in b.log()
    assert a.status()["p2p_server"]["chunks_served_from_gpu_tier"] == 16
    # Taken behind A's stores, not at pull time (all 16 unless a store's job was still queued).
    assert a.status()["p2p_server"]["device_checksums_kept"] > 0
    # Checked on B's GPU against A's device checksums behind the pull: no step waits for the host.
    assert b.status()["p2p_client"]["gpu_landed_checked_on_device"] == 16
    # (one check a batch of the pull, p2p_batch_chunks 8 here)
    checks = re.findall(r"checked (\d+) landed chunk\(s\) on the device in [\d.]+ ms .*: (\d+) differ", b.log())
    assert sum(int(n) for n, _ in checks) == 16 and all(d == "0" for _, d in checks), checks
    # Written back behind the pull: B's CPU tier has them, checked, and the controller knows.
    holders_ready(controller, b, prompt, 16 * CHUNK)
    storage = b.status()["storage"]
    assert storage["gpu"]["write_back_mismatches"] == 0 and storage["gpu"]["pins_held"] == 0
    assert storage["gpu"]["device_check_mismatches"] == 0
    assert storage["cpu"]["chunks"] == 16


@pytest.mark.gpu
@gpu
def test_a_pull_into_the_gpu_tier_may_carry_more_chunks_than_receive_slots_in_one_request(controller, spawn):
    """Tier pages are the destination, not receive slots (16): with p2p_batch_chunks 40 a
    40-chunk prefix is one request, landed and checked on the device, bit-exact."""
    a, b = (on_gpu(spawn, controller, f"lmcache_instance_{i}", gpu_pages=128, p2p_batch_chunks=40) for i in (1, 2))
    prompt = tokens(40 * CHUNK, seed=8)
    assert a.prefill(prompt) == 40 * CHUNK
    holders_ready(controller, a, prompt, 40 * CHUNK)
    assert b.lookup(prompt) == 40 * CHUNK
    assert "[1 batches, ms summed:" in b.log(), b.log()[-2000:]
    assert "40 chunk(s) landed in the GPU tier (40 checked on the device)" in b.log()
    got = b.retrieve(prompt)
    assert got["retrieved"] == 40 * CHUNK and got["exact"], got


@pytest.mark.gpu
@gpu
def test_a_holder_whose_gpu_tier_evicted_serves_from_host_memory(controller, spawn):
    a = on_gpu(spawn, controller, "lmcache_instance_1", gpu_pages=4)
    b = on_gpu(spawn, controller, "lmcache_instance_2")
    prompt = tokens(12 * CHUNK, seed=6)
    for chunks in (4, 8, 12):  # three stores: each evicts the last one's 4 chunks from the tier
        a.prefill(prompt[: chunks * CHUNK])
    holders_ready(controller, a, prompt, 12 * CHUNK)
    assert a.status()["storage"]["gpu"]["evictions"] == 8
    assert b.lookup(prompt) == 12 * CHUNK
    assert b.retrieve(prompt)["exact"]
    assert a.status()["p2p_server"]["chunks_served_from_gpu_tier"] == 4  # the rest went through send slots


@pytest.mark.gpu
@gpu
def test_a_holder_dying_mid_pull_leaves_no_corrupt_chunk_and_no_held_page(controller, spawn):
    a, b = (on_gpu(spawn, controller, f"lmcache_instance_{i}", gpu_pages=128) for i in (1, 2))
    prompt = tokens(96 * CHUNK, seed=7)
    a.prefill(prompt)
    holders_ready(controller, a, prompt, 96 * CHUNK)
    hit = {}
    puller = threading.Thread(target=lambda: hit.__setitem__("tokens", b.lookup(prompt)))
    puller.start()
    wait_for(lambda: "Retrieved" in b.log() or a.status()["p2p_server"]["pulls_served"] > 0, timeout=30)
    a.proc.send_signal(signal.SIGKILL)
    puller.join(120)
    assert not puller.is_alive()
    got = b.retrieve(prompt)  # whatever B holds now is exact, the rest a miss
    assert got["exact"] and got["retrieved"] == hit["tokens"], (got, hit)

    def every_page_back() -> bool:  # pages of requests the dead holder never answered come back after a grace
        g = b.status()["storage"]["gpu"]
        return g["pins_held"] == 0 and g["free_pages"] + g["chunks"] == g["capacity_chunks"]

    wait_for(every_page_back, what="B's GPU tier pins released and no page lost", timeout=30)
