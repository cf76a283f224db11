"""LocalGPUBackend: a copy of the hottest chunks in VRAM, beside the engine's own KV cache.

Why: a chunk in pinned host memory reaches vLLM's blocks over PCIe (~55 GB/s on an H200) and a
peer's GPU only through PCIe twice; a chunk in VRAM is loaded into the blocks device to device
and served to a peer on the same host over cuda_ipc or NVLink (BENCHMARKS.md, issue 21). The
price is VRAM that vLLM's KV cache does not get, so the tier is off by default (``local_gpu``)
and small when on (``max_local_gpu_size``, GB).

It is a cache over the CPU tier, never instead of it: a stored chunk is written to both (one
gather), a chunk the CPU tier evicts or drops leaves this tier too, and this tier evicts on its
own (LRU) without telling the controller, whose index knows the CPU and disk tiers only. The
one moment a chunk is here alone is a pull that landed in VRAM: it is loadable at once and
joins the CPU tier when its write-back (copy to host, checksum check) is done.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lmcache_p2p.device_checksum import device_checksums
from lmcache_p2p.keys import ChunkKey, payload_checksum
from lmcache_p2p.storage.cpu_tier import CpuTier, PinnedChunk, _Entry
from lmcache_p2p.storage.memory import PagePool
from lmcache_p2p.vocab import GPU


class GpuTier(CpuTier):
    """Chunks in a VRAM :class:`PagePool`, LRU, pinned like the CPU tier's. ``checksum_of``
    gives a chunk's checksum from the CPU tier (pages here are never hashed on the host)."""

    location = GPU

    def __init__(self, pool: PagePool, checksum_of: Callable[[ChunkKey], int | None]):
        super().__init__(pool)
        self._checksum_source = checksum_of

    def admit_pinned(self, key: ChunkKey, page: int, checksum: int | None) -> tuple[PinnedChunk, bool]:
        """Index ``page`` under ``key`` (if the key is held already, free it and use the held
        copy) and pin the entry, in one step: nothing can evict it in between. Also whether
        ``page`` is the one indexed (False: the held copy was pinned)."""
        with self._lock:
            admitted = self.admit(key, page, checksum)
            chunk = self.pin(key)
        assert chunk is not None  # admitted or held, under the lock
        return chunk, admitted

    def keep_checked_device_checksums(self, keys: list[ChunkKey], pages: list[int], sums: list[int]) -> None:
        """Keep each page's device checksum, computed here and equal to the holder's, on its key's
        entry if that is still the page (chunks that landed from a peer: a peer pulling them from
        here is then sent them). Only a checked number is kept: a holder vouches for nothing else."""
        with self._lock:
            for key, page, value in zip(keys, pages, sums, strict=True):
                entry = self._entries.get(key)
                if entry is not None and entry.page == page:
                    entry.device_checksum = value

    def _checksum_of(self, key: ChunkKey, entry: _Entry, data: torch.Tensor) -> int:
        if entry.checksum is None:
            checksum = self._checksum_source(key)
            # Not in the CPU tier (a write-back in flight, or dropped there): hash a host copy.
            entry.checksum = checksum if checksum is not None else payload_checksum(data.cpu().numpy())
        return entry.checksum

    def keep_device_checksums(self, keys: list[ChunkKey]) -> int:
        """Compute the device checksums of ``keys``' copies here (one launch) and keep each on its
        entry, so that a peer pulling them later is sent them without waiting (a page here is
        written once per entry: the number stays true while the entry lives). Returns how many
        were computed; keys the tier no longer holds, or whose number is kept already, are skipped."""
        # Each with its pin (the page is not reused while read; a use for LRU: they were just stored).
        todo: list[tuple[_Entry, PinnedChunk]] = []
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is None or entry.device_checksum is not None:
                    continue
                chunk = self.pin(key)
                assert chunk is not None  # under the lock, pin finds the entry just found
                todo.append((entry, chunk))
        try:
            sums = device_checksums([chunk.data for _, chunk in todo])
            for (entry, _), value in zip(todo, sums, strict=True):
                entry.device_checksum = value
        finally:
            for _, chunk in todo:
                chunk.release()
        return len(todo)
