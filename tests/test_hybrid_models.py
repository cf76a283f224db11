"""Models whose layers keep different caches: which ones the connector serves, and that a
sliding-window model's KV is shared exactly (integration/vllm/model_kinds.py says why)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import transformers
from instances import instance_config
from protocol_client import ControllerProcess, wait_for

from lmcache_p2p.config import ConfigError
from lmcache_p2p.integration.vllm.model_kinds import attention_layers, check_model
from lmcache_p2p.testing.tiny_model import sample_prompts

CHUNK = 256


@dataclass
class RegistryFacts:
    """The three things check_model reads of vLLM's ModelConfig: the model's name, its text
    config (a real transformers config here) and the registry's facts about its class."""

    hf_text_config: Any
    model: str
    is_hybrid: bool = False
    is_attention_free: bool = False


@pytest.mark.parametrize("name", ["Qwen3NextConfig", "JambaConfig", "NemotronHConfig", "FalconH1Config"])
def test_a_model_with_state_space_or_linear_layers_is_refused_naming_it_and_what_still_works(name):
    config = getattr(transformers, name)()
    with pytest.raises(ConfigError, match=r"kv_connector=.*model tiny-" + name + r" has state-space") as refused:
        check_model(RegistryFacts(config, f"tiny-{name}"))
    assert "Serve this model without lmcache-p2p's connector" in str(refused.value)
    # The registry's word is enough, whatever the config lists.
    with pytest.raises(ConfigError, match="state-space"):
        check_model(RegistryFacts(transformers.LlamaConfig(), "m", is_hybrid=True))
    with pytest.raises(ConfigError, match="is attention-free"):
        check_model(RegistryFacts(transformers.LlamaConfig(), "m", is_attention_free=True))


def test_full_and_sliding_window_models_are_served_and_their_layers_counted():
    assert check_model(RegistryFacts(transformers.LlamaConfig(num_hidden_layers=4), "llama")).sliding == 0
    gemma = attention_layers(RegistryFacts(transformers.Gemma3TextConfig(num_hidden_layers=12), "gemma"))
    assert (gemma.layers, gemma.sliding, gemma.window, gemma.state) == (12, 10, 4096, False)


@pytest.fixture(scope="module")
def tiny_sliding(tmp_path_factory) -> str:
    """The tiny Llama with its first layer attending to the last 64 tokens only."""
    from lmcache_p2p.testing.tiny_model import build

    return build(str(tmp_path_factory.mktemp("tiny-sliding")), sliding_window=64)


@pytest.mark.engine
@pytest.mark.newest_only
def test_a_sliding_window_model_pulled_from_a_peer_answers_as_its_cold_run(engine, tiny_sliding):
    """Prompts far longer than the window: every layer's KV travels (vLLM keeps the sliding layers'
    KV for every token with our connector), and B's hit answers exactly as A's cold prefill."""
    prompt = sample_prompts(tiny_sliding, 2 * CHUNK + 40, [7])[0]
    controller = ControllerProcess().start()
    try:
        keys = dict(chunk_size=CHUNK, cpu_gb=0.25)
        a = engine(instance_config("sliding_a", controller, **keys), name="a", model=tiny_sliding)
        b = engine(instance_config("sliding_b", controller, **keys), name="b", model=tiny_sliding)
        assert "1 of 2 layers use sliding-window attention (window 64 tokens)" in a.log()
        cold = a.generate(prompt)
        a.request("flush")
        wait_for(lambda: controller.holders(prompt), timeout=10, what="the controller to index engine A's chunks")
        assert b.generate(prompt) == cold
        assert b.status()["p2p_client"]["chunks_pulled"] == 2
    finally:
        controller.stop()
