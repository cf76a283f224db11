"""Serving this rank's chunks to peers (the holder side of P2P).

Two ROUTER sockets: ``p2p_init`` takes a requester's hello (its channel, layout fingerprint and,
for NIXL, its agent metadata and pool geometry) and opens a session; ``p2p_lookup`` takes chunk
pulls and move/copy fetches. Each request runs as its own task, so one slow transfer does not
hold up the others; at most ``max_concurrent_pulls`` pulls pin pages at once.

A pull pins the leading chunks we hold (a disk hit is promoted into the CPU tier first), sends
them over the session's channel with their checksums, and releases the pins once the reply is
on the wire. A request for another layout (model, dtype, TP rank...) is refused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

import zmq
import zmq.asyncio

from lmcache_p2p.keys import in_parallel
from lmcache_p2p.protocol import (
    Ack, ChannelHello, ChannelHelloReply, ChunkPull, ChunkPullReply, DecodeError, FetchChunks, FetchReply, encode,
    pack_hashes, peer_request_decoder, unpack_hashes, unpack_pages,
)
from lmcache_p2p.storage.cpu_tier import PinnedChunk
from lmcache_p2p.storage.manager import StorageManager
from lmcache_p2p.transfer import Transport, TransferError
from lmcache_p2p.worker.identity import WorkerIdentity
from lmcache_p2p.worker.p2p_client import P2PClient, Peer

logger = logging.getLogger(__name__)


class PeerServer:
    def __init__(self, ctx: zmq.asyncio.Context, identity: WorkerIdentity, storage: StorageManager,
                 transports: dict[str, Transport], client: P2PClient, max_concurrent_pulls: int = 4):
        self.me = identity
        self.storage = storage
        self.transports = transports
        self.client = client
        self._sessions: dict[str, Transport] = {}
        self._pull_slots = asyncio.Semaphore(max_concurrent_pulls)
        self._sockets: dict[str, zmq.asyncio.Socket] = {}
        self._tasks: list[asyncio.Task] = []
        self._requests: set[asyncio.Task] = set()
        for name, port in (("p2p_init", identity.p2p_init_port), ("p2p_lookup", identity.p2p_lookup_port)):
            sock = ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.bind(f"tcp://*:{port}")
            except zmq.ZMQError as e:
                sock.close(linger=0)
                self.close()
                raise OSError(f"{identity.describe()}: cannot bind {name} port {port}: {e.strerror} "
                              f"(set {name}_ports to free ports, one per TP rank)") from None
            self._sockets[name] = sock
        self.stats = {"sessions": 0, "pulls_served": 0, "chunks_served": 0, "bytes_served": 0, "pulls_refused": 0,
                      "bad_frames": 0}

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._loop(name)) for name in self._sockets]

    def close(self) -> None:
        for task in [*self._tasks, *self._requests]:
            task.cancel()
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()

    async def _loop(self, name: str) -> None:
        sock = self._sockets[name]
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                self.stats["bad_frames"] += 1
                logger.warning("%s: bad frame on %s: %d frames", self.me.describe(), name, len(frames))
                continue
            identity, request_id, payload = frames
            try:
                request = peer_request_decoder.decode(payload)
            except DecodeError as e:
                self.stats["bad_frames"] += 1
                logger.warning("%s: undecodable request on %s: %s", self.me.describe(), name, e)
                await sock.send_multipart([identity, request_id, encode(Ack(ok=False, error=f"undecodable: {e}"))])
                continue
            task = asyncio.ensure_future(self._answer(sock, identity, request_id, request))
            self._requests.add(task)
            task.add_done_callback(self._requests.discard)

    async def _answer(self, sock: zmq.asyncio.Socket, identity: bytes, request_id: bytes, request) -> None:
        pins: list[PinnedChunk] = []
        try:
            if isinstance(request, ChannelHello):
                reply, frames = await self._on_hello(request), []
            elif isinstance(request, ChunkPull):
                async with self._pull_slots:
                    reply, frames = await self._on_pull(request, pins)
                    await self._send(sock, [identity, request_id, encode(reply), *frames])
                return
            elif isinstance(request, FetchChunks):
                reply, frames = await self._on_fetch(request), []
            else:
                reply, frames = Ack(ok=False, error=f"{type(request).__name__} is not a peer request"), []
            await self._send(sock, [identity, request_id, encode(reply), *frames])
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.exception("%s: serving %s failed", self.me.describe(), type(request).__name__)
            await sock.send_multipart([identity, request_id, encode(Ack(ok=False, error=f"holder error: {e}"))])
        finally:
            for chunk in pins:
                chunk.release()

    @staticmethod
    async def _send(sock: zmq.asyncio.Socket, frames: list) -> None:
        if len(frames) <= 3:
            await sock.send_multipart(frames)
            return
        # Payload frames are zero-copy views of pinned pages: wait until ZMQ is done with them
        # before the caller releases the pins.
        tracker = await sock.send_multipart(frames, copy=False, track=True)
        pause = 0.0005
        while not tracker.done:
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.01)

    # -- handlers --------------------------------------------------------------------------------

    async def _on_hello(self, hello: ChannelHello) -> ChannelHelloReply:
        channels = list(self.transports)
        if hello.fingerprint != self.storage.fingerprint:
            return ChannelHelloReply(ok=False, channels=channels, error=(
                f"layout mismatch: {self.me.describe()} stores {self.me.layout.model}/{self.me.layout.dtype} "
                f"tp {self.me.layout.tp_rank}/{self.me.layout.tp_size} (fingerprint {self.storage.fingerprint:016x}), "
                f"requester has {hello.fingerprint:016x}"))
        transport = self.transports.get(hello.channel)
        if transport is None:
            return ChannelHelloReply(ok=False, channels=channels,
                                     error=f"channel {hello.channel!r} not served here (serving {channels})")
        try:
            staged = await transport.accept(hello)
        except TransferError as e:
            return ChannelHelloReply(ok=False, channels=channels, error=str(e))
        self._sessions[hello.session] = transport
        self.stats["sessions"] += 1
        return ChannelHelloReply(ok=True, channels=channels, staged=staged)

    async def _on_pull(self, request: ChunkPull, pins: list[PinnedChunk]) -> tuple[ChunkPullReply, list]:
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
        for h in hashes:
            chunk = self.storage.pin(int(h))
            if chunk is None:
                break
            if not transport.addressable(chunk):
                chunk.release()
                break
            pins.append(chunk)
        if not pins:
            return ChunkPullReply(ok=True, served=0), []
        # Known since store for most chunks; the rest are hashed now, on several threads.
        checksums = await asyncio.to_thread(in_parallel, lambda c: c.checksum, pins)
        try:
            frames, staged = await transport.send(request.session, pins, pages, slots, 0.9 * request.timeout_s)
        except TransferError as e:
            self.stats["pulls_refused"] += 1
            logger.warning("%s: sending %d chunk(s) failed: %s", self.me.describe(), len(pins), e)
            return ChunkPullReply(ok=False, error=str(e)), []
        nbytes = len(pins) * self.storage.page_bytes
        elapsed = time.perf_counter() - t0
        self.stats["pulls_served"] += 1
        self.stats["chunks_served"] += len(pins)
        self.stats["bytes_served"] += nbytes
        logger.debug("%s: served %d chunk(s), %.1f MiB over %s%s in %.2f ms (%.2f GB/s)", self.me.describe(), len(pins),
                     nbytes / 2**20, transport.name, " (GPU staged)" if staged else "", elapsed * 1e3,
                     nbytes / 1e9 / max(elapsed, 1e-9))
        return ChunkPullReply(ok=True, served=len(pins), checksums=pack_hashes(checksums), staged=staged,
                              holder_ms=elapsed * 1e3), frames

    async def _on_fetch(self, request: FetchChunks) -> FetchReply:
        """Move/copy destination: pull the listed chunks from the source into ``location``."""
        if request.location not in self.storage.locations:
            return FetchReply(ok=False, error=f"{self.me.describe()} has no location {request.location!r} "
                                              f"(it has {self.storage.locations})")
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
        held = have + (result.held if result else [])
        error: Optional[str] = result.error if result and len(result.held) < len(wanted) else None
        logger.info("%s: %s fetched %d of %d chunk(s) from %s into %s (%d held already)%s", self.me.describe(),
                    request.event_id, len(held) - len(have), len(wanted), peer.describe(), request.location, len(have),
                    f"; {error}" if error else "")
        return FetchReply(ok=True, held=pack_hashes(held), error=error)
