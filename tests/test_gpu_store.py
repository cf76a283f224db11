"""The engine's store path on a GPU: chunks gathered on a copy stream beside the next forward
pass (CacheEngine.store_async), indexed only once the copy is done. Marked ``gpu`` (run on the
H200 device); the CPU test checks the same calls where there is no CUDA (copied at once)."""

from __future__ import annotations

import pytest
import torch

from lmcache_p2p.cache_engine import CacheEngine
from lmcache_p2p.config import LMCacheConfig
from lmcache_p2p.keys import chunk_hash_array
from lmcache_p2p.testing.standin import MODEL_SHAPES, StandInKV
from lmcache_p2p.testing.sync_engine import retrieve
from lmcache_p2p.worker import build_engine

CHUNK = 32
CUDA = torch.cuda.is_available()


def engine_and_kv(device: str, model: str = "qwen2.5-0.5b") -> tuple[CacheEngine, StandInKV]:
    kv = StandInKV(MODEL_SHAPES[model], num_blocks=64, device=device)
    config = LMCacheConfig.from_dict({"chunk_size": CHUNK, "max_local_cpu_size": 0.2})
    engine = build_engine(
        config, kv.layout(), pin_memory=device != "cpu", device=torch.device(device) if device != "cpu" else None
    )
    return engine, kv


def check_async_store(device: str) -> None:
    engine, kv = engine_and_kv(device)
    hashes, blocks = chunk_hash_array(list(range(8 * CHUNK)), CHUNK), list(range(64))
    kv.prefill(hashes, blocks, CHUNK)
    try:
        assert engine.store_async(hashes, kv.layers, blocks, owner="req-1") == 8
        # The same chunks are not launched twice while the first copy is in flight.
        assert engine.store_async(hashes, kv.layers, blocks, owner="req-2") == 0
        engine.poll_stores(wait=True)
        assert not engine.stores_pending("req-1")
        assert engine.counters.stored_tokens == 8 * CHUNK
        kv.wipe()
        assert retrieve(engine, hashes, kv.layers, blocks) == 8 * CHUNK
        assert kv.matches(hashes, blocks, CHUNK, 8 * CHUNK)
    finally:
        engine.close()


def test_async_store_without_cuda_copies_at_once():
    check_async_store("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA (runs on the H200 device)")
def test_async_store_on_the_gpu_is_indexed_after_its_copy_and_bit_exact():
    check_async_store("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA (runs on the H200 device)")
def test_a_fenced_stream_writes_blocks_only_after_the_copy_read_them():
    engine, kv = engine_and_kv("cuda", "llama-3.1-8b")  # 32 chunks of 4 MiB: a copy of ~2.5 ms
    hashes, blocks = chunk_hash_array(list(range(32 * CHUNK)), CHUNK), list(range(64))
    kv.prefill(hashes, blocks, CHUNK)
    try:
        assert engine.store_async(hashes, kv.layers, blocks, owner="req-1") == 32
        engine.order_stores_before(torch.cuda.current_stream())
        for layer in kv.layers:  # what a preempted request's next owner would do to its blocks
            layer.zero_()
        engine.poll_stores(wait=True)
        kv.wipe()
        assert retrieve(engine, hashes, kv.layers, blocks) == 32 * CHUNK
        assert kv.matches(hashes, blocks, CHUNK, 32 * CHUNK)  # the pages hold the KV from before
    finally:
        engine.close()
