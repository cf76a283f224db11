"""CPU pool and tier, disk tier, StorageManager: caps, LRU, pins, corruption, events."""

import os
import threading
from pathlib import Path

import msgspec
import pytest
import torch

from lmcache_p2p.config import GB, LMCacheConfig
from lmcache_p2p.keys import KEY_FORMAT, ChunkKey, LayoutFingerprint, payload_checksum
from lmcache_p2p.storage import CpuTier, DiskTier, PagePool, StorageManager
from lmcache_p2p.vocab import CPU, DISK

# A tiny layout: 2 layers of fp16 blocks (2, 16, 2, 8) -> 128 bytes a token, 2 KiB a 16-token chunk.
LAYOUT = LayoutFingerprint(
    model="tiny", dtype="float16", block_size=16, block_shape=(2, 16, 2, 8), block_stride=(256, 16, 8, 1), num_layers=2
)
CHUNK = 16
PAGE = LAYOUT.bytes_per_token * CHUNK


def payload(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=g)


def key(i: int) -> ChunkKey:
    return ChunkKey(LAYOUT.digest, 1000 + i)


def make_tier(pages: int, evicted=None) -> CpuTier:
    return CpuTier(
        PagePool(PAGE, pages * PAGE, pin_memory=False), on_evict=evicted.append if evicted is not None else None
    )


def make_manager(tmp_path=None, cpu_pages=4, disk_pages=0, local_cpu=True) -> StorageManager:
    values = {"chunk_size": CHUNK, "local_cpu": local_cpu, "max_local_cpu_size": (cpu_pages * PAGE + 1) / GB}
    if disk_pages:
        values.update(local_disk=f"file://{tmp_path}/disk/", max_local_disk_size=(disk_pages * (PAGE + 64)) / GB)
    return StorageManager(LMCacheConfig.from_dict(values), LAYOUT, pin_memory=False)


# -- pool and CPU tier ------------------------------------------------------------------------


def test_pool_holds_whole_pages_within_the_cap():
    pool = PagePool(PAGE, int(10.5 * PAGE), pin_memory=False)
    assert pool.num_pages == 10 and pool.buffer.numel() == 10 * PAGE and not pool.buffer.is_pinned()
    pages = [pool.alloc() for _ in range(10)]
    assert sorted(pages) == list(range(10)) and pool.alloc() is None
    pool.free(pages[3])
    assert pool.alloc() == pages[3]


def test_put_get_round_trip_is_exact():
    tier = make_tier(2)
    assert tier.put(key(0), payload(0))
    assert tier.get(key(0)) == payload(0).numpy().tobytes()
    assert not tier.put(key(0), payload(0)), "a second put of a held key is not a new admit"
    assert tier.get(key(9)) is None


def test_payload_must_be_one_page():
    with pytest.raises(ValueError, match=f"pages are {PAGE} bytes"):
        make_tier(2).put(key(0), torch.zeros(PAGE + 2, dtype=torch.uint8))


def test_lru_evicts_least_recently_used_and_reports_it():
    evicted = []
    tier = make_tier(3, evicted)
    for i in range(3):
        tier.put(key(i), payload(i))
    tier.pin(key(0)).release()  # a read makes key 0 the most recently used
    tier.put(key(3), payload(3))
    assert evicted == [key(1)]
    assert tier.keys() == [key(2), key(0), key(3)]


def test_cap_and_lru_hold_under_a_stream_of_puts():
    evicted = []
    tier = make_tier(8, evicted)
    for i in range(500):
        tier.put(key(i), payload(i % 17))
        assert len(tier) <= 8 and tier.pool.used_pages == len(tier)
    assert tier.keys() == [key(i) for i in range(492, 500)]
    assert evicted == [key(i) for i in range(492)]
    assert tier.get(key(499)) == payload(499 % 17).numpy().tobytes()


def test_pinned_chunk_survives_eviction_pressure():
    tier = make_tier(4)
    tier.put(key(0), payload(0))
    held = tier.pin(key(0))
    for i in range(1, 200):
        tier.put(key(i), payload(i))
    assert tier.contains(key(0)) and tier.pin_count(key(0)) == 1
    assert torch.equal(held.data, payload(0))
    held.release()
    assert tier.pin_count(key(0)) == 0
    for i in range(200, 204):
        tier.put(key(i), payload(i))
    assert not tier.contains(key(0)), "once released it is evictable again"


def test_all_pages_pinned_rejects_the_put_without_blocking():
    tier = make_tier(2)
    tier.put(key(0), payload(0))
    tier.put(key(1), payload(1))
    pins = [tier.pin(key(0)), tier.pin(key(1))]
    assert not tier.put(key(2), payload(2)) and tier.rejected_puts == 1
    for p in pins:
        p.release()
    assert tier.put(key(2), payload(2))


