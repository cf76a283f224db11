"""A rank's command server over a real StorageManager, and the controller's side of it: the
worker's ``CommandServer`` on a free port with an ``RpcClient`` that sends it commands, as the
controller's command bus does (no controller process, no engine)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import zmq.asyncio
from protocol_client import layout

from lmcache_p2p.protocol import command_reply_decoder
from lmcache_p2p.rpc import RpcClient
from lmcache_p2p.storage.manager import StorageManager
from lmcache_p2p.testing.ports import free_ports
from lmcache_p2p.worker.commands import CommandServer
from lmcache_p2p.worker.identity import WorkerIdentity


@contextlib.asynccontextmanager
async def served_commands(
    storage: StorageManager, chunk_size: int = 16
) -> AsyncIterator[tuple[CommandServer, RpcClient]]:
    """``(server, client)`` for instance ``inst`` rank 0; both closed on exit."""
    port = free_ports(1)[0]
    identity = WorkerIdentity(
        instance_id="inst", rank=0, host="127.0.0.1", worker_port=port, layout=layout(), chunk_size=chunk_size
    )
    ctx = zmq.asyncio.Context()
    commands = CommandServer(ctx, identity, storage, link=None, peers=None, status=dict)
    commands.start()
    client = RpcClient(ctx, f"tcp://127.0.0.1:{port}", command_reply_decoder, "controller")
    try:
        yield commands, client
    finally:
        client.close()
        commands.close()
        ctx.destroy(0)
