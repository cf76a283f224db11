"""The worker's side of the controller protocol with one controller, in three parts, each with one
job and its own state:

* :class:`~lmcache_p2p.worker.session.ControllerSession` (``session``): registration, liveness
  (heartbeats; whether the controller answers) and the warm set;
* :class:`~lmcache_p2p.worker.event_stream.EventStream` (``events``): the store's key events as
  numbered batches on the controller's pull socket, every other message after them, re-syncs;
* :class:`~lmcache_p2p.worker.peer_lookup.PeerLookup` (``lookup``): who holds a prompt's chunks.

:class:`ControllerLink` only puts them together over the controller's reply socket, which all
three use (one connection per controller), and starts and closes them.
"""

from __future__ import annotations

from collections.abc import Callable

import zmq.asyncio

from lmcache_p2p.config import split_host_port
from lmcache_p2p.mesh_security import MeshSecurity
from lmcache_p2p.protocol import Deregister, EngineLoad, Traffic, controller_reply_decoder
from lmcache_p2p.rpc import RpcClient
from lmcache_p2p.storage.chunk_store import ChunkStore
from lmcache_p2p.worker.adapters import ServedAdapters
from lmcache_p2p.worker.event_stream import EventStream
from lmcache_p2p.worker.identity import WorkerIdentity
from lmcache_p2p.worker.peer_lookup import PeerLookup
from lmcache_p2p.worker.session import ControllerSession


class ControllerLink:
    """One controller: this rank's session, event stream and peer lookup with it."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        identity: WorkerIdentity,
        storage: ChunkStore,
        pull_url: str,
        reply_url: str,
        heartbeat_time: float,
        flush_interval: float = 0.05,
        traffic: Callable[[], Traffic] | None = None,
        security: MeshSecurity | None = None,
        load: Callable[[], EngineLoad | None] | None = None,
        adapters: ServedAdapters | None = None,
    ):
        self.me = identity
        # Either spelling of a controller URL (host:port, tcp://host:port) names the same socket.
        reply_host, reply_port = split_host_port(reply_url)
        self.reply = RpcClient(
            ctx,
            f"tcp://{reply_host}:{reply_port}",
            controller_reply_decoder,
            "controller reply socket",
            security=security,
        )
        # Each link takes its own queue of the store's events: every controller indexes every key.
        self.events = EventStream(
            ctx, identity, storage, pull_url, self.reply, lambda: self.session.registered, flush_interval, security
        )
        self.session = ControllerSession(
            ctx,
            identity,
            self.reply,
            reply_host,
            heartbeat_time,
            storage.locations,
            self.events,
            traffic=traffic,
            security=security,
            load=load,
            adapters=adapters,
        )
        self.lookup = PeerLookup(identity, self.reply, self.session)

    @property
    def stats(self) -> dict[str, int]:
        """The three parts' counters, in one dict (as /status shows them)."""
        return {**self.session.stats, **self.events.stats, **self.lookup.stats}

    def start(self) -> None:
        self.session.start()
        self.events.start()

    def close(self, deregister: bool = True) -> None:
        self.session.close()
        if deregister and self.session.registered:
            self.events.send(Deregister(instance_id=self.me.instance_id, rank=self.me.rank))
        self.reply.close()
        self.events.close(linger=100 if deregister else 0)
