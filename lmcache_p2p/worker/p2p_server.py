"""Serving this rank's chunks to peers (the holder side of P2P).

Two ROUTER sockets, each an :class:`~lmcache_p2p.rpc.RpcServer`: ``p2p_init`` takes a
requester's hello (its channel, layout fingerprint and, for NIXL, its agent metadata and pool
geometry) and opens a session; ``p2p_lookup`` takes chunk pulls and move/copy fetches. Each
request runs as its own task, so one slow transfer does not hold up the others; at most
``max_concurrent_pulls`` pulls pin pages at once.

A pull pins the leading chunks we hold (a disk hit is promoted into the CPU tier first), sends
them over the session's channel with their checksums, and releases the pins once the reply is
on the wire (``Answer.on_sent``). Over tcp the payloads go over the session's data streams
(the transport's data port, bound on this rank's p2p host and offered in the hello reply) when
the requester opened some, else as reply frames. A request for another layout (model, dtype,
TP rank...) is refused.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from lmcache_p2p import device_checksum
from lmcache_p2p.keys import hashed
from lmcache_p2p.mesh_security import MeshSecurity
from lmcache_p2p.protocol import (
    ChannelHello,
    ChannelHelloReply,
    ChunkPull,
    ChunkPullReply,
    FetchChunks,
    FetchReply,
    pack_hashes,
    unpack_hashes,
    unpack_pages,
)
from lmcache_p2p.rpc import Answer, Handler, RpcServer
from lmcache_p2p.storage.chunk_store import ChunkStore
from lmcache_p2p.storage.cpu_tier import PinnedChunk
from lmcache_p2p.transfer import TransferError, Transport
from lmcache_p2p.vocab import GPU
from lmcache_p2p.worker.identity import WorkerIdentity
from lmcache_p2p.worker.p2p_client import P2PClient
from lmcache_p2p.worker.peer_links import Peer

logger = logging.getLogger(__name__)

# ZMQ_MAXMSGSIZE of the two sockets (a bigger frame ends the connection before it is allocated):
# * p2p_init takes only ChannelHellos: ~0.2 KiB plus NIXL's agent metadata (0.5 KiB with one
#   registered pool over UCX here; more with many NICs), which accept() bounds to 4 MiB;
# * p2p_lookup takes ChunkPulls (a batch of 8-32 chunks: under 1 KiB) and FetchChunks (a move's
#   or copy's chunk hashes: 512 KiB for a 1M-token prompt in 16-token chunks).
P2P_INIT_MAX_MESSAGE_BYTES = 8 * 2**20
P2P_LOOKUP_MAX_MESSAGE_BYTES = 4 * 2**20


class PeerServer:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        identity: WorkerIdentity,
        storage: ChunkStore,
        transports: dict[str, Transport],
        client: P2PClient,
        max_concurrent_pulls: int = 4,
        security: MeshSecurity | None = None,
    ):
        self.me = identity
        self.storage = storage
        self.transports = transports
        self.client = client
        self._sessions: dict[str, Transport] = {}
        self._pull_slots = asyncio.Semaphore(max_concurrent_pulls)
        # Called with (instance id, rank) of each requester that opened a session: a rank that
        # greets us is live and of our layout, which the worker uses to learn of newcomers early.
        self.on_greeted: Callable[[str, int], object] | None = None
        # Sends the storage events waiting in the worker's batchers (EventStream.flush): a move's
        # destination reports what it now holds before its reply lets the source call it done.
        self.flush_events: Callable[[], object] | None = None
        self.stats = {
            "sessions": 0,
            "pulls_served": 0,
            "chunks_served": 0,
            "chunks_served_from_gpu_tier": 0,  # sent from VRAM (local_gpu): no host copy first
            "device_checksums_kept": 0,  # of those, sent with the device checksum taken at their store
            "bytes_served": 0,
            "pulls_refused": 0,
            "bad_frames": 0,
        }
        self._servers: list[RpcServer] = []
        sockets: list[tuple[str, int | None, dict[type, Handler], int]] = [
            ("p2p_init", identity.p2p_init_port, {ChannelHello: self._on_hello}, P2P_INIT_MAX_MESSAGE_BYTES),
            (
                "p2p_lookup",
                identity.p2p_lookup_port,
                {ChunkPull: self._on_pull, FetchChunks: self._on_fetch},
                P2P_LOOKUP_MAX_MESSAGE_BYTES,
            ),
        ]
        for name, port, handlers, max_bytes in sockets:
            server = RpcServer(
                ctx,
                f"{identity.describe()} {name}",
                handlers,
                concurrent=True,
                on_bad_frame=self._count_bad_frame,
                security=security,
                max_message_bytes=max_bytes,
            )
            try:
                identity.bound(f"{name}_port", server.bind(f"tcp://{identity.host}:{port}"))
            except zmq.ZMQError as e:
                self.close()
                raise OSError(
                    f"{identity.describe()}: cannot bind {name} port {port}: {e.strerror} "
                    f"(set {name}_ports to free ports, one per TP rank)"
                ) from None
            self._servers.append(server)
        for transport in transports.values():
            try:
                transport.listen(identity.host)  # the configured p2p host only, never every interface
            except OSError as e:
                # Pulls from us still work: the payloads ride the replies (slower).
                logger.warning(
                    "%s: no %s data port on %s (%s); peers get payloads in replies",
                    identity.describe(),
                    transport.name,
                    identity.host,
                    e,
                )

    def start(self) -> None:
        for server in self._servers:
            server.start()

    def close(self) -> None:
        for server in self._servers:
            server.close()
        self._servers.clear()

    def _count_bad_frame(self, why: str) -> None:
        self.stats["bad_frames"] += 1

    # -- handlers --------------------------------------------------------------------------------

    async def _on_hello(self, hello: ChannelHello) -> ChannelHelloReply:
        channels = list(self.transports)
        if hello.fingerprint != self.storage.fingerprint:
            return ChannelHelloReply(
                ok=False,
                channels=channels,
                error=(
                    f"layout mismatch: {self.me.describe()} stores {self.me.layout.model}/{self.me.layout.dtype} "
                    f"tp {self.me.layout.tp_rank}/{self.me.layout.tp_size} "
                    f"(fingerprint {self.storage.fingerprint:016x}), "
                    f"requester has {hello.fingerprint:016x}"
                ),
            )
        transport = self.transports.get(hello.channel)
        if transport is None:
            return ChannelHelloReply(
                ok=False, channels=channels, error=f"channel {hello.channel!r} not served here (serving {channels})"
            )
        try:
            staged = await transport.accept(hello)
        except TransferError as e:
            return ChannelHelloReply(ok=False, channels=channels, error=str(e))
        self._sessions[hello.session] = transport
        self.stats["sessions"] += 1
        data_port, data_token = transport.offer(hello.session)
        if self.on_greeted is not None:
            try:
                self.on_greeted(hello.instance_id, hello.rank)
            except Exception:  # a hook's failure is no reason to refuse the session
                logger.exception("%s: on_greeted hook failed", self.me.describe())
        return ChannelHelloReply(ok=True, channels=channels, staged=staged, data_port=data_port, data_token=data_token)

    async def _on_pull(self, request: ChunkPull) -> Answer:
        """A pull, at most ``max_concurrent_pulls`` at once. Its pins and its slot are held until
        the reply is sent: TCP payload frames are zero-copy views of the pinned pages (streamed
        payloads are in the kernel's socket buffers by then)."""
        await self._pull_slots.acquire()
        pins: list[PinnedChunk] = []

        def release() -> None:
            for chunk in pins:
                chunk.release()
            self._pull_slots.release()

        try:
            reply, frames = await self._serve_pull(request, pins)
        except BaseException:  # no Answer takes the pins to on_sent
            release()
            raise
        return Answer(reply, frames, on_sent=release)

    async def _serve_pull(self, request: ChunkPull, pins: list[PinnedChunk]) -> tuple[ChunkPullReply, list]:
        """Pin (into ``pins``) and send the leading chunks we hold; the reply and its frames."""
        transport = self._sessions.get(request.session)
        if transport is None:
            self.stats["pulls_refused"] += 1
            return ChunkPullReply(ok=False, error=f"unknown session {request.session!r}: hello on p2p_init first"), []
        if request.fingerprint != self.storage.fingerprint:
            self.stats["pulls_refused"] += 1
            return ChunkPullReply(ok=False, error="layout mismatch"), []
        t0 = time.perf_counter()
        hashes = unpack_hashes(request.hashes)
        pages = unpack_pages(request.pages)
        slots = unpack_pages(request.slots)
        # VRAM copies go out device to device, through the receive slots the requester offered;
        # a request without enough slots (none were free in time) is served from host memory.
        from_gpu = transport.reads_gpu_tier(request.session) and len(slots) >= len(hashes)
        for h in hashes:
            chunk = self.storage.pin(int(h), gpu=from_gpu)
            if chunk is None:
                break
            if not transport.addressable(chunk):
                chunk.release()
                break
            pins.append(chunk)
        if not pins:
            return ChunkPullReply(ok=True, served=0), []
        # Known since store for most chunks; the rest are hashed now: here when they are few host
        # pages (a hop to a thread and back costs more in an engine's process), else on threads.
        to_hash = sum(math.inf if c.location == GPU else c.data.numel() for c in pins if not c.checksum_known)
        checksums = await hashed(lambda c: c.checksum, pins, to_hash)
        device_sums = await self._device_checksums(request, pins)
        timeout = 0.9 * request.timeout_s
        frames: list = []
        staged = False
        queued: float | None = None
        t_write = time.perf_counter()
        try:
            if request.transfer:  # tcp: over the data streams the requester opened, if it has any
                queued = await transport.send_streamed(request.session, pins, request.transfer, timeout)
            if queued is None:
                frames, staged = await transport.send(request.session, pins, pages, slots, timeout)
        except TransferError as e:
            self.stats["pulls_refused"] += 1
            logger.warning("%s: sending %d chunk(s) failed: %s", self.me.describe(), len(pins), e)
            return ChunkPullReply(ok=False, error=str(e)), []
        streamed = queued is not None
        write_ms = (time.perf_counter() - t_write - (queued or 0.0)) * 1e3
        nbytes = len(pins) * self.storage.page_bytes
        # Waiting behind the session's earlier requests for its streams is queueing, not our work.
        elapsed = time.perf_counter() - t0 - (queued or 0.0)
        self.stats["pulls_served"] += 1
        self.stats["chunks_served"] += len(pins)
        self.stats["chunks_served_from_gpu_tier"] += sum(c.location == GPU for c in pins)
        if staged and device_sums:  # sent: those taken at their store, not computed for this pull
            self.stats["device_checksums_kept"] += sum(c.device_checksum is not None for c in pins)
        self.stats["bytes_served"] += nbytes
        logger.debug(
            "%s: served %d chunk(s), %.1f MiB over %s%s in %.2f ms (%.2f GB/s)",
            self.me.describe(),
            len(pins),
            nbytes / 2**20,
            transport.name,
            " (GPU staged)" if staged else " (data streams)" if streamed else "",
            elapsed * 1e3,
            nbytes / 1e9 / max(elapsed, 1e-9),
        )
        return ChunkPullReply(
            ok=True,
            served=len(pins),
            checksums=pack_hashes(checksums),
            device_checksums=pack_hashes(device_sums) if staged and device_sums else b"",
            staged=staged,
            streamed=streamed,
            holder_ms=elapsed * 1e3,
            holder_write_ms=write_ms,
        ), frames

    async def _device_checksums(self, request: ChunkPull, pins: list[PinnedChunk]) -> list[int]:
        """Device checksums of the chunks about to be written, for a requester that checks its
        landed GPU tier pages with them instead of holding its step for a host copy and a hash.
        Only over GPU tier copies whose own bytes are checked: stored here, or landed here and
        checked (on the device, or by its write-back); one whose check still runs is not vouched
        for. Else none."""
        if request.device_check != device_checksum.VERSION:
            return []
        if not all(c.location == GPU and c.check is None for c in pins):
            return []
        # Stored chunks' were taken behind their stores (StoreHasher.keep_device_checksums) and
        # landed ones' kept when they matched on the device; the rest (checked on the host, or a
        # store's job not done yet) are computed now, in one launch.
        missing = [c.data for c in pins if c.device_checksum is None]
        computed: list[int] = []
        if missing:
            try:
                computed = await asyncio.to_thread(device_checksum.device_checksums, missing)
            except Exception:  # the requester then checks on the host, as without them
                logger.exception("%s: device checksums of %d chunk(s) failed", self.me.describe(), len(missing))
                return []
        fresh = iter(computed)  # in the order of the pins that lacked one
        return [c.device_checksum if c.device_checksum is not None else next(fresh) for c in pins]

    async def _on_fetch(self, request: FetchChunks) -> FetchReply:
        """Move/copy destination: pull the listed chunks from the source into ``location``."""
        if request.location not in self.storage.locations:
            return FetchReply(
                ok=False,
                error=f"{self.me.describe()} has no location {request.location!r} (it has {self.storage.locations})",
            )
        if request.fingerprint != self.storage.fingerprint:
            return FetchReply(ok=False, error=f"layout mismatch with {self.me.describe()}")
        src = request.source
        if not src.p2p_init_port or not src.p2p_lookup_port:
            return FetchReply(ok=False, error=f"source {src.instance_id} rank {src.rank} has no p2p ports")
        hashes = unpack_hashes(request.hashes).tolist()
        have = [h for h in hashes if self.storage.holds(h, request.location)]
        have_set = set(have)
        wanted = [h for h in hashes if h not in have_set]
        peer = Peer(src.instance_id, src.rank, src.host, src.p2p_init_port, src.p2p_lookup_port)
        result = await self.client.pull(peer, wanted, request.location, skip_missing=True) if wanted else None
        pulled = result.held if result else []
        problems = [result.error] if result and result.error and len(pulled) < len(wanted) else []
        # The source evicts what we report (move): only chunks held now count. In a pool smaller
        # than the move, a later batch's pages can evict a chunk an earlier batch brought.
        held = [h for h in have + pulled if self.storage.holds(h, request.location)]
        if len(held) < len(have) + len(pulled):
            problems.append(
                f"{len(have) + len(pulled) - len(held)} chunk(s) evicted here again before the fetch "
                f"ended (the pool is smaller than the move)"
            )
        error = "; ".join(problems) or None
        logger.info(
            "%s: %s fetched %d of %d chunk(s) from %s into %s (%d held already)%s",
            self.me.describe(),
            request.event_id,
            len(pulled),
            len(wanted),
            peer.describe(),
            request.location,
            len(have),
            f"; {error}" if error else "",
        )
        if self.flush_events is not None:
            self.flush_events()
        return FetchReply(ok=True, held=pack_hashes(held), error=error)