def test_a_full_pool_refusing_a_store_or_pull_reservation_counts_as_a_rejected_put(tmp_path):
    """Stores (kernel gather) and peer pulls reserve pages and fill them in place; when every page
    is pinned the chunk is dropped, and that drop is counted like a refused put()."""
    m = make_manager(tmp_path, cpu_pages=2, disk_pages=10)
    put_all(m, [1, 2])
    pins = [m.pin(1), m.pin(2)]
    assert m.reserve_page() is None and m.reserve_page() is None
    assert m.stats()["cpu"]["rejected_puts"] == 2
    assert not m.put(3, payload(3)) and m.stats()["cpu"]["rejected_puts"] == 3
    # A disk hit read while the pool is full is no dropped put: it is read privately.
    assert m.flush()
    m.cpu.remove(m.key(1))  # chunk 1 now on disk only (its pinned page stays until released)
    with m.pin(1) as chunk:
        assert torch.equal(chunk.data, payload(1))
    assert m.stats()["cpu"]["rejected_puts"] == 3
    for p in pins:
        p.release()
    assert m.reserve_page() is not None and m.stats()["cpu"]["rejected_puts"] == 3
    m.close()


def test_removed_while_pinned_keeps_its_page_until_the_reader_is_done():
    tier = make_tier(2)
    tier.put(key(0), payload(0))
    with tier.pin(key(0)) as chunk:
        assert tier.remove(key(0)) and not tier.contains(key(0))
        assert tier.pool.free_pages == 1, "page still belongs to the reader"
        assert tier.put(key(1), payload(1))
        # The pool is full: this put can only evict key 1; the reader's page is not up for grabs.
        assert tier.put(key(2), payload(2)) and tier.keys() == [key(2)]
        assert tier.pool.free_pages == 0
        assert torch.equal(chunk.data, payload(0)), "the reader's bytes were not overwritten"
    assert tier.pool.free_pages == 1, "released: the detached page went back to the pool"


def test_pin_carries_the_payload_checksum():
    from lmcache_p2p.keys import payload_checksum

    tier = make_tier(1)
    tier.put(key(0), payload(0))
    with tier.pin(key(0)) as chunk:
        assert chunk.checksum == payload_checksum(payload(0).numpy())


def test_concurrent_puts_and_pins_keep_the_pool_consistent():
    tier = make_tier(16)
    errors = []

    def worker(offset):
        try:
            for i in range(300):
                tier.put(key(offset + i % 40), payload(i))
                chunk = tier.pin(key(offset + (i * 7) % 40))
                if chunk:
                    chunk.release()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(o,)) for o in (0, 20, 40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert tier.pool.used_pages == len(tier) <= 16


# -- disk tier --------------------------------------------------------------------------------


def test_disk_round_trip_is_atomic_and_survives_a_restart(tmp_path):
    disk = DiskTier(str(tmp_path), 10 * PAGE)
    assert disk.write(key(0), payload(0).numpy())
    assert disk.read(key(0), PAGE) == payload(0).numpy().tobytes()
    files = [f for _, _, fs in os.walk(tmp_path) for f in fs]
    assert files == [f"{key(0).chunk_hash:016x}.kv"], "no temp files left behind"
    again = DiskTier(str(tmp_path), 10 * PAGE)
    assert again.contains(key(0)) and again.read(key(0), PAGE) == payload(0).numpy().tobytes()


def test_disk_cap_evicts_oldest(tmp_path):
    evicted = []
    disk = DiskTier(str(tmp_path), 3 * (PAGE + 40), on_evict=evicted.append)
    for i in range(5):
        disk.write(key(i), payload(i).numpy())
    assert disk.keys() == [key(2), key(3), key(4)] and evicted == [key(0), key(1)]
    assert disk.used_bytes <= 3 * (PAGE + 40)
    assert not os.path.exists(disk.path(key(0)))


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "wrong_header", "empty"])
def test_damaged_file_is_a_miss_and_is_deleted(tmp_path, damage, caplog):
    evicted = []
    disk = DiskTier(str(tmp_path), 10 * PAGE, on_evict=evicted.append)
    disk.write(key(0), payload(0).numpy())
    path = disk.path(key(0))
    data = bytearray(Path(path).read_bytes())
    if damage == "flip_byte":
        data[-100] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "wrong_header":
        data[:4] = b"JUNK"
    else:
        data = bytearray()
    Path(path).write_bytes(bytes(data))
    out = bytearray(PAGE)
    assert disk.read_into(key(0), out) is None
    assert not os.path.exists(path) and not disk.contains(key(0))
    assert disk.corrupt_files == 1 and evicted == [key(0)]
    assert "damaged" in caplog.text and path in caplog.text


