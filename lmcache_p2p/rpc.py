"""One request/reply layer for every ROUTER/DEALER pair of the mesh.

Five places ask and answer over ZMQ: the controller's command channel to each worker, the
worker's questions to the controller (register, re-sync, peer lookup, heartbeat), the worker's
questions to peers (hello, chunk pulls, move/copy fetches), and the three servers that answer
them (the controller's reply and heartbeat sockets, a worker's command socket, a worker's two
P2P sockets). They all use this module, so there is one framing, one request-id scheme, one
timeout and reset policy, and one rule for what an error reply is.

Framing: a request is ``[request_id, payload, *extra]`` on the DEALER (the ROUTER prepends the
sender's identity); the answer echoes ``request_id``. ``request_id`` is 8 bytes, a per-client
counter. ``extra`` frames carry bulk bytes beside a small msgpack payload (chunk pages over the
tcp channel) without copying them into it.

Errors: :class:`RpcClient.request` returns the reply as the type the caller expects, or raises
:class:`RemoteError` when the other side answered with an error (any reply whose ``ok`` is
False, or a reply of another type), or :class:`RequestFailed` when no usable answer came (a
timeout, a failed send, an undecodable reply, a closed client). Callers never inspect a reply's
type or its ``error`` field themselves.

Security (issue 18): with a :class:`~lmcache_p2p.mesh_security.MeshSecurity` every server is a
CurveZMQ server and every client a CurveZMQ client of the mesh, so only members holding the mesh
secret get a request in or an answer out. A server or client not handed one takes the one
attached to its context (``MeshSecurity.attach``): no socket of a secured context is plain. Every
server bounds the frames it takes (``max_message_bytes``, ZMQ_MAXMSGSIZE): a bigger frame ends
the connection before anything is allocated for it. Clients take any size: their answers come
from members only, and chunk pages ride them.

It imports neither torch nor vLLM: the controller uses it.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, Union

import msgspec
import zmq
import zmq.asyncio

from lmcache_p2p.logs import RateLimitedLog
from lmcache_p2p.mesh_security import MeshSecurity, client_socket, resolve, server_socket
from lmcache_p2p.protocol import Ack, DecodeError, encode

logger = logging.getLogger(__name__)
_bad_frames = RateLimitedLog(logger, every_s=10.0)

R = TypeVar("R")

# A socket's receive loop hands the event loop back after this long of back-to-back messages: a
# message already queued makes ``await recv`` return at once, so a flood on one socket would
# otherwise keep every other socket, and the HTTP API on the same loop, waiting until it ends.
FAIR_SLICE_S = 0.002


class FairShare:
    """A receive loop's turn on a shared event loop: :meth:`turn` yields once its slice is used."""

    def __init__(self, slice_s: float = FAIR_SLICE_S):
        self.slice_s = slice_s
        self._since = time.perf_counter()

    async def turn(self) -> None:
        if time.perf_counter() - self._since >= self.slice_s:
            await asyncio.sleep(0)  # to the back of the ready queue; the selector is polled first
            self._since = time.perf_counter()


# The holder side of a pull gives up at 0.9x the requester's timeout, so once a requester has
# timed out, a few more seconds are ample for a late answer before its resources are reused.
LATE_GRACE_S = 5.0

# A server's frame bound unless it names its own: the largest request any server here takes from
# a member is a few hundred KiB of packed chunk hashes (a move, pin or lookup of a long prompt).
DEFAULT_MAX_MESSAGE_BYTES = 4 * 2**20


class RequestFailed(Exception):
    """No usable answer: timed out, the send failed, the socket closed, or the answer did not decode."""


class RemoteError(Exception):
    """The other side answered, with an error. ``reply`` is the reply as received (with whatever
    detail it carries besides its error), or None when it was not of the expected type."""

    def __init__(self, message: str, reply: Any = None):
        super().__init__(message)
        self.reply = reply


def _request_id(counter: int) -> bytes:
    return counter.to_bytes(8, "little")


LateHandler = Callable[[Any, list], None]


@dataclass(eq=False)
class _Connection:
    """One DEALER socket and the task reading it. Requests remember the connection they went out
    on: after a reset the old one keeps reading for late answers owed on it."""

    sock: zmq.asyncio.Socket
    reader: asyncio.Task

    def close(self) -> None:
        self.reader.cancel()
        self.sock.close(linger=0)


@dataclass(eq=False)
class _Waiting:
    future: asyncio.Future
    conn: _Connection
    on_late: LateHandler | None
    deadline: float  # time.monotonic() when the caller stops waiting; the server gives up before


