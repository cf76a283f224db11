"""What a chunk store is to the code that uses it: an index of chunk hashes across the local tiers
and the lifecycle of the pages chunks live in, behind one small protocol (:class:`ChunkStore`),
the queue of admit/evict records it keeps for each reader (:class:`StorageEventQueue`), and what
peer pulls need beyond it to land pages (:class:`PullLanding`).

:class:`~lmcache_p2p.storage.manager.StorageManager` is the store; the write-back of pulls that
landed in VRAM (``storage.landing``) writes into a :class:`ChunkStore`, and so depends on this
protocol, never on the manager. So does the worker: only ``worker.build_engine``, which builds the
store, sees the manager; it hands the worker the store twice, as a :class:`ChunkStore` and as
the :class:`PullLanding` of its pools.

Page lifecycle: a producer that fills a page in place (a kernel gather, a peer pull, the remote
tier's fetch) ``reserve_page``\\s one, fills it, then ``commit_page``\\s it under its chunk hash,
or ``abandon_page``\\s it when the fill failed. A reader ``pin``\\s a chunk: its page is neither
evicted nor reused until the pin is released.

Events: every change of what a location holds is queued as a
:class:`~lmcache_p2p.vocab.StorageEvent` on each reader's queue, by whichever thread made the
change; each reader drains its own queue on its own thread (``take_events``), as vLLM's block
pool queues its KV events for the scheduler to take. No reader's code runs on the thread that
stored or evicted a chunk.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from lmcache_p2p.keys import ChunkKey
from lmcache_p2p.storage.cpu_tier import PinnedChunk
from lmcache_p2p.storage.gpu_tier import GpuTier
from lmcache_p2p.storage.memory import PagePool
from lmcache_p2p.vocab import CPU, StorageEvent


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """The longest run of leading chunks held locally, and where each one is."""

    locations: tuple[str, ...]

    @property
    def num_chunks(self) -> int:
        return len(self.locations)


class StorageEventQueue:
    """One reader's admit/evict records, in the order they happened. Written by any thread that
    changes a tier (the engine's store path, the disk writer, a pull's write-back), drained by its
    one reader: a deque's append and popleft are atomic, so neither side takes a lock."""

    def __init__(self) -> None:
        self._events: deque[StorageEvent] = deque()

    def put(self, event: StorageEvent) -> None:
        self._events.append(event)

    def take_events(self) -> list[StorageEvent]:
        """Everything queued so far, oldest first (events queued meanwhile wait for the next call)."""
        events = self._events
        return [events.popleft() for _ in range(len(events))]

    def __len__(self) -> int:
        return len(self._events)


class ChunkStore(Protocol):
    """A rank's chunks by hash (the caller hashed the tokens; the store never sees them)."""

    chunk_size: int
    page_bytes: int
    # The layout's exchange digest: what peers compare at hello and in every pull, so engines
    # with other layouts or key rules never exchange chunks.
    fingerprint: int

    def key(self, chunk_hash: int) -> ChunkKey: ...

    @property
    def locations(self) -> list[str]:
        """The locations chunks are held at here (LocalCPUBackend, LocalDiskBackend), as the
        controller names them."""
        ...

    # -- lookup ----------------------------------------------------------------------------------

    def lookup_prefix(self, chunk_hashes: Sequence[int]) -> PrefixHit:
        """How many leading chunks are held here, and where (the first miss ends the prefix)."""
        ...

    def location_of(self, chunk_hash: int) -> str | None: ...

    def holds(self, chunk_hash: int, location: str) -> bool: ...

    def held_hashes(self, location: str) -> np.ndarray:
        """Every chunk hash held at ``location`` (a re-sync's full key set); ValueError for a
        location that is none of :attr:`locations`' kinds."""
        ...

    def pin(self, chunk_hash: int, gpu: bool = False) -> PinnedChunk | None:
        """The chunk's payload, held (not evicted, its page not reused) until released."""
        ...

    # -- pages -----------------------------------------------------------------------------------

    def reserve_page(self) -> tuple[int, torch.Tensor] | None:
        """A free CPU page to fill in place; None when every page is pinned."""
        ...

    def commit_page(
        self, chunk_hash: int, page: int, checksum: int | None = None, location: str = CPU, from_remote: bool = False
    ) -> bool:
        """Index a reserved page once filled; False (the page given back) if the chunk was held."""
        ...

    def abandon_page(self, page: int) -> None:
        """Give back a reserved page whose fill failed."""
        ...

    # -- removal and events ----------------------------------------------------------------------

    def remove(self, chunk_hash: int, location: str | None = None) -> list[str]: ...

    def clear(self, location: str | None = None) -> int: ...

    def record_events(self) -> StorageEventQueue:
        """A new queue of this store's admits and evicts from now on, for one reader to drain."""
        ...

    def stats(self) -> dict:
        """Each tier's counters, for /status and the health command."""
        ...


class PullLanding(Protocol):
    """What a peer pull needs of a rank's store beyond :class:`ChunkStore` (whose
    ``reserve_page``/``commit_page``/``abandon_page`` it fills CPU pages with) to land pages: the
    pools a holder may write into, and the GPU tier's side of a pull that landed in VRAM."""

    @property
    def cpu_pool(self) -> PagePool:
        """The pool ``reserve_page``'s pages are in: the transports register it, and a pull reads
        the pages it landed there to check them."""
        ...

    @property
    def gpu_tier(self) -> GpuTier | None:
        """The GPU tier a same-host holder may write the engine's prefix pulls into (``local_gpu``),
        else None; the transports register and reserve its pages."""
        ...

    def commit_landed(
        self,
        chunk_hashes: Sequence[int],
        gpu_pages: Sequence[int],
        cpu_pages: Sequence[int],
        checksums: Sequence[int],
        device_checksums: Sequence[int] | None = None,
    ) -> None:
        """Chunks a holder wrote into GPU tier pages: loadable now, written back behind into the
        reserved ``cpu_pages`` (:meth:`VramLanding.commit_landed`)."""
        ...

    def abandon_gpu_page(self, page: int) -> None:
        """Give back a GPU tier page a pull landed in but does not commit."""
        ...
