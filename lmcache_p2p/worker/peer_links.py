"""Connections to peer ranks: one per peer, its channel agreed by one hello.

A hello agrees the channel (ours, else tcp) and opens our session at the holder (NIXL metadata,
GPU staging, tcp data streams). A caller that finds a hello still on its way waits for that one
rather than sending another, and a caller that gives up leaves it running, so the connection is
ready for the next pull. A failed pull drops the connection; whoever needs it next connects again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import zmq.asyncio

from lmcache_p2p.mesh_security import MeshSecurity
from lmcache_p2p.protocol import ChannelHelloReply, peer_reply_decoder
from lmcache_p2p.rpc import RemoteError, RpcClient
from lmcache_p2p.transfer import TransferError, Transport
from lmcache_p2p.worker.identity import WorkerIdentity

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Peer:
    instance_id: str
    rank: int
    host: str
    init_port: int
    lookup_port: int

    @property
    def key(self) -> tuple[str, int]:
        """What its connection is kept under: the address of its p2p_lookup port."""
        return (self.host, self.lookup_port)

    def describe(self) -> str:
        return f"{self.instance_id} rank {self.rank} ({self.host}:{self.lookup_port})"


class PeerConnection:
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
        self.channel: str | None = None  # None until hello agrees one (PeerConnections.connect)
        self.staged = False  # the holder writes through GPU staging (agreed at hello)
        self.hello: asyncio.Task | None = None  # the hello on its way or done (one at a time)
        self.hello_ms = 0.0  # its round trip: the holder's session set-up (NIXL remote agent) included
        self.peer_session = ""  # the holder process it was warmed for ("" when connected on demand)
        self.closed = asyncio.Event()  # set once closed: a warm peer's keeper connects again

    @property
    def agreed(self) -> str:
        """The channel agreed at hello; only connections :meth:`PeerConnections.connect` returned have one."""
        assert self.channel is not None, "connection used before its hello"
        return self.channel

    def describe_channel(self) -> str | None:
        """The channel as pull logs name it; None before its hello."""
        return None if self.channel is None else self.channel + (" via GPU staging" if self.staged else "")

    def close(self) -> None:
        # A hello still on its way fails with the closed socket (RequestFailed), so whoever waits
        # on it sees a failed connection, never a cancellation of its own task.
        self.init.close()
        self.lookup.close()
        self.closed.set()


def _retrieve(task: asyncio.Task) -> None:
    """A hello's failure is seen by whoever awaits it; this keeps asyncio quiet when nobody did."""
    if not task.cancelled():
        task.exception()


class PeerConnections:
    """This rank's connections to its peers, by peer address; hellos and drops."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        identity: WorkerIdentity,
        fingerprint: int,
        transports: dict[str, Transport],
        preferred: str,
        security: MeshSecurity | None = None,
    ):
        self.ctx = ctx
        self.security = security  # the mesh's CurveZMQ keys; None: plain sockets
        self.me = identity
        self.fingerprint = fingerprint  # our layout, which the holder checks at hello
        self.transports = transports
        self.preferred = preferred if preferred in transports else "tcp"
        self._connections: dict[tuple[str, int], PeerConnection] = {}

    def get(self, key: tuple[str, int]) -> PeerConnection | None:
        """The connection kept under ``key``, if any (agreed or not)."""
        return self._connections.get(key)

    def connection(self, peer: Peer) -> PeerConnection:
        """The peer's connection, opened (without a hello) if there is none."""
        conn = self._connections.get(peer.key)
        if conn is None:
            conn = self._connections[peer.key] = PeerConnection(self.ctx, peer, self.security)
        return conn

    def channel_of(self, peer: Peer) -> str | None:
        """The channel agreed with ``peer`` as pull logs name it; None before its hello."""
        conn = self._connections.get(peer.key)
        return conn.describe_channel() if conn is not None else None

    def busy(self, key: tuple[str, int]) -> int:
        """Requests in flight to the peer at ``key``."""
        conn = self._connections.get(key)
        return conn.lookup.in_flight if conn else 0

    async def connect(self, peer: Peer) -> PeerConnection:
        """The peer's connection with its channel agreed. A pull that arrives while a hello is on
        its way (a warm-up's) waits for that one; a pull that gives up (the engine's timeout)
        leaves the hello running, so the connection is ready for the next one."""
        conn = self.connection(peer)
        if conn.channel is None:
            await asyncio.shield(self.start_hello(peer, conn, "on demand"))
        elif conn.hello is not None and not conn.hello.done():
            # Agreed, but a hello is still finishing (the channel's own set-up after the reply,
            # or a keeper's second hello): the session is ready only once it is done.
            await asyncio.shield(conn.hello)
        return conn

    def start_hello(self, peer: Peer, conn: PeerConnection, why: str) -> asyncio.Task:
        """The connection's hello in flight, or a new one when none is (or the last one failed)."""
        if conn.hello is None or conn.hello.done():
            conn.hello = asyncio.ensure_future(self._hello(peer, conn, why))
            conn.hello.add_done_callback(_retrieve)
        return conn.hello

    async def _hello(self, peer: Peer, conn: PeerConnection, why: str) -> None:
        """Agree a channel with the holder (and open its session for us): ours, else tcp."""
        t0 = time.perf_counter()
        error = "refused"
        for channel in dict.fromkeys([self.preferred, "tcp"]):
            hello = self.transports[channel].hello(self.me.instance_id, self.me.rank, self.fingerprint)
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
            # The pulls' socket, connected now: a warm peer's first pull then finds it up.
            conn.lookup.connect()
            await self.transports[channel].connect(peer.key, reply)  # tcp data streams
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
        self.drop(peer, conn)
        raise TransferError(f"{peer.describe()} refused the {self.preferred} session: {error}")

    def drop(self, peer: Peer, conn: PeerConnection | None = None) -> None:
        """Close the peer's connection (only if it is still ``conn``, when given): the next pull,
        or the peer's keeper when it is warm, connects again."""
        current = self._connections.get(peer.key)
        if current is None or (conn is not None and current is not conn):
            return
        del self._connections[peer.key]
        current.close()

    def close(self) -> None:
        for conn in self._connections.values():
            conn.close()
        self._connections.clear()
