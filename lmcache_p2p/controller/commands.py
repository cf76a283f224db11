"""The controller's side of the workers' command sockets: one :class:`RpcClient` per worker.

Each client's DEALER connects to the ROUTER the worker binds on its ``lmcache_worker_ports``
entry; framing, request ids, timeouts and the reset after a timeout are the RPC layer's. This
module only decides what an outcome means to the orchestration: an answer is a
:class:`CommandReply` (a refusal is one with ``ok`` False), and no answer is
:class:`WorkerUnreachable`.
"""

from __future__ import annotations

import msgspec
import zmq.asyncio

from lmcache_p2p.controller.errors import WorkerUnreachable
from lmcache_p2p.controller.registry import WorkerKey
from lmcache_p2p.protocol import Ack, Command, CommandReply
from lmcache_p2p.rpc import RemoteError, RequestFailed, RpcClient

# An Ack decodes too: a worker whose server fails before it can build a CommandReply answers
# with one, and that is a refusal with the worker's reason, not an undecodable reply.
_reply_decoder = msgspec.msgpack.Decoder(CommandReply | Ack)

# Don't queue without bound for a worker that is gone: a full queue fails the send.
SEND_HWM = 1000


class CommandBus:
    def __init__(self, ctx: zmq.asyncio.Context):
        self.ctx = ctx
        self._clients: dict[WorkerKey, RpcClient] = {}

    def connect(self, worker: WorkerKey, host: str, port: int) -> None:
        """Point ``worker``'s channel at its command port; a worker that came back elsewhere gets a new one."""
        address = f"tcp://{host}:{port}"
        old = self._clients.get(worker)
        if old is not None and old.address == address:
            return
        if old is not None:
            old.close()
        self._clients[worker] = RpcClient(
            self.ctx, address, _reply_decoder, f"{worker[0]} rank {worker[1]}", send_hwm=SEND_HWM
        )

    def disconnect(self, worker: WorkerKey) -> None:
        client = self._clients.pop(worker, None)
        if client is not None:
            client.close()  # a command still waiting on it fails as unreachable

    async def request(self, worker: WorkerKey, command: Command, timeout: float) -> CommandReply:
        """The worker's answer, a refusal included; :class:`WorkerUnreachable` when none came."""
        client = self._clients.get(worker)
        if client is None:
            raise WorkerUnreachable(f"no command channel to {worker[0]} rank {worker[1]}")
        try:
            return await client.request(command, CommandReply, timeout)
        except RequestFailed as e:
            raise WorkerUnreachable(f"{type(command).__name__} to {e}") from None
        except RemoteError as e:
            if isinstance(e.reply, CommandReply):
                return e.reply
            return CommandReply(event_id=command.event_id, ok=False, error=str(e))

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
