"""A load's life in vLLM's CUDA build around what vLLM does to the request meanwhile: preemption
while other requests' loads are pending, and vLLM 0.34's cap on loads in flight, which parks a
hit (asking ``get_num_new_matched_tokens`` again later) until a slot frees. Every request must
end with its cold output, and every pin our loads took must be released (a leak shows as pins
still held once the engine is idle). Marked ``gpu``: vLLM schedules asynchronously only there."""

from __future__ import annotations

import pytest
import torch
from protocol_client import wait_for

from lmcache_p2p.integration.vllm import compat
from lmcache_p2p.testing.tiny_model import sample_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on the GPU device)"),
]

CHUNK = 256
# Every load beside the steps (asynchronous in vLLM's terms), so each hit goes through vLLM's
# WAITING_FOR_REMOTE_KVS path and, on 0.34 with a cap, through its queue of parked loads.
CONFIG = {"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 1.0, "async_kv_loads": True}


def _ieee_engine(engine, tmp_path, args: tuple):
    """A float32 engine whose attention is IEEE float32 whatever the batch: on a GPU vLLM runs
    float32 attention in Triton, whose dot products are TF32 by default, and its decode kernel
    differs between decode-only batches and batches with a prefill. A hit whose suffix prefills
    beside another request's decode changes that request's kernel, enough to flip a near-tied
    greedy token of a random-weight model; with IEEE dots the kernels agree to ~1e-6."""
    return engine(CONFIG, args=args, env={"TRITON_F32_DEFAULT": "ieee", "TRITON_CACHE_DIR": str(tmp_path / "triton")})


def _pins_released(eng) -> None:
    wait_for(lambda: eng.status()["storage"]["cpu"]["pins_held"] == 0, 30, "every pin our loads took released")


def _cold_then_hits(eng, prompts: list[list[int]], max_tokens: int) -> tuple[dict, dict]:
    cold = eng.request("generate_batch", prompts=prompts, max_tokens=max_tokens, timeout=600)
    eng.request("flush")
    before = eng.status()["engine"]["retrieved_tokens"]
    warm = eng.request("generate_batch", prompts=prompts, max_tokens=max_tokens, timeout=600)
    loaded = eng.status()["engine"]["retrieved_tokens"] - before
    assert loaded >= len(prompts) * CHUNK, f"the repeat loaded {loaded} tokens from our tier"
    return cold, warm


def test_requests_preempted_while_loads_are_pending_resume_with_their_cold_outputs(engine, tiny_model, tmp_path):
    # 200 GPU blocks of 16 tokens (3,200 tokens; vLLM 0.34's default block holds 64) admit five of
    # the eight 600-token prompts (vLLM >= 0.34 admits a prompt only when all of it fits), and
    # those five outgrow the cache as they decode to 1,100 tokens: the batch preempts while the
    # other requests' loads are queued or in flight.
    args = ["--num-blocks", "200", "--block-size", "16", "--max-model-len", "1200"]
    if compat.installed_release().release >= (0, 34):
        args += ["--max-num-inflight-kv-loads", "2"]
    eng = _ieee_engine(engine, tmp_path, tuple(args))
    prompts = sample_prompts(tiny_model, 600, seeds=list(range(40, 48)))
    cold, warm = _cold_then_hits(eng, prompts, max_tokens=500)
    assert warm["preemptions"] > 0, f"nothing was preempted while the hits loaded: {eng.request('engine_info')}"
    assert warm["outputs"] == cold["outputs"]
    _pins_released(eng)


@pytest.mark.skipif(
    compat.installed_release().release < (0, 34), reason="--max-num-inflight-kv-loads is vLLM >= 0.34's"
)
def test_eight_concurrent_hits_under_a_cap_of_one_load_in_flight_give_cold_outputs_and_leak_no_pins(
    engine, tiny_model, tmp_path
):
    eng = _ieee_engine(engine, tmp_path, ("--max-model-len", "2048", "--max-num-inflight-kv-loads", "1"))
    prompts = sample_prompts(tiny_model, 1100, seeds=list(range(60, 68)))
    cold, warm = _cold_then_hits(eng, prompts, max_tokens=16)
    assert warm["outputs"] == cold["outputs"]
    _pins_released(eng)
