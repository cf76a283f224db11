"""Blending through vLLM's own modules (docs/blend.md).

:class:`VllmDecoder` is the blender's model adapter (``blend.blender.BlendModel``) over a loaded
vLLM ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or ``Qwen3ForCausalLM`` (one layer layout): its
embedding, each layer's fused-residual RMSNorms, ``qkv_proj`` (with Qwen2's biases), Qwen3's
per-head ``q_norm``/``k_norm``, ``rotary_emb``, ``o_proj`` and MLP, i.e. the engine's weights and
its own RoPE. Only attention is ours (blend.blender.attend): vLLM offers no way to run its
attention kernels outside a scheduled batch.

A KV connector is never handed the model. With ``enable_blending`` our vLLM plugin re-registers
each supported architecture as this module's class of the same name: vLLM's class, unchanged but
for recording each instance it builds, which :func:`tracked_model` returns to the connector's
worker half (built after the model loads). The classes are made on first access (module
``__getattr__``), so importing this module needs no vLLM.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from lmcache_p2p.blend.support import check_architecture, check_full_attention, check_rope_kind


class VllmDecoder:
    """blender.BlendModel over vLLM's Llama, Qwen2 or Qwen3. ``residual`` is vLLM's: the layers carry
    it beside the hidden states and fuse the add into the next RMSNorm. Under tensor parallelism
    each rank runs the blend on its own heads, in step with the others: the embedding and the
    row-parallel projections all-reduce inside vLLM's modules, and the check layer's deviation is
    summed over ranks so that every rank recomputes the same tokens."""

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
        if config is not None:
            check_full_attention(config)
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
        if getattr(attn, "q_norm", None) is not None:  # Qwen3 (and Qwen2 with qk_norm): per head, before RoPE
            q = attn.q_norm(q.reshape(-1, self.num_heads, self.head_dim)).reshape(q.shape[0], -1)
            k = attn.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)).reshape(k.shape[0], -1)
        q, k = attn.rotary_emb(positions, q.contiguous(), k.contiguous())
        return q, k, v.contiguous(), residual

    def finish(self, layer: int, attn_out: torch.Tensor, residual: torch.Tensor):
        block = self.layers[layer]
        out, _ = block.self_attn.o_proj(attn_out)
        hidden, residual = block.post_attention_layernorm(out, residual)
        return block.mlp(hidden), residual

    def sum_over_ranks(self, per_token: torch.Tensor) -> torch.Tensor:
        from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce

        if get_tensor_model_parallel_world_size() == 1:
            return per_token
        return tensor_model_parallel_all_reduce(per_token.contiguous())


_built: list[weakref.ref] = []
_built_lock = threading.Lock()
_tracking_classes: dict[str, type] = {}


def tracked_model() -> Any:
    """The newest live model built by the tracking class in this process, or None."""
    with _built_lock:
        for ref in reversed(_built):
            model = ref()
            if model is not None:
                return model
    return None


# Where vLLM keeps each supported architecture's class (blend.support.SUPPORTED).
VLLM_MODULES = {
    "LlamaForCausalLM": "vllm.model_executor.models.llama",
    "Qwen2ForCausalLM": "vllm.model_executor.models.qwen2",
    "Qwen3ForCausalLM": "vllm.model_executor.models.qwen3",
}


def _make_tracking_class(name: str) -> type:
    import importlib

    base = getattr(importlib.import_module(VLLM_MODULES[name]), name)

    # vLLM reads the constructor's signature to decide how to call it: it must name vllm_config.
    def __init__(self: Any, *, vllm_config: Any, prefix: str = "", **kwargs: Any) -> None:
        base.__init__(self, vllm_config=vllm_config, prefix=prefix, **kwargs)
        with _built_lock:
            _built.append(weakref.ref(self))

    # The same name as vLLM's: vLLM keys some behaviour on it.
    tracking = type(name, (base,), {"__init__": __init__, "__module__": __name__})
    return tracking


def __getattr__(name: str) -> Any:
    if name not in VLLM_MODULES:
        raise AttributeError(name)
    if name not in _tracking_classes:
        _tracking_classes[name] = _make_tracking_class(name)
    return _tracking_classes[name]
