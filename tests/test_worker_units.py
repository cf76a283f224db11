"""Worker pieces that need no network: event batching and page residency."""

from lmcache_p2p.keys import ChunkKey
from lmcache_p2p.protocol import unpack_hashes
from lmcache_p2p.storage.manager import CPU, DISK, StorageEvent
from lmcache_p2p.storage.memory import PagePool
from lmcache_p2p.worker.link import EventBatcher


def event(kind, h, location=CPU):
    return StorageEvent(kind, location, ChunkKey(1, h))


def test_batches_keep_the_last_event_per_key_and_number_batches_per_location():
    batcher = EventBatcher()
    for e in [event("admit", 1), event("admit", 2), event("evict", 1),  # 1 came and went
              event("evict", 3), event("admit", 3),  # 3 went and came back
              event("admit", 9, DISK)]:
        batcher.add(e)
    batches = {b.location: b for b in batcher.cut("inst", 0)}
    cpu = batches[CPU]
    # The controller applies admits, then evicts: a key in both lists would end up wrong.
    assert sorted(unpack_hashes(cpu.admitted).tolist()) == [2, 3]
    assert unpack_hashes(cpu.evicted).tolist() == [1]
    assert cpu.seq == 1 and batches[DISK].seq == 1
    batcher.add(event("admit", 4))
    (second,) = batcher.cut("inst", 0)
    assert second.location == CPU and second.seq == 2 and batcher.last_seq(DISK) == 1
    assert batcher.cut("inst", 0) == []


def test_a_full_batch_wakes_the_sender():
    batcher = EventBatcher(max_batch=3)
    woken = []
    batcher.wake = lambda: woken.append(True)
    for h in range(2):
        batcher.add(event("admit", h))
    assert not woken
    batcher.add(event("admit", 7))
    assert woken


def test_pages_are_made_resident_once():
    pool = PagePool(page_bytes=64 * 1024, capacity_bytes=4 * 64 * 1024, pin_memory=False)
    assert pool.make_resident([0, 2]) == 2
    assert pool.make_resident([0, 1, 2]) == 1
