"""VramLanding: peer pulls that landed in GPU tier pages, loadable at once and written back behind.

A prefix pull for the engine may land in VRAM (the GPU tier's pages, ``local_gpu``): the chunks
are indexed in the GPU tier at once, so the request that asked loads them device to device, and
are written back to the CPU tier behind it (copied to the host, their checksums checked there,
then committed to the chunk store like any pulled chunk, which indexes and announces them).

With the holder's device checksums, the landed pages are also checked on the device, one launch
per committed batch behind the pull: it ends long before the write-back, and readers that pinned
a landed chunk wait for it rather than for the write-back (``PinnedChunk.check``).

The store owns one of these when it has a GPU tier; it routes GPU-tier pins and removals through
it, and this writes back into the store through the :class:`ChunkStore` protocol only.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Sequence

import torch

from lmcache_p2p import device_checksum, gpu_ops
from lmcache_p2p.keys import ChunkKey, in_parallel, payload_checksum
from lmcache_p2p.storage.chunk_store import ChunkStore
from lmcache_p2p.storage.cpu_tier import PinnedChunk
from lmcache_p2p.storage.gpu_tier import GpuTier
from lmcache_p2p.storage.memory import PagePool

logger = logging.getLogger(__name__)


class VramLanding:
    """Pulls landed in ``gpu``'s pages: their device check and their write-back into ``store``
    (whose CPU pages are ``cpu_pool``'s)."""

    def __init__(self, gpu: GpuTier, cpu_pool: PagePool, store: ChunkStore):
        self.gpu = gpu
        self.cpu_pool = cpu_pool
        self.store = store
        self.write_back_mismatches = 0
        self.device_check_mismatches = 0
        self._write_backs: list[concurrent.futures.Future] = []  # on their way to the CPU tier
        self._write_back_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lmcache-gpu-writeback")
        # Landed pages checked on the device against the holder's device checksums, one launch a
        # committed batch, behind the pull (so its requester learns of the hit without waiting).
        self._device_check_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lmcache-device-check")
        # Landed chunks whose write-back has not finished: key -> (its job's token, the future
        # readers wait for, which answers the hashes that failed: the device check's while it
        # runs when the chunk's page is checked on the device, None once it matched, else the
        # write-back's own); and those removed meanwhile, which the write-back must not bring
        # back into the CPU tier.
        self._landing: dict[ChunkKey, tuple[object, concurrent.futures.Future | None]] = {}
        self._dropped_while_landing: dict[ChunkKey, object] = {}  # key -> the landing job's token
        self._lock = threading.Lock()

    # -- what the store routes here --------------------------------------------------------------

    def pin(self, key: ChunkKey) -> PinnedChunk | None:
        """The GPU tier's copy of ``key``, pinned, with the check a reader must wait for when it
        landed and its check has not passed yet."""
        with self._lock:  # its check, if one runs, is taken with the pin: never missed
            landing = self._landing.get(key)
            chunk = self.gpu.pin(key)
        if chunk is not None:
            chunk.check = landing[1] if landing is not None else None
        return chunk

    def forget(self, key: ChunkKey) -> None:
        """``key`` was removed: if it is landing, its write-back must not bring it back."""
        with self._lock:
            if key in self._landing:
                self._dropped_while_landing[key] = self._landing[key][0]

    def forget_all(self) -> None:
        """The GPU tier was cleared: no write-back in flight brings its chunk back."""
        with self._lock:
            self._dropped_while_landing.update((key, token) for key, (token, _) in self._landing.items())

    def wait(self, timeout: float) -> bool:
        """Whether every write-back queued so far finished within ``timeout`` seconds."""
        with self._lock:  # commit_landed rebuilds the list on the event loop's thread
            write_backs = list(self._write_backs)
        done, _ = concurrent.futures.wait(write_backs, timeout)
        return len(done) == len(write_backs)

    def close(self) -> None:
        self._write_back_thread.shutdown(wait=True)  # its jobs wait for their device checks
        self._device_check_thread.shutdown(wait=True)

    def stats(self) -> dict[str, int]:
        return {
            "write_back_mismatches": self.write_back_mismatches,
            "device_check_mismatches": self.device_check_mismatches,
        }

    # -- landing ---------------------------------------------------------------------------------

    def commit_landed(
        self,
        chunk_hashes: Sequence[int],
        gpu_pages: Sequence[int],
        cpu_pages: Sequence[int],
        checksums: Sequence[int],
        device_checksums: Sequence[int] | None = None,
    ) -> None:
        """Chunks a peer wrote into GPU tier pages (the engine's prefix pulls): loadable from the
        GPU tier now, and written back behind the caller into the reserved ``cpu_pages``, where
        their checksums are checked before the CPU tier indexes them. A chunk whose checksum
        differs is dropped from both and logged. Readers of a chunk pinned before its write-back
        ends get a check to wait for (``PinnedChunk.check``): with the holder's
        ``device_checksums`` (one per chunk) the pages are checked on the device behind the
        caller, in one launch that ends long before the write-back, and readers wait for that
        (the tier keeps each number that matched, for peers that pull the chunk from here); else
        for the write-back's host check."""
        gpu, key = self.gpu, self.store.key
        # Under the landing lock from admit to registration: a pin taken meanwhile waits, and so
        # gets the check with the chunk (lock order: landing, then the GPU tier's).
        with self._lock:
            # Pinned until written back: the tier may not evict them meanwhile.
            admits = [
                gpu.admit_pinned(key(chunk_hash), page, checksum)
                for chunk_hash, page, checksum in zip(chunk_hashes, gpu_pages, checksums, strict=True)
            ]
            pins = [pin for pin, _ in admits]
            # Only pages the tier took are checked on the device: a copy held already (its page
            # was freed) is what the write-back reads and checks, so its readers wait for that.
            on_device_at = [i for i, (_, admitted) in enumerate(admits) if admitted] if device_checksums else []
            token = object()
            device_check = None
            if device_checksums and on_device_at:  # (both: the type checker's narrowing)
                device_check = self._device_check_thread.submit(
                    self._check_on_device,
                    token,
                    [chunk_hashes[i] for i in on_device_at],
                    [gpu_pages[i] for i in on_device_at],
                    [pins[i].data for i in on_device_at],
                    [device_checksums[i] for i in on_device_at],
                )
            job = (list(chunk_hashes), list(cpu_pages), list(checksums), pins, token, device_check)
            future = self._write_back_thread.submit(self._write_back, *job)
            self._write_backs = [f for f in self._write_backs if not f.done()]
            self._write_backs.append(future)
            checked = set(on_device_at)
            for i, chunk_hash in enumerate(chunk_hashes):
                self._landing[key(chunk_hash)] = (token, device_check if i in checked else future)

    def _check_on_device(
        self, token: object, chunk_hashes: list[int], pages: list[int], data: list[torch.Tensor], expected: list[int]
    ) -> set[int]:
        """The hashes of landed GPU tier ``pages`` (of the landing job ``token``) whose device
        checksum differs from the holder's (their loads are recomputed; the write-back drops
        them). The others are good from here: the tier keeps their numbers, and readers pinning
        them from now on have no check to wait for (and a peer pulling them is vouched for).
        Raises if the check could not run: its readers then recompute, the write-back's host
        check alone decides what is kept, and no number is kept for a peer."""
        t0 = time.perf_counter()
        timing: dict[str, float] = {}
        try:
            got = device_checksum.device_checksums(data, timing)
        except Exception:
            logger.exception("device check of %d landed chunk(s) failed; their loads are recomputed", len(data))
            raise
        bad: set[int] = set()
        good: list[int] = []  # indexes
        for i, (chunk_hash, actual, wanted) in enumerate(zip(chunk_hashes, got, expected, strict=True)):
            if actual == wanted:
                good.append(i)
                continue
            bad.add(chunk_hash)
            logger.error(
                "chunk %016x landed in VRAM with device checksum %016x, the holder's is %016x: dropped",
                chunk_hash,
                actual,
                wanted,
            )
        keys = [self.store.key(chunk_hashes[i]) for i in good]
        self.gpu.keep_checked_device_checksums(keys, [pages[i] for i in good], [got[i] for i in good])
        with self._lock:  # after the numbers: a pin without a check has its number
            for key in keys:
                entry = self._landing.get(key)
                if entry is not None and entry[0] is token:
                    self._landing[key] = (token, None)
        self.device_check_mismatches += len(bad)
        logger.info(
            "checked %d landed chunk(s) on the device in %.1f ms (on the GPU %.1f, waiting %.1f): %d differ",
            len(data),
            (time.perf_counter() - t0) * 1e3,
            timing.get("gpu_ms", 0.0),
            timing.get("wait_ms", 0.0),
            len(bad),
        )
        return bad

    def _write_back(
        self,
        chunk_hashes: list[int],
        cpu_pages: list[int],
        checksums: list[int],
        pins: list[PinnedChunk],
        token: object,
        device_check: concurrent.futures.Future | None,
    ) -> set[int]:
        """Returns the hashes that are not good: checksum mismatches, on the device or here
        (dropped from both tiers), and every chunk not handled when something failed (dropped
        from the GPU tier too). Ends after the device check, if one runs: until then a reader may
        have pinned a chunk of this job with that check to wait for, and its page must stay."""
        gpu, store = self.gpu, self.store
        t0 = time.perf_counter()
        bad: set[int] = set()
        failed_on_device: set[int] = set()
        if device_check is not None:
            with contextlib.suppress(Exception):  # could not run (logged): the host check decides
                failed_on_device = device_check.result()
        handled = 0  # chunks whose CPU page the tier took or that was freed: never freed again
        try:
            targets = [self.cpu_pool.page(page) for page in cpu_pages]
            _copy_pages([pin.data for pin in pins], targets)
            got = in_parallel(lambda page: payload_checksum(page.numpy()), targets)
            written = 0
            for i, (chunk_hash, page, expected, actual) in enumerate(
                zip(chunk_hashes, cpu_pages, checksums, got, strict=True)
            ):
                handled = i + 1  # from here the page is the tier's or freed, whatever follows raises
                key = store.key(chunk_hash)
                if actual != expected or chunk_hash in failed_on_device:  # checked first: a load may have used it
                    bad.add(chunk_hash)
                    store.abandon_page(page)
                    gpu.remove(key)
                    if actual != expected:
                        self.write_back_mismatches += 1
                        logger.error(
                            "chunk %016x landed in VRAM with checksum %016x, the holder's is %016x: dropped",
                            chunk_hash,
                            actual,
                            expected,
                        )
                elif self._dropped_by(key, token):  # removed (clear, move) while on its way: stays so
                    store.abandon_page(page)
                else:
                    written += store.commit_page(chunk_hash, page, expected)
                    if self._dropped_by(key, token):  # removed while it was being admitted
                        store.remove(chunk_hash)
            logger.debug(
                "wrote back %d of %d landed chunk(s) in %.1f ms",
                written,
                len(chunk_hashes),
                (time.perf_counter() - t0) * 1e3,
            )
        except Exception:
            logger.exception(
                "writing back %d chunk(s) landed in VRAM failed; %d not checked are dropped",
                len(chunk_hashes),
                len(chunk_hashes) - handled,
            )
            for chunk_hash, page in zip(chunk_hashes[handled:], cpu_pages[handled:], strict=True):
                store.abandon_page(page)
                gpu.remove(store.key(chunk_hash))
                bad.add(chunk_hash)
        finally:
            for pin in pins:
                pin.release()
            with self._lock:
                for chunk_hash in chunk_hashes:
                    key = store.key(chunk_hash)
                    entry = self._landing.get(key)
                    if entry is not None and entry[0] is token:
                        del self._landing[key]
                    if self._dropped_while_landing.get(key) is token:
                        del self._dropped_while_landing[key]
        return bad

    def _dropped_by(self, key: ChunkKey, token: object) -> bool:
        """Whether ``key`` was removed while the landing job ``token`` carried it."""
        with self._lock:
            return self._dropped_while_landing.get(key) is token


def _copy_pages(sources: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> None:
    """Copy VRAM pages to host pages and wait: on a stream of its own when on CUDA, so the
    write-back queues behind no forward pass."""
    if not sources:
        return
    device = sources[0].device
    if device.type != "cuda":
        for src, dst in zip(sources, targets, strict=True):
            dst.copy_(src)
        return
    stream = gpu_ops.side_stream("write-back", device)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        for src, dst in zip(sources, targets, strict=True):
            dst.copy_(src, non_blocking=True)
        stream.synchronize()  # inside the guard: this thread makes no call against device 0
