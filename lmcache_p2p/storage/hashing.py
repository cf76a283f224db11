"""StoreHasher: with peers, the checksums a holder sends are taken right after the store, not at
pull time.

A holder hashing a chunk when a peer first pulled it (~3 ms a 32 MiB chunk) put most of a same-host
pull's time on its critical path, and computing a GPU tier copy's device checksum on every pull
added ~12 ms to a document's pull. So a stored chunk's XXH3 and its GPU tier copy's device
checksum are computed behind the store, on threads of their own, and cached on the tier entries;
a chunk not done yet (or whose job failed) gets its number computed when first served.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging

from lmcache_p2p.keys import ChunkKey
from lmcache_p2p.storage.cpu_tier import CpuTier
from lmcache_p2p.storage.gpu_tier import GpuTier

logger = logging.getLogger(__name__)

HASH_THREADS = 2  # xxh3 lets go of the GIL: two stored chunks hashed at once


class StoreHasher:
    """Checksums of stored chunks taken behind their stores: ``cpu``'s XXH3, ``gpu``'s copies'
    device checksums (one job, one launch per store)."""

    def __init__(self, cpu: CpuTier, gpu: GpuTier | None):
        self.cpu = cpu
        self.gpu = gpu
        self._threads = concurrent.futures.ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="lmcache-hash")

    def hash_stored(self, key: ChunkKey) -> None:
        with contextlib.suppress(RuntimeError):  # closing: hashed when first served, if ever
            self._threads.submit(self._hash, key)

    def keep_device_checksums(self, keys: list[ChunkKey]) -> None:
        """Take the device checksums of ``keys``' GPU tier copies, which a peer pulling them from
        VRAM is sent (PeerServer._device_checksums)."""
        if self.gpu is None or not keys:
            return
        with contextlib.suppress(RuntimeError):  # closing: computed when first served, if ever
            self._threads.submit(self._keep_device_checksums, self.gpu, keys)

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)

    def _hash(self, key: ChunkKey) -> None:
        try:
            chunk = self.cpu.pin(key)  # pinned while hashed; None if evicted since
            if chunk is not None:
                with chunk:
                    chunk.checksum  # noqa: B018 computed on first read and cached in its entry
        except Exception:  # a chunk not hashed now is hashed when first served
            logger.exception("hashing stored chunk %s failed", key)

    @staticmethod
    def _keep_device_checksums(gpu: GpuTier, keys: list[ChunkKey]) -> None:
        try:
            gpu.keep_device_checksums(keys)
        except Exception:  # chunks without one get it computed when a peer pulls them
            logger.exception("device checksums of %d stored chunk(s) failed", len(keys))
