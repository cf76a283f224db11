"""Pulling chunks from peers into this rank's tiers.

A pull reserves pages in our CPU pool, asks the holder (ChunkPull on its p2p_lookup port) to
fill them, verifies every payload's checksum, and commits the verified leading run. Anything
else (the holder lacks a chunk, a checksum differs, a timeout, a dead peer, our pool is full)
ends the run: those chunks are a miss, logged with the reason, and their pages go back to the
pool. Nothing here raises into the engine.

Over NIXL the holder writes into our pages directly, so pages of a request that timed out are
kept out of the pool until the holder's late answer arrives (or a grace period passes): a slow
holder must never write into a page that already holds another chunk.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import zmq.asyncio

from lmcache_p2p.keys import in_parallel, payload_checksum
from lmcache_p2p.protocol import (
    ChannelHelloReply,
    ChunkPull,
    ChunkPullReply,
    pack_hashes,
    pack_pages,
    peer_reply_decoder,
    unpack_hashes,
)
from lmcache_p2p.rpc import RemoteError, RequestFailed, RpcClient
from lmcache_p2p.storage.manager import CPU, StorageManager
from lmcache_p2p.transfer import TransferError, Transport
from lmcache_p2p.worker.identity import WorkerIdentity
from lmcache_p2p.worker.link import ControllerLink

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 3.0
# A pull may take this long plus its bytes at this slowest acceptable rate; then it is a miss.
BASE_TIMEOUT_S = 2.0
SLOWEST_RATE_BPS = 0.25e9


@dataclass(frozen=True)
class Peer:
    instance_id: str
    rank: int
    host: str
    init_port: int
    lookup_port: int

    def describe(self) -> str:
        return f"{self.instance_id} rank {self.rank} ({self.host}:{self.lookup_port})"


@dataclass
class PullResult:
    held: list[int] = field(default_factory=list)  # hashes now held here (in order of the request)
    error: str | None = None  # why the run ended early, if it did


# Where a pull's batches spend their time, in its log line (see _Batch.phases_ms).
PHASES = ("slots", "holder", "queue+wire", "land", "verify")


@dataclass
class _Batch:
    hashes: list[int]  # the chunks asked for: one per reserved page
    pages: list[int] = field(default_factory=list)  # reserved here; committed or abandoned later
    good: int = 0  # leading chunks landed with matching checksums
    checksums: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    peer_failed: bool = False  # no usable answer: the connection is dropped (a miss is not that)
    pool_full: str | None = None  # fewer pages were free than the batch had chunks: the run ends here
    error: str | None = None
    # The error is a chunk the holder lacks or sent damaged: a move/copy (skip_missing) goes on
    # with ``rest``, the hashes after it.
    skippable: bool = False
    rest: list[int] = field(default_factory=list)
    # Where its time went, ms: waiting for receive slots, the holder's work on it (pins,
    # checksums, copies, its write), the rest of the round trip (queueing behind the session's
    # other requests, the wire), landing the bytes in our pages, checking them.
    phases_ms: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))


def _split(items: list[int], size: int) -> list[list[int]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class _Connection:
    """One peer's sockets and the channel agreed with it at hello."""

    def __init__(self, ctx: zmq.asyncio.Context, peer: Peer):
        self.init = RpcClient(
            ctx, f"tcp://{peer.host}:{peer.init_port}", peer_reply_decoder, f"{peer.describe()} p2p_init"
        )
        self.lookup = RpcClient(
            ctx, f"tcp://{peer.host}:{peer.lookup_port}", peer_reply_decoder, f"{peer.describe()} p2p_lookup"
        )
        self.channel: str | None = None  # None until hello agrees one (P2PClient._connect)
        self.staged = False  # the holder writes through GPU staging (agreed at hello)

    @property
    def agreed(self) -> str:
        """The channel agreed at hello; only connections :meth:`P2PClient._connect` returned have one."""
        assert self.channel is not None, "connection used before its hello"
        return self.channel

    def close(self) -> None:
        self.init.close()
        self.lookup.close()


