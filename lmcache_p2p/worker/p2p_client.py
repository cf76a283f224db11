"""Pulling chunks from peers into this rank's tiers.

A pull reserves pages in our CPU pool, asks the holder (ChunkPull on its p2p_lookup port) to
fill them, verifies every payload's checksum, and commits the verified leading run. Anything
else (the holder lacks a chunk, a checksum differs, a timeout, a dead peer, our pool is full)
ends the run: those chunks are a miss, logged with the reason, and their pages go back to the
pool. Nothing here raises into the engine.

Over NIXL the holder writes into our pages directly, so pages of a request that timed out are
kept out of the pool until the holder's late answer arrives (or a grace period passes): a slow
holder must never write into a page that already holds another chunk.

Connections: one per peer rank, its channel agreed by one hello (NIXL metadata, GPU staging);
a pull that finds one still saying hello waits for that hello rather than sending another. The
controller names the peers worth connecting before any pull needs them (the warm set,
:meth:`P2PClient.set_warm_peers`): each gets a keeper task that says hello in the background,
retries with backoff while the peer does not answer (logged once), connects again after a
failed pull dropped the connection, and ends when the peer leaves the set (its connection is
then closed). Pulls from other peers connect on demand, as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import zmq.asyncio

from lmcache_p2p import device_checksum
from lmcache_p2p.keys import in_parallel, payload_checksum
from lmcache_p2p.mesh_security import MeshSecurity
from lmcache_p2p.protocol import (
    ChannelHelloReply,
    ChunkPull,
    ChunkPullReply,
    MeshPeer,
    pack_hashes,
    pack_pages,
    peer_reply_decoder,
    unpack_hashes,
)
from lmcache_p2p.pull_policy import PullPolicy
from lmcache_p2p.rpc import RemoteError, RequestFailed, RpcClient
from lmcache_p2p.storage.manager import StorageManager
from lmcache_p2p.transfer import TransferError, Transport
from lmcache_p2p.transfer.base import Landing
from lmcache_p2p.vocab import CPU
from lmcache_p2p.worker.identity import WorkerIdentity
from lmcache_p2p.worker.link import REQUEST_TIMEOUT_S, ControllerLink

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 3.0
# A warm-set peer that does not answer its hello is tried again after 1 s, then 2, 4... up to a
# minute; the controller drops it from the set once it is reaped.
WARM_RETRY_FIRST_S = 1.0
WARM_RETRY_MAX_S = 60.0
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


@dataclass(frozen=True)
class PeerOffer:
    """Leading chunks of a prompt (after the asking rank's local hit) that a pull from ``peer``
    would bring, as the controller and the pull policy decided when the engine asked."""

    peer: Peer
    hashes: np.ndarray  # uint64, in prompt order
    made: float = field(default_factory=time.perf_counter)

    @property
    def chunks(self) -> int:
        return len(self.hashes)

    def first(self, chunks: int) -> PeerOffer:
        return replace(self, hashes=self.hashes[:chunks])


@dataclass
class PullResult:
    held: list[int] = field(default_factory=list)  # hashes now held here (in order of the request)
    error: str | None = None  # why the run ended early, if it did
    gpu_landed: int = 0  # of those, chunks the holder wrote into our GPU tier
    gpu_checked_on_device: int = 0  # of those, checked against the holder's device checksums


# Where a pull's batches spend their time (see _Batch.phases_ms): each phase with the parts of
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
class _Batch:
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
    # tcp with data streams: the payloads land in ``pages`` from our own reader threads; until it
    # is closed and idle, the pages may still be written.
    landing: Landing | None = None


def _split(items: list[int], size: int) -> list[list[int]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class _Connection:
    """One peer's sockets and the channel agreed with it at hello."""

    def __init__(self, ctx: zmq.asyncio.Context, peer: Peer, security: MeshSecurity | None = None):
        self.init = RpcClient(
            ctx,
            f"tcp://{peer.host}:{peer.init_port}",
            peer_reply_decoder,
            f"{peer.describe()} p2p_init",
            security=security,
        )
        self.lookup = RpcClient(
            ctx,
            f"tcp://{peer.host}:{peer.lookup_port}",
            peer_reply_decoder,
            f"{peer.describe()} p2p_lookup",
            security=security,
        )
        self.channel: str | None = None  # None until hello agrees one (P2PClient._connect)
        self.staged = False  # the holder writes through GPU staging (agreed at hello)
        self.hello: asyncio.Task | None = None  # the hello on its way or done (one at a time)
        self.hello_ms = 0.0  # its round trip: the holder's session set-up (NIXL remote agent) included
        self.peer_session = ""  # the holder process it was warmed for ("" when connected on demand)
        self.closed = asyncio.Event()  # set once closed: a warm peer's keeper connects again

    @property
    def agreed(self) -> str:
        """The channel agreed at hello; only connections :meth:`P2PClient._connect` returned have one."""
        assert self.channel is not None, "connection used before its hello"
        return self.channel

    def describe_channel(self) -> str | None:
        return None if self.channel is None else self.channel + (" via GPU staging" if self.staged else "")

    def close(self) -> None:
        # A hello still on its way fails with the closed socket (RequestFailed), so whoever waits
        # on it sees a failed connection, never a cancellation of its own task.
        self.init.close()
        self.lookup.close()
        self.closed.set()


@dataclass
class _Warm:
    """A warm-set peer and its keeper task (P2PClient._keep_warm)."""

    peer: Peer
    session: str  # the peer's process, as the controller knows it
    keeper: asyncio.Task | None = None
    state: str = "connecting"  # "connecting", "warm" or "retrying"
    ms: float | None = None  # the last warm-up's time
    failures: int = 0  # hellos failed in a row
    error: str | None = None


def _retrieve(task: asyncio.Task) -> None:
    """A hello's failure is seen by whoever awaits it; this keeps asyncio quiet when nobody did."""
    if not task.cancelled():
        task.exception()


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
        policy: PullPolicy | None = None,
        security: MeshSecurity | None = None,
        prefix_pull_turns: bool = True,
    ):
        self.ctx = ctx
        self.security = security  # the mesh's CurveZMQ keys; None: plain sockets
        self.me = identity
        self.storage = storage
        self.link = link
        self.transports = transports
        self.preferred = preferred if preferred in transports else "tcp"
        self.batch_chunks = batch_chunks  # chunks per request (config p2p_batch_chunks)
        self.pipeline_depth = pipeline_depth  # requests in flight per pull (p2p_pipeline_depth)
        self._connections: dict[tuple[str, int], _Connection] = {}
        self._warm: dict[tuple[str, int], _Warm] = {}  # the controller's warm set (set_warm_peers)
        # The engine's prefix pulls take turns, first asked first served: requests that arrive
        # together then become ready one after another, each at full bandwidth, instead of all
        # sharing it and all being ready only when the last pull ends. Pulls whose time is per-
        # request latency rather than bytes (VRAM to VRAM on one host) finish sooner all at once
        # (p2p_prefix_pull_turns: False).
        self._prefix_turn: AbstractAsyncContextManager = asyncio.Lock() if prefix_pull_turns else nullcontext()
        # Prefix pulls running now, and started so far: only a pull that ran alone measures the
        # link for the pull policy (one sharing it would make the link look slower than it is).
        self._prefix_pulls_running = 0
        self._prefix_pulls_started = 0
        # Whether a prefix pull beats recomputing it (config p2p_pull_policy); None: always pull.
        self.policy = policy
        self.stats: dict[str, Any] = {
            "pulls": 0,
            "chunks_pulled": 0,
            "bytes_pulled": 0,
            "pull_failures": 0,
            "prefix_hit_chunks": 0,
            "checksum_mismatches": 0,
            "pages_quarantined": 0,
            "gpu_landed_chunks": 0,
            "gpu_landed_checked_on_device": 0,  # of those, checked on the device (the rest by their write-back)
            "transfer_ms": 0.0,
            "verify_ms": 0.0,
            # The pull policy's skips: prefix pulls not made (slower than recomputing), the chunks
            # peers offered that were recomputed instead (skips, and the rest of a re-measuring
            # pull), and the skips per peer; its estimates as of its last decision.
            "pulls_skipped": 0,
            "chunks_skipped": 0,
            "pulls_skipped_by_peer": {},
            "pull_policy": policy.snapshot() if policy else None,
        }

    # -- the engine's question: pull the rest of this prefix -------------------------------------

    async def fetch_prefix(self, hashes: np.ndarray) -> int:
        """Pull as much of ``hashes`` (a prompt's chunks after the local hit) as one peer holds,
        where the pull policy says pulling beats recomputing; returns how many leading chunks are
        now held locally."""
        offer = await self.offer_prefix(hashes)
        return 0 if offer is None else await self.pull_offer(offer)

    async def offer_prefix(self, hashes: np.ndarray, timeout: float = REQUEST_TIMEOUT_S) -> PeerOffer | None:
        """What a pull of ``hashes`` (a prompt's chunks after the local hit) would bring, without
        moving a byte: the holder the controller names and the leading chunks the pull policy
        says to pull from it (None: no live peer holds the first one, or recomputing wins). The
        engine's scheduler promises these chunks at once; :meth:`pull_offer` brings them."""
        t0 = time.perf_counter()
        holders = [
            (h.matched_chunks, Peer(h.instance_id, h.rank, h.host, h.p2p_init_port, h.p2p_lookup_port))
            for h in await self.link.p2p_lookup(hashes, timeout)
            if h.p2p_lookup_port and h.p2p_init_port and h.matched_chunks > 0
        ]
        if not holders:
            return None
        asked_ms = (time.perf_counter() - t0) * 1e3
        # Longest prefix first; among equals the peer we have the fewest requests in flight to.
        holders.sort(key=lambda h: (-h[0], self._busy((h[1].host, h[1].lookup_port))))
        peer, chunks = self._decide(holders, asked_ms)
        if not chunks:
            return None
        return PeerOffer(peer, np.asarray(hashes[:chunks], dtype=np.uint64))

    async def pull_offer(self, offer: PeerOffer) -> int:
        """Pull an offer's chunks from its holder, in the engine's turn (prefix pulls take turns
        unless ``prefix_pull_turns`` is off); how many leading chunks are now held locally."""
        peer, hashes = offer.peer, offer.hashes
        t_turn = time.perf_counter()
        async with self._prefix_turn:
            logger.info(
                "%s: pulling %d chunk(s) from %s (offered %.1f ms ago; waited %.1f ms for the turn)",
                self.me.describe(),
                len(hashes),
                peer.describe(),
                (time.perf_counter() - offer.made) * 1e3,
                (time.perf_counter() - t_turn) * 1e3,
            )
            if self._channel_of(peer) is None:
                # Say hello first: a hello is no part of a pull's time, and a failed one is
                # reported as the pull's failure, as pull() would.
                try:
                    await self._connect(peer)
                except (RequestFailed, TransferError) as e:
                    self._report(peer, "?", len(hashes), PullResult(error=str(e)), 0.0, 0, dict.fromkeys(PHASES, 0.0))
                    return 0
            channel = self._channel_of(peer)
            self._prefix_pulls_running += 1
            self._prefix_pulls_started += 1
            started_alone, mine = self._prefix_pulls_running == 1, self._prefix_pulls_started
            t0 = time.perf_counter()
            try:
                result = await self.pull(peer, hashes, CPU, into_gpu_tier=True)
            finally:
                self._prefix_pulls_running -= 1
            elapsed = time.perf_counter() - t0
            alone = started_alone and self._prefix_pulls_started == mine  # none began meanwhile
        if self.policy is not None and alone and result.error is None and result.held and channel is not None:
            # Only clean pulls measure the link: a failure's time says how long a timeout is.
            self.policy.observe_pull(peer.describe(), channel, len(result.held) * self.storage.page_bytes, elapsed)
            self.stats["pull_policy"] = self.policy.snapshot()
        self.stats["prefix_hit_chunks"] += len(result.held)  # pulled for the engine (not for a move)
        return len(result.held)

    def _decide(self, holders: list[tuple[int, Peer]], asked_ms: float = 0.0) -> tuple[Peer, int]:
        """The holder to pull from and how many leading chunks, by the pull policy: the longest
        prefix whose pull beats recomputing it (holders come longest first). Logs the decision."""
        matched, peer = holders[0]
        if self.policy is None:
            return peer, matched
        first = chosen = None
        seen = set()
        for matched, peer in holders:
            if (peer.host, peer.lookup_port) in seen:
                continue  # the same rank again (another of its tiers): its longest prefix came first
            seen.add((peer.host, peer.lookup_port))
            decision = self.policy.decide(peer.describe(), self._channel_of(peer), matched)
            if first is None:
                first = (peer, decision)
            if decision.pull:
                chosen = (peer, decision)
                break
        assert first is not None
        peer, decision = chosen or first
        line = decision.describe(peer.describe(), self._channel_of(peer))
        if chosen is not None and chosen[0] is not first[0]:  # a shorter prefix over a faster link
            line += f" (instead of {first[1].offered} chunks at {first[0].describe()}: {first[1].numbers()})"
        logger.info("%s [holders from the controller in %.1f ms]", line, asked_ms)
        recomputed = first[1].offered - decision.chunks  # offered by a peer, recomputed instead
        if recomputed > 0:
            self.stats["chunks_skipped"] += recomputed
        if not decision.pull:
            self.stats["pulls_skipped"] += 1
            by_peer = self.stats["pulls_skipped_by_peer"]
            by_peer[peer.describe()] = by_peer.get(peer.describe(), 0) + 1
        self.stats["pull_policy"] = self.policy.snapshot()
        return peer, decision.chunks

    def _channel_of(self, peer: Peer) -> str | None:
        """The channel agreed with ``peer`` as pull logs name it; None before its hello."""
        conn = self._connections.get((peer.host, peer.lookup_port))
        if conn is None or conn.channel is None:
            return None
        return conn.channel + (" via GPU staging" if conn.staged else "")

    def _busy(self, key: tuple[str, int]) -> int:
        conn = self._connections.get(key)
        return conn.lookup.in_flight if conn else 0

    # -- pulls -----------------------------------------------------------------------------------

    async def pull(
        self, peer: Peer, hashes, location: str, skip_missing: bool = False, into_gpu_tier: bool = False
    ) -> PullResult:
        """Pull ``hashes`` from ``peer`` into ``location``, in order. The run ends at the first
        failure; with ``skip_missing`` (move/copy of an arbitrary key set) a chunk the holder
        merely lacks (or sent damaged) is skipped instead. A full pool here ends it either way.
        With ``into_gpu_tier`` (the engine's prefix pulls) a same-host holder may write them into
        our GPU tier, where the engine loads them at once; other pulls (move, copy) land in the
        CPU tier, whose index their callers read right after.

        Requests of ``batch_chunks`` chunks are pipelined, ``pipeline_depth`` in flight: checksums of
        one batch are verified while the next is on the wire. Batches are committed in order."""
        result = PullResult()
        t0 = time.perf_counter()
        todo: deque[list[int]] = deque()
        channel = "?"
        try:
            conn = await self._connect(peer)
            channel = conn.agreed + (" via GPU staging" if conn.staged else "")
            limit = self.transports[conn.agreed].max_batch(into_gpu_tier and conn.staged)
            batch_chunks = min(self.batch_chunks, limit or self.batch_chunks)
            todo.extend(_split([int(h) for h in hashes], batch_chunks))
        except (RequestFailed, TransferError) as e:
            result.error = str(e)
        window: deque[asyncio.Task] = deque()
        stopped = False
        phases_ms = dict.fromkeys(PHASES, 0.0)
        batches = 0
        while todo or window:
            while todo and not stopped and len(window) < self.pipeline_depth:
                window.append(asyncio.ensure_future(self._fetch(conn, peer, todo.popleft(), into_gpu_tier)))
            try:
                # Shielded: a caller that gives up (the engine's timeout) leaves the batches to
                # finish their own requests, and their pages (CPU and GPU tier) are given back then.
                batch = await asyncio.shield(window[0])
            except BaseException:  # given up on (or a batch raised): nothing commits what is in flight
                for task in window:
                    task.add_done_callback(self._abandon_finished)
                raise
            window.popleft()
            batches += 1
            for phase, ms in batch.phases_ms.items():
                phases_ms[phase] += ms
            if stopped:  # an earlier batch failed: what follows it is a miss
                self._abandon_batch(batch)
                continue
            landed = min(batch.good, len(batch.gpu_pages))
            result.gpu_landed += landed
            if batch.device_checksums is not None:
                result.gpu_checked_on_device += landed
                self.stats["gpu_landed_checked_on_device"] += landed
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
                "(from %s over %s, to rank %d) [%d batches, ms summed: %s]%s",
                len(result.held) * self.me.chunk_size,
                asked * self.me.chunk_size,
                nbytes / 1e9,
                elapsed * 1e3,
                nbytes / 1e9 / max(elapsed, 1e-9),
                peer.describe(),
                channel,
                self.me.rank,  # vLLM's per-process line prefixes interleave when ranks log at once
                batches,
                describe_phases(phases_ms),
                (
                    f"; {result.gpu_landed} chunk(s) landed in the GPU tier"
                    f" ({result.gpu_checked_on_device} checked on the device)"
                )
                if result.gpu_landed
                else "",
            )
            self.stats["gpu_landed_chunks"] += result.gpu_landed
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
            conn = self._connections[key] = _Connection(self.ctx, peer, self.security)
        return conn

    def lookup_socket(self, peer: Peer) -> RpcClient:
        """The peer's p2p_lookup socket, for requests that need no channel session (FetchChunks)."""
        return self._connection(peer).lookup

    async def _connect(self, peer: Peer) -> _Connection:
        """The peer's connection with its channel agreed. A pull that arrives while a hello is on
        its way (a warm-up's) waits for that one; a pull that gives up (the engine's timeout)
        leaves the hello running, so the connection is ready for the next one."""
        conn = self._connection(peer)
        if conn.channel is None:
            await asyncio.shield(self._start_hello(peer, conn, "on demand"))
        elif conn.hello is not None and not conn.hello.done():
            # Agreed, but a hello is still finishing (the channel's own set-up after the reply,
            # or a keeper's second hello): the session is ready only once it is done.
            await asyncio.shield(conn.hello)
        return conn

    def _start_hello(self, peer: Peer, conn: _Connection, why: str) -> asyncio.Task:
        """The connection's hello in flight, or a new one when none is (or the last one failed)."""
        if conn.hello is None or conn.hello.done():
            conn.hello = asyncio.ensure_future(self._hello(peer, conn, why))
            conn.hello.add_done_callback(_retrieve)
        return conn.hello

    async def _hello(self, peer: Peer, conn: _Connection, why: str) -> None:
        """Agree a channel with the holder (and open its session for us): ours, else tcp."""
        t0 = time.perf_counter()
        error = "refused"
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
            await self.transports[channel].connect((peer.host, peer.lookup_port), reply)  # tcp data streams
            conn.hello_ms = (time.perf_counter() - t0) * 1e3
            if channel != self.preferred:
                logger.info("%s serves %s only; pulling from it over tcp", peer.describe(), reply.channels)
            if why == "on demand":  # a warm-up logs its own line
                logger.info(
                    "%s: connected to peer %s on demand over %s in %.1f ms (its first pull waited for it)",
                    self.me.describe(),
                    peer.describe(),
                    conn.describe_channel(),
                    conn.hello_ms,
                )
            return
        self._drop(peer, conn)
        raise TransferError(f"{peer.describe()} refused the {self.preferred} session: {error}")

    def _drop(self, peer: Peer, conn: _Connection | None = None) -> None:
        """Close the peer's connection (only if it is still ``conn``, when given): the next pull,
        or the peer's keeper when it is warm, connects again."""
        key = (peer.host, peer.lookup_port)
        current = self._connections.get(key)
        if current is None or (conn is not None and current is not conn):
            return
        del self._connections[key]
        current.close()

    async def _fetch(self, conn: _Connection, peer: Peer, hashes: list[int], into_gpu_tier: bool = False) -> _Batch:
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
        slots = await transport.prepare(pages, conn.staged, timeout, gpu_tier=into_gpu_tier)
        batch.phases_ms["slots"] = (time.perf_counter() - t_slots) * 1e3
        # tcp: the payloads come over our data streams from this holder, straight into the pages
        batch.landing = transport.begin((peer.host, peer.lookup_port), pages)
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
            self._close_landing(batch)
            return batch
        except RemoteError as e:  # the holder refused (unknown session, layout, its transfer failed)
            transport.release(slots)
            batch.error, batch.peer_failed = str(e), True
            self._close_landing(batch)
            return batch
        return await self._land(batch, transport, reply, frames, slots, peer, t0, timeout)

    async def _land(
        self,
        batch: _Batch,
        transport: Transport,
        reply: ChunkPullReply,
        frames: list,
        slots: list[int],
        peer: Peer,
        t0: float,
        timeout: float,
    ) -> _Batch:
        """Place and verify what the holder's reply says it sent; gives the receive slots back.
        Streamed payloads (tcp) may still be on their way when the reply arrives: they are waited
        for here, within what is left of the request's timeout."""
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
                idle = self._close_landing(batch)
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
        """Index the verified leading pages of a batch; the rest go back to the pool. (Batches
        landed in the GPU tier are prefix pulls for the engine, whose ``location`` is the CPU.)"""
        good = batch.good
        held = list(batch.hashes[:good])
        if batch.gpu_pages:
            checksums = [int(c) for c in batch.checksums[:good]]
            landing = self.storage.landing
            assert landing is not None  # GPU tier pages were reserved: the store has the tier and its landing
            landing.commit_landed(
                held,
                batch.gpu_pages[:good],
                batch.pages[:good],
                checksums,
                device_checksums=None if batch.device_checksums is None else batch.device_checksums[:good],
            )
        else:
            for i in range(good):
                self.storage.commit_page(batch.hashes[i], batch.pages[i], int(batch.checksums[i]), location)
        self._abandon_batch(batch, good)
        return held

    def _abandon_finished(self, task: asyncio.Task) -> None:
        """A batch of a pull its caller gave up on: nothing commits it, so its pages go back."""
        if not task.cancelled() and task.exception() is None:
            self._abandon_batch(task.result())

    def _abandon_batch(self, batch: _Batch, start: int = 0) -> None:
        """Give a batch's pages (CPU and GPU tier) back from chunk ``start`` on."""
        self._abandon(batch.pages[start:])
        for page in batch.gpu_pages[start:]:
            self.storage.abandon_gpu_page(page)

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

    def _close_landing(self, batch: _Batch) -> bool:
        """Stop a batch's streamed payloads (tcp) from landing. True when nothing writes into its
        pages any more; else a segment is being received into them right now, and the pages are
        quarantined (taken from the batch) until that write ends."""
        landing, batch.landing = batch.landing, None
        if landing is None:
            return True
        pages, batch.pages = batch.pages, []

        def release() -> None:
            self._abandon(pages)
            self.stats["pages_quarantined"] -= len(pages)

        if landing.close(on_idle=release):
            batch.pages = pages
            return True
        self.stats["pages_quarantined"] += len(pages)
        return False

    # -- the warm set -----------------------------------------------------------------------------

    def set_warm_peers(self, peers: list[MeshPeer], registered: bool = False, limit: int | None = None) -> None:
        """Take the controller's warm set (at most ``limit`` of ``peers``): keep a connection to
        each, in the background. A peer that left the set is dropped, and one at the same address
        under another session (it restarted) is connected afresh. With ``registered`` (the set
        that came with a registration: the controller may have restarted and not every peer be
        back yet), connections to peers missing from it stay open, as on-demand ones."""
        wanted: dict[tuple[str, int], tuple[Peer, str]] = {}
        for p in peers[:limit]:
            if p.p2p_init_port and p.p2p_lookup_port:
                peer = Peer(p.instance_id, p.rank, p.host, p.p2p_init_port, p.p2p_lookup_port)
                wanted[(peer.host, peer.lookup_port)] = (peer, p.session)
        for key, warm in list(self._warm.items()):
            target = wanted.get(key)
            if target == (warm.peer, warm.session):
                continue
            del self._warm[key]
            if warm.keeper is not None:
                warm.keeper.cancel()
            if target is not None:
                outcome = "restarted: connecting to its new process"
                self._drop(warm.peer)
            elif registered:
                outcome = "not in the controller's first warm set since registering: kept, on demand"
            elif self._busy(key):
                outcome = "left the warm set: its pulls in flight finish, then it connects on demand"
            else:
                outcome = "left the warm set: connection closed"
                self._drop(warm.peer)
            logger.info("%s: peer %s %s", self.me.describe(), warm.peer.describe(), outcome)
        for key, (peer, session) in wanted.items():
            if key not in self._warm:
                warm = self._warm[key] = _Warm(peer, session)
                warm.keeper = asyncio.ensure_future(self._keep_warm(warm))

    async def _keep_warm(self, warm: _Warm) -> None:
        """Connect to a warm-set peer, and again whenever its connection is dropped (a failed
        pull); a hello that fails is retried with backoff, logged once. Runs until cancelled."""
        peer, delay = warm.peer, WARM_RETRY_FIRST_S
        while True:
            t0 = time.perf_counter()
            try:
                conn = self._connection(peer)
                if conn.channel is None or conn.peer_session != warm.session:
                    # Also on a connection a pull opened: the hello is idempotent at the holder
                    # and (re)opens our session there if this is a process it has not seen.
                    await asyncio.shield(self._start_hello(peer, conn, "warm-up"))
                    conn.peer_session = warm.session
            except (RequestFailed, TransferError) as e:
                warm.failures += 1
                warm.state, warm.error = "retrying", str(e)
                log = logger.warning if warm.failures == 1 else logger.debug
                log(
                    "%s: could not warm peer %s (%s); retrying in %.0f s and then with backoff up to %.0f s "
                    "(pulls from it connect on demand meanwhile)",
                    self.me.describe(),
                    peer.describe(),
                    e,
                    delay,
                    WARM_RETRY_MAX_S,
                )
                await asyncio.sleep(delay)
                delay = min(2 * delay, WARM_RETRY_MAX_S)
                continue
            warm.state, warm.ms, warm.error = "warm", (time.perf_counter() - t0) * 1e3, None
            logger.info(
                "%s: peer %s warm over %s in %.1f ms (hello %.1f ms)%s",
                self.me.describe(),
                peer.describe(),
                conn.describe_channel(),
                warm.ms,
                conn.hello_ms,
                f" after {warm.failures} failed tries" if warm.failures else "",
            )
            warm.failures, delay = 0, WARM_RETRY_FIRST_S
            await conn.closed.wait()
            warm.state = "connecting"
            await asyncio.sleep(WARM_RETRY_FIRST_S)  # a pull just failed on it: give the peer a moment

    def is_warm(self, instance_id: str, rank: int) -> bool:
        """Whether (instance_id, rank) is in the warm set the controller last sent."""
        return any(w.peer.instance_id == instance_id and w.peer.rank == rank for w in self._warm.values())

    def warm_peers(self) -> list[dict]:
        """The warm set as /status shows it (read from the engine's thread too: a snapshot)."""
        out = []
        for key, warm in list(self._warm.items()):
            conn = self._connections.get(key)
            out.append(
                {
                    "peer": warm.peer.describe(),
                    "state": warm.state,
                    "channel": conn.describe_channel() if conn else None,
                    "warm_ms": None if warm.ms is None else round(warm.ms, 1),
                    "failures": warm.failures,
                    "error": warm.error,
                }
            )
        return out

    def close(self) -> None:
        for warm in self._warm.values():
            if warm.keeper is not None:
                warm.keeper.cancel()
        self._warm.clear()
        for conn in self._connections.values():
            conn.close()
        self._connections.clear()
