"""An HTTP listener with bounds: what the controller's API and ``lmcache_router`` both serve with.

uvicorn alone leaves three holes (uvicorn 0.54; docs/architecture.md, "Listener bounds"):

* ``limit_concurrency`` answers 503 to a *request* past the limit, but every connection is still
  accepted and held, so idle ones pile up until descriptors run out;
* a connection that never sends a request is never closed (``timeout_keep_alive`` starts only
  after a response), and httptools keeps whatever header bytes arrive;
* running out of descriptors is the event loop's business: asyncio logs a traceback for every
  failed accept, uvloop silently drops the pending connections.

So :class:`BoundedServer` accepts connections itself (:class:`Acceptor`) and keeps a
:class:`~lmcache_p2p.connection_book.ConnectionBook` of them: a newcomer past its address's cap or
the listener's cap, or one that finds no descriptor left, displaces the oldest connection that has
not sent a complete request (of its own address, for the per-address cap), and is refused only
when every open connection has; each is counted and logged (at most once a minute per reason).
:class:`BoundedHTTPProtocol` closes a connection whose request headers are not complete within the
header timeout, or pass :data:`MAX_HEADER_BYTES`. Keep-alive idling is uvicorn's own
``timeout_keep_alive``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from dataclasses import dataclass, field
from typing import Any, ClassVar

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from lmcache_p2p.connection_book import AT_CAP, ConnectionBook
from lmcache_p2p.descriptors import OUT_OF_DESCRIPTORS, SpareDescriptor, connection_cap, descriptor_limit
from lmcache_p2p.logs import RateLimitedLog

logger = logging.getLogger("lmcache_p2p.http")

# A request line and headers larger than this close the connection: the controller's and the
# router's largest legitimate ones (a bearer token, a few standard headers) are under 4 KiB.
# h11's own default limit is 16 KiB; httptools has none.
MAX_HEADER_BYTES = 64 * 1024
# At most this share of the descriptors free at start goes to HTTP connections: the rest stay for
# the controller's ZMQ sockets and its commands' connections, or the router's connections to
# engines (one per request it forwards).
DESCRIPTOR_SHARE = 0.5
DESCRIPTOR_RESERVE = 32
# Refusals and closes are logged at most this often per reason, with the count since: a flooder
# must not write a line per connection.
LOG_EVERY_S = 60.0


@dataclass(frozen=True)
class ConnectionLimits:
    """What a listener allows. ``max_connections`` is the configured cap; the one applied may be
    lower (:func:`lmcache_p2p.descriptors.connection_cap`)."""

    max_connections: int
    header_timeout_s: float  # from connect (or the end of the last response) to a complete header
    keep_alive_s: float  # an idle keep-alive connection is closed after this (uvicorn's)
    backlog: int = 1024
    # Open connections from one client address at most (None: max_connections).
    max_per_address: int | None = None
    # The settings' names, for log lines that say which one to raise.
    cap_flag: str = "--max-connections"
    per_address_flag: str = "--max-connections-per-address"


@dataclass
class ListenerCounts:
    """Connections turned away, by reason (the controller's /metrics and the router's
    /router/stats read them). ``refused``: closed on accept; ``closed``: closed after it."""

    refused: dict[str, int] = field(default_factory=lambda: {"at_cap": 0, "per_address": 0, "no_descriptors": 0})
    closed: dict[str, int] = field(
        default_factory=lambda: {
            "header_timeout": 0,
            "header_too_large": 0,
            # The oldest connection without a request, closed to admit a newcomer.
            "evicted_at_cap": 0,
            "evicted_per_address": 0,
            "evicted_no_descriptors": 0,
        }
    )


class BoundedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    """uvicorn's HTTP protocol (httptools or h11), plus a deadline for each request's header.

    The deadline is armed when the connection is made and again when a response completes (or,
    when the response went out before its request's body was read, once that body is drained), and
    it is met once uvicorn starts a new request cycle (``self.cycle`` changes: its headers are in).
    """

    counts: ClassVar[ListenerCounts]
    header_timeout_s: ClassVar[float]
    log: ClassVar[RateLimitedLog]
    book: ClassVar[ConnectionBook[BoundedHTTPProtocol]]

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._answered: Any = None  # the cycle whose response went out last
        self.opened_at = asyncio.get_running_loop().time()
        self.book.add(self, peer_host(transport.get_extra_info("peername")))
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._answered = self.cycle
        if not self.transport.is_closing() and not self.cycle.more_body:
            self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            return
        if self.cycle is not self._waiting_for:
            if self._header_timer is not None:  # a request's headers are in: uvicorn has it from here
                self._header_timer.cancel()
                self._header_timer = None
                self.book.proved(self)  # a client that speaks is never displaced by a newcomer
            elif self.cycle is self._answered and not self.cycle.more_body:
                # A refused request's body (a 413) drained: the next request's header is due now.
                self._arm_header_deadline()
            return
        self._header_bytes += len(data)
        if self._header_bytes > MAX_HEADER_BYTES:
            self._close("header_too_large", "sent %d header bytes (limit %d)", self._header_bytes, MAX_HEADER_BYTES)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self.book.remove(self)
        super().connection_lost(exc)

    def evict(self) -> None:
        """Closed to make room for a newcomer: out of the book at once, so the newcomer is counted
        in its place; the transport closes the socket on the loop's next turn."""
        self.book.remove(self)
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self.transport.close()

    def _arm_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._waiting_for = self.cycle
        self._header_bytes = 0
        self._header_timer = asyncio.get_running_loop().call_later(self.header_timeout_s, self._header_deadline)

    def _header_deadline(self) -> None:
        self._header_timer = None
        if self.cycle is self._waiting_for and not self.transport.is_closing():
            self._close("header_timeout", "sent no complete request header within %g s", self.header_timeout_s)

    def _close(self, reason: str, what: str, *args: Any) -> None:
        self.counts.closed[reason] += 1
        self.log.info(reason, "closed a connection that " + what + " (%d so far)", *args, self.counts.closed[reason])
        self.transport.close()


def peer_host(peername: Any) -> str:
    """The client address of a TCP peer name (its host), as connections are counted by."""
    return str(peername[0]) if isinstance(peername, tuple) and peername else "?"


class Acceptor:
    """Accepts on one listening socket and hands each connection to uvicorn's protocol, within the
    book's caps (module docstring)."""

    def __init__(
        self,
        listener: socket.socket,
        book: ConnectionBook[BoundedHTTPProtocol],
        counts: ListenerCounts,
        log: RateLimitedLog,
    ):
        self.listener = listener
        self.book = book
        self.counts = counts
        self.log = log
        self.spare = SpareDescriptor()

    async def run(self, protocol_factory: Any) -> None:
        loop = asyncio.get_running_loop()
        self.listener.setblocking(False)
        while True:
            try:
                sock, addr = await loop.sock_accept(self.listener)
            except OSError as e:
                if e.errno not in OUT_OF_DESCRIPTORS:
                    logger.debug("accept failed: %s", e)  # e.g. ECONNABORTED: that client is gone
                    continue
                victim = self.book.oldest_unproved()
                if victim is not None:
                    self._evict(victim, "evicted_no_descriptors", "to free a descriptor (limit %d", descriptor_limit())
                    # Its transport closes the socket on the loop's next turn: then accept again.
                    await asyncio.sleep(0)
                    continue
                self.counts.refused["no_descriptors"] += 1
                self.log.warning(
                    "no_descriptors",
                    "refused a connection: no file descriptor left (limit %d, %d open connections, each past "
                    "its first request; %d refused so far)",
                    descriptor_limit(),
                    len(self.book),
                    self.counts.refused["no_descriptors"],
                )
                if not self.spare.refuse_one(self.listener):
                    await asyncio.sleep(0.05)  # nothing could be shed: wait, rather than spin on the listener
                continue
            host = peer_host(addr)
            refused = self.book.make_room(host, self._evict)
            if refused is not None:
                sock.close()
                self._refused(refused, host)
                continue
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                await loop.connect_accepted_socket(protocol_factory, sock)
            except OSError as e:
                logger.debug("could not set up an accepted connection: %s", e)
                sock.close()

    def _evict(self, victim: BoundedHTTPProtocol, reason: str, why: str, *args: Any) -> None:
        where = self.book.address_of(victim)
        age = asyncio.get_running_loop().time() - victim.opened_at
        victim.evict()
        self.counts.closed[reason] += 1
        self.log.warning(
            reason,
            "closed the oldest connection without a request from %s (open %.1f s) " + why + "; %d closed so far)",
            where,
            age,
            *args,
            self.counts.closed[reason],
        )

    def _refused(self, reason: str, host: str) -> None:
        self.counts.refused[reason] += 1
        held, flag, cap = self.book.bound(reason, host)
        what = "%d open, the cap" if reason == AT_CAP else "it holds %d open, its cap"
        self.log.warning(
            reason,
            "refused a connection from %s: " + what + " (%s %d), each past its first request (%d refused so far)",
            host,
            held,
            flag,
            cap,
            self.counts.refused[reason],
        )

    def close(self) -> None:
        self.spare.close()
        self.listener.close()


class BoundedServer(uvicorn.Server):
    """``uvicorn.Server`` serving ``app`` on ``listener`` within ``limits``; ``name`` heads its log
    lines. Use ``await server.serve()`` (no sockets: the acceptor owns the listener)."""

    def __init__(self, app: Any, listener: socket.socket, limits: ConnectionLimits, name: str, **config: Any):
        counts = ListenerCounts()
        log = RateLimitedLog(logging.getLogger(f"lmcache_p2p.{name}"), every_s=LOG_EVERY_S)
        self.cap = connection_cap(limits.max_connections, DESCRIPTOR_SHARE, DESCRIPTOR_RESERVE)
        per_address = min(self.cap, limits.max_per_address or self.cap)
        book: ConnectionBook[BoundedHTTPProtocol] = ConnectionBook(
            self.cap, per_address, cap_flag=limits.cap_flag, per_address_flag=limits.per_address_flag
        )
        # A class of this server's own: uvicorn builds protocols from a class, never an instance.
        protocol = type(
            "BoundedHTTPProtocol",
            (BoundedHTTPProtocol,),
            {"counts": counts, "header_timeout_s": limits.header_timeout_s, "log": log, "book": book},
        )
        super().__init__(
            uvicorn.Config(
                app,
                http=protocol,
                timeout_keep_alive=max(1, round(limits.keep_alive_s)),
                backlog=limits.backlog,
                **config,
            )
        )
        self.counts = counts
        self.book = book
        self.acceptor = Acceptor(listener, book, counts, log)
        self._accepting: asyncio.Task[None] | None = None
        logging.getLogger(f"lmcache_p2p.{name}").info(
            "HTTP connections: at most %d (configured %d, descriptor limit %d), %d per client address, "
            "header timeout %g s, keep-alive %g s",
            self.cap,
            limits.max_connections,
            descriptor_limit(),
            per_address,
            limits.header_timeout_s,
            limits.keep_alive_s,
        )

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=[])  # the lifespan and server state, no listener of uvicorn's
        config = self.config

        def create_protocol() -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state=self.lifespan.state
            )

        self._accepting = asyncio.create_task(self.acceptor.run(create_protocol))

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
        self.acceptor.close()
        await super().shutdown(sockets=[])
