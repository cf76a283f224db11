"""Peer pulls through GPU staging (lmcache_p2p.transfer.gpu_staging; nixl_buffer_device).

Tests marked ``gpu`` run two stand-in engine processes whose KV lives on the GPU, on the H200
device: a real controller, real NIXL over cuda_ipc, our kernels for KV <-> pool. The others run
everywhere: the slot lists, the device choice, and what a CPU machine says when told to stage
on CUDA.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from instances import InstanceProcess, instance_config, tokens
from protocol_client import wait_for

from lmcache_p2p.config import ConfigError, LMCacheConfig
from lmcache_p2p.transfer import TransferError
from lmcache_p2p.transfer.gpu_staging import _SlotList, staging_device

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA (runs on the H200 device)")
CHUNK = 32
CPU = "LocalCPUBackend"


@pytest.fixture
def controller(controllers):
    return controllers()


def staged(spawn, controller, instance_id: str, **extra) -> InstanceProcess:
    """A nixl instance whose KV lives on the GPU (staging on by default there)."""
    return spawn(
        instance_config(instance_id, controller, "nixl", chunk_size=CHUNK, **extra), num_blocks=32, device="cuda"
    )


def pull_and_check(controller, a: InstanceProcess, b: InstanceProcess, chunks: int, seed: int = 0) -> None:
    prompt = tokens(chunks * CHUNK, seed=seed)
    assert a.prefill(prompt) == chunks * CHUNK
    wait_for(
        lambda: controller.holders(prompt).get(a.config["lmcache_instance_id"]) == [CPU, chunks * CHUNK],
        what="the holder's keys",
    )
    assert b.lookup(prompt) == chunks * CHUNK
    got = b.retrieve(prompt)  # wipes B's GPU KV, scatters the pulled pages back, compares
    assert got["retrieved"] == chunks * CHUNK and got["exact"], got
    assert b.status()["p2p_client"]["checksum_mismatches"] == 0


# -- on the GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
def test_gpu_kv_pulled_through_staging_on_both_ends_is_bit_exact(controller, spawn):
    a, b = (staged(spawn, controller, f"lmcache_instance_{i}") for i in (1, 2))
    pull_and_check(controller, a, b, chunks=8)
    assert "over nixl via GPU staging, to rank 0)" in b.log()
    assert "GPU staging on cuda:0: 32 slots" in a.log()
    assert a.status()["p2p_server"]["chunks_served"] == 8
    # Released by A's server once its reply has left (on its event loop): a moment after B has it.
    wait_for(lambda: a.status()["storage"]["cpu"]["pins_held"] == 0, 10, "A's pins released after serving")


@pytest.mark.gpu
@gpu
def test_a_requester_without_staging_is_written_pool_to_pool(controller, spawn):
    a = staged(spawn, controller, "lmcache_instance_1")
    b = staged(spawn, controller, "lmcache_instance_2", nixl_buffer_device="cpu")
    pull_and_check(controller, a, b, chunks=8)
    assert "over nixl, to rank" in b.log() and "via GPU staging" not in b.log()


@pytest.mark.gpu
@gpu
def test_staging_smaller_than_a_batch_still_moves_every_chunk(controller, spawn):
    page_bytes = CHUNK * 32 * 2 * 8 * 128 * 2  # Llama-3.1-8B, bf16
    small = dict(nixl_buffer_size=2 * page_bytes)  # one slot to send, one to receive
    a, b = (staged(spawn, controller, f"lmcache_instance_{i}", **small) for i in (1, 2))
    pull_and_check(controller, a, b, chunks=12, seed=3)
    assert "over nixl via GPU staging, to rank 0)" in b.log()
    assert "(1 receive, 1 send)" in b.log()


@pytest.mark.gpu
@gpu
def test_two_instances_pulling_from_each_other_at_once(controller, spawn):
    """Each is holder and requester at the same time: receive and send slots are separate, so
    neither waits on itself."""
    small = dict(nixl_buffer_size=4 * CHUNK * 32 * 2 * 8 * 128 * 2)
    a, b = (staged(spawn, controller, f"lmcache_instance_{i}", **small) for i in (1, 2))
    pa, pb = tokens(16 * CHUNK, seed=11), tokens(16 * CHUNK, seed=12)
    a.prefill(pa)
    b.prefill(pb)
    # Registration is batched: wait for every chunk, not the first batch (a lookup racing the
    # rest pulls what is registered so far).
    wait_for(
        lambda: (
            (controller.holders(pa).get("lmcache_instance_1") or [None, 0])[1] == 16 * CHUNK
            and (controller.holders(pb).get("lmcache_instance_2") or [None, 0])[1] == 16 * CHUNK
        ),
        what="both instances' keys, every chunk",
    )
    hits = {}
    threads = [
        threading.Thread(target=lambda: hits.__setitem__("b", b.lookup(pa))),
        threading.Thread(target=lambda: hits.__setitem__("a", a.lookup(pb))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert hits == {"a": 16 * CHUNK, "b": 16 * CHUNK}
    assert b.retrieve(pa)["exact"] and a.retrieve(pb)["exact"]


# -- everywhere ----------------------------------------------------------------------------------


def test_slot_lists_hand_out_whole_batches_or_what_is_free():
    async def scenario():
        slots = _SlotList(range(4))
        first = await slots.take(3, timeout=0.1)
        assert sorted(first) == [0, 1, 2] and slots.free == 1
        assert await slots.take(2, timeout=0.05, whole=True) == []  # a requester: all or none
        assert len(await slots.take(2, timeout=0.05)) == 1  # a holder: works with fewer
        with pytest.raises(TransferError, match="no GPU staging slot free within 0.1s"):
            await slots.take(1, timeout=0.1)
        # A waiter wakes when slots come back.
        waiter = asyncio.ensure_future(slots.take(2, timeout=2.0, whole=True))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        slots.give(first[:2])
        assert sorted(await waiter) == sorted(first[:2])

    asyncio.run(scenario())


def test_staging_device_follows_the_setting():
    assert staging_device("cpu", None) is None
    if CUDA:
        assert staging_device("auto", None).type == "cuda"
    else:
        assert staging_device("auto", None) is None
        with pytest.raises(TransferError, match="nixl_buffer_device is cuda but CUDA is not available"):
            staging_device("cuda", None)


def test_bad_staging_settings_name_the_key():
    with pytest.raises(ConfigError, match="nixl_buffer_device.*expected one of auto, cuda, cpu"):
        LMCacheConfig.from_dict({"nixl_buffer_device": "gpu"})
    with pytest.raises(ConfigError, match="nixl_buffer_size"):
        LMCacheConfig.from_dict({"nixl_buffer_size": 0})


@pytest.mark.skipif(CUDA, reason="checks what a machine without CUDA says")
def test_staging_required_without_cuda_stops_the_engine_with_the_reason(controller, tmp_path):
    config = instance_config("lmcache_instance_1", controller, "nixl", chunk_size=CHUNK, nixl_buffer_device="cuda")
    proc = InstanceProcess(config, tmp_path, num_blocks=8)
    with pytest.raises(AssertionError, match="exited"):
        proc.start()
    proc.stop()
    assert "lmcache_instance_1 rank 0: nixl_buffer_device is cuda but CUDA is not available here" in proc.log()
