"""A rank's key events on the controller's pull socket (lmcache_p2p.worker.event_stream), over
real ZMQ sockets on loopback, with a real store behind them."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
import zmq
import zmq.asyncio
from protocol_client import CPU, layout

from lmcache_p2p.config import LMCacheConfig
from lmcache_p2p.mesh_security import gate_connections, stop_zap
from lmcache_p2p.protocol import (
    Ack,
    KeyEvents,
    ResyncBatch,
    controller_reply_decoder,
    unpack_hashes,
    worker_message_decoder,
)
from lmcache_p2p.rpc import RpcClient, RpcServer
from lmcache_p2p.storage.manager import StorageManager
from lmcache_p2p.worker import event_stream
from lmcache_p2p.worker.event_stream import EventStream
from lmcache_p2p.worker.identity import WorkerIdentity


def _run_refused_once(reopen_after_s: float, monkeypatch) -> tuple[list[int], list[str], dict, int]:
    """A controller's pull socket behind a gate that refuses its first connection (as one at its
    descriptor limit does), a rank registered with it storing a chunk every 0.2 s for up to 6 s;
    what the pull socket received (the admitted hashes), the gate's refusals, the stream's
    counters and the re-syncs the reply socket got."""
    monkeypatch.setattr(event_stream, "REOPEN_AFTER_S", reopen_after_s)

    async def main():
        controller_ctx = zmq.asyncio.Context()
        refusals: list[str] = []

        def gate(domain: str, address: str) -> str | None:
            if not refusals:
                refusals.append(f"{domain} {address}")
                return "at capacity"
            return None

        gate_connections(controller_ctx, gate)
        pull = controller_ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.setsockopt(zmq.ZAP_DOMAIN, b"pull")  # libzmq asks ZAP about a plain client only with one
        pull_port = pull.bind_to_random_port("tcp://127.0.0.1")
        resyncs: list[ResyncBatch] = []

        def on_resync(batch: ResyncBatch) -> Ack:
            resyncs.append(batch)
            return Ack(ok=True)

        reply_server = RpcServer(controller_ctx, "reply", {ResyncBatch: on_resync})
        reply_port = reply_server.bind("tcp://127.0.0.1:0")
        reply_server.start()

        ctx = zmq.asyncio.Context()
        config = LMCacheConfig.from_dict({"chunk_size": 16, "max_local_cpu_size": 0.01})
        storage = StorageManager(config, layout(), pin_memory=False)
        me = WorkerIdentity("ranked", 0, "127.0.0.1", 0, layout(), 16)
        reply = RpcClient(ctx, f"tcp://127.0.0.1:{reply_port}", controller_reply_decoder, "reply")
        stream = EventStream(ctx, me, storage, f"127.0.0.1:{pull_port}", reply, lambda: True, 0.05)
        stream.start()
        received: list[int] = []
        try:
            deadline = time.monotonic() + 6.0
            chunk = 0
            while time.monotonic() < deadline and not received:
                chunk += 1
                assert storage.put(chunk, torch.zeros(storage.page_bytes, dtype=torch.uint8))
                if await pull.poll(200):
                    message = worker_message_decoder.decode(await pull.recv())
                    assert isinstance(message, KeyEvents) and message.location == CPU
                    received += unpack_hashes(message.admitted).tolist()
            return received, refusals, dict(stream.stats), len(resyncs)
        finally:
            stream.close()
            reply.close()
            reply_server.close()
            pull.close(0)
            storage.close()
            stop_zap(controller_ctx)
            ctx.destroy(0)
            controller_ctx.destroy(0)

    return asyncio.run(asyncio.wait_for(main(), 30))


def test_a_pull_socket_the_controller_refused_is_opened_again_and_the_events_flow():
    """libzmq may give a refused connection up for good (as it did every time on a quiet host),
    or reconnect by itself (seen under load). Either way the events reach the controller's pull
    socket within seconds: a refusal the socket's monitor heard has the stream open a new socket
    2 s later, and nothing else does."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        received, refusals, stats, resyncs = _run_refused_once(event_stream.REOPEN_AFTER_S, monkeypatch)
    assert len(refusals) == 1 and refusals[0].startswith("pull ")
    assert received, f"no key events reached the pull socket in 6 s (stats {stats})"
    assert stats["pull_socket_reopened"] <= stats["pull_socket_refused"] <= 1, stats
    # What the refused batches held went over the reply socket as a re-sync meanwhile.
    assert resyncs >= 1 and stats["events_dropped"] >= 1


def test_without_reopening_a_refusal_libzmq_gave_up_on_stays_unconnected():
    """The test above can fail: where libzmq gives the refused connection up and the stream never
    opens a new socket, nothing arrives in 6 s. (Where libzmq reconnected by itself instead, the
    run shows nothing and is tried again, up to 3 times.)"""
    for _ in range(3):
        with pytest.MonkeyPatch.context() as monkeypatch:
            received, refusals, stats, _ = _run_refused_once(3600.0, monkeypatch)
        assert len(refusals) == 1 and stats["pull_socket_reopened"] == 0
        if not received:
            assert stats["pull_socket_refused"] == 1, stats  # the monitor heard it
            return
    pytest.skip("libzmq reconnected by itself after each of 3 refusals")
