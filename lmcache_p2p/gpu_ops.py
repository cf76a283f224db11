"""Moving KV chunks between an engine's paged cache and contiguous chunk pages.

A chunk page holds, for every layer in order, the chunk's blocks in order, each block as the
engine stores it (opaque bytes; DESIGN.md §4):

    page = layer_0[b_0] | layer_0[b_1] | ... | layer_1[b_0] | ...

``layers`` is the engine's cache: one tensor per layer whose first dimension is the block index
(vLLM's GPU flash layout ``[num_blocks, 2, block_size, heads, head_size]``, or any other per-block
shape). A batch of chunks moves in one call:

* on CUDA, with the kernels of csrc/ (``kv_kernels``): one launch for every chunk, layer and
  block of the batch, writing pages in GPU memory or straight into pinned host memory;
* elsewhere (CPU engines, no CUDA, pages in pageable memory), with torch indexing.

Inputs are checked before anything is launched, and errors name the argument, chunk and value.
Calls return when the copy is complete: a page is only indexed, or released to be reused, once
its bytes are final. The exceptions run on a stream of their own, beside the engine's forward
pass, and hand back a :class:`PendingCopy` to poll: :func:`gather_chunks_async` (the engine's
store path), :func:`scatter_layers_async` (layer-wise loads and loads beside the steps) and
:func:`scatter_staged_async` (loads beside the steps from host memory, by the copy engine).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from lmcache_p2p import kv_kernels

# What a KV cache is stored as. The copy itself is byte-wise, so this only guards against
# handing it something that is not a KV cache.
KV_DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    *(
        getattr(torch, name)
        for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
        if hasattr(torch, name)
    ),
)

_layer_tables: OrderedDict[tuple, torch.Tensor] = OrderedDict()  # layer addresses on the device, per cache
_side_streams: dict[tuple[str, torch.device], torch.cuda.Stream] = {}
_side_streams_lock = threading.Lock()


def side_stream(purpose: str, device: torch.device) -> torch.cuda.Stream:
    """The process's one CUDA stream for ``purpose`` on ``device`` ("store", "load",
    "write-back", "checksum"): work queued there runs beside the engine's forward pass, and
    each purpose keeps its own order."""
    key = (purpose, device)
    with _side_streams_lock:
        stream = _side_streams.get(key)
        if stream is None:
            stream = _side_streams[key] = torch.cuda.Stream(device)
    return stream


class PendingCopy:
    """A copy still running on a side stream. It holds the launch's inputs until done."""

    def __init__(self, event: torch.cuda.Event, keep: tuple):
        self.event = event
        self._keep = keep

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()

    def order_before(self, stream: torch.cuda.Stream) -> None:
        """Make work queued on ``stream`` from now on start after this copy (no host wait)."""
        stream.wait_event(self.event)


class _Batch:
    """A validated batch: the cache's geometry and each chunk's block ids."""

    def __init__(
        self,
        layers: Sequence[torch.Tensor],
        block_ids: Sequence[Sequence[int]],
        pages: Sequence[torch.Tensor],
        first_blocks: Sequence[int] | None,
    ):
        if not layers:
            raise ValueError("layers is empty: expected one KV cache tensor per layer")
        first = layers[0]
        for i, layer in enumerate(layers):
            if layer.dtype not in KV_DTYPES:
                raise TypeError(f"layers[{i}] is {layer.dtype}; a KV cache is one of {[str(d) for d in KV_DTYPES]}")
            if layer.dtype != first.dtype or layer.shape != first.shape or layer.device != first.device:
                raise ValueError(
                    f"layers[{i}] is {layer.dtype} {tuple(layer.shape)} on {layer.device}; layers[0] is "
                    f"{first.dtype} {tuple(first.shape)} on {first.device}: all layers must match"
                )
        if len(block_ids) != len(pages):
            raise ValueError(f"{len(block_ids)} block id lists for {len(pages)} pages: one list per chunk")
        self.layers, self.pages = list(layers), list(pages)
        self.num_blocks = first.shape[0]
        self.block_bytes = first[0].numel() * first.element_size() if self.num_blocks else 0
        self.blocks_per_chunk = len(block_ids[0]) if block_ids else 0
        self.block_ids: list[list[int]] = []
        for c, ids in enumerate(block_ids):
            ids = [int(b) for b in ids]
            if len(ids) != self.blocks_per_chunk or not ids:
                raise ValueError(
                    f"chunk {c} has {len(ids)} block ids; every chunk of a batch needs "
                    f"{self.blocks_per_chunk or 'at least one'}"
                )
            bad = [b for b in ids if not 0 <= b < self.num_blocks]
            if bad:
                raise IndexError(f"chunk {c}: block ids {bad} out of range [0, {self.num_blocks})")
            self.block_ids.append(ids)
        self.first_blocks = [0] * len(pages) if first_blocks is None else [int(f) for f in first_blocks]
        if len(self.first_blocks) != len(pages):
            raise ValueError(f"{len(self.first_blocks)} first_blocks for {len(pages)} chunks")
        for c, f in enumerate(self.first_blocks):
            if not 0 <= f <= self.blocks_per_chunk:
                raise ValueError(f"chunk {c}: first_block {f} outside [0, {self.blocks_per_chunk}]")
        need = len(layers) * self.blocks_per_chunk * self.block_bytes
        for c, page in enumerate(pages):
            if page.dtype != torch.uint8 or page.numel() != need or not page.is_contiguous():
                raise ValueError(
                    f"page {c} is {page.numel()} {page.dtype} elements"
                    f"{'' if page.is_contiguous() else ', not contiguous'}; {len(layers)} layers x "
                    f"{self.blocks_per_chunk} blocks of {tuple(first.shape[1:])} {first.dtype} need "
                    f"{need} contiguous uint8"
                )

    def kernel_ok(self) -> bool:
        """Whether the CUDA kernel can do this batch: cache on CUDA, blocks contiguous, and every
        page reachable from the device (GPU memory on the same device, or pinned host memory)."""
        first = self.layers[0]
        if not first.is_cuda or not all(layer.is_contiguous() for layer in self.layers):
            return False
        return all(p.device == first.device or (p.device.type == "cpu" and p.is_pinned()) for p in self.pages)

    def page_view(self, c: int) -> torch.Tensor:
        first = self.layers[0]
        return self.pages[c].view(first.dtype).view(len(self.layers), self.blocks_per_chunk, *first.shape[1:])