def test_leftover_temp_files_are_cleaned_at_start(tmp_path):
    d = tmp_path / f"{LAYOUT.digest:016x}"
    d.mkdir()
    (d / "00000000000003e8.kv.123.456.tmp").write_bytes(b"partial")
    disk = DiskTier(str(tmp_path), 10 * PAGE)
    assert len(disk) == 0 and not list(d.iterdir())


# -- storage manager --------------------------------------------------------------------------


def put_all(manager, hashes):
    """Puts with the write-behind drained after each, so CPU eviction order is deterministic."""
    for h in hashes:
        assert manager.put(h, payload(h))
        assert manager.flush()


def collect(manager):
    """A reader of the manager's events from now on: each call takes what was queued since, as
    (kind, location, hash)."""
    queue = manager.record_events()
    return lambda: [(e.kind, e.location, e.key.chunk_hash) for e in queue.take_events()]


def test_longest_prefix_spans_cpu_and_disk_and_stops_at_a_gap(tmp_path):
    m = make_manager(tmp_path, cpu_pages=2, disk_pages=10)
    hashes = [1, 2, 3, 4, 5]
    put_all(m, hashes[:4])
    # CPU holds only the two most recent (3, 4); disk holds all four.
    hit = m.lookup_prefix(hashes)
    assert hit.locations == (DISK, DISK, CPU, CPU) and hit.num_chunks == 4
    m.remove(2)
    assert m.lookup_prefix(hashes).num_chunks == 1
    m.close()


def test_disk_hit_is_promoted_into_cpu_and_bytes_are_exact(tmp_path):
    m = make_manager(tmp_path, cpu_pages=2, disk_pages=10)
    put_all(m, range(1, 5))
    take = collect(m)
    assert m.location_of(1) == DISK
    with m.pin(1) as chunk:
        assert torch.equal(chunk.data, payload(1))
    assert m.location_of(1) == CPU
    events = take()
    assert ("admit", CPU, 1) in events and ("evict", CPU, 3) in events
    m.close()


def test_events_follow_every_change(tmp_path):
    m = make_manager(tmp_path, cpu_pages=2, disk_pages=10)
    take = collect(m)
    put_all(m, [1, 2, 3])
    events = take()
    assert [e for e in events if e[1] == CPU] == [
        ("admit", CPU, 1),
        ("admit", CPU, 2),
        ("evict", CPU, 1),
        ("admit", CPU, 3),
    ]
    assert sorted(e for e in events if e[1] == DISK) == [("admit", DISK, 1), ("admit", DISK, 2), ("admit", DISK, 3)]
    assert take() == []  # taken: each event once
    assert m.clear(CPU) == 2
    assert sorted(take()) == [("evict", CPU, 2), ("evict", CPU, 3)]
    m.close()


def test_each_reader_drains_its_own_queue_and_a_store_without_readers_keeps_none():
    m = make_manager(cpu_pages=2)
    m.put(1, payload(1))  # nobody reads yet: nothing is kept for later readers
    first, second = collect(m), collect(m)
    m.put(2, payload(2))
    assert first() == [("admit", CPU, 2)]
    assert first() == []  # taken
    assert second() == [("admit", CPU, 2)]  # the other reader's queue is its own
    m.close()


def test_a_fresh_process_reloads_from_disk(tmp_path):
    m = make_manager(tmp_path, cpu_pages=4, disk_pages=10)
    m.put(7, payload(7))
    m.close()
    fresh = make_manager(tmp_path, cpu_pages=4, disk_pages=10)
    assert fresh.lookup_prefix([7]).locations == (DISK,)
    with fresh.pin(7) as chunk:
        assert torch.equal(chunk.data, payload(7))
    fresh.close()


def test_corrupted_disk_chunk_is_a_miss_through_the_manager(tmp_path):
    m = make_manager(tmp_path, cpu_pages=1, disk_pages=10)
    put_all(m, [1, 2])  # 2 evicts 1 from CPU; disk keeps it
    path = m.disk.path(m.key(1))
    raw = bytearray(Path(path).read_bytes())
    raw[-1] ^= 1
    Path(path).write_bytes(bytes(raw))
    assert m.pin(1) is None
    assert m.lookup_prefix([1, 2]).num_chunks == 0
    m.close()


def test_a_burst_of_puts_is_never_rejected_and_reaches_disk(tmp_path):
    m = make_manager(tmp_path, cpu_pages=8, disk_pages=64)
    assert all(m.put(h, payload(h)) for h in range(1, 41))
    assert m.flush()
    st = m.stats()
    assert st["cpu"]["rejected_puts"] == 0 and st["cpu"]["chunks"] == 8
    assert st["disk"]["chunks"] + st["disk_writes_missed"] == 40, "every chunk is on disk or counted as missed"
    m.close()


def test_disk_only_instance(tmp_path):
    m = make_manager(tmp_path, local_cpu=False, disk_pages=4)
    take = collect(m)
    assert m.put(1, payload(1))
    assert take() == [("admit", DISK, 1)]
    with m.pin(1) as chunk:
        assert torch.equal(chunk.data, payload(1))
    m.close()


