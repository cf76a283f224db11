"""TierLanding: the :class:`~lmcache_p2p.storage.chunk_store.PullLanding` of a
:class:`~lmcache_p2p.storage.manager.StorageManager`: its CPU tier's pool, its GPU tier, and the
:class:`~lmcache_p2p.storage.landing.VramLanding` made with that tier.

``worker.build_engine`` makes one (:meth:`TierLanding.of`) beside the store it builds; the worker
lands its pulls through it and sees no tier otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lmcache_p2p.storage.gpu_tier import GpuTier
from lmcache_p2p.storage.landing import VramLanding
from lmcache_p2p.storage.manager import StorageManager
from lmcache_p2p.storage.memory import PagePool


@dataclass(frozen=True, slots=True)
class TierLanding:
    """Where a rank's pulls land: ``cpu_pool`` (the CPU tier's pages), and with ``local_gpu`` the
    GPU tier and the landing of pulls written into it (``vram``)."""

    cpu_pool: PagePool
    gpu_tier: GpuTier | None = None
    vram: VramLanding | None = None

    @classmethod
    def of(cls, store: StorageManager) -> TierLanding | None:
        """``store``'s tiers; None without a CPU tier, where no pull can land
        (``config.validate()``: ``enable_p2p`` requires ``local_cpu``)."""
        if store.cpu is None:
            return None
        return cls(store.cpu.pool, store.gpu, store.landing)

    def commit_landed(
        self,
        chunk_hashes: Sequence[int],
        gpu_pages: Sequence[int],
        cpu_pages: Sequence[int],
        checksums: Sequence[int],
        device_checksums: Sequence[int] | None = None,
    ) -> None:
        if self.vram is None:
            raise RuntimeError("no GPU tier (local_gpu is off), so no pull can have landed in it")
        self.vram.commit_landed(chunk_hashes, gpu_pages, cpu_pages, checksums, device_checksums=device_checksums)

    def abandon_gpu_page(self, page: int) -> None:
        if self.gpu_tier is None:
            raise RuntimeError("no GPU tier (local_gpu is off), so no GPU page can have been reserved")
        self.gpu_tier.pool.free(page)
