"""Request/reply over a ZMQ DEALER socket, with request ids, timeouts and reconnects.

The worker asks the controller (register, re-sync, peer lookup, heartbeat) and peers (channel
hello, chunk pulls, fetches) questions whose answers may never come: the other side may be down,
restarting or slow. Each question gets a request id; one reader task routes answers to their
waiters and drops answers nobody waits for any more (late replies after a timeout). After a
timeout the socket is replaced, so messages ZMQ queued for a dead peer are not delivered to its
successor minutes later.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Callable, Optional

import msgspec
import zmq
import zmq.asyncio

from lmcache_p2p.protocol import DecodeError, encode

logger = logging.getLogger(__name__)


class RequestFailed(Exception):
    """No usable answer: timed out, the socket closed, or the answer did not decode."""


class Dealer:
    def __init__(self, ctx: zmq.asyncio.Context, address: str, decoder: msgspec.msgpack.Decoder, name: str):
        self.ctx = ctx
        self.address = address  # "tcp://host:port"
        self.decoder = decoder
        self.name = name
        self._ids = itertools.count(1)
        self._waiting: dict[bytes, asyncio.Future] = {}
        self._late: dict[bytes, Callable[[object, list], None]] = {}  # answers owed to a timed-out caller
        self._sock: Optional[zmq.asyncio.Socket] = None
        self._reader: Optional[asyncio.Task] = None
        self.in_flight = 0
        self.timeouts = 0

    def _open(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # Without this, ZMQ queues messages for a peer that is not connected yet (or any more)
        # and delivers them whenever it comes back; with it, sends to nobody fail fast.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.connect(self.address)
        self._sock = sock
        self._reader = asyncio.ensure_future(self._read(sock))

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
            try:
                reply = self.decoder.decode(frames[1].buffer)
            except DecodeError as e:
                reply = RequestFailed(f"{self.name}: undecodable reply: {e}")
            extra = frames[2:]
            waiter = self._waiting.pop(request_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result((reply, extra))
                continue
            late = self._late.pop(request_id, None)
            if late is not None:
                try:
                    late(reply, extra)
                except Exception:
                    logger.exception("%s: late-reply handler failed", self.name)

    async def request(self, message, timeout: float, extra: Optional[list] = None,
                      on_late: Optional[Callable[[object, list], None]] = None) -> tuple[object, list]:
        """Send ``message`` and wait for its answer: (reply, extra frames). ``on_late`` is called
        if the answer comes after the timeout (to free resources the request tied up)."""
        if self._sock is None:
            self._open()
        request_id = str(next(self._ids)).encode()
        waiter = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = waiter
        self.in_flight += 1
        deadline = time.monotonic() + timeout
        try:
            # asyncio.wait, not wait_for: closing a socket cancels its pending futures, and that
            # must read as a failed request, not as a cancellation of the caller's task.
            send = asyncio.ensure_future(self._sock.send_multipart([request_id, encode(message), *(extra or [])],
                                                                   copy=False))
            done, _ = await asyncio.wait({send}, timeout=timeout)
            if done and (send.cancelled() or send.exception() is not None):
                self._waiting.pop(request_id, None)
                raise RequestFailed(f"{self.name}: send to {self.address} failed")
            if done:
                done, _ = await asyncio.wait({waiter}, timeout=max(0.0, deadline - time.monotonic()))
            else:
                send.cancel()
            if not done:
                self.timeouts += 1
                self._waiting.pop(request_id, None)
                if on_late is not None:
                    self._late[request_id] = on_late
                self.reset(keep_late=on_late is not None)
                raise RequestFailed(f"{self.name}: no answer from {self.address} within {timeout:.1f}s")
            if waiter.cancelled():
                raise RequestFailed(f"{self.name}: closed")
            reply, frames = waiter.result()  # raises the RequestFailed a reset put there
            if isinstance(reply, RequestFailed):
                raise reply
            return reply, frames
        finally:
            self.in_flight -= 1
            if waiter.done() and not waiter.cancelled():
                waiter.exception()  # a failure nobody awaited is still handled: no asyncio warning

    # The holder gives up a transfer at 0.9x the requester's timeout, so once the requester has
    # timed out a few more seconds are ample before its pages may be reused.
    LATE_GRACE_S = 5.0

    def reset(self, keep_late: bool = False) -> None:
        """Drop the socket (and with it whatever ZMQ still queues); the next request reconnects.
        With ``keep_late`` the old socket keeps reading for LATE_GRACE_S, for late answers; then
        each answer still owed is given up (its handler called with ``None``)."""
        sock, reader = self._sock, self._reader
        self._sock = self._reader = None
        if sock is None:
            return
        # Questions still waiting on this socket can no longer be answered: fail them now
        # rather than at their own timeouts.
        for waiter in self._waiting.values():
            if not waiter.done():
                waiter.set_exception(RequestFailed(f"{self.name}: connection reset after a timeout"))
        self._waiting.clear()
        if keep_late and self._late:
            owed = list(self._late)
            asyncio.get_running_loop().call_later(self.LATE_GRACE_S, self._give_up, sock, reader, owed)
        else:
            self._close_socket(sock, reader)

    def _give_up(self, sock: zmq.asyncio.Socket, reader: Optional[asyncio.Task], owed: list[bytes]) -> None:
        self._close_socket(sock, reader)
        for request_id in owed:
            handler = self._late.pop(request_id, None)
            if handler is not None:
                try:
                    handler(None, [])
                except Exception:
                    logger.exception("%s: late-reply handler failed", self.name)

    @staticmethod
    def _close_socket(sock: zmq.asyncio.Socket, reader: Optional[asyncio.Task]) -> None:
        if reader is not None:
            reader.cancel()
        sock.close(linger=0)

    def close(self) -> None:
        for waiter in self._waiting.values():
            waiter.cancel()
        self._waiting.clear()
        self.reset()
