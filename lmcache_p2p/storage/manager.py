"""StorageManager: one engine rank's chunk store (:class:`ChunkStore`) across the GPU, CPU and
disk tiers and a remote store.

It answers the scheduler's question ("how much of this prefix do we hold locally?") for chunk
hashes its caller computed (it never sees tokens), hands out pinned chunk payloads (promoting
disk hits into the CPU tier), reserves and commits the pages producers fill in place, writes CPU
admits behind to disk and to the remote store (``remote_url``; the remote tier fetches a prefix
into the CPU tier through :meth:`reserve_page` and :meth:`commit_page`:
``RemoteTier.fetch_prefix_into``), and queues an admit/evict :class:`StorageEvent` for every
change of what a location holds on each reader's queue (:meth:`record_events`): the worker
drains its queue on its loop and reports to the controller, which is how the mesh knows who holds
what.

With ``local_gpu`` a :class:`GpuTier` keeps a VRAM copy of the hottest CPU chunks (gpu_tier's
docstring says why and at what price). Peer pulls that land in VRAM are the business of
:attr:`landing` (:class:`VramLanding`: committed there at once, checked, written back to the CPU
tier behind the request); the store routes GPU-tier pins and removals through it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
import torch

from lmcache_p2p.config import LMCacheConfig
from lmcache_p2p.keys import ChunkKey, LayoutFingerprint
from lmcache_p2p.remote.connect import open_store
from lmcache_p2p.remote.tier import RemoteTier
from lmcache_p2p.storage.chunk_store import PrefixHit, StorageEventQueue
from lmcache_p2p.storage.cpu_tier import CpuTier, PinnedChunk
from lmcache_p2p.storage.disk_tier import DiskTier
from lmcache_p2p.storage.gpu_tier import GpuTier
from lmcache_p2p.storage.hashing import StoreHasher
from lmcache_p2p.storage.landing import VramLanding
from lmcache_p2p.storage.memory import PagePool
from lmcache_p2p.vocab import CPU, DISK, GPU, StorageEvent
from lmcache_p2p.write_behind import WriteBehind

logger = logging.getLogger(__name__)


class StorageManager:
    """The :class:`ChunkStore` of one engine rank: its tiers' index and page lifecycle, the
    write-behind of CPU admits, and the event queues of its readers; and the :class:`PullLanding`
    its peer pulls land through, once it has a CPU tier."""

    def __init__(
        self,
        config: LMCacheConfig,
        layout: LayoutFingerprint,
        pin_memory: bool | None = None,
        write_behind_depth: int = 100_000,
        device: torch.device | None = None,
    ):
        """``device`` is the engine's KV device when it is a GPU: the GPU tier's (``local_gpu``).
        Tests pass a CPU device to run the tier's logic in host memory."""
        self.config = config
        self.layout = layout
        # What peers compare at hello and in every pull: the layout and its key format, so
        # engines with other key rules never exchange chunks.
        self.fingerprint = layout.digest
        # The namespace of this store's keys (every tier, disk directories, remote keys): the
        # same for every key format, so what was stored before an upgrade keeps its address.
        self.key_fingerprint = layout.storage_digest
        self.chunk_size = config.chunk_size
        self.page_bytes = layout.bytes_per_token * config.chunk_size
        # One queue per reader (record_events), filled by whichever thread changed a tier. A
        # tuple, replaced whole when a reader joins: writers iterate it without a lock.
        self._event_queues: tuple[StorageEventQueue, ...] = ()

        self.cpu: CpuTier | None = None
        if config.local_cpu:
            pool = PagePool(self.page_bytes, config.max_local_cpu_bytes, pin_memory=pin_memory)
            if pool.num_pages == 0:
                logger.warning(
                    "max_local_cpu_size=%s GB holds no %.1f MiB chunk; the CPU tier is empty",
                    config.max_local_cpu_size,
                    self.page_bytes / 2**20,
                )
            self.cpu = CpuTier(pool, on_evict=self._on_cpu_evict)
        self.gpu: GpuTier | None = None
        self.landing: VramLanding | None = None  # pulls landed in the GPU tier; made with it
        if config.local_gpu:
            self.gpu = self._build_gpu_tier(device)
            if self.gpu is not None and self.cpu is not None:
                self.landing = VramLanding(self.gpu, self.cpu.pool, self)
        # With peers, the checksums a holder sends are taken behind the stores (hashing.py says why).
        self.hasher: StoreHasher | None = None
        if config.enable_p2p and self.cpu is not None:
            self.hasher = StoreHasher(self.cpu, self.gpu)
        self.disk: DiskTier | None = None
        self._writer: _DiskWriter | None = None
        if config.local_disk:
            self.disk = DiskTier(
                config.local_disk,
                config.max_local_disk_bytes,
                on_evict=lambda key: self._record("evict", DISK, key),
                key_format=layout.key_format,
            )
            if self.cpu is not None:
                self._writer = _DiskWriter(self.cpu, self.disk, write_behind_depth, self._on_disk_written)
        if self.cpu is None and self.disk is None:
            logger.warning("neither local_cpu nor local_disk is enabled: this instance caches nothing locally")
        self.remote = self._build_remote_tier()

    def _build_gpu_tier(self, device: torch.device | None) -> GpuTier | None:
        if device is None:
            logger.warning("local_gpu is on but the engine's KV is not on a GPU; the GPU tier is off")
            return None
        if self.cpu is None:  # config.validate() refuses this; a cache over nothing caches nothing
            logger.warning("local_gpu needs local_cpu (the GPU tier is a copy of CPU chunks); the GPU tier is off")
            return None
        try:
            pool = PagePool(self.page_bytes, self.config.max_local_gpu_bytes, device=device)
        except torch.OutOfMemoryError:
            logger.error(
                "no room on %s for a %.2f GB GPU tier (max_local_gpu_size); the GPU tier is off",
                device,
                self.config.max_local_gpu_size,
            )
            return None
        if pool.num_pages == 0:
            logger.warning(
                "max_local_gpu_size=%s GB holds no %.1f MiB chunk; the GPU tier is off",
                self.config.max_local_gpu_size,
                self.page_bytes / 2**20,
            )
            return None
        return GpuTier(pool, checksum_of=self._cpu_checksum)

    def _build_remote_tier(self) -> RemoteTier | None:
        config, remote_url = self.config, self.config.remote
        if remote_url is None:
            return None
        if self.cpu is None:
            # Reads land in CPU pages and writes are behind from them: without a CPU tier
            # there is nothing to write from or fetch into.
            logger.warning("remote_url %s needs local_cpu: the remote tier is off", remote_url.describe())
            return None
        remote = RemoteTier(
            open_store(remote_url, config.remote_timeout_s),
            self.page_bytes,
            config.remote_write_queue_chunks,
            key_format=self.layout.key_format,
        )
        remote.start_writer(self.cpu.pin)
        logger.info(
            "remote tier %s (layout %016x, write-behind queue %d chunks, timeout %.1f s)",
            remote_url.describe(),
            self.key_fingerprint,
            config.remote_write_queue_chunks,
            config.remote_timeout_s,
        )
        return remote

    def _cpu_checksum(self, key: ChunkKey) -> int | None:
        chunk = self.cpu.pin(key) if self.cpu is not None else None
        if chunk is None:
            return None
        with chunk:
            return chunk.checksum

    def _on_cpu_evict(self, key: ChunkKey) -> None:
        self._record("evict", CPU, key)
        if self.gpu is not None:  # a copy of the CPU tier: what leaves it leaves the GPU too
            self.gpu.remove(key)

    # -- keys ------------------------------------------------------------------------------------

    def key(self, chunk_hash: int) -> ChunkKey:
        return ChunkKey(self.key_fingerprint, chunk_hash)

    # -- events ----------------------------------------------------------------------------------

    def record_events(self) -> StorageEventQueue:
        """A queue of this store's admits and evicts from now on, for one reader to drain on its
        own thread (``take_events``). Nothing is queued for nobody: a store without readers keeps
        no events."""
        queue = StorageEventQueue()
        self._event_queues = (*self._event_queues, queue)
        return queue

    def _record(self, kind: Literal["admit", "evict"], location: str, key: ChunkKey) -> None:
        if not self._event_queues:
            return
        event = StorageEvent(kind, location, key)
        for queue in self._event_queues:
            queue.put(event)

    # -- lookup ----------------------------------------------------------------------------------

    def location_of(self, chunk_hash: int) -> str | None:
        """Where the chunk is held: the CPU tier, else the GPU tier alone (a pull landed in VRAM
        and not yet written back), else the disk tier; None when nowhere here."""
        key = self.key(chunk_hash)
        if self.cpu is not None and self.cpu.contains(key):
            return CPU
        if self.gpu is not None and self.gpu.contains(key):
            return GPU
        if self.disk is not None and self.disk.contains(key):
            return DISK
        return None

    def load_location(self, chunk_hash: int) -> str | None:
        """Where a load (``pin(gpu=True)``) reads the chunk from: the GPU tier's copy first, then
        the CPU tier, then the disk tier; None when nowhere here."""
        if self.gpu is not None and self.gpu.contains(self.key(chunk_hash)):
            return GPU
        return self.location_of(chunk_hash)

    def held_hashes(self, location: str) -> np.ndarray:
        """Every chunk hash of this layout held at ``location`` (a re-sync's full key set)."""
        tier = self._tier(location)
        if tier is None:
            return np.zeros(0, dtype=np.uint64)
        return np.fromiter(
            (k.chunk_hash for k in tier.keys() if k.fingerprint == self.key_fingerprint),  # noqa: SIM118 a tier is no dict
            dtype=np.uint64,
        )

    @property
    def locations(self) -> list[str]:
        return [loc for loc, tier in ((CPU, self.cpu), (DISK, self.disk)) if tier is not None]

    def holds(self, chunk_hash: int, location: str) -> bool:
        tier = self._tier(location)
        return tier is not None and tier.contains(self.key(chunk_hash))

    def lookup_prefix(self, chunk_hashes: Sequence[int]) -> PrefixHit:
        """How many leading chunks we hold locally (the first miss ends the prefix)."""
        found = []
        for h in chunk_hashes:
            where = self.location_of(h)
            if where is None:
                break
            found.append(where)
        return PrefixHit(tuple(found))

    # -- store -----------------------------------------------------------------------------------

    def put(self, chunk_hash: int, payload: torch.Tensor, checksum: int | None = None) -> bool:
        """Store one chunk's payload; True if it is newly held."""
        key = self.key(chunk_hash)
        if self.cpu is None:
            if self.disk is None:
                return False
            stored = self.disk.write(key, payload.reshape(-1).view(torch.uint8).numpy(), checksum)
            if stored:
                self._record("admit", DISK, key)
            return stored
        if not self.cpu.put(key, payload, checksum):
            return False
        self._after_cpu_admit(key)
        return True

    def _page_owner(self) -> CpuTier:
        """The CPU tier, for a page :meth:`reserve_page` handed out (which only it can)."""
        if self.cpu is None:
            raise RuntimeError("no CPU tier (local_cpu is off), so no pool page can have been reserved")
        return self.cpu

    def reserve_page(self) -> tuple[int, torch.Tensor] | None:
        """A free CPU page for a producer that fills it in place (kernel gather, peer transfer).
        None when every page is pinned: the chunk it was for is dropped, and counted with the
        tier's ``rejected_puts`` (a store or a pull that ends there is a put the pool refused)."""
        reserved = self._reserve_cpu_page()
        if reserved is None and self.cpu is not None:
            self.cpu.rejected_puts += 1
            logger.debug("CPU tier full of pinned chunks; a page reservation for a store or pull was refused")
        return reserved

    def _reserve_cpu_page(self) -> tuple[int, torch.Tensor] | None:
        if self.cpu is None:
            return None
        page = self.cpu.allocate()
        return None if page is None else (page, self.cpu.pool.page(page))

    def commit_page(
        self, chunk_hash: int, page: int, checksum: int | None = None, location: str = CPU, from_remote: bool = False
    ) -> bool:
        """Index a page filled after :meth:`reserve_page`; False if the key was held already.
        With ``location`` DISK the page is written to the disk tier and returned to the pool.
        ``from_remote``: the page came from the remote store, which is not written it back."""
        key = self.key(chunk_hash)
        cpu = self._page_owner()
        if location == DISK:
            try:
                if self.disk is None or self.disk.contains(key):
                    return False
                stored = self.disk.write(key, cpu.pool.page(page).numpy(), checksum)
            finally:
                self.abandon_page(page)
            if stored:
                self._record("admit", DISK, key)
            return stored
        if not cpu.admit(key, page, checksum):
            return False
        self._after_cpu_admit(key, from_remote=from_remote)
        if checksum is None and self.hasher is not None:
            self.hasher.hash_stored(key)
        return True

    def abandon_page(self, page: int) -> None:
        self._page_owner().pool.free(page)

    # -- the GPU tier ----------------------------------------------------------------------------

    def reserve_gpu_page(self) -> tuple[int, torch.Tensor] | None:
        """A free GPU tier page (evicting the tier's least recently used unpinned chunk), or None
        without a GPU tier or when every page is pinned."""
        if self.gpu is None:
            return None
        page = self.gpu.allocate()
        return None if page is None else (page, self.gpu.pool.page(page))

    def commit_gpu_page(self, chunk_hash: int, page: int, checksum: int | None = None) -> bool:
        """Index a GPU page filled after :meth:`reserve_gpu_page` (a store's copy of a chunk the
        CPU tier holds); False, and the page freed, if it is held there already or the CPU tier
        no longer holds the chunk (evicted meanwhile: the GPU tier copies, it never holds alone)."""
        gpu, key = self._gpu_tier(), self.key(chunk_hash)
        admitted = self._page_owner().while_held(key, lambda: gpu.admit(key, page, checksum))
        if admitted is None:
            gpu.pool.free(page)
            return False
        return admitted

    def keep_device_checksums(self, chunk_hashes: Sequence[int]) -> None:
        """With peers: take the device checksums of a store's GPU tier copies behind it, which a
        peer pulling them from VRAM is sent (a holder computing them on every pull added ~12 ms
        to a document's pull)."""
        if self.hasher is not None and self.gpu is not None:
            self.hasher.keep_device_checksums([self.key(h) for h in chunk_hashes])

    def abandon_gpu_page(self, page: int) -> None:
        self._gpu_tier().pool.free(page)

    # -- the PullLanding of peer pulls -----------------------------------------------------------

    @property
    def cpu_pool(self) -> PagePool:
        if self.cpu is None:  # build_engine hands the worker no landing then (P2P requires local_cpu)
            raise RuntimeError("no CPU tier (local_cpu is off), so no pull can land here")
        return self.cpu.pool

    @property
    def gpu_tier(self) -> GpuTier | None:
        return self.gpu

    def commit_landed(
        self,
        chunk_hashes: Sequence[int],
        gpu_pages: Sequence[int],
        cpu_pages: Sequence[int],
        checksums: Sequence[int],
        device_checksums: Sequence[int] | None = None,
    ) -> None:
        if self.landing is None:  # made with the GPU tier
            raise RuntimeError("no GPU tier (local_gpu is off), so no pull can have landed in it")
        self.landing.commit_landed(chunk_hashes, gpu_pages, cpu_pages, checksums, device_checksums=device_checksums)

    def _gpu_tier(self) -> GpuTier:
        if self.gpu is None:
            raise RuntimeError("no GPU tier (local_gpu is off), so no GPU page can have been reserved")
        return self.gpu

    def _after_cpu_admit(self, key: ChunkKey, from_remote: bool = False) -> None:
        self._record("admit", CPU, key)
        # (a writer exists only with a disk tier)
        if self._writer is not None and self.disk is not None and not self.disk.contains(key):
            self._writer.queue.submit(key)
        if self.remote is not None and not from_remote:
            self.remote.submit(key)

    @property
    def cpu_pages_unpinned(self) -> int:
        """CPU pages a fill could take (free, or evictable): the pool less what is pinned."""
        return 0 if self.cpu is None else max(0, self.cpu.pool.num_pages - self.cpu.pins_held)

    def _on_disk_written(self, key: ChunkKey) -> None:
        self._record("admit", DISK, key)

    # -- retrieve --------------------------------------------------------------------------------

    def pin(self, chunk_hash: int, gpu: bool = False) -> PinnedChunk | None:
        """The chunk's payload held until released; disk hits are promoted into the CPU tier.
        With ``gpu``, the GPU tier's copy when it has one (its ``data`` is in VRAM): for readers
        that copy on the device (loads into vLLM's blocks, staged NIXL sends)."""
        key = self.key(chunk_hash)
        if gpu and self.landing is not None:  # (made with the GPU tier)
            chunk = self.landing.pin(key)
            if chunk is not None:
                return chunk
        if self.cpu is not None:
            chunk = self.cpu.pin(key)
            if chunk is not None:
                return chunk
        if self.disk is None or not self.disk.contains(key):
            return None
        # Not reserve_page: a promotion that finds no page is no dropped put; it reads privately.
        reserved = self._reserve_cpu_page()
        if reserved is None:  # no CPU tier, or every page pinned: read into a private buffer
            data = torch.empty(self.page_bytes, dtype=torch.uint8)
            checksum = self.disk.read_into(key, data.numpy())
            return None if checksum is None else PinnedChunk(key, data, checksum=checksum)
        page, data = reserved
        cpu = self._page_owner()
        checksum = self.disk.read_into(key, data.numpy())
        if checksum is None:
            self.abandon_page(page)
            return None
        if cpu.admit(key, page, checksum):
            self._record("admit", CPU, key)
        return cpu.pin(key)

    # -- removal ---------------------------------------------------------------------------------

    def remove(self, chunk_hash: int, location: str | None = None) -> list[str]:
        """Drop a chunk from one location (or all); returns the locations it was dropped from."""
        key = self.key(chunk_hash)
        dropped = []
        for loc in [location] if location else [CPU, DISK]:
            tier = self._tier(loc)
            if tier is not None and tier.remove(key):
                dropped.append(loc)
                self._record("evict", loc, key)
        if self.gpu is not None and CPU in ([location] if location else [CPU]):
            self.gpu.remove(key)
            if self.landing is not None:
                self.landing.forget(key)
        return dropped

    def clear(self, location: str | None = None) -> int:
        """Drop everything from one location (or all); returns the number of chunks dropped."""
        n = 0
        for loc in [location] if location else [CPU, DISK]:
            tier = self._tier(loc)
            if tier is None:
                continue
            for key in tier.clear():
                self._record("evict", loc, key)
                n += 1
        if self.gpu is not None and location in (None, CPU):
            self.gpu.clear()
            if self.landing is not None:
                self.landing.forget_all()
        return n

    def _tier(self, location: str) -> CpuTier | DiskTier | None:
        if location == CPU:
            return self.cpu
        if location == DISK:
            return self.disk
        raise ValueError(f"unknown location {location!r}; expected {CPU!r} or {DISK!r}")

    # -- lifecycle -------------------------------------------------------------------------------

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until queued disk and remote writes are done (tests, shutdown)."""
        written = self.landing.wait(timeout) if self.landing is not None else True  # they queue CPU admits: first
        disk = self._writer.queue.flush(timeout) if self._writer is not None else True
        remote = self.remote.flush(timeout) if self.remote is not None else True
        return written and disk and remote

    def close(self) -> None:
        if self.hasher is not None:
            self.hasher.close()
            self.hasher = None
        if self.landing is not None:
            self.landing.close()
        if self._writer is not None:
            self._writer.queue.close(timeout=60.0)
            self._writer = None
        if self.remote is not None:
            self.remote.close()
            self.remote = None

    def stats(self) -> dict:
        out: dict = {"chunk_size": self.chunk_size, "page_bytes": self.page_bytes}
        if self.cpu is not None:
            out["cpu"] = {**self.cpu.stats(), "rejected_puts": self.cpu.rejected_puts}
        if self.gpu is not None:
            out["gpu"] = {**self.gpu.stats(), **(self.landing.stats() if self.landing is not None else {})}
        if self.disk is not None:
            out["disk"] = {
                "chunks": len(self.disk),
                "used_bytes": self.disk.used_bytes,
                "evictions": self.disk.evictions,
                "corrupt_files": self.disk.corrupt_files,
                "legacy_files_read": self.disk.legacy_files_read,
            }
        if self.remote is not None:
            out["remote"] = self.remote.stats()
        if self._writer is not None:
            out["disk_writes_dropped"] = self._writer.dropped
            out["disk_writes_missed"] = self._writer.missed
        return out


class _DiskWriter:
    """CPU admits written behind to disk (:class:`WriteBehind`, one key at a time). A chunk the
    CPU tier evicts before its turn is counted in ``missed`` (the disk cannot keep up with the
    ingest rate); a full queue counts ``dropped``."""

    def __init__(self, cpu: CpuTier, disk: DiskTier, depth: int, on_written: Callable[[ChunkKey], None]):
        self.cpu = cpu
        self.disk = disk
        self.on_written = on_written
        self.missed = 0
        self.queue = WriteBehind("disk", depth, self._write)

    @property
    def dropped(self) -> int:
        return self.queue.dropped

    def _write(self, keys: list[ChunkKey]) -> None:
        for key in keys:
            chunk = self.cpu.pin(key)
            if chunk is None:
                self.missed += 1
                logger.debug("%s left the CPU tier before its disk write", key)
                continue
            with chunk:
                t0 = time.perf_counter()
                if self.disk.write(key, chunk.data.numpy(), chunk.checksum):
                    logger.debug("wrote %s to disk in %.2f ms", key, (time.perf_counter() - t0) * 1e3)
                    self.on_written(key)
