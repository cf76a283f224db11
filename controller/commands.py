"""The controller's side of the workers' command sockets.

One DEALER per worker, connected to the ROUTER the worker binds on its ``lmcache_worker_ports``
entry. Requests are ``[request_id, payload]``; one reader task per socket matches answers to the
waiting futures. Every request has a timeout; an answer that comes after it is dropped.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import zmq
import zmq.asyncio

from lmcache_p2p.protocol import Command, CommandReply, DecodeError, command_reply_decoder, encode

logger = logging.getLogger(__name__)


class WorkerUnreachable(Exception):
    """A worker did not answer a command within the timeout."""


class _Channel:
    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str):
        self.endpoint = endpoint
        self.socket = ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        # Don't queue without bound for a worker that is gone: a full queue fails the send.
        self.socket.setsockopt(zmq.SNDHWM, 1000)
        self.socket.connect(endpoint)
        self.waiting: dict[bytes, asyncio.Future] = {}
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        while True:
            try:
                frames = await self.socket.recv_multipart()
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            if len(frames) != 2:
                logger.warning("command reply from %s with %d frames; dropped", self.endpoint, len(frames))
                continue
            future = self.waiting.pop(frames[0], None)
            if future is None or future.done():
                continue  # answered after its timeout
            try:
                future.set_result(command_reply_decoder.decode(frames[1]))
            except DecodeError as e:
                future.set_exception(WorkerUnreachable(f"undecodable reply from {self.endpoint}: {e}"))

    def close(self) -> None:
        self.reader.cancel()
        for future in self.waiting.values():
            if not future.done():
                future.set_exception(WorkerUnreachable(f"{self.endpoint} was removed"))
        self.socket.close(linger=0)


class CommandBus:
    def __init__(self, ctx: zmq.asyncio.Context):
        self.ctx = ctx
        self._channels: dict[tuple[str, int], _Channel] = {}
        self._ids = itertools.count(1)

    def connect(self, worker: tuple[str, int], host: str, port: int) -> None:
        endpoint = f"tcp://{host}:{port}"
        old = self._channels.get(worker)
        if old is not None and old.endpoint == endpoint:
            return
        if old is not None:
            old.close()
        self._channels[worker] = _Channel(self.ctx, endpoint)

    def disconnect(self, worker: tuple[str, int]) -> None:
        channel = self._channels.pop(worker, None)
        if channel is not None:
            channel.close()

    async def request(self, worker: tuple[str, int], command: Command, timeout: float) -> CommandReply:
        channel = self._channels.get(worker)
        if channel is None:
            raise WorkerUnreachable(f"no command channel to {worker[0]} rank {worker[1]}")
        request_id = next(self._ids).to_bytes(8, "little")
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        channel.waiting[request_id] = future
        try:
            await channel.socket.send_multipart([request_id, encode(command)], flags=zmq.NOBLOCK)
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise WorkerUnreachable(f"{worker[0]} rank {worker[1]} ({channel.endpoint}) did not answer "
                                    f"{type(command).__name__} within {timeout:g}s") from None
        except zmq.Again:
            raise WorkerUnreachable(f"{worker[0]} rank {worker[1]} ({channel.endpoint}) is not accepting commands") from None
        finally:
            channel.waiting.pop(request_id, None)

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

