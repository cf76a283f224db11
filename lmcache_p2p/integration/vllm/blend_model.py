"""Blending through vLLM's own Llama modules (issue 23; docs/blend.md).

:class:`VllmLlama` is the blender's model adapter (``blend.blender.BlendModel``) over a loaded
vLLM ``LlamaForCausalLM``: its embedding, each layer's fused-residual RMSNorms, ``qkv_proj``,
``rotary_emb``, ``o_proj`` and MLP, i.e. the engine's weights and its own RoPE. Only attention is
ours (scaled dot-product over the gathered KV): vLLM offers no way to run its attention kernels
outside a scheduled batch.

A KV connector is never handed the model; a general plugin can re-register the architecture
with a subclass that records itself (docs/blend.md, "The connector, next"). Until the connector
blends, tests reach the model through ``LLM.apply_model``.
"""

from __future__ import annotations

from typing import Any

import torch

from lmcache_p2p.blend.models import check_architecture
from lmcache_p2p.blend.rope import check_rope_kind


class VllmLlama:
    """blender.BlendModel over vLLM's LlamaForCausalLM. ``residual`` is vLLM's: the layers carry
    it beside the hidden states and fuse the add into the next RMSNorm."""

    def __init__(self, model: Any):
        check_architecture([type(model).__name__])
        inner = model.model
        if inner.start_layer != 0 or inner.end_layer != len(inner.layers):
            raise ValueError("blending needs every layer in this process (pipeline parallelism is not supported)")
        self.model = inner
        self.layers = list(inner.layers)
        attn = self.layers[0].self_attn
        self.rope = attn.rotary_emb
        config = getattr(model, "config", None)
        rope_parameters = getattr(config, "rope_parameters", None) or {}
        check_rope_kind(rope_parameters.get("rope_type"))
        self.num_layers = len(self.layers)
        self.num_heads = attn.num_heads  # this TP rank's
        self.num_kv_heads = attn.num_kv_heads
        self.head_dim = attn.head_dim
        self.scale = attn.scaling
        self.rotary_dim = self.rope.rotary_dim
        self.neox_style = self.rope.is_neox_style
        self.inv_freq = self.rope._compute_inv_freq(self.rope.base).float()  # llama3's rescaling included

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(token_ids)

    def qkv(self, layer: int, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor):
        block = self.layers[layer]
        attn = block.self_attn
        # vLLM's RMSNorm may write into its inputs: they are not used again here.
        if residual is None:
            residual = hidden.clone()
            normed = block.input_layernorm(hidden)
        else:
            normed, residual = block.input_layernorm(hidden, residual)
        qkv, _ = attn.qkv_proj(normed)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = attn.rotary_emb(positions, q.contiguous(), k.contiguous())
        return q, k, v.contiguous(), residual

    def finish(self, layer: int, attn_out: torch.Tensor, residual: torch.Tensor):
        block = self.layers[layer]
        out, _ = block.self_attn.o_proj(attn_out)
        hidden, residual = block.post_attention_layernorm(out, residual)
        return block.mlp(hidden), residual
