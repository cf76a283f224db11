"""LocalCPUBackend: chunk payloads in pool pages, LRU eviction, and pins.

A pin is a reference count held through a :class:`PinnedChunk` handle. A pinned chunk is never
evicted, and if it is removed (clear, move) while pinned it disappears from the index at once but
its page is only returned to the pool when the last pin is released, so a reader (a peer pulling
it, a disk write-behind, a scatter into vLLM blocks) never sees its page reused underneath it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

import torch

from lmcache_p2p.keys import ChunkKey, payload_checksum
from lmcache_p2p.storage.memory import PagePool
from lmcache_p2p.vocab import CPU

logger = logging.getLogger(__name__)

T = TypeVar("T")


class _Entry:
    __slots__ = ("page", "pins", "checksum", "device_checksum", "detached")

    def __init__(self, page: int, checksum: int | None):
        self.page = page
        self.pins = 0
        self.checksum = checksum
        # The GPU tier's: its page's device checksum (lmcache_p2p.device_checksum), for peers.
        self.device_checksum: int | None = None
        self.detached = False  # removed from the index while pinned; freed on last release


class PinnedChunk:
    """A chunk held against eviction and reuse until :meth:`release` (or the end of ``with``)."""

    __slots__ = ("key", "data", "location", "check", "device_checksum", "_checksum", "_compute_checksum", "_release")

    def __init__(
        self,
        key: ChunkKey,
        data: torch.Tensor,
        checksum: int | None = None,
        release: Callable[[], None] | None = None,
        compute_checksum: Callable[[], int] | None = None,
        location: str = "",
    ):
        self.key = key
        self.data = data  # uint8 tensor view of the payload; valid until release
        self.location = location  # the tier it was pinned in (the GPU tier's: data in VRAM)
        # A GPU tier chunk a peer wrote whose checksum check was still running when pinned: that
        # check's future (on the device, or the write-back's on the host), answering the hashes
        # that failed (VramLanding.commit_landed).
        self.check: concurrent.futures.Future | None = None
        # A GPU tier chunk's device checksum when it was taken behind its store (else None).
        self.device_checksum: int | None = None
        self._checksum = checksum
        self._compute_checksum = compute_checksum
        self._release = release

    @property
    def checksum(self) -> int:
        """XXH3 of the payload, computed on first use: a local retrieve never needs it, a disk
        write or a peer transfer does (~30 GB/s)."""
        if self._checksum is None:
            self._checksum = self._compute_checksum() if self._compute_checksum else payload_checksum(self.data.numpy())
        return self._checksum

    @property
    def checksum_known(self) -> bool:
        """Whether :attr:`checksum` is at hand (no hashing to do)."""
        return self._checksum is not None

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def __enter__(self) -> PinnedChunk:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class CpuTier:
    """Chunks in a :class:`PagePool`, least recently used first out."""

    location = CPU

    def __init__(self, pool: PagePool, on_evict: Callable[[ChunkKey], None] | None = None):
        self.pool = pool
        self.on_evict = on_evict
        self._entries: OrderedDict[ChunkKey, _Entry] = OrderedDict()  # LRU first
        self._lock = threading.RLock()
        self.evictions = 0
        # Chunks not stored because every page was pinned (nothing could be evicted): put() here,
        # and StorageManager.reserve_page for stores and pulls that fill pages in place.
        self.rejected_puts = 0
        self.pins_held = 0  # pins not yet released, over all chunks (a leak shows here)

    # -- queries ---------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def contains(self, key: ChunkKey) -> bool:
        return key in self._entries

    def keys(self) -> list[ChunkKey]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._entries)

    def pin_count(self, key: ChunkKey) -> int:
        entry = self._entries.get(key)
        return entry.pins if entry else 0

    def stats(self) -> dict[str, int]:
        return {
            "chunks": len(self._entries),
            "capacity_chunks": self.pool.num_pages,
            "free_pages": self.pool.free_pages,
            "pins_held": self.pins_held,
            "evictions": self.evictions,
        }

    @property
    def used_bytes(self) -> int:
        return len(self._entries) * self.pool.page_bytes

    # -- writes ----------------------------------------------------------------------------------

    def allocate(self) -> int | None:
        """A free page, evicting least recently used unpinned chunks if needed; None if all pinned."""
        with self._lock:
            page = self.pool.alloc()
            if page is not None:
                return page
            victim = next((k for k, e in self._entries.items() if e.pins == 0), None)
            if victim is None:
                return None
            entry = self._entries.pop(victim)
            self.evictions += 1
        if self.on_evict is not None:
            self.on_evict(victim)
        return entry.page

    def admit(self, key: ChunkKey, page: int, checksum: int | None = None) -> bool:
        """Index a filled page under ``key``; False (and the page freed) if the key is already held."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                self.pool.free(page)
                return False
            self._entries[key] = _Entry(page, checksum)
            return True

    def put(self, key: ChunkKey, payload: torch.Tensor, checksum: int | None = None) -> bool:
        """Copy a payload of exactly one page into the tier. False if held already or no room."""
        if payload.numel() * payload.element_size() != self.pool.page_bytes:
            raise ValueError(
                f"payload for {key} is {payload.numel() * payload.element_size()} bytes; "
                f"pages are {self.pool.page_bytes} bytes (one chunk of this layout)"
            )
        if key in self._entries:
            self.touch(key)
            return False
        page = self.allocate()
        if page is None:
            self.rejected_puts += 1
            logger.debug("CPU tier full of pinned chunks; dropped %s", key)
            return False
        self.pool.page(page).copy_(payload.reshape(-1).view(torch.uint8))
        return self.admit(key, page, checksum)

    def while_held(self, key: ChunkKey, action: Callable[[], T]) -> T | None:
        """``action()`` if the tier holds ``key``, with nothing evicting or removing it meanwhile;
        None if it does not hold it."""
        with self._lock:
            return action() if key in self._entries else None

    def touch(self, key: ChunkKey) -> None:
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)

    def remove(self, key: ChunkKey) -> bool:
        """Drop a chunk from the index now; a pinned one keeps its page until the last release."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            if entry.pins:
                entry.detached = True
            else:
                self.pool.free(entry.page)
            return True

    def clear(self) -> list[ChunkKey]:
        with self._lock:
            keys = list(self._entries)
            for key in keys:
                self.remove(key)
            return keys

    # -- reads -----------------------------------------------------------------------------------

    def pin(self, key: ChunkKey) -> PinnedChunk | None:
        """Hold a chunk (counts as a use for LRU). None if the tier does not hold it."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            entry.pins += 1
            self.pins_held += 1
        data = self.pool.page(entry.page)
        chunk = PinnedChunk(
            key,
            data,
            entry.checksum,
            release=lambda: self._unpin(entry),
            compute_checksum=lambda: self._checksum_of(key, entry, data),
            location=self.location,
        )
        chunk.device_checksum = entry.device_checksum
        return chunk

    def _checksum_of(self, key: ChunkKey, entry: _Entry, data: torch.Tensor) -> int:
        # Cached on the entry: computed at most once per stored chunk, outside the lock (the
        # caller's pin keeps the page from being reused meanwhile).
        if entry.checksum is None:
            entry.checksum = payload_checksum(data.numpy())
        return entry.checksum

    def _unpin(self, entry: _Entry) -> None:
        with self._lock:
            entry.pins -= 1
            self.pins_held -= 1
            if entry.pins == 0 and entry.detached:
                self.pool.free(entry.page)

    def get(self, key: ChunkKey) -> bytes | None:
        """A copy of the payload (tests, small tools); hot paths use :meth:`pin`."""
        chunk = self.pin(key)
        if chunk is None:
            return None
        with chunk:
            return chunk.data.numpy().tobytes()
