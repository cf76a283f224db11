"""Attention for a blend on a GPU: queries at scattered positions (the tokens a blend recomputes,
or every token up to its check layer) over a whole prompt's keys, each query seeing the keys up
to its own position.

PyTorch's scaled_dot_product_attention has no fused kernel for that mask: given it as a boolean
[queries, keys] mask it takes the kernel that materialises the scores (measured on an H200, 8,192
keys: 300 ms over 30 layers at a 15% selection, more than a full prefill; and 55 ms for one causal
layer of every token given 3-D tensors, which its fused kernels refuse). Here a
FlashAttention-style Triton kernel does it: a program takes ``BLOCK_M`` consecutive selected
queries (sorted by position, so their positions are close) of one head, walks the key blocks up
to the largest of their positions with an online softmax, and masks only inside the last blocks.
Grouped-query attention reads each query head's KV head in place (no repeated K and V).

The kernel is ours; its loop is the textbook online-softmax form (Dao et al., FlashAttention).
"""

from __future__ import annotations

import torch

try:  # Triton comes with torch's CUDA builds; a CPU host runs the blender's SDPA path instead.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None


def supports(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the kernel takes these queries [Tq, H, D] and keys [Tk, Hkv, D]: on a GPU with
    Triton, a power-of-two head size of 16 or more (its matrix units' tile), H a multiple of Hkv."""
    head_dim = q.shape[-1]
    return (
        triton is not None
        and q.device.type == "cuda"
        and head_dim >= 16
        and head_dim & (head_dim - 1) == 0
        and q.shape[1] % k.shape[1] == 0
    )


if triton is not None:

    @triton.jit
    def _selected_attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        q_pos_ptr,
        scale_log2,
        num_queries,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_ot,
        stride_oh,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        block = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // GROUP
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        valid = rows < num_queries
        dims = tl.arange(0, HEAD_DIM)
        # A padding row sees key 0 only: its softmax stays finite, and it is never stored.
        q_pos = tl.load(q_pos_ptr + rows, mask=valid, other=0)
        q = tl.load(
            q_ptr + rows[:, None] * stride_qt + head * stride_qh + dims[None, :], mask=valid[:, None], other=0.0
        )
        last = tl.max(q_pos, axis=0)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        for start in range(0, last + 1, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            in_range = cols <= last
            k = tl.load(
                k_ptr + cols[None, :] * stride_kt + kv_head * stride_kh + dims[:, None],
                mask=in_range[None, :],
                other=0.0,
            )
            scores = tl.dot(q, k, input_precision=PRECISION) * scale_log2  # [M, N], in log2 units
            scores = tl.where(cols[None, :] <= q_pos[:, None], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            p = tl.math.exp2(scores - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(
                v_ptr + cols[:, None] * stride_vt + kv_head * stride_vh + dims[None, :],
                mask=in_range[:, None],
                other=0.0,
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        acc = acc / l_i[:, None]
        tl.store(
            out_ptr + rows[:, None] * stride_ot + head * stride_oh + dims[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=valid[:, None],
        )


def selected_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """Queries [Tq, H, D] at positions ``q_pos`` ([Tq], ascending) over keys/values [Tk, Hkv, D]
    at positions 0..Tk-1, each query seeing the keys up to its position; [Tq, H*D]."""
    num_queries, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if not supports(q, k):
        raise ValueError(f"selected_attention: unsupported q {tuple(q.shape)} on {q.device}, k {tuple(k.shape)}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty_like(q)
    block_m, block_n = 64, 64
    grid = (triton.cdiv(num_queries, block_m), heads)
    _selected_attention_kernel[grid](
        q,
        k,
        v,
        out,
        q_pos.to(torch.int32).contiguous(),
        scale * 1.4426950408889634,  # log2(e): the kernel exponentiates base 2
        num_queries,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=heads // kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        # float32 inputs multiply as float32 (TF32 would round them: a CPU-equal blend needs them),
        # half-precision ones on the tensor cores as always
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
        num_stages=2,
    )
    return out.reshape(num_queries, heads * head_dim)
