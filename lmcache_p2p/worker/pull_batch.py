"""One batch of a pull: its pages in our store, and the request that fills them.

A batch reserves pages in our CPU pool (:class:`PullPages`), asks the holder (ChunkPull on its
p2p_lookup port) to fill them, and verifies every payload's checksum (:class:`BatchFetch`); the
pull job commits the verified leading run in order. Anything else (the holder lacks a chunk, a
checksum differs, a timeout, a dead peer, our pool is full) ends the batch's run with the reason,
and its pages go back to the pool.

Over NIXL the holder writes into our pages directly, so pages of a request that timed out are
kept out of the pool until the holder's late answer arrives (or a grace period passes): a slow
holder must never write into a page that already holds another chunk.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from lmcache_p2p import device_checksum
from lmcache_p2p.keys import hashed, payload_checksum
from lmcache_p2p.miss_reasons import CHECKSUM_FAILED, EVICTED, HOLDER_GONE, POOL_FULL, Miss
from lmcache_p2p.protocol import ChunkPull, ChunkPullReply, pack_hashes, pack_pages, unpack_hashes
from lmcache_p2p.rpc import RemoteError, RequestFailed
from lmcache_p2p.storage.chunk_store import ChunkStore, PullLanding
from lmcache_p2p.transfer import TransferError, Transport
from lmcache_p2p.transfer.base import Landing
from lmcache_p2p.worker.peer_links import Peer, PeerConnection
from lmcache_p2p.worker.pull_stats import PullStats

# A pull request may take its p2p_pull_timeout_s (vocab.PULL_REQUEST_TIMEOUT_S by default) plus
# its bytes at this slowest acceptable rate; then it is a miss.
SLOWEST_RATE_BPS = 0.25e9

# Where a pull's batches spend their time (see Batch.phases_ms): each phase with the parts of
# it measured apart, and how the log line names them (the holder's send of the bytes). Pages
# landed in the GPU tier are checked on the device behind the pull (VramLanding.commit_landed,
# its own log line): their verify is only the reading of the holder's numbers.
PHASE_PARTS: dict[str, tuple[tuple[str, str], ...]] = {
    "slots": (),
    "holder": (("holder write", "its write"),),
    "queue+wire": (),
    "land": (),
    "verify": (),
}
PHASES = tuple(name for phase, parts in PHASE_PARTS.items() for name in (phase, *(key for key, _ in parts)))


def describe_phases(phases_ms: dict) -> str:
    """``slots 0.1, holder 15.4 (its write 9.0), queue+wire 18.0, land 0.0, verify 26.4``: the
    summed milliseconds of a pull's batches, as its log line gives them."""
    out = []
    for phase, parts in PHASE_PARTS.items():
        text = f"{phase} {phases_ms[phase]:.1f}"
        if parts:
            text += " (" + ", ".join(f"{label} {phases_ms[key]:.1f}" for key, label in parts) + ")"
        out.append(text)
    return ", ".join(out)


@dataclass
class Batch:
    hashes: list[int]  # the chunks asked for: one per reserved page
    pages: list[int] = field(default_factory=list)  # reserved here; committed or abandoned later
    # GPU tier pages the holder wrote the served chunks into (local_gpu): ``pages`` then receive
    # them by the write-back (VramLanding.commit_landed), which also checks the checksums.
    gpu_pages: list[int] = field(default_factory=list)
    good: int = 0  # leading chunks landed (with matching checksums, where checked before commit)
    # Landed in the GPU tier: the holder's device checksums of the served pages, which they are
    # checked against on the device behind the pull (None: the holder sent none; the
    # write-back checks them).
    device_checksums: list[int] | None = None
    checksums: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    peer_failed: bool = False  # no usable answer: the connection is dropped (a miss is not that)
    # Of those, no answer at all (the holder is dead or stalled): its other requests go unanswered too.
    unanswered: bool = False
    pool_full: str | None = None  # fewer pages were free than the batch had chunks: the run ends here
    error: str | None = None
    miss: Miss | None = None  # the error as a miss reason, for the chunk it stopped at
    # The error is a chunk the holder lacks or sent damaged: a move/copy (skip_missing) goes on
    # with ``rest``, the hashes after it.
    skippable: bool = False
    rest: list[int] = field(default_factory=list)
    # Where its time went, ms: waiting for receive slots, the holder's work on it (pins,
    # checksums, copies, its write), the rest of the round trip (queueing behind the session's
    # other requests, the wire), landing the bytes in our pages, checking them.
    phases_ms: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    # tcp with data streams: the payloads land in ``pages`` from our own reader threads; until it
    # is closed and idle, the pages may still be written.
    landing: Landing | None = None


