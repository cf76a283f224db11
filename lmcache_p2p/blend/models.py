"""Model adapters for blending (blender.BlendModel): one per model family, over the model's own
modules and weights.

* :class:`HFDecoder`: a transformers ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or
  ``Qwen3ForCausalLM`` (one layer layout: Qwen2 adds biases to the q/k/v projections, which the
  modules apply; Qwen3 normalises each head's q and k before RoPE, which ``qkv`` does). The
  quality benchmarks run segments through it to compare blended KV with a full prefill on the
  same weights, and the tests hold the blender to a full prefill with it.

Adding a RoPE family means writing ``embed`` / ``qkv`` / ``finish`` over its modules and saying
where its ``inv_freq`` and rope type are; ``support.SUPPORTED`` lists the architectures blending
accepts, and anything else is refused by name.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from lmcache_p2p.blend.support import check_architecture, check_full_attention, check_rope_kind


class HFDecoder:
    """blender.BlendModel over a transformers Llama, Qwen2 or Qwen3. ``residual`` is the residual
    stream itself: transformers' layers add, they do not fuse the add into the norm."""

    def __init__(self, model: Any):
        check_architecture(list(getattr(model.config, "architectures", None) or ["LlamaForCausalLM"]))
        config = model.config
        rope = getattr(config, "rope_parameters", None) or {}
        check_rope_kind(rope.get("rope_type"))
        check_full_attention(config)
        self.model = model.model
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scale = self.head_dim**-0.5
        self.inv_freq = self.model.rotary_emb.inv_freq.float()

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids)

    def _rotate(self, x: torch.Tensor, heads: int, positions: torch.Tensor, cos_sin) -> torch.Tensor:
        cos, sin = cos_sin  # [1, T, D]
        t = x.view(-1, heads, self.head_dim).transpose(0, 1)  # [H, T, D]
        half = self.head_dim // 2
        rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
        return (t * cos + rotated * sin).transpose(0, 1).reshape(x.shape)

    def qkv(self, layer: int, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor):
        block = self.model.layers[layer]
        attn = block.self_attn
        normed = block.input_layernorm(hidden)
        q, k, v = attn.q_proj(normed), attn.k_proj(normed), attn.v_proj(normed)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3: each head's q and k normalised before RoPE
            q = attn.q_norm(q.view(-1, self.num_heads, self.head_dim)).view(q.shape)
            k = attn.k_norm(k.view(-1, self.num_kv_heads, self.head_dim)).view(k.shape)
        cos_sin = self.model.rotary_emb(hidden, positions[None])
        q = self._rotate(q, self.num_heads, positions, cos_sin)
        k = self._rotate(k, self.num_kv_heads, positions, cos_sin)
        return q, k, v, hidden

    def finish(self, layer: int, attn_out: torch.Tensor, residual: torch.Tensor):
        block = self.model.layers[layer]
        x = residual + block.self_attn.o_proj(attn_out)
        x = x + block.mlp(block.post_attention_layernorm(x))
        return x, x

    def sum_over_ranks(self, per_token: torch.Tensor) -> torch.Tensor:
        return per_token  # one process holds every head


def cache_keyword(model: Any) -> str:
    """transformers' name for forward's cache argument: ``past_key_values``, ``cache`` from 5.24.
    (Under the other name the cache lands in ``**kwargs`` and is silently ignored.)"""
    params = inspect.signature(model.forward).parameters
    return "past_key_values" if "past_key_values" in params else "cache"


@torch.inference_mode()
def hf_prefill_kv(model: Any, token_ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A plain prefill's KV of ``token_ids`` (positions 0..T-1) by transformers itself: per layer
    [T, kv_heads, head_dim] keys (rotated) and values."""
    out = model(input_ids=token_ids[None], use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values  # transformers >= 5.24 names it cache
    layers = cache.layers if hasattr(cache, "layers") else None
    keys, values = [], []
    for i in range(model.config.num_hidden_layers):
        k, v = (layers[i].keys, layers[i].values) if layers is not None else cache[i]
        keys.append(k[0].transpose(0, 1).contiguous())
        values.append(v[0].transpose(0, 1).contiguous())
    return keys, values
