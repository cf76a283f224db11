"""The connector hooks of current vLLM releases, on real vLLM CPU engines: the engine says which
vLLM it runs on; its scheduler takes our best-effort delivery (a preemption never makes a
request recompute for a save of ours); hits are counted by source on the engine's /metrics
(``vllm:prompt_tokens_cached_by_source``, vLLM >= 0.32). Failed receives are in
test_vllm_cpu.py's failed-load tests, which assert the path each release takes."""

from __future__ import annotations

import re

import httpx
import pytest
import torch
from conftest import ENGINE_ENV

from lmcache_p2p.integration.vllm import compat
from lmcache_p2p.testing.served_fleet import ServedFleet
from lmcache_p2p.testing.tiny_model import sample_prompts, sample_text

pytestmark = [pytest.mark.slow, pytest.mark.engine]

CHUNK = 256


def _preempt_and_repeat(engine, tiny_model, num_blocks: int, block_args: tuple = ()) -> dict:
    """Four prompts of 260 tokens (a chunk each) generating 300 tokens in a KV cache of
    ``num_blocks`` blocks: some start, grow, and vLLM preempts one while our stores of them are
    in flight. The batch run again, its chunks now loaded from our CPU tier, gives the same
    tokens. Returns the engine's info after the first batch."""
    eng = engine(
        {"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.25},
        args=("--num-blocks", str(num_blocks), "--max-model-len", "640", *block_args),
    )
    prompts = sample_prompts(tiny_model, 260, seeds=[21, 22, 23, 24])
    first = eng.request("generate_batch", prompts=prompts, max_tokens=300, timeout=300)
    assert first["preemptions"] > 0, f"the batch fit: nothing was preempted ({eng.request('engine_info')})"
    assert all(len(tokens) == 300 for tokens in first["outputs"])
    info = eng.request("engine_info")
    again = eng.request("generate_batch", prompts=prompts, max_tokens=300, timeout=300)
    assert again["outputs"] == first["outputs"]
    assert eng.status()["engine"]["retrieved_tokens"] >= 4 * CHUNK  # the repeat loaded each prompt's chunk
    assert f"lmcache-p2p runs on {info['vllm']}" in eng.log()
    assert compat.VllmRelease(*info["vllm"].split(" ")).supported, info
    return info


def test_an_engine_runs_a_supported_vllm_and_preempted_requests_keep_their_outputs(engine, tiny_model):
    """Our connector is a best-effort cache: vLLM's scheduler takes requires_kv_delivery False
    from it, so a request preempted while our save of it is pending keeps its output in flight
    rather than recomputing it. (On a CPU engine vLLM schedules synchronously, so nothing is in
    flight to drop; the GPU test below has asynchronous scheduling.)"""
    info = _preempt_and_repeat(engine, tiny_model, num_blocks=12)  # 12 CPU blocks of 128 tokens
    assert info["requires_kv_delivery"] in (False, None), info  # None: a vLLM before the hook (0.25)
    assert info["preemptions_keeping_output"] > 0 and info["preemptions_dropping_output"] == 0, info


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on the H200 device)")
def test_on_a_gpu_with_asynchronous_scheduling_a_preemption_drops_no_output_for_our_saves(engine, tiny_model):
    # 60 GPU blocks of 16 tokens (vLLM 0.34's default block holds 64: the batch would fit)
    info = _preempt_and_repeat(engine, tiny_model, num_blocks=60, block_args=("--block-size", "16"))
    assert info["async_scheduling"] is True, info
    assert info["preemptions_keeping_output"] > 0 and info["preemptions_dropping_output"] == 0, info


def _cached_by_source(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.findall(
        r'^vllm:prompt_tokens_cached_by_source_total\{[^}]*source="(\w+)"[^}]*\} ([0-9.e+]+)$', text, re.M
    )
    return {source: float(value) for source, value in found}


@pytest.mark.skipif(
    compat.installed_release().release < (0, 32), reason="vllm:prompt_tokens_cached_by_source is vLLM >= 0.32's"
)
def test_hits_are_counted_on_the_engines_metrics_by_the_tier_they_came_from(tiny_model, tmp_path):
    """With vLLM's own prefix cache off, a repeat on engine 1 is a CPU-tier hit (host) and the
    same prompt on engine 2 is a peer pull (p2p); vLLM's own cache counts nothing (device)."""
    fleet = ServedFleet(
        tmp_path / "fleet", tiny_model, engines=2, engine_env=ENGINE_ENV, engine_args=("--no-enable-prefix-caching",)
    )
    try:
        fleet.start()
        one, two = fleet.engine_urls
        prompt = sample_text(700, seed=31)
        body = {"model": tiny_model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0}
        cold = httpx.post(f"{one}/v1/completions", json=body, timeout=120).json()
        warm = httpx.post(f"{one}/v1/completions", json=body, timeout=120).json()
        pulled = httpx.post(f"{two}/v1/completions", json=body, timeout=120).json()
        assert cold["choices"][0]["text"] == warm["choices"][0]["text"] == pulled["choices"][0]["text"]

        tokens = warm["usage"]["prompt_tokens"]
        held = min(tokens // CHUNK * CHUNK, tokens - 1)  # vLLM computes at least the last token
        assert held >= 2 * CHUNK
        on_one, on_two = _cached_by_source(one), _cached_by_source(two)
        assert on_one.get("host") == held and on_one.get("p2p", 0) == 0, on_one
        assert on_two.get("p2p") == held and on_two.get("host", 0) == 0, on_two
        assert on_one.get("device", 0) == on_two.get("device", 0) == 0
        assert on_one.get("external_unspecified", 0) == on_two.get("external_unspecified", 0) == 0
    finally:
        fleet.stop()