class PullPages:
    """The store's side of pulls: pages reserved for a batch, checked, committed, or given back
    (kept out of the pool, counted as quarantined, while a holder may still write into them).
    CPU pages go through the store (``storage``), pages landed in the GPU tier through
    ``landing``, whose ``cpu_pool`` holds the pages the store reserves."""

    def __init__(self, storage: ChunkStore, landing: PullLanding, stats: PullStats):
        self.storage = storage
        self.landing = landing
        self.stats = stats

    def reserve(self, batch: Batch) -> None:
        """A page per chunk of ``batch``; where the pool runs out, the batch is cut to the pages
        it got and says why (``pool_full``)."""
        hashes = batch.hashes
        for _ in hashes:
            reserved = self.storage.reserve_page()
            if reserved is None:
                break
            batch.pages.append(reserved[0])
        if len(batch.pages) < len(hashes):
            # Only the chunks we have pages for are asked for. The rest are no miss at the
            # holder: our pool is full, and the run ends here (a move/copy must not skip them).
            batch.pool_full = (
                f"CPU pool full: reserved {len(batch.pages)} of {len(hashes)} pages (every other "
                f"page of {self.landing.cpu_pool.num_pages} is pinned or in a transfer)"
            )
            batch.hashes = hashes[: len(batch.pages)]

    async def verify(self, pages: list[int], checksums: np.ndarray) -> int:
        """How many leading pages match their checksums (a few hashed in place, more on threads)."""
        pool = self.landing.cpu_pool
        pages = pages[: len(checksums)]
        got = await hashed(lambda page: payload_checksum(pool.page(page).numpy()), pages, len(pages) * pool.page_bytes)
        for i, checksum in enumerate(got):
            if checksum != int(checksums[i]):
                return i
        return len(got)

    def commit(self, batch: Batch, location: str) -> list[int]:
        """Index the verified leading pages of a batch; the rest go back to the pool. (Batches
        landed in the GPU tier are prefix pulls for the engine, whose ``location`` is the CPU.)"""
        return self.commit_some(batch, range(batch.good), location)

    def commit_some(self, batch: Batch, indices: Iterable[int], location: str) -> list[int]:
        """Index the chunks of ``batch`` at ``indices`` (verified ones, in order: each below
        ``batch.good``) and give every other page of it back: a batch that carried chunks of
        several pulls commits those of the pulls still waiting for them. Their hashes."""
        kept = [i for i in indices if i < batch.good]
        held = [batch.hashes[i] for i in kept]
        if batch.gpu_pages:
            if kept:
                device = batch.device_checksums
                self.landing.commit_landed(
                    held,
                    [batch.gpu_pages[i] for i in kept],
                    [batch.pages[i] for i in kept],
                    [int(batch.checksums[i]) for i in kept],
                    device_checksums=None if device is None else [device[i] for i in kept],
                )
        else:
            for i in kept:
                self.storage.commit_page(batch.hashes[i], batch.pages[i], int(batch.checksums[i]), location)
        taken = set(kept)  # their pages are the store's now
        self.give_back([page for i, page in enumerate(batch.pages) if i not in taken])
        for i, page in enumerate(batch.gpu_pages):
            if i not in taken:
                self.landing.abandon_gpu_page(page)
        return held

    def abandon(self, batch: Batch, start: int = 0) -> None:
        """Give a batch's pages (CPU and GPU tier) back from chunk ``start`` on."""
        self.give_back(batch.pages[start:])
        for page in batch.gpu_pages[start:]:
            self.landing.abandon_gpu_page(page)

    def abandon_finished(self, task: asyncio.Task) -> None:
        """A batch of a pull its caller gave up on: nothing commits it, so its pages go back."""
        if not task.cancelled() and task.exception() is None:
            self.abandon(task.result())

    def give_back(self, pages: list[int]) -> None:
        for page in pages:
            self.storage.abandon_page(page)

    def quarantine(self, pages: list[int]) -> None:
        """``pages`` stay out of the pool until :meth:`release` (a holder may still write them)."""
        self.stats.pages_quarantined += len(pages)

    def release(self, pages: list[int]) -> None:
        """Quarantined pages nothing writes into any more: back to the pool."""
        self.give_back(pages)
        self.stats.pages_quarantined -= len(pages)

    def close_landing(self, batch: Batch) -> bool:
        """Stop a batch's streamed payloads (tcp) from landing. True when nothing writes into its
        pages any more; else a segment is being received into them right now, and the pages are
        quarantined (taken from the batch) until that write ends."""
        landing, batch.landing = batch.landing, None
        if landing is None:
            return True
        pages, batch.pages = batch.pages, []
        if landing.close(on_idle=lambda: self.release(pages)):
            batch.pages = pages
            return True
        self.quarantine(pages)
        return False