class P2PClient:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        identity: WorkerIdentity,
        storage: StorageManager,
        link: ControllerLink,
        transports: dict[str, Transport],
        preferred: str,
        batch_chunks: int = 8,
        pipeline_depth: int = 3,
    ):
        self.ctx = ctx
        self.me = identity
        self.storage = storage
        self.link = link
        self.transports = transports
        self.preferred = preferred if preferred in transports else "tcp"
        self.batch_chunks = batch_chunks  # chunks per request (config p2p_batch_chunks)
        self.pipeline_depth = pipeline_depth  # requests in flight per pull (p2p_pipeline_depth)
        self._connections: dict[tuple[str, int], _Connection] = {}
        # The engine's prefix pulls take turns, first asked first served: requests that arrive
        # together then become ready one after another, each at full bandwidth, instead of all
        # sharing it and all being ready only when the last pull ends.
        self._prefix_turn = asyncio.Lock()
        self.stats = {
            "pulls": 0,
            "chunks_pulled": 0,
            "bytes_pulled": 0,
            "pull_failures": 0,
            "prefix_hit_chunks": 0,
            "checksum_mismatches": 0,
            "pages_quarantined": 0,
            "transfer_ms": 0.0,
            "verify_ms": 0.0,
        }

    # -- the engine's question: pull the rest of this prefix -------------------------------------

    async def fetch_prefix(self, hashes: np.ndarray) -> int:
        """Pull as much of ``hashes`` (a prompt's chunks after the local hit) as one peer holds;
        returns how many leading chunks are now held locally."""
        holders = [
            (h.matched_chunks, Peer(h.instance_id, h.rank, h.host, h.p2p_init_port, h.p2p_lookup_port))
            for h in await self.link.p2p_lookup(hashes)
            if h.p2p_lookup_port and h.p2p_init_port and h.matched_chunks > 0
        ]
        if not holders:
            return 0
        best = max(matched for matched, _ in holders)
        # Longest prefix first; among equals the peer we have the fewest requests in flight to.
        peer = min((p for matched, p in holders if matched == best), key=lambda p: self._busy((p.host, p.lookup_port)))
        async with self._prefix_turn:
            result = await self.pull(peer, hashes[:best], CPU)
        self.stats["prefix_hit_chunks"] += len(result.held)  # pulled for the engine (not for a move)
        return len(result.held)

    def _busy(self, key: tuple[str, int]) -> int:
        conn = self._connections.get(key)
        return conn.lookup.in_flight if conn else 0

    # -- pulls -----------------------------------------------------------------------------------

    async def pull(self, peer: Peer, hashes, location: str, skip_missing: bool = False) -> PullResult:
        """Pull ``hashes`` from ``peer`` into ``location``, in order. The run ends at the first
        failure; with ``skip_missing`` (move/copy of an arbitrary key set) a chunk the holder
        merely lacks (or sent damaged) is skipped instead. A full pool here ends it either way.

        Requests of ``batch_chunks`` chunks are pipelined, ``pipeline_depth`` in flight: checksums of
        one batch are verified while the next is on the wire. Batches are committed in order."""
        result = PullResult()
        t0 = time.perf_counter()
        todo: deque[list[int]] = deque()
        channel = "?"
        try:
            conn = await self._connect(peer)
            channel = conn.agreed + (" via GPU staging" if conn.staged else "")
            batch_chunks = min(self.batch_chunks, self.transports[conn.agreed].max_batch or self.batch_chunks)
            todo.extend(_split([int(h) for h in hashes], batch_chunks))
        except (RequestFailed, TransferError) as e:
            result.error = str(e)
        window: deque[asyncio.Task] = deque()
        stopped = False
        phases_ms = dict.fromkeys(PHASES, 0.0)
        batches = 0
        while todo or window:
            while todo and not stopped and len(window) < self.pipeline_depth:
                window.append(asyncio.ensure_future(self._fetch(conn, peer, todo.popleft())))
            batch = await window.popleft()
            batches += 1
            for phase, ms in batch.phases_ms.items():
                phases_ms[phase] += ms
            if stopped:  # an earlier batch failed: what follows it is a miss
                self._abandon(batch.pages)
                continue
            result.held += self._commit(batch, location)
            if batch.error is None:
                continue
            result.error = batch.error
            if batch.peer_failed:
                self._drop(peer)
            if skip_missing and batch.skippable:
                if batch.rest:
                    todo.appendleft(batch.rest)  # go on after the chunk the holder lacked
            else:
                stopped = True
                todo.clear()
        self._report(peer, channel, len(hashes), result, time.perf_counter() - t0, batches, phases_ms)
        return result

    def _report(
        self, peer: Peer, channel: str, asked: int, result: PullResult, elapsed: float, batches: int, phases_ms: dict
    ) -> None:
        nbytes = len(result.held) * self.storage.page_bytes
        self.stats["pulls"] += 1
        self.stats["chunks_pulled"] += len(result.held)
        self.stats["bytes_pulled"] += nbytes
        if result.held:
            # The seed's line, then where the batches' time went (summed: batches overlap).
            logger.info(
                "Retrieved %d out of total %d tokens. size: %.4f gb, cost %.4f ms, throughput: %.4f GB/s "
                "(from %s over %s) [%d batches, ms summed: %s]",
                len(result.held) * self.me.chunk_size,
                asked * self.me.chunk_size,
                nbytes / 1e9,
                elapsed * 1e3,
                nbytes / 1e9 / max(elapsed, 1e-9),
                peer.describe(),
                channel,
                batches,
                ", ".join(f"{phase} {ms:.1f}" for phase, ms in phases_ms.items()),
            )
        if result.error:
            self.stats["pull_failures"] += 1
            logger.warning(
                "peer pull from %s: %d of %d chunks; the rest is a miss: %s",
                peer.describe(),
                len(result.held),
                asked,
                result.error,
            )

    def _connection(self, peer: Peer) -> _Connection:
        key = (peer.host, peer.lookup_port)
        conn = self._connections.get(key)
        if conn is None:
            conn = self._connections[key] = _Connection(self.ctx, peer)
        return conn

    def lookup_socket(self, peer: Peer) -> RpcClient:
        """The peer's p2p_lookup socket, for requests that need no channel session (FetchChunks)."""
        return self._connection(peer).lookup

    async def _connect(self, peer: Peer) -> _Connection:
        conn = self._connection(peer)
        if conn.channel is not None:
            return conn
        for channel in dict.fromkeys([self.preferred, "tcp"]):
            hello = self.transports[channel].hello(self.me.instance_id, self.me.rank, self.storage.fingerprint)
            try:
                reply = await conn.init.request(hello, ChannelHelloReply, HELLO_TIMEOUT_S)
            except RemoteError as e:
                refusal = e.reply if isinstance(e.reply, ChannelHelloReply) else None
                error = (refusal.error if refusal else None) or str(e)
                if refusal is None or "tcp" not in refusal.channels:
                    break
                continue  # it serves tcp: ask for that instead
            conn.channel = channel
            conn.staged = reply.staged
            if channel != self.preferred:
                logger.info("%s serves %s only; pulling from it over tcp", peer.describe(), reply.channels)
            return conn
        self._drop(peer)
        raise TransferError(f"{peer.describe()} refused the {self.preferred} session: {error}")

    def _drop(self, peer: Peer) -> None:
        conn = self._connections.pop((peer.host, peer.lookup_port), None)
        if conn is not None:
            conn.close()

    async def _fetch(self, conn: _Connection, peer: Peer, hashes: list[int]) -> _Batch:
        """One ChunkPull into freshly reserved pages, landed and verified, not yet committed."""
        batch = _Batch(hashes)
        for _ in hashes:
            reserved = self.storage.reserve_page()
            if reserved is None:
                break
            batch.pages.append(reserved[0])
        if len(batch.pages) < len(hashes):
            # Only the chunks we have pages for are asked for. The rest are no miss at the
            # holder: our pool is full, and the run ends here (a move/copy must not skip them).
            cpu = self.storage.cpu
            assert cpu is not None  # config.validate(): enable_p2p requires local_cpu
            batch.pool_full = (
                f"CPU pool full: reserved {len(batch.pages)} of {len(hashes)} pages (every other "
                f"page of {cpu.pool.num_pages} is pinned or in a transfer)"
            )
            batch.hashes = hashes = hashes[: len(batch.pages)]
        if not batch.pages:
            batch.error = batch.pool_full
            return batch
        transport = self.transports[conn.agreed]
        direct = conn.agreed != "tcp"  # the holder writes into our pages (or slots) itself
        # The holder sends a session's requests one after another, so this one may wait behind
        # the others in flight: allow for the whole window's bytes.
        timeout = BASE_TIMEOUT_S + self.pipeline_depth * len(hashes) * self.storage.page_bytes / SLOWEST_RATE_BPS
        pages = list(batch.pages)
        t_slots = time.perf_counter()
        slots = await transport.prepare(pages, conn.staged, timeout)
        batch.phases_ms["slots"] = (time.perf_counter() - t_slots) * 1e3
        request = ChunkPull(
            session=transport.session,
            fingerprint=self.storage.fingerprint,
            hashes=pack_hashes(hashes),
            pages=pack_pages(batch.pages) if direct else b"",
            slots=pack_pages(slots),
            timeout_s=timeout,
        )

        def release_late(reply, frames) -> None:
            # The holder answered after all (or has surely given up): it writes no more. The rpc
            # layer calls this exactly once for a failed request, also for one failed because
            # another request's timeout reset the socket.
            self._abandon(pages)
            transport.release(slots)
            self.stats["pages_quarantined"] -= len(pages)

        t0 = time.perf_counter()
        try:
            reply, frames = await conn.lookup.request_frames(
                request, ChunkPullReply, timeout, on_late=release_late if direct else None
            )
        except RequestFailed as e:
            if direct:  # the holder may still write: the pages and slots stay out of use until release_late
                self.stats["pages_quarantined"] += len(pages)
                batch.pages = []
            else:
                transport.release(slots)
            batch.error, batch.peer_failed = str(e), True
            return batch
        except RemoteError as e:  # the holder refused (unknown session, layout, its transfer failed)
            transport.release(slots)
            batch.error, batch.peer_failed = str(e), True
            return batch
        return await self._land(batch, transport, reply, frames, slots, peer, t0)

    async def _land(
        self,
        batch: _Batch,
        transport: Transport,
        reply: ChunkPullReply,
        frames: list,
        slots: list[int],
        peer: Peer,
        t0: float,
    ) -> _Batch:
        """Place and verify what the holder's reply says it sent; gives the receive slots back."""
        hashes = batch.hashes
        served = min(reply.served, len(hashes))
        t1 = time.perf_counter()
        batch.phases_ms["holder"] = reply.holder_ms
        batch.phases_ms["queue+wire"] = max(0.0, (t1 - t0) * 1e3 - reply.holder_ms)
        try:
            try:
                await transport.land(frames, batch.pages[:served], slots[:served] if reply.staged else [])
            finally:  # the bytes are in our pages: the slots take the next request's while we verify
                transport.release(slots)
            batch.phases_ms["land"] = (time.perf_counter() - t1) * 1e3
            batch.checksums = unpack_hashes(reply.checksums)
            batch.good = await asyncio.to_thread(self._verify, batch.pages[:served], batch.checksums)
        except (TransferError, ValueError) as e:
            batch.good, batch.peer_failed, batch.error = 0, True, str(e)
            return batch
        batch.phases_ms["verify"] = (time.perf_counter() - t1) * 1e3 - batch.phases_ms["land"]
        self.stats["transfer_ms"] += (t1 - t0) * 1e3
        self.stats["verify_ms"] += (time.perf_counter() - t1) * 1e3
        if batch.good < served:
            self.stats["checksum_mismatches"] += 1
            batch.error = f"checksum mismatch on chunk {hashes[batch.good]:016x}"
        elif served < len(hashes):
            batch.error = f"{peer.instance_id} does not hold chunk {hashes[served]:016x}"
        if batch.error:
            batch.skippable, batch.rest = True, hashes[batch.good + 1 :]
        if batch.pool_full:
            batch.skippable = False
            batch.error = f"{batch.error}; {batch.pool_full}" if batch.error else batch.pool_full
        return batch

    def _commit(self, batch: _Batch, location: str) -> list[int]:
        """Index the verified leading pages of a batch; the rest go back to the pool."""
        held = []
        for i in range(batch.good):
            self.storage.commit_page(batch.hashes[i], batch.pages[i], int(batch.checksums[i]), location)
            held.append(batch.hashes[i])
        self._abandon(batch.pages[batch.good :])
        return held

    def _verify(self, pages: list[int], checksums: np.ndarray) -> int:
        """How many leading pages match their checksums (hashed on several threads)."""
        cpu = self.storage.cpu
        assert cpu is not None  # config.validate(): enable_p2p requires local_cpu
        pool = cpu.pool
        got = in_parallel(lambda page: payload_checksum(pool.page(page).numpy()), pages[: len(checksums)])
        for i, checksum in enumerate(got):
            if checksum != int(checksums[i]):
                return i
        return len(got)

    def _abandon(self, pages: list[int]) -> None:
        for page in pages:
            self.storage.abandon_page(page)

    def close(self) -> None:
        for conn in self._connections.values():
            conn.close()
        self._connections.clear()
