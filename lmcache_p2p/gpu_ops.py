"""Moving one chunk's KV between an engine's paged cache and a contiguous chunk page.

A chunk page holds, for every layer in order, the chunk's blocks in order, each block as the
engine stores it (opaque bytes; DESIGN.md §4):

    page = layer_0[b_0] | layer_0[b_1] | ... | layer_1[b_0] | ...

``layers`` is the engine's cache: one tensor per layer whose first dimension is the block index
(vLLM's GPU flash layout ``[num_blocks, 2, block_size, heads, head_size]``, or any other per-block
shape). This module is the torch implementation, used on CPU and wherever the CUDA kernels of
csrc/ are not built; it writes straight into the page (``index_select(out=...)``) with no
temporary copy.
"""

from __future__ import annotations

from typing import Sequence

import torch


def _page_view(page: torch.Tensor, layers: Sequence[torch.Tensor], num_blocks: int) -> torch.Tensor:
    first = layers[0]
    block_elems = first[0].numel()
    need = len(layers) * num_blocks * block_elems * first.element_size()
    if page.dtype != torch.uint8 or page.numel() != need:
        raise ValueError(f"chunk page is {page.numel()} {page.dtype} elements; {len(layers)} layers x "
                         f"{num_blocks} blocks of {tuple(first.shape[1:])} {first.dtype} need {need} uint8")
    return page.view(first.dtype).view(len(layers), num_blocks, *first.shape[1:])


def _block_index(block_ids, layers: Sequence[torch.Tensor]) -> torch.Tensor:
    ids = torch.as_tensor(block_ids, dtype=torch.long, device=layers[0].device)
    num_blocks = layers[0].shape[0]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise IndexError(f"block ids must be in [0, {num_blocks}); got {ids.tolist()}")
    return ids


def gather_chunk(layers: Sequence[torch.Tensor], block_ids, page: torch.Tensor) -> None:
    """Copy the chunk's blocks from every layer into ``page``."""
    ids = _block_index(block_ids, layers)
    view = _page_view(page, layers, ids.numel())
    for i, layer in enumerate(layers):
        torch.index_select(layer, 0, ids, out=view[i])


def scatter_chunk(page: torch.Tensor, layers: Sequence[torch.Tensor], block_ids, first_block: int = 0) -> None:
    """Copy a chunk page into the given blocks of every layer.

    ``block_ids`` are all the chunk's blocks; with ``first_block`` only ``block_ids[first_block:]``
    are written (the engine already computed the leading ones, and they may be shared)."""
    ids = _block_index(block_ids, layers)
    view = _page_view(page, layers, ids.numel())
    if first_block:
        ids, view = ids[first_block:], view[:, first_block:]
    for i, layer in enumerate(layers):
        layer.index_copy_(0, ids, view[i])