def backend(layers: Sequence[torch.Tensor]) -> str:
    """ "cuda-kernel" where the batch copies run as one kernel launch, else "torch"."""
    return "cuda-kernel" if layers and layers[0].is_cuda and kv_kernels.load() is not None else "torch"


# -- the public calls --------------------------------------------------------------------------------


def gather_chunks(
    layers: Sequence[torch.Tensor], block_ids: Sequence[Sequence[int]], pages: Sequence[torch.Tensor]
) -> None:
    """Copy each chunk's blocks (``block_ids[c]``, in order) from every layer into ``pages[c]``."""
    batch = _Batch(layers, block_ids, pages, None)
    if pages:
        _run(batch, to_pages=True)


def scatter_chunks(
    pages: Sequence[torch.Tensor],
    layers: Sequence[torch.Tensor],
    block_ids: Sequence[Sequence[int]],
    first_blocks: Sequence[int] | None = None,
) -> None:
    """Copy each page into its chunk's blocks of every layer. With ``first_blocks[c]`` only
    ``block_ids[c][first_blocks[c]:]`` are written (the engine computed the leading ones already,
    and they may be shared with other requests)."""
    batch = _Batch(layers, block_ids, pages, first_blocks)
    if pages:
        _run(batch, to_pages=False)


def gather_chunks_async(
    layers: Sequence[torch.Tensor], block_ids: Sequence[Sequence[int]], pages: Sequence[torch.Tensor], max_ctas: int = 0
) -> PendingCopy | None:
    """:func:`gather_chunks` without waiting: on CUDA the copy runs on a stream of its own after
    the work already queued on the current stream (the forward pass that wrote the KV), and the
    caller polls the returned copy before using the pages and keeps the blocks unchanged until it
    is done. Elsewhere it copies at once and returns None.

    With ``max_ctas`` the copy runs on that many CTAs, walking the blocks, so that it leaves the
    SMs to the forward pass beside it (0: one CTA per block, the whole GPU). A gather into host
    memory is bound by PCIe: on the H200, 4 CTAs move 52 GB/s, as many as one per block, and slow
    a GEMM beside them 9% instead of 34% (benchmarks/gpu/bench_store_overlap.py)."""
    batch = _Batch(layers, block_ids, pages, None)
    if not pages:
        return None
    module = _kernels_for(batch)
    if module is None:
        _run_torch(batch, to_pages=True)
        return None
    device = batch.layers[0].device
    stream = side_stream("store", device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        keep = _launch(module, batch, to_pages=True, max_ctas=max_ctas)
        event = torch.cuda.Event()
        event.record(stream)
    return PendingCopy(event, keep)


def scatter_layers_async(
    pages: Sequence[torch.Tensor],
    layers: Sequence[torch.Tensor],
    groups: Sequence[range],
    block_ids: Sequence[Sequence[int]],
    first_blocks: Sequence[int] | None,
    stream: torch.cuda.Stream,
) -> list[PendingCopy] | None:
    """A layer-wise load: one launch per group of layers (``groups``: index ranges of
    ``layers``, in page order), queued on ``stream``, each with its copy to wait for. The batch
    is checked once and its block ids and page addresses go to the device in one upload (a
    group's pages are the slices at its offset), so the host time does not grow with the
    layers. None where the kernels cannot do the batch: the caller copies group by group."""
    batch = _Batch(layers, block_ids, pages, first_blocks)
    if not pages:
        return []
    module = _kernels_for(batch)
    if module is None:
        return None
    device = batch.layers[0].device
    rows = _layer_meta_rows(batch, groups)
    # Tables first, on the current stream: building one synchronises it, which must not stall
    # the load stream behind copies already queued.
    tables = [_layer_table(batch.layers[g.start : g.stop]) for g in groups]
    host = torch.from_numpy(rows).pin_memory()
    vector = _vector_bytes(batch)
    copies = []
    with torch.cuda.stream(stream):
        meta = host.to(device, non_blocking=True)
        for row, table in zip(meta, tables, strict=True):
            module.copy_blocks(table, row, len(pages), batch.blocks_per_chunk, batch.block_bytes, vector, False, 0)
            event = torch.cuda.Event()
            event.record(stream)
            copies.append(PendingCopy(event, (host, meta, table)))
    return copies


def scatter_staged_async(
    pages: Sequence[torch.Tensor],
    layers: Sequence[torch.Tensor],
    block_ids: Sequence[Sequence[int]],
    first_blocks: Sequence[int] | None,
    stream: torch.cuda.Stream,
    staging: torch.Tensor,
) -> PendingCopy | None:
    """A whole load (every layer) from pages in pinned host memory, through ``staging``: a ring
    of chunk pages in GPU memory, ``[slots, >= page bytes]`` uint8. The GPU's copy engine brings
    each page across PCIe into a slot, with no SM time, so a forward pass beside it runs at full
    speed (the kernel reading host memory directly takes a CTA per block: every SM, for as long
    as PCIe takes); the kernel then scatters a ring's worth at a time device to device, in well
    under a millisecond. Everything runs on ``stream``, whose order keeps a slot from being
    refilled before the scatter reading it is done, so one ring serves one stream. Pages already
    in GPU memory are scattered from where they are. None where the kernels cannot do the batch."""
    batch = _Batch(layers, block_ids, pages, first_blocks)
    if not pages:
        return None
    module = _kernels_for(batch)
    if module is None:
        return None
    device = batch.layers[0].device
    page_bytes = batch.pages[0].numel()
    if staging.dtype != torch.uint8 or staging.dim() != 2 or staging.device != device:
        raise ValueError(
            f"staging is {staging.dtype} {tuple(staging.shape)} on {staging.device}: expected 2-D uint8 on {device}"
        )
    if staging.shape[0] < 1 or staging.shape[1] < page_bytes:
        raise ValueError(f"staging holds {staging.shape[0]} slots of {staging.shape[1]} bytes; a page is {page_bytes}")
    if staging.stride(1) != 1 or staging.stride(0) < staging.shape[1]:
        raise ValueError(f"staging's slots are not contiguous rows (strides {staging.stride()})")
    _layer_table(batch.layers)  # built (and its stream synchronised) here, not behind the queued copies
    # Chunks the engine computed whole write nothing: they neither cross PCIe nor take a slot.
    todo = [c for c, first in enumerate(batch.first_blocks) if first < batch.blocks_per_chunk]
    slots = staging.shape[0]
    keep: list[tuple] = []
    with torch.cuda.stream(stream):
        for lo in range(0, len(todo), slots):
            chunks = todo[lo : lo + slots]
            staged = []
            for j, c in enumerate(chunks):
                page = batch.pages[c]
                if page.device == device:
                    staged.append(page)
                else:
                    slot = staging[j, :page_bytes]
                    slot.copy_(page, non_blocking=True)
                    staged.append(slot)
            ids, firsts = [batch.block_ids[c] for c in chunks], [batch.first_blocks[c] for c in chunks]
            keep.append(_launch(module, _Batch(batch.layers, ids, staged, firsts), to_pages=False))
        event = torch.cuda.Event()
        event.record(stream)
    return PendingCopy(event, (staging, *keep))


def _layer_meta_rows(batch: _Batch, groups: Sequence[range]) -> np.ndarray:
    """The kernel's metadata for each group of layers: the row :func:`_launch` builds for the
    whole batch (block ids | page addresses | first blocks), with each page address moved to the
    group's slice of the page (``group.start`` planes in)."""
    plane_bytes = batch.blocks_per_chunk * batch.block_bytes
    n_pages = len(batch.pages)
    n_ids = n_pages * batch.blocks_per_chunk
    rows = np.empty((len(groups), n_ids + 2 * n_pages), dtype=np.int64)
    rows[:, :n_ids] = np.asarray(batch.block_ids, dtype=np.int64).reshape(-1)
    addresses = np.asarray([p.data_ptr() for p in batch.pages], dtype=np.int64)
    starts = np.asarray([g.start for g in groups], dtype=np.int64)
    rows[:, n_ids : n_ids + n_pages] = addresses[None, :] + starts[:, None] * plane_bytes
    rows[:, n_ids + n_pages :] = np.asarray(batch.first_blocks, dtype=np.int64)
    return rows


def gather_chunk(layers: Sequence[torch.Tensor], block_ids: Sequence[int], page: torch.Tensor) -> None:
    gather_chunks(layers, [block_ids], [page])


def scatter_chunk(
    page: torch.Tensor, layers: Sequence[torch.Tensor], block_ids: Sequence[int], first_block: int = 0
) -> None:
    scatter_chunks([page], layers, [block_ids], [first_block])


# -- the two paths -----------------------------------------------------------------------------------


def _kernels_for(batch: _Batch):
    """The compiled kernels when they can do this batch, else None (torch indexing)."""
    module = kv_kernels.load() if batch.layers[0].is_cuda else None
    return module if module is not None and batch.kernel_ok() else None


def _run(batch: _Batch, to_pages: bool) -> None:
    module = _kernels_for(batch)
    if module is not None:
        _run_kernel(module, batch, to_pages)
    else:
        _run_torch(batch, to_pages)


def _vector_bytes(batch: _Batch) -> int:
    """The widest copy (up to 16 bytes) every block and every address allows."""
    width = math.gcd(16, batch.block_bytes)
    for t in (*batch.layers, *batch.pages):
        width = math.gcd(width, t.data_ptr() % 16 or 16)
    return width


def _layer_table(layers: list[torch.Tensor]) -> torch.Tensor:
    key = (layers[0].device, *(layer.data_ptr() for layer in layers))
    table = _layer_tables.get(key)
    if table is None:
        table = torch.tensor(key[1:], dtype=torch.int64).to(layers[0].device)
        # Built once per cache and then read from any stream: complete before anyone uses it.
        torch.cuda.current_stream(layers[0].device).synchronize()
        _layer_tables[key] = table
        # Room for a table per layer (layer-wise loads copy one layer at a time) and then some:
        # building one synchronizes the stream, which must not happen on every step.
        while len(_layer_tables) > 512:
            _layer_tables.popitem(last=False)
    return table


def _launch(module, batch: _Batch, to_pages: bool, max_ctas: int = 0) -> tuple:
    """Queue the batch's one kernel on the current stream (on ``max_ctas`` CTAs; 0: one per
    block, the whole GPU); returns what must outlive it."""
    device = batch.layers[0].device
    ids = [b for chunk in batch.block_ids for b in chunk]
    host = torch.tensor(ids + [p.data_ptr() for p in batch.pages] + batch.first_blocks, dtype=torch.int64).pin_memory()
    meta = host.to(device, non_blocking=True)
    table = _layer_table(batch.layers)
    module.copy_blocks(
        table,
        meta,
        len(batch.pages),
        batch.blocks_per_chunk,
        batch.block_bytes,
        _vector_bytes(batch),
        to_pages,
        max_ctas,
    )
    return host, meta, table


def _run_kernel(module, batch: _Batch, to_pages: bool) -> None:
    _launch(module, batch, to_pages)
    # Complete before returning: a gathered page is indexed (and may be served to a peer) next,
    # and a scattered page may be released and reused next.
    torch.cuda.current_stream(batch.layers[0].device).synchronize()


def _run_torch(batch: _Batch, to_pages: bool) -> None:
    device = batch.layers[0].device
    for c, ids in enumerate(batch.block_ids):
        view = batch.page_view(c)
        skip = 0 if to_pages else batch.first_blocks[c]
        index = torch.tensor(ids[skip:], dtype=torch.long, device=device)
        if not index.numel():
            continue
        if to_pages:
            if view.device == device:
                for i, layer in enumerate(batch.layers):
                    torch.index_select(layer, 0, index, out=view[i])
            else:  # pages elsewhere (pageable host memory): gather on the device, then one copy
                view.copy_(torch.stack([layer.index_select(0, index) for layer in batch.layers]))
        else:
            src = view[:, skip:].to(device)
            for i, layer in enumerate(batch.layers):
                layer.index_copy_(0, index, src[i])
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
