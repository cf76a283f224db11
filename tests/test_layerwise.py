"""Layer-wise loads (``use_layerwise``, lmcache_p2p.layerwise): each layer's KV reaches its blocks
when that layer's wait comes (CPU) or is ordered before it on the device (GPU, tests marked
``gpu``, run on the H200); in a real vLLM CPU engine the output equals a cold run's."""

from __future__ import annotations

import pytest
import torch
from instances import tokens

from lmcache_p2p.config import GB, LMCacheConfig
from lmcache_p2p.keys import chunk_hash_array
from lmcache_p2p.layerwise import LayerwiseLoad
from lmcache_p2p.testing.standin import MODEL_SHAPES, StandInKV
from lmcache_p2p.testing.sync_engine import store
from lmcache_p2p.worker import build_engine

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA (runs on the H200 device)")
CHUNK = 32
SHAPE = MODEL_SHAPES["qwen2.5-0.5b"]


def stored_prompt(device: str, chunks: int = 4):
    """An engine holding a prompt's chunks, its KV wiped: (engine, kv, hashes, blocks, layer map)."""
    config = LMCacheConfig.from_dict({"chunk_size": CHUNK, "max_local_cpu_size": 64 * 2**20 / GB})
    kv = StandInKV(SHAPE, 64, device=device)
    engine = build_engine(config, kv.layout(), pin_memory=device != "cpu", device=kv.layers[0].device)
    hashes = chunk_hash_array(tokens(chunks * CHUNK, seed=4), CHUNK)
    blocks = list(range(len(kv.layers[0])))
    kv.prefill(hashes, blocks, CHUNK)
    assert store(engine, hashes, kv.layers, blocks) == chunks * CHUNK
    kv.wipe()
    layers = {f"model.layers.{i}.self_attn.attn": range(i, i + 1) for i in range(len(kv.layers))}
    return engine, kv, hashes, blocks, layers


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (the stand-in's KV is random bytes: some are NaNs as bf16)."""
    return torch.equal(a.cpu().view(torch.int16), b.cpu().view(torch.int16))


def layer_matches(kv: StandInKV, layer: int, reference: StandInKV) -> bool:
    return same_bytes(kv.layers[layer], reference.layers[layer])


def reference_kv(hashes, blocks) -> StandInKV:
    ref = StandInKV(SHAPE, 64)
    ref.prefill(hashes, blocks, CHUNK)
    return ref


def test_each_layer_is_loaded_when_its_wait_comes_and_not_before():
    engine, kv, hashes, blocks, layers = stored_prompt("cpu")
    try:
        ref = reference_kv(hashes, blocks)
        with engine.pin_prefix(hashes) as prefix:
            plan = engine.plan_load(prefix, blocks)
            load = LayerwiseLoad([plan], kv.layers, layers)
            names = list(layers)
            load.wait(names[0])
            assert layer_matches(kv, 0, ref) and not kv.layers[1].any()  # layer 1 untouched yet
            assert load.not_waited() == names[1:]
            for name in names[1:]:
                load.wait(name)
            assert load.not_waited() == [] and load.done()
            assert kv.matches(hashes, blocks, CHUNK, len(hashes) * CHUNK)
    finally:
        engine.close()


def test_a_load_that_starts_mid_prompt_leaves_the_computed_blocks_alone():
    engine, kv, hashes, blocks, layers = stored_prompt("cpu")
    try:
        for layer in kv.layers:  # the engine computed the first chunk and a block itself
            layer[:3].fill_(7)
        with engine.pin_prefix(hashes) as prefix:
            load = LayerwiseLoad([engine.plan_load(prefix, blocks, start=3 * 16)], kv.layers, layers)
            for name in layers:
                load.wait(name)
        assert all(bool((layer[:3] == 7).all()) for layer in kv.layers)
        ref = reference_kv(hashes, blocks)
        assert all(same_bytes(a[3:8], b[3:8]) for a, b in zip(kv.layers, ref.layers, strict=True))
    finally:
        engine.close()


# -- on the GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
def test_on_a_gpu_every_layer_is_queued_at_once_and_ordered_before_its_reader():
    engine, kv, hashes, blocks, layers = stored_prompt("cuda", chunks=8)
    try:
        with engine.pin_prefix(hashes) as prefix:
            load = LayerwiseLoad([engine.plan_load(prefix, blocks)], kv.layers, layers)
            for name in layers:
                load.wait(name)  # no host wait: the current stream waits on the device
            # What the forward pass reads after the waits, on its own stream, is the loaded KV.
            snapshot = [layer.clone() for layer in kv.layers]
            load.synchronize()
            assert load.done() and load.seconds > 0
        torch.cuda.synchronize()
        ref = reference_kv(hashes, blocks)
        assert all(same_bytes(s, r) for s, r in zip(snapshot, ref.layers, strict=True))
    finally:
        engine.close()


@pytest.mark.gpu
@gpu
def test_blocks_reused_after_a_layer_wise_load_keep_their_new_owners_writes():
    """A request preempted after its load step: its blocks go to another request, whose writes
    are queued after the forward pass. No copy of the load may land after them."""
    engine, kv, hashes, blocks, layers = stored_prompt("cuda", chunks=8)
    try:
        with engine.pin_prefix(hashes) as prefix:
            load = LayerwiseLoad([engine.plan_load(prefix, blocks)], kv.layers, layers)
            for name in layers:
                load.wait(name)
            for layer in kv.layers:  # the next owner's prefill, on the forward pass's stream
                layer.fill_(3)
            load.synchronize()
        torch.cuda.synchronize()
        assert all(bool((layer == 3).all()) for layer in kv.layers)
    finally:
        engine.close()


# -- in vLLM (CPU) -------------------------------------------------------------------------------


@pytest.mark.engine
def test_a_layer_wise_hit_in_vllm_gives_the_cold_output_and_corrupted_kv_does_not(engine, tiny_model):
    from lmcache_p2p.testing.tiny_model import sample_prompts

    prompt = sample_prompts(tiny_model, 700, seeds=[12])[0]
    eng = engine({"chunk_size": 256, "local_cpu": True, "max_local_cpu_size": 0.25, "use_layerwise": True})
    cold = eng.generate(prompt)
    assert eng.generate(prompt) == cold
    log = eng.log()
    assert "Retrieved 512 out of total 700 tokens" in log and "(layer by layer)" in log
    assert "were not waited for" not in log
    assert eng.request("corrupt")["chunks"] == 2
    assert eng.generate(prompt) != cold, "the output ignored the layer-wise loaded KV"