class BatchFetch:
    """Requests of one pull from one holder over the channel agreed with it: each a batch of
    chunks into freshly reserved pages, landed and verified, not yet committed."""

    def __init__(
        self,
        peer: Peer,
        conn: PeerConnection,
        transport: Transport,
        pages: PullPages,
        pipeline_depth: int,
        timeout_s: float,
        into_gpu_tier: bool = False,
    ):
        self.peer = peer
        self.conn = conn
        self.transport = transport
        self.pages = pages
        self.storage = pages.storage
        self.stats = pages.stats
        self.pipeline_depth = pipeline_depth  # requests in flight per pull: they queue at the holder
        self.timeout_s = timeout_s  # a request's before its bytes (p2p_pull_timeout_s)
        self.into_gpu_tier = into_gpu_tier

    async def fetch(self, hashes: list[int]) -> Batch:
        """One ChunkPull for ``hashes``, landed and verified."""
        batch = Batch(hashes)
        self.pages.reserve(batch)
        hashes = batch.hashes
        if not batch.pages:
            batch.error, batch.miss = batch.pool_full, Miss(POOL_FULL, batch.pool_full or "")
            return batch
        transport, conn = self.transport, self.conn
        direct = conn.agreed != "tcp"  # the holder writes into our pages (or slots) itself
        # The holder sends a session's requests one after another, so this one may wait behind
        # the others in flight: allow for the whole window's bytes.
        timeout = self.timeout_s + self.pipeline_depth * len(hashes) * self.storage.page_bytes / SLOWEST_RATE_BPS
        pages = list(batch.pages)
        t_slots = time.perf_counter()
        slots = await transport.prepare(pages, conn.staged, timeout, gpu_tier=self.into_gpu_tier)
        batch.phases_ms["slots"] = (time.perf_counter() - t_slots) * 1e3
        # tcp: the payloads come over our data streams from this holder, straight into the pages
        batch.landing = transport.begin(self.peer.key, pages)
        request = ChunkPull(
            session=transport.session,
            fingerprint=self.storage.fingerprint,
            hashes=pack_hashes(hashes),
            pages=pack_pages(batch.pages) if direct else b"",
            slots=pack_pages(slots),
            timeout_s=timeout,
            transfer=batch.landing.id if batch.landing is not None else 0,
            device_check=device_checksum.VERSION if transport.gpu_landing(slots) else 0,
        )

        def release_late(reply, frames) -> None:
            # The holder answered after all (or has surely given up): it writes no more. The rpc
            # layer calls this exactly once for a failed request, also for one failed because
            # another request's timeout reset the socket.
            self.pages.release(pages)
            transport.release(slots)

        t0 = time.perf_counter()
        try:
            reply, frames = await conn.lookup.request_frames(
                request, ChunkPullReply, timeout, on_late=release_late if direct else None
            )
        except RequestFailed as e:
            if direct:  # the holder may still write: the pages and slots stay out of use until release_late
                self.pages.quarantine(pages)
                batch.pages = []
            else:
                transport.release(slots)
            batch.error, batch.peer_failed, batch.unanswered = str(e), True, True
            batch.miss = Miss(HOLDER_GONE, f"{self.peer.describe()} did not answer (dead or stalled): {e}")
            self.pages.close_landing(batch)
            return batch
        except RemoteError as e:  # the holder refused (unknown session, layout, its transfer failed)
            transport.release(slots)
            batch.error, batch.peer_failed = str(e), True
            batch.miss = Miss(HOLDER_GONE, f"{self.peer.describe()} failed the request: {e}")
            self.pages.close_landing(batch)
            return batch
        return await self._land(batch, reply, frames, slots, t0, timeout)

    async def _land(
        self, batch: Batch, reply: ChunkPullReply, frames: list, slots: list[int], t0: float, timeout: float
    ) -> Batch:
        """Place and verify what the holder's reply says it sent; gives the receive slots back.
        Streamed payloads (tcp) may still be on their way when the reply arrives: they are waited
        for here, within what is left of the request's timeout."""
        transport, peer = self.transport, self.peer
        hashes = batch.hashes
        served = min(reply.served, len(hashes))
        t1 = time.perf_counter()
        batch.phases_ms["holder"] = reply.holder_ms
        batch.phases_ms["holder write"] = reply.holder_write_ms
        batch.phases_ms["queue+wire"] = max(0.0, (t1 - t0) * 1e3 - reply.holder_ms)
        # The holder wrote into GPU tier pages we reserved: the bytes stay there, and the batch
        # owns the served pages from here (committed or freed with it).
        in_gpu_tier = transport.gpu_landing(slots) if reply.staged else []
        batch.gpu_pages = in_gpu_tier[:served]
        try:
            try:
                if reply.streamed:
                    if batch.landing is None:
                        raise TransferError(f"{peer.describe()} streamed payloads we did not ask to be streamed")
                    await batch.landing.landed(served, max(1.0, timeout - (t1 - t0)))
                elif not in_gpu_tier:
                    await transport.land(frames, batch.pages[:served], slots[:served] if reply.staged else [])
            finally:  # the bytes are in our pages: the slots take the next request's while we verify
                transport.release(slots[served:] if in_gpu_tier else slots)
                idle = self.pages.close_landing(batch)
            if not idle:  # its pages are kept out of use until that write ends
                raise TransferError(f"{peer.describe()} still writes into pages after its reply")
            batch.phases_ms["land"] = (time.perf_counter() - t1) * 1e3
            batch.checksums = unpack_hashes(reply.checksums)
            if in_gpu_tier:
                # Checked where the bytes are, against the holder's device checksums, behind the
                # pull (VramLanding.commit_landed: one launch, 0.6 ms a document on the H200,
                # plus its host calls): the hit is known without it, and the step that loads them
                # waits for it at its end, failing the loads of any that differ (vLLM recomputes
                # them). A holder that sent none leaves the check to the write-back.
                batch.good = min(served, len(batch.checksums))
                expected = unpack_hashes(reply.device_checksums)
                if batch.good and len(expected) >= batch.good:
                    batch.device_checksums = expected[: batch.good].tolist()
            else:
                batch.good = await self.pages.verify(batch.pages[:served], batch.checksums)
        except (TransferError, ValueError) as e:
            batch.good, batch.peer_failed, batch.error = 0, True, str(e)
            batch.miss = Miss(HOLDER_GONE, f"{peer.describe()}: {e}")
            return batch
        batch.phases_ms["verify"] = (time.perf_counter() - t1) * 1e3 - batch.phases_ms["land"]
        self.stats.transfer_ms += (t1 - t0) * 1e3
        self.stats.verify_ms += (time.perf_counter() - t1) * 1e3
        if batch.good < served:
            self.stats.checksum_mismatches += 1
            batch.error = f"checksum mismatch on chunk {hashes[batch.good]:016x}"
            batch.miss = Miss(CHECKSUM_FAILED, f"chunk {hashes[batch.good]:016x} from {peer.describe()}")
        elif served < len(hashes):
            batch.error = f"{peer.instance_id} does not hold chunk {hashes[served]:016x}"
            batch.miss = Miss(EVICTED, f"by the holder {peer.describe()} since its offer")
        if batch.error:
            batch.skippable, batch.rest = True, hashes[batch.good + 1 :]
        if batch.pool_full:
            batch.skippable = False
            batch.error = f"{batch.error}; {batch.pool_full}" if batch.error else batch.pool_full
            batch.miss = batch.miss or Miss(POOL_FULL, batch.pool_full)
        return batch
