"""vLLM's paged KV tensors seen as *block planes*, and the layout fingerprint they imply.

A block plane is a tensor whose first dimension is vLLM's block id, so one block's bytes in that
plane are ``plane[block_id]``. Chunk pages are built from planes (``gpu_ops``), so the connector
does not need to know an attention backend's in-block layout, only where the block dimension is:

* ``[num_blocks, ...]`` (GPU flash ``[num_blocks, 2, block, heads, dim]``; CPU
  ``[num_blocks, heads, block, 2*dim]``): the tensor is one plane;
* ``[2, num_blocks, ...]`` (K and V stored apart): one plane per leading index.

Anything else is refused with the tensor's shape in the message rather than guessed at.

A plane's other dimensions are taken in memory order: vLLM >= 0.27 hands a GPU layer's KV over as
a view whose logical order (``[num_blocks, heads, block, 2*dim]``) is not its memory order
(``[num_blocks, block, heads, 2*dim]``), and the copy kernels need a block to be one contiguous run.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from lmcache_p2p.keys import KEY_FORMAT, LayoutFingerprint


class UnsupportedKVLayout(ValueError):
    pass


def block_planes(kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> list[torch.Tensor]:
    """Every layer's planes, in layer order then plane order."""
    planes = [plane for name, tensor in kv_caches.items() for plane in _layer_planes(name, tensor, num_blocks)]
    if not planes:
        raise UnsupportedKVLayout("vLLM registered no KV cache tensors")
    first = planes[0]
    for plane in planes[1:]:
        if plane.shape[1:] != first.shape[1:] or plane.dtype != first.dtype:
            raise UnsupportedKVLayout(
                f"layers differ in block shape or dtype ({tuple(first.shape[1:])} {first.dtype} vs "
                f"{tuple(plane.shape[1:])} {plane.dtype}); hybrid models are not supported"
            )
    return planes


def planes_by_layer(kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> dict[str, range]:
    """Each layer's block planes as indices into :func:`block_planes`'s list (one plane, or
    two where K and V are stored apart), in the same order."""
    out: dict[str, range] = {}
    first = 0
    for name, tensor in kv_caches.items():
        count = len(_layer_planes(name, tensor, num_blocks))
        out[name] = range(first, first + count)
        first += count
    return out


def _layer_planes(name: str, tensor: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    """One layer's planes: the tensor itself (block dimension first), or one per leading index
    (block dimension second: K and V apart); anything else is refused, naming the shape."""
    if tensor.dim() >= 2 and tensor.shape[0] == num_blocks:
        return [_in_memory_order(tensor)]
    if tensor.dim() >= 3 and tensor.shape[1] == num_blocks:
        return [_in_memory_order(plane) for plane in tensor.unbind(0)]
    raise UnsupportedKVLayout(
        f"KV cache of layer {name!r} has shape {tuple(tensor.shape)}; expected the block "
        f"dimension ({num_blocks} blocks) first or second"
    )


def _in_memory_order(plane: torch.Tensor) -> torch.Tensor:
    """The plane with its in-block dimensions ordered as they lie in memory (largest stride
    first); the block dimension stays first. A contiguous plane comes back as it is."""
    strides = plane.stride()
    order = sorted(range(1, plane.dim()), key=lambda d: -strides[d])
    return plane if order == list(range(1, plane.dim())) else plane.permute(0, *order)


def fingerprint(
    planes: list[torch.Tensor], model: str, block_size: int, tp_size: int, tp_rank: int
) -> LayoutFingerprint:
    first = planes[0]
    return LayoutFingerprint(
        model=model,
        dtype=str(first.dtype).removeprefix("torch."),
        block_size=block_size,
        block_shape=tuple(first.shape[1:]),
        block_stride=tuple(first.stride()[1:]),
        num_layers=len(planes),
        tp_size=tp_size,
        tp_rank=tp_rank,
        key_format=KEY_FORMAT,  # our keys carry salts, adapters and images: only such engines share
    )
