"""Which models the connector can share and offload KV for, decided at start-up from the model's
config and vLLM's own registry facts, before any KV exists.

The connector stores and loads one KV cache group: every layer's K and V for every token. vLLM
groups a model's layers by cache kind only through its hybrid KV cache manager, which a connector
opts into (``SupportsHMA``); ours does not, so vLLM turns the manager off when it selects our
connector. Then:

* **Full attention** (Llama, Qwen, ...): one group; everything works.
* **Sliding-window layers beside full ones** (Gemma 3, gpt-oss, a Llama with ``layer_types``):
  vLLM gives the sliding layers full-length caches (one group); their attention still reads only
  the window. A chunk holds every layer's KV, so stores, tiers, peers and the remote store serve
  these models exactly; what is lost is the window's memory saving in vLLM's own cache. The
  connector says so in one line at start-up.
* **State-space or linear-attention layers** (Mamba, Jamba, Qwen3-Next, Nemotron-H): their
  layers keep a recurrent state, not KV per token; vLLM needs its hybrid manager for them, and a
  prefix's state is not a chunk of our KV. Refused at start-up by name, with what still works.
* **Attention-free models**: nothing to share; refused the same way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from lmcache_p2p.config import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionLayers:
    """A model's layers as the connector sees them."""

    model: str
    layers: int
    sliding: int  # sliding-window attention layers
    window: int | None  # their window, tokens
    state: bool  # some layers keep a recurrent state (Mamba, linear attention)
    attention_free: bool


def attention_layers(model_config: Any) -> AttentionLayers:
    """From vLLM's ``ModelConfig``: its text config's ``layer_types`` and ``sliding_window``, and
    the registry's facts about the model class (``is_hybrid``, ``is_attention_free``)."""
    text = getattr(model_config, "hf_text_config", None) or model_config.hf_config
    types = [str(t) for t in (getattr(text, "layer_types", None) or [])]
    layers = int(getattr(text, "num_hidden_layers", 0) or len(types))
    sliding = sum(t == "sliding_attention" for t in types)
    window = getattr(text, "sliding_window", None) if sliding else None
    state = bool(getattr(model_config, "is_hybrid", False)) or any(
        t in ("mamba", "linear_attention", "hybrid", "conv", "ssm") for t in types
    )
    return AttentionLayers(
        model=str(getattr(model_config, "model", "?")),
        layers=layers,
        sliding=sliding,
        window=int(window) if window else None,
        state=state,
        attention_free=bool(getattr(model_config, "is_attention_free", False)),
    )


def check_model(model_config: Any) -> AttentionLayers:
    """The model's layers, after refusing what the connector cannot serve (the module docstring
    says what and why) and saying what a sliding-window model costs."""
    found = attention_layers(model_config)
    if found.attention_free or found.state:
        kind = "is attention-free" if found.attention_free else "has state-space or linear-attention layers"
        raise ConfigError(
            "kv_connector",
            f"model {found.model} {kind}: its layers keep a recurrent state, not KV per token, which "
            "lmcache-p2p cannot store or share (vLLM serves such models only with its hybrid KV cache manager, "
            "which this connector does not implement). Serve this model without lmcache-p2p's connector; "
            "full-attention and sliding-window models share as usual",
            value="LMCacheConnectorV1",
        )
    if found.sliding:
        logger.info(
            "model %s: %d of %d layers use sliding-window attention (window %s tokens); vLLM keeps their KV for "
            "every token with lmcache-p2p's connector (one KV cache group), so stores, tiers and peer hits carry "
            "every layer as for any model, and the window's memory saving in vLLM's own cache is lost",
            found.model,
            found.sliding,
            found.layers,
            found.window,
        )
    return found
