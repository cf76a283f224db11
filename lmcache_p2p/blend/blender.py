"""CacheBlend: KV for a prompt made of separately cached segments, fixed up by recomputing a few
tokens in every layer (issue 23).

Segments cached on their own lack each other: a document's KV was computed without the text
before it, so reusing it as is (``naive``) makes later layers attend to KV that never saw its
context. Recomputing everything costs a full prefill. CacheBlend recomputes only the tokens whose
KV deviates most from what a full prefill would give, found at a cheap early layer:

1. Layers up to ``check_layer``: every token is recomputed (cheap: a layer or two), which gives
   the hidden states the check needs; their fresh KV replaces the cached.
2. At ``check_layer``: every token's K is compared with its cached K; the
   ``ratio`` share of cached tokens deviating most (squared L2 over heads and dims) is selected,
   plus every token that was not cached at all (separators, new text): those have no KV to reuse.
3. From there on, only the selected tokens flow through the layers: their Q, K, V are computed
   from their own hidden states, their K and V replace the cached ones, and their queries attend
   to the whole prompt's KV (cached and fresh) under the causal mask.

The result is every layer's KV for every token: the selected tokens' recomputed, the others'
cached (re-rotated to their new positions, :mod:`lmcache_p2p.blend.rope`). The engine then
computes the prompt's tail. ``ratio`` 1.0 is a full recompute (the KV equals a plain prefill's
up to rounding: a test holds it to that); 0.0 with ``check_layer`` 0 is naive reuse.

The model is reached through :class:`BlendModel`: the engine's own weights and modules, one
adapter per model family (blend/models.py). Attention is ours, over the gathered KV (vLLM has no
public way to run its attention kernels outside a scheduled batch; see docs/blend.md): on a GPU a
Triton kernel (:mod:`lmcache_p2p.blend.sparse_attention`), elsewhere PyTorch's SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from lmcache_p2p.blend import sparse_attention
from lmcache_p2p.blend.timing import NoTimer, PhaseTimer


class BlendModel(Protocol):
    """What blending needs of a decoder-only RoPE model. Tensors are 2-D ``[tokens, features]``;
    ``residual`` is whatever the model's layers carry between them (None before the first)."""

    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int
    scale: float  # attention's softmax scale

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor: ...

    def qkv(
        self, layer: int, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v, residual) of ``layer`` for these tokens: the input norm applied, q and k
        rotated at ``positions``; q [T, heads*dim], k and v [T, kv_heads*dim]."""
        ...

    def finish(self, layer: int, attn_out: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) after the attention output projection, the post-attention norm and
        the MLP of ``layer``."""
        ...

    def sum_over_ranks(self, per_token: torch.Tensor) -> torch.Tensor:
        """A per-token quantity summed over tensor-parallel ranks (each holds some heads): every
        rank must select the same tokens, or their row-parallel all-reduces see other shapes."""
        ...


@dataclass
class BlendResult:
    keys: list[torch.Tensor]  # per layer [tokens, kv_heads, head_dim]
    values: list[torch.Tensor]
    recomputed: torch.Tensor  # indices of the tokens recomputed past the check layer (ascending)
    deviation: torch.Tensor | None  # per token at the check layer (cached tokens), None if not reached


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, kv_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """Queries [Tq, H, D] over keys/values [Tk, Hkv, D], each query seeing the keys at positions
    up to its own; [Tq, H*D]. ``kv_pos`` is 0..Tk-1 and ``q_pos`` ascending (a blend's rows). On a
    GPU one Triton kernel serves every layer, all tokens or a selection (sparse_attention.py
    says why); elsewhere PyTorch's SDPA, causal when every position asks."""
    if sparse_attention.supports(q, k):
        return sparse_attention.selected_attention(q, k, v, q_pos, scale)
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads != kv_heads:  # grouped-query attention: each KV head serves heads/kv_heads queries
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    # 4-D [1, heads, tokens, dim]: SDPA's fused kernels take nothing else.
    q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))
    if q.shape[0] == k.shape[0]:
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale)
    else:
        mask = kv_pos[None, :] <= q_pos[:, None]  # [Tq, Tk], True: may attend
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1).reshape(q.shape[0], -1)


@torch.inference_mode()
def blend(
    model: BlendModel,
    token_ids: torch.Tensor,
    cached_keys: list[torch.Tensor],
    cached_values: list[torch.Tensor],
    cached: torch.Tensor,
    ratio: float,
    check_layer: int = 1,
    timer: PhaseTimer | NoTimer | None = None,
) -> BlendResult:
    """Every layer's KV for ``token_ids`` (positions 0..T-1) from cached KV: ``cached_keys`` /
    ``cached_values`` per layer [T, kv_heads, head_dim], already at these positions (anything
    where ``cached`` [T] bool is False), fixed up as the module docstring says. ``timer``: marks
    the phases (layers up to the check, the selection, then each later layer's qkv / attention /
    MLP summed)."""
    timer = timer or NoTimer()
    n = token_ids.shape[0]
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"blend_recompute_ratios: {ratio} is not within 0..1")
    if not 0 <= check_layer < model.num_layers:
        raise ValueError(f"blend_check_layers: layer {check_layer} is not within 0..{model.num_layers - 1}")
    positions = torch.arange(n, device=token_ids.device)
    cached = cached.to(token_ids.device)
    shape = (n, model.num_kv_heads, model.head_dim)
    keys = [k.clone() for k in cached_keys]
    values = [v.clone() for v in cached_values]
    hidden, residual = model.embed(token_ids), None
    rows = positions  # the tokens flowing through the layers
    deviation = None
    timer.mark("copy")
    for layer in range(model.num_layers):
        q, k, v, residual = model.qkv(layer, hidden, residual, positions[rows])
        k, v = k.view(-1, *shape[1:]), v.view(-1, *shape[1:])
        # The tokens flowing here get their fresh KV (up to the check layer: every token).
        keys[layer][rows], values[layer][rows] = k, v
        if layer > check_layer:
            timer.mark("qkv")
        if layer == check_layer:
            # K deviation of every cached token; uncached tokens are recomputed whatever it is.
            deviation = model.sum_over_ranks((k.float() - cached_keys[layer].float()).square().sum(dim=(1, 2)))
            deviation = torch.where(cached, deviation, torch.full_like(deviation, float("inf")))
            reused = int(cached.sum())
            chosen = min(n, int(round(reused * ratio)) + (n - reused))
            rows = torch.sort(torch.topk(deviation, chosen).indices).values
            q, residual = q[rows], residual[rows]
            timer.mark("select")
        out = attend(
            q.view(-1, model.num_heads, model.head_dim),
            keys[layer],
            values[layer],
            positions[rows],
            positions,
            model.scale,
        )
        if layer > check_layer:
            timer.mark("attention")
        hidden, residual = model.finish(layer, out, residual)
        timer.mark("mlp" if layer > check_layer else "to check layer")
    return BlendResult(keys=keys, values=values, recomputed=rows, deviation=deviation)
