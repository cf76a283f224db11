"""Moving cached keys to new positions: RoPE re-rotation by a position delta.

RoPE rotates each pair of a key's dimensions by ``position * inv_freq[j]``. Rotations compose,
R(p + d) = R(d) R(p), so a key computed at position p is the key at p + d after one more rotation
by d, exactly (up to the arithmetic's rounding), without the pre-RoPE key. That holds for the
RoPE kinds whose angle is linear in the position: the original (``default``), ``linear`` and
Llama 3's (``llama3`` only rescales ``inv_freq``). It does not hold for YaRN (cos and sin are
also scaled, by ``mscale``) nor for dynamic NTK (the frequencies depend on the sequence length):
:func:`~lmcache_p2p.blend.support.check_rope_kind` refuses those by name.

Segments are stored normalised (their first token at position 0: rotated by ``-start`` when
stored) and rotated by ``+new_start`` when reused. Angles are computed in float32 from the
model's own ``inv_freq`` (vLLM: ``rotary_emb._compute_inv_freq(rotary_emb.base)``; it includes
Llama 3's rescaling), and keys rotated in float32, then cast back.
"""

from __future__ import annotations

import torch


def rotate_keys(
    keys: torch.Tensor,
    delta: torch.Tensor | int,
    inv_freq: torch.Tensor,
    rotary_dim: int | None = None,
    neox_style: bool = True,
) -> torch.Tensor:
    """``keys`` ([tokens, heads, head_dim]) rotated by ``delta`` positions (an int, or one per
    token), a new tensor of the same dtype. Only the first ``rotary_dim`` dimensions of each head
    rotate (default: all). ``neox_style``: pairs are (j, j + rotary_dim/2), as Llama's; else
    (2j, 2j + 1)."""
    tokens, _, head_dim = keys.shape
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    half = rotary_dim // 2
    if inv_freq.shape != (half,):
        raise ValueError(f"inv_freq has shape {tuple(inv_freq.shape)}, expected ({half},) for rotary_dim {rotary_dim}")
    if isinstance(delta, int):
        delta = torch.full((tokens,), delta, dtype=torch.float32, device=keys.device)
    angle = delta.to(keys.device, torch.float32)[:, None] * inv_freq.to(keys.device, torch.float32)[None, :]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]  # [tokens, 1, half]
    k = keys.to(torch.float32)
    rot = k[..., :rotary_dim]
    if neox_style:
        x1, x2 = rot[..., :half], rot[..., half:]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    out = torch.cat((rotated, k[..., rotary_dim:]), dim=-1) if rotary_dim < head_dim else rotated
    return out.to(keys.dtype)