class RpcClient:
    """Request/reply on one DEALER to one server address.

    One reader task routes answers to their waiters. A request that times out resets the socket
    (so messages ZMQ still queues for a dead server are not delivered to its successor minutes
    later) and fails every other request waiting on it.

    ``on_late`` is for a caller that tied up resources in a request (pages a holder may still
    write into): if the request fails, the handler is called exactly once, later, with the late
    answer when it comes, or with ``None`` once the request's own timeout plus :data:`LATE_GRACE_S`
    has passed (or at once when it was never sent). The old socket keeps reading until then."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        address: str,
        decoder: msgspec.msgpack.Decoder,
        name: str,
        send_hwm: int | None = None,
        security: MeshSecurity | None = None,
    ):
        self.ctx = ctx
        self.address = address  # "tcp://host:port"
        self.decoder = decoder
        self.name = name
        self.send_hwm = send_hwm
        # The mesh's keys (None: those attached to ctx, if any; plain without either).
        self.security = resolve(ctx, security)
        self._ids = itertools.count(1)
        self._waiting: dict[bytes, _Waiting] = {}
        self._late: dict[bytes, _Waiting] = {}  # failed requests whose late handler is owed
        self._conn: _Connection | None = None
        self.in_flight = 0
        self.timeouts = 0

    # -- asking ----------------------------------------------------------------------------------

    async def request(self, message: msgspec.Struct, expect: type[R], timeout: float) -> R:
        """Send ``message`` and return its answer as an ``expect``."""
        reply, _ = await self.request_frames(message, expect, timeout)
        return reply

    async def request_frames(
        self,
        message: msgspec.Struct,
        expect: type[R],
        timeout: float,
        extra: Sequence[Any] = (),
        on_late: LateHandler | None = None,
    ) -> tuple[R, list]:
        """:meth:`request` with extra frames both ways: sends ``extra`` after the payload and
        returns the answer's extra frames (zero-copy ``zmq.Frame``s) beside it."""
        reply, frames = await self._exchange(message, timeout, extra, on_late)
        if not isinstance(reply, expect):
            error = getattr(reply, "error", None)
            raise RemoteError(
                f"{self.name}: {error}"
                if error
                else f"{self.name}: answered {type(reply).__name__} to {type(message).__name__}",
                reply,
            )
        if getattr(reply, "ok", True) is False:
            raise RemoteError(f"{self.name}: {getattr(reply, 'error', None) or 'refused'}", reply)
        return reply, frames

    async def _exchange(
        self, message: msgspec.Struct, timeout: float, extra: Sequence[Any], on_late: LateHandler | None
    ) -> tuple[Any, list]:
        conn = self._conn or self._open()
        request_id = _request_id(next(self._ids))
        deadline = time.monotonic() + timeout
        waiting = _Waiting(asyncio.get_running_loop().create_future(), conn, on_late, deadline)
        self._waiting[request_id] = waiting
        self.in_flight += 1
        try:
            # asyncio.wait, not wait_for: a reset fails pending futures, and that must read as a
            # failed request, not as a cancellation of the caller's task.
            send = asyncio.ensure_future(conn.sock.send_multipart([request_id, encode(message), *extra], copy=False))
            sent, _ = await asyncio.wait({send}, timeout=timeout)
            if sent and (send.cancelled() or send.exception() is not None):
                # Never sent, so nothing can come back (unless a reset took the request over).
                if self._waiting.pop(request_id, None) is not None and on_late is not None:
                    asyncio.get_running_loop().call_soon(_call_late, self.name, on_late, None, [])
                raise RequestFailed(f"{self.name}: send to {self.address} failed")
            answered: set = set()
            if sent:
                answered, _ = await asyncio.wait({waiting.future}, timeout=max(0.0, deadline - time.monotonic()))
            else:
                send.cancel()
            if not answered:
                self.timeouts += 1
                if self._waiting.pop(request_id, None) is not None:  # else a reset failed it already
                    self._owe(request_id, waiting)
                if waiting.conn is self._conn:
                    self.reset()
                # Which of the two tells a dead holder from one we never reached (IMMEDIATE: a
                # send waits for the connection, so "not sent" means no connection came up).
                how = "sent, not answered" if sent else "not sent: no connection came up, or its queue stayed full"
                raise RequestFailed(f"{self.name}: no answer from {self.address} within {timeout:.1f}s ({how})")
            reply, frames = waiting.future.result()  # raises the RequestFailed a reset put there
            if isinstance(reply, RequestFailed):
                raise reply
            return reply, frames
        finally:
            self.in_flight -= 1
            if waiting.future.done() and not waiting.future.cancelled():
                waiting.future.exception()  # a failure nobody awaited is still handled: no asyncio warning

    def _owe(self, request_id: bytes, waiting: _Waiting) -> None:
        """A failed request whose answer may still come: its handler waits on its connection."""
        if waiting.on_late is None:
            return
        self._late[request_id] = waiting
        if waiting.conn is not self._conn:  # already reset, maybe closed: make sure it is given up
            self._schedule_give_up(waiting.conn)

    # -- the socket ------------------------------------------------------------------------------

    def connect(self) -> None:
        """Open the socket now rather than at the first request, so that request does not wait
        for the TCP (and CurveZMQ) handshake. Nothing is sent."""
        if self._conn is None:
            self._open()

    def _open(self) -> _Connection:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # Without this ZMQ queues messages for a server that is not connected (yet, or any more)
        # and delivers them whenever it comes back; with it, a send to nobody waits and times out.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        if self.send_hwm is not None:
            sock.setsockopt(zmq.SNDHWM, self.send_hwm)
        client_socket(sock, self.security, self.name)
        sock.connect(self.address)
        self._conn = _Connection(sock, asyncio.ensure_future(self._read(sock)))
        return self._conn

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await sock.recv_multipart(copy=False)
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            if len(frames) < 2:
                logger.warning("%s: reply with %d frame(s) dropped", self.name, len(frames))
                continue
            request_id = frames[0].bytes
            reply: Any
            try:
                reply = self.decoder.decode(frames[1].buffer)
            except DecodeError as e:
                reply = RequestFailed(f"{self.name}: undecodable reply: {e}")
            extra = frames[2:]
            waiting = self._waiting.pop(request_id, None)
            if waiting is not None and not waiting.future.done():
                waiting.future.set_result((reply, extra))
                continue
            late = self._late.pop(request_id, None)
            if late is not None and late.on_late is not None:
                _call_late(self.name, late.on_late, reply, extra)

    def reset(self, why: str = "connection reset after a timeout") -> None:
        """Drop the socket (and whatever ZMQ still queues); the next request reconnects. Requests
        still waiting on it fail now rather than at their own timeouts. While answers are owed on
        it (``on_late``), the old socket keeps reading for :data:`LATE_GRACE_S`."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        for request_id, waiting in list(self._waiting.items()):
            if waiting.conn is not conn:
                continue
            del self._waiting[request_id]
            if not waiting.future.done():
                waiting.future.set_exception(RequestFailed(f"{self.name}: {why}"))
                if waiting.on_late is not None:
                    self._late[request_id] = waiting
        if any(owed.conn is conn for owed in self._late.values()):
            self._schedule_give_up(conn)
        else:
            conn.close()

    def _schedule_give_up(self, conn: _Connection) -> None:
        """Keep ``conn`` reading until every request owed on it is past its own deadline (the server
        gives up before that) plus the grace period; then give the rest up."""
        last = max(owed.deadline for owed in self._late.values() if owed.conn is conn)
        wait = max(0.0, last - time.monotonic()) + LATE_GRACE_S
        asyncio.get_running_loop().call_later(wait, self._give_up, conn)

    def _give_up(self, conn: _Connection) -> None:
        conn.close()
        for request_id, owed in list(self._late.items()):
            if owed.conn is conn and owed.on_late is not None:
                del self._late[request_id]
                _call_late(self.name, owed.on_late, None, [])

    def close(self) -> None:
        self.reset("closed")


def _call_late(name: str, handler: LateHandler, reply: Any, frames: list) -> None:
    try:
        handler(reply, frames)
    except Exception:
        logger.exception("%s: late-reply handler failed", name)


# -- answering -------------------------------------------------------------------------------------


@dataclass
class Answer:
    """A handler's reply with bulk frames after it. The frames are sent zero-copy and
    ``on_sent`` runs once ZMQ no longer reads them (or the send failed): release pins there."""

    message: msgspec.Struct
    frames: Sequence[Any] = ()
    on_sent: Callable[[], None] | None = None


Handler = Callable[[Any], msgspec.Struct | Answer | Awaitable[msgspec.Struct | Answer]]


def _error_ack(error: str) -> msgspec.Struct:
    return Ack(ok=False, error=error)


class RpcServer:
    """A ROUTER that decodes each request as one of the types it has a handler for and answers
    with what the handler returns (a reply Struct, an :class:`Answer`, or an awaitable of either).

    A frame that does not decode is answered with ``error_reply(why)`` and counted; a handler that
    raises is logged and answered the same way; the loop goes on. With ``concurrent`` each request
    runs as its own task (one slow pull does not hold up a hello); otherwise requests are answered
    one at a time, in order of arrival.

    ``security``: the mesh's keys (None: those attached to ``ctx``, if any; plain without
    either). ``max_message_bytes``: ZMQ drops a connection that sends a bigger frame."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        name: str,
        handlers: dict[type, Handler],
        *,
        concurrent: bool = False,
        error_reply: Callable[[str], msgspec.Struct] = _error_ack,
        on_message: Callable[[Any], None] | None = None,
        on_bad_frame: Callable[[str], None] | None = None,
        on_error: Callable[[Any, BaseException], None] | None = None,
        security: MeshSecurity | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ):
        self.name = name
        self.handlers = dict(handlers)
        self.decoder: msgspec.msgpack.Decoder = msgspec.msgpack.Decoder(Union[tuple(self.handlers)])  # noqa: UP007  (built at run time)
        self.concurrent = concurrent
        self.error_reply = error_reply
        self.on_message = on_message
        self.on_bad_frame = on_bad_frame
        self.on_error = on_error
        self.security = resolve(ctx, security)
        self.max_message_bytes = max_message_bytes
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        try:
            server_socket(self.sock, self.security, name, max_message_bytes)
        except BaseException:
            self.sock.close(linger=0)
            raise
        self._loop_task: asyncio.Task | None = None
        self._requests: set[asyncio.Task] = set()

    def bind(self, address: str) -> int:
        """Bind and return the TCP port bound: the one asked for, or the one the OS chose for a
        ``host:0`` address. Raises zmq.ZMQError (the caller names the setting) and closes the socket."""
        try:
            self.sock.bind(address)
        except zmq.ZMQError:
            self.sock.close(linger=0)
            raise
        endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)  # tcp://127.0.0.1:40123
        return int(endpoint.rpartition(":")[2])

    def start(self) -> None:
        self._loop_task = asyncio.ensure_future(self._serve())

    def close(self) -> None:
        for task in [self._loop_task, *self._requests]:
            if task is not None:
                task.cancel()
        self.sock.close(linger=0)

    async def _serve(self) -> None:
        fair = FairShare()
        while True:
            await fair.turn()
            try:
                frames = await self.sock.recv_multipart()
            except zmq.ZMQError:
                return
            if len(frames) < 3:
                self._bad_frame(f"{len(frames)} frame(s), expected [identity, request id, payload]")
                continue
            identity, request_id, payload = frames[0], frames[1], frames[2]
            try:
                request = self.decoder.decode(payload)
            except DecodeError as e:
                self._bad_frame(f"{e} ({len(payload)} bytes)")
                await self._send(identity, request_id, self.error_reply(f"undecodable request: {e}"))
                continue
            if self.on_message is not None:
                self.on_message(request)
            if self.concurrent:
                task = asyncio.ensure_future(self._answer(identity, request_id, request))
                self._requests.add(task)
                task.add_done_callback(self._requests.discard)
            else:
                await self._answer(identity, request_id, request)

    def _bad_frame(self, why: str) -> None:
        if self.on_bad_frame is not None:
            self.on_bad_frame(why)
        # One line per socket every 10 s at most (with a count of the rest): a flood of bad
        # frames must not become a flood of log lines.
        _bad_frames.warning(self.name, "%s: bad frame: %s", self.name, why)

    async def _answer(self, identity: bytes, request_id: bytes, request: Any) -> None:
        try:
            result = self.handlers[type(request)](request)
            if inspect.isawaitable(result):
                result = await result
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if self.on_error is not None:
                self.on_error(request, e)
            logger.exception("%s: handling %s failed", self.name, type(request).__name__)
            result = self.error_reply(f"{self.name} error: {e}")
        await self._send(identity, request_id, result)

    async def _send(self, identity: bytes, request_id: bytes, result: msgspec.Struct | Answer) -> None:
        answer = result if isinstance(result, Answer) else Answer(result)
        try:
            head = [identity, request_id, encode(answer.message)]
            if not answer.frames:
                await self.sock.send_multipart(head)
                return
            # Bulk frames are zero-copy views (of pinned pages): wait until ZMQ is done with them
            # before on_sent lets the caller reuse the memory.
            tracker = await self.sock.send_multipart([*head, *answer.frames], copy=False, track=True)
            pause = 0.0005
            while tracker is not None and not tracker.done:
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.01)
        except zmq.ZMQError as e:
            logger.warning("%s: could not answer %s: %s", self.name, type(answer.message).__name__, e)
        finally:
            if answer.on_sent is not None:
                answer.on_sent()
