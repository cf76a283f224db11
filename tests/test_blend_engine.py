"""Blending in a real vLLM CPU engine (issue 23): ``enable_blending`` with the tiny Llama.

A prompt of segments joined by ``" # # "`` is computed as usual the first time, and its segments
(all but the last) are stored under keys of their own tokens; a later prompt holding the same
segments in another order is blended from them. With every token recomputed
(``blend_recompute_ratios: [1.0]``) a blend is a full prefill by other means, so the engine's
greedy output must equal a plain engine's: the oracle that segments were found, stored, loaded,
moved to their new places and written into vLLM's blocks correctly.
"""

from __future__ import annotations

import re

import pytest
from instances import instance_config
from protocol_client import ControllerProcess, wait_for

from lmcache_p2p.config import ConfigError, LMCacheConfig
from lmcache_p2p.testing.tiny_model import sample_text

CHUNK = 256
BASE = {"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.25}


def test_blend_keys_load_and_bad_values_are_named():
    config = LMCacheConfig.from_dict(
        {"enable_blending": True, "blend_special_str": " ## ", "blend_recompute_ratios": [0.3], "blend_check_layers": 2}
    )
    assert (config.blend_special_str, config.blend_recompute_ratios, config.blend_check_layers) == (" ## ", [0.3], [2])
    with pytest.raises(ConfigError, match=r"blend_recompute_ratios=\[1.5\].*within 0..1"):
        LMCacheConfig.from_dict({"blend_recompute_ratios": [1.5]})
    with pytest.raises(ConfigError, match="blend_special_str"):
        LMCacheConfig.from_dict({"blend_special_str": "  "})
    env = LMCacheConfig.load({"LMCACHE_ENABLE_BLENDING": "True", "LMCACHE_BLEND_RECOMPUTE_RATIOS": "0.05"})
    assert env.enable_blending and env.blend_recompute_ratios == [0.05]


@pytest.fixture(scope="module")
def prompts(tiny_model) -> tuple[list[int], list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    system, first, second = (sample_text(120, seed) for seed in (21, 22, 23))
    one = " # # ".join([system, first, second, sample_text(30, 24)])
    other = " # # ".join([system, second, first, sample_text(30, 25)])
    return tuple(tokenizer.encode(text, add_special_tokens=False) for text in (one, other))  # type: ignore[return-value]


@pytest.mark.engine
def test_segments_stored_once_are_blended_in_another_order_and_a_full_blend_equals_a_prefill(engine, prompts):
    one, other = prompts
    eng = engine({**BASE, "enable_blending": True, "blend_recompute_ratios": [1.0]}, name="blend")
    cold = eng.generate(other)  # nothing stored: computed as usual, and its leading segments stored
    log = eng.log()
    nothing = "0 held or offered (0 tokens; 0 pulled first); blending tokens [0, 0)"
    assert nothing in log
    assert "stored 3 segment(s)" in log
    eng.generate(one)  # the same segments in another order, after other text: blended
    log = eng.log()
    assert "blend: 3 segment(s) before the last, 3 held" in log
    assert "cached in 3 segment(s) reused" in log and "recomputed past layer 1 (ratio 1.00)" in log
    assert "stored 1 segment(s)" not in log  # nothing new to store
    # Every token recomputed: the blend is a prefill by other means, and the output the cold one.
    assert eng.generate(other) == cold
    assert eng.log().count("cached in 3 segment(s) reused") == 2


@pytest.mark.engine
def test_naive_reuse_recomputes_nothing_its_separators_computed_once_on_their_own(engine, prompts):
    """Naive reuse (ratio 0 at check layer 0): every token of the blended span is a segment's or a
    separator's KV computed alone; the model runs for no token of it (what makes it cheap)."""
    one, other = prompts
    eng = engine(
        {**BASE, "enable_blending": True, "blend_recompute_ratios": [0.0], "blend_check_layers": [0]}, name="naive"
    )
    eng.generate(other)
    first = eng.generate(one)
    log = eng.log()
    blended = re.search(r"blended (\d+) tokens: (\d+) cached in 3 segment\(s\) reused, 0 recomputed", log)
    assert blended is not None, log[-3000:]
    assert blended.group(1) == blended.group(2)  # every token of [0, N) reused, none computed
    assert eng.generate(one) == first  # the separators' KV kept by the rank: the same blocks again


@pytest.mark.engine
@pytest.mark.newest_only
def test_a_qwen3_engine_blends_and_a_full_blend_equals_its_cold_answer(engine, tiny_qwen3):
    """Blending's other model family in an engine: the plugin builds vLLM's Qwen3 through its
    tracking class, and a full blend (every token recomputed) is the cold prefill."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    system, first, second = (sample_text(120, seed) for seed in (21, 22, 23))
    one, other = (
        tokenizer.encode(" # # ".join(parts), add_special_tokens=False)
        for parts in ([system, first, second, sample_text(30, 24)], [system, second, first, sample_text(30, 25)])
    )
    eng = engine({**BASE, "enable_blending": True, "blend_recompute_ratios": [1.0]}, name="qwen3", model=tiny_qwen3)
    cold = eng.generate(other)
    eng.generate(one)
    # (The rank finds the model only if the plugin built it through its Qwen3 tracking class.)
    assert "cached in 3 segment(s) reused" in eng.log()
    assert eng.generate(other) == cold


@pytest.mark.engine
def test_with_blending_off_a_prompt_of_segments_is_served_as_before(engine, prompts):
    """``enable_blending`` off (the default) changes nothing: vLLM builds its own Llama class,
    separators mean nothing, a repeated prompt is a prefix hit from the CPU tier, and every answer
    equals plain vLLM's (no connector) token for token."""
    one, other = prompts
    plain = engine({}, name="vllm", connector=False)
    ours = engine(BASE, name="ours")
    for prompt in (one, other, one):
        assert ours.generate(prompt) == plain.generate(prompt)
    log = ours.log()
    assert "blend" not in log.lower()  # neither the model class nor a segment path
    whole = len(one) // CHUNK * CHUNK
    assert f"Total tokens {len(one)}, LMCache hit tokens: {whole}, need to load: {whole}" in log


@pytest.mark.engine
def test_an_engine_pulls_the_segments_a_peer_stored_and_blends_them(engine, prompts):
    """Segment chunks are chunks like any other: the controller indexes them and a peer pulls
    them. Engine B has never seen these documents; it pulls the three segments engine A stored
    and blends them, and at ratio 1.0 answers as A does from its own tier."""
    one, other = prompts
    controller = ControllerProcess().start()
    try:
        blend = {"enable_blending": True, "blend_recompute_ratios": [1.0], "cpu_gb": 0.25}
        a = engine(instance_config("blend_a", controller, chunk_size=CHUNK, **blend), name="a")
        b = engine(instance_config("blend_b", controller, chunk_size=CHUNK, **blend), name="b")
        a.generate(other)
        a.request("flush")

        def indexed() -> bool:
            workers = controller.http.get("/controller/workers").json()["workers"]
            return any(w["instance_id"] == "blend_a" and sum(w["keys"].values()) >= 3 for w in workers)

        wait_for(indexed, timeout=10, what="the controller to index engine A's three segment chunks")
        out = b.generate(one)
        log = b.log()
        # Offered at the lookup, pulled beside the steps by the load, blended in the next step.
        assert "3 held or offered (" in log and "; 3 pulled first)" in log
        assert "pulling 3 segment(s) of 3 chunk(s) a peer offered" in log
        assert "cached in 3 segment(s) reused" in log
        assert b.status()["p2p_client"]["chunks_pulled"] == 3
        assert a.generate(one) == out
    finally:
        controller.stop()


@pytest.mark.engine
def test_an_engine_fetches_the_segments_another_stored_in_the_remote_store_and_blends_them(engine, prompts, lm_server):
    """Seed 001's remote tier serves segments like any chunk: engine A (no controller, no peers,
    only ``remote_url``) stores its three segments there; engine B has never seen these documents,
    fetches them from the store and blends them, and at ratio 1.0 answers as A does."""
    one, other = prompts
    config = {**BASE, "enable_blending": True, "blend_recompute_ratios": [1.0], "remote_url": lm_server.url}
    a = engine(config, name="a")
    a.generate(other)
    a.request("flush")  # write-behind done: the store holds A's segment chunks
    assert a.status()["storage"]["remote"]["chunks_written"] == 3
    b = engine(config, name="b")
    out = b.generate(one)
    log = b.log()
    assert "3 held or offered (" in log and "; 3 pulled first)" in log
    assert "pulling 3 segment(s) of 3 chunk(s) the remote store offered" in log
    assert "cached in 3 segment(s) reused" in log
    remote = b.status()["storage"]["remote"]
    assert remote["chunks_read"] == 3 and remote["bad_values"] == 0
    assert a.generate(one) == out
