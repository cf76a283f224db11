"""Worker pieces on their own: event batching, page residency, the controller's address, and
the command server over a real socket on loopback."""

import asyncio
import logging

import pytest
import torch
from command_harness import served_commands
from protocol_client import layout

from lmcache_p2p.config import LMCacheConfig
from lmcache_p2p.keys import ChunkKey
from lmcache_p2p.protocol import CommandReply, PinCommand, pack_hashes, unpack_hashes
from lmcache_p2p.rpc import RemoteError
from lmcache_p2p.storage.manager import StorageManager
from lmcache_p2p.storage.memory import PagePool
from lmcache_p2p.vocab import CPU, DISK, StorageEvent
from lmcache_p2p.worker.event_stream import EventBatcher
from lmcache_p2p.worker.identity import _route_address


def event(kind, h, location=CPU):
    return StorageEvent(kind, location, ChunkKey(1, h))


def test_batches_keep_the_last_event_per_key_and_number_batches_per_location():
    batcher = EventBatcher()
    for e in [
        event("admit", 1),
        event("admit", 2),
        event("evict", 1),  # 1 came and went
        event("evict", 3),
        event("admit", 3),  # 3 went and came back
        event("admit", 9, DISK),
    ]:
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


def test_keys_that_come_and_go_in_one_window_count_once():
    """3,000 keys admitted and evicted before a flush are 3,000 pending events, not 6,000: a
    dropped window reports what a cut would have sent."""
    batcher = EventBatcher()
    for h in range(3000):
        batcher.add(event("admit", h))
        batcher.add(event("evict", h))
    (batch,) = batcher.cut("inst", 0)
    assert len(unpack_hashes(batch.evicted)) == 3000 and not batch.admitted
    # drop() reports distinct events: a key stored and evicted twice is one.
    for _ in range(2):
        for h in range(10):
            batcher.add(event("admit", h))
            batcher.add(event("evict", h))
    assert batcher.drop() == 10 and batcher.drop() == 0


def test_the_controller_route_accepts_both_url_forms_and_warns_when_it_falls_back(caplog):
    with caplog.at_level(logging.WARNING, logger="lmcache_p2p.worker.identity"):
        assert _route_address("127.0.0.1:8300") == "127.0.0.1"
        assert _route_address("tcp://127.0.0.1:8300") == "127.0.0.1"
        assert not caplog.records
        assert _route_address("tcp://no-such-host.invalid:8300") == "127.0.0.1"
    (warning,) = caplog.records
    assert "tcp://no-such-host.invalid:8300" in warning.getMessage()
    assert "registering as 127.0.0.1" in warning.getMessage()


def test_pin_and_unpin_on_disk_are_refused_naming_the_location(tmp_path):
    """A pin holds a CPU page; a disk file cannot be held, so a disk pin would be a false success."""
    config = LMCacheConfig.from_dict(
        {
            "chunk_size": 16,
            "max_local_cpu_size": 0.001,
            "local_disk": f"file://{tmp_path}/",
            "max_local_disk_size": 0.01,
        }
    )
    storage = StorageManager(config, layout(), pin_memory=False)
    assert storage.put(7, torch.zeros(storage.page_bytes, dtype=torch.uint8))
    assert storage.flush() and storage.holds(7, DISK) and storage.holds(7, CPU)

    async def main():
        async with served_commands(storage) as (commands, client):
            for unpin in (False, True):
                with pytest.raises(RemoteError) as refused:
                    await client.request(
                        PinCommand(event_id=f"disk-{unpin}", location=DISK, hashes=pack_hashes([7]), unpin=unpin),
                        CommandReply,
                        5,
                    )
                assert "pinning is supported on LocalCPUBackend only, not LocalDiskBackend" in str(refused.value)
                assert refused.value.reply.event_id == f"disk-{unpin}"
            assert storage.cpu.pins_held == 0 and commands.pinned_chunks == 0
            # The CPU tier pins as before.
            pinned = await client.request(
                PinCommand(event_id="cpu", location=CPU, hashes=pack_hashes([7])), CommandReply, 5
            )
            assert pinned.num_tokens == 16 and storage.cpu.pins_held == 1

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
        assert storage.cpu.pins_held == 0  # close() released the command's pin
    finally:
        storage.close()


def test_pages_are_made_resident_once():
    pool = PagePool(page_bytes=64 * 1024, capacity_bytes=4 * 64 * 1024, pin_memory=False)
    assert pool.make_resident([0, 2]) == 2
    assert pool.make_resident([0, 1, 2]) == 1