def test_unknown_location_is_named():
    with pytest.raises(ValueError, match="'RedisBackend'"):
        make_manager().clear("RedisBackend")


def test_with_peers_a_stored_chunk_is_hashed_behind_its_store_not_when_first_served():
    """A holder that hashed a chunk when a peer first pulled it spent most of a same-host pull
    doing so (issue 21); with enable_p2p the hash is taken right after the store commits."""
    from lmcache_p2p.keys import payload_checksum

    values = {"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": (4 * PAGE + 1) / GB}
    for p2p in (False, True):
        peers = dict(
            enable_p2p=True,
            enable_controller=True,
            controller_pull_url="localhost:8300",
            controller_reply_url="localhost:8400",
            lmcache_worker_ports=[8500],
            p2p_init_ports=[8200],
            p2p_lookup_ports=[8201],
            transfer_channel="tcp",
        )
        config = LMCacheConfig.from_dict({**values, **(peers if p2p else {})})
        m = StorageManager(config, LAYOUT, pin_memory=False)
        page, data = m.reserve_page()
        data.copy_(payload(7).reshape(data.shape))
        assert m.commit_page(7, page)
        entry = m.cpu._entries[m.key(7)]
        if m.hasher is not None:
            m.hasher._threads.shutdown(wait=True)  # the hashing behind the store, done
        m.close()
        assert entry.checksum == (payload_checksum(payload(7).numpy()) if p2p else None)


def test_a_pinned_pool_is_announced_before_it_is_taken_loudly_past_half_the_host(caplog):
    """The seeds' files ask for 100 GB; pinned at start on a CUDA host, a pool sized for another
    host is said first, as a WARNING naming the key that sizes it once it is over half the host."""
    import logging
    import os

    from lmcache_p2p.storage import memory

    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with caplog.at_level(logging.INFO, logger=memory.__name__):
        memory._say_what_is_pinned(host // 10)
        memory._say_what_is_pinned(host)
    small, large = caplog.records[-2:]
    assert small.levelno == logging.INFO and "pinning" in small.getMessage()
    assert large.levelno == logging.WARNING and "(100% of this host's" in large.getMessage()
    assert "LMCACHE_MAX_LOCAL_CPU_SIZE" in large.getMessage()


# -- key formats: chunks stored before tenant-safe keys ------------------------------------------


def test_a_disk_tier_written_before_key_format_2_is_served_after_the_upgrade_and_counted(tmp_path):
    """Plain keys did not change, and the storage namespace is format 1's: an upgraded engine finds
    the files an old one wrote (nothing flushed), and counts them as legacy reads."""
    old = make_manager(tmp_path, cpu_pages=4, disk_pages=10)  # LAYOUT: key format 1
    assert old.layout.key_format == 1
    old.put(7, payload(7))
    old.close()
    # A file from before the header carried a key format (the field was reserved, 0).
    legacy = Path(old.disk.path(old.key(8)))
    header = bytearray(Path(old.disk.path(old.key(7))).read_bytes()[:40])
    header[6:8] = (0).to_bytes(2, "little")
    header[16:24] = old.key(8).chunk_hash.to_bytes(8, "little")
    header[32:40] = payload_checksum(payload(8).numpy()).to_bytes(8, "little")
    legacy.write_bytes(bytes(header) + payload(8).numpy().tobytes())

    layout_v2 = msgspec.structs.replace(LAYOUT, key_format=KEY_FORMAT)
    values = {
        "chunk_size": CHUNK,
        "local_cpu": True,
        "max_local_cpu_size": (4 * PAGE + 1) / GB,
        "local_disk": f"file://{tmp_path}/disk/",
        "max_local_disk_size": (10 * (PAGE + 64)) / GB,
    }
    new = StorageManager(LMCacheConfig.from_dict(values), layout_v2, pin_memory=False)
    assert new.key(7) == old.key(7)  # the same address
    assert new.fingerprint != old.fingerprint  # but peers tell the formats apart
    assert new.lookup_prefix([7, 8]).locations == (DISK, DISK)
    for h in (7, 8):
        with new.pin(h) as chunk:
            assert torch.equal(chunk.data, payload(h))
    assert new.stats()["disk"]["legacy_files_read"] == 2
    # What the upgraded engine writes itself is not legacy.
    new.put(9, payload(9))
    new.flush()
    new.remove(9, CPU)
    with new.pin(9) as chunk:
        assert torch.equal(chunk.data, payload(9))
    assert new.stats()["disk"]["legacy_files_read"] == 2
    assert int.from_bytes(Path(new.disk.path(new.key(9))).read_bytes()[6:8], "little") == KEY_FORMAT
    new.close()
