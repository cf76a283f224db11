"""The one request/reply layer (lmcache_p2p.rpc) over real ZMQ sockets on loopback."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import zmq
import zmq.asyncio

from lmcache_p2p.protocol import Ack, ClearCommand, CommandReply, HealthCommand, StatusCommand, command_reply_decoder
from lmcache_p2p.rpc import Answer, RemoteError, RequestFailed, RpcClient, RpcServer
from lmcache_p2p.testing.ports import free_ports


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def _server(ctx, port, handlers, **kw) -> RpcServer:
    server = RpcServer(
        ctx, "test server", handlers, error_reply=lambda e: CommandReply(event_id="", ok=False, error=e), **kw
    )
    server.bind(f"tcp://127.0.0.1:{port}")
    server.start()
    return server


def test_typed_reply_error_reply_and_wrong_type():
    async def main():
        ctx = zmq.asyncio.Context()
        port = free_ports(1)[0]
        server = _server(
            ctx,
            port,
            {
                HealthCommand: lambda c: CommandReply(event_id=c.event_id, ok=True, num_tokens=7),
                ClearCommand: lambda c: CommandReply(
                    event_id=c.event_id, ok=False, error=f"no location {c.location!r}"
                ),
                StatusCommand: lambda c: Ack(ok=True),  # a server bug: the wrong reply type
            },
        )
        either = msgspec.msgpack.Decoder(CommandReply | Ack)
        client = RpcClient(ctx, f"tcp://127.0.0.1:{port}", either, "worker 0")
        try:
            reply = await client.request(HealthCommand(event_id="e1"), CommandReply, 5)
            assert (reply.event_id, reply.num_tokens) == ("e1", 7)
            with pytest.raises(RemoteError, match="no location 'disk'") as refused:
                await client.request(ClearCommand(event_id="e2", location="disk"), CommandReply, 5)
            assert refused.value.reply.event_id == "e2"  # the typed reply rides the error
            with pytest.raises(RemoteError, match="answered Ack to StatusCommand"):
                await client.request(StatusCommand(event_id="e3"), CommandReply, 5)
        finally:
            client.close()
            server.close()
            ctx.destroy(0)

    run(main())


def test_handler_errors_and_garbage_are_answered_and_the_server_goes_on():
    errors, bad = [], []

    async def main():
        ctx = zmq.asyncio.Context()
        port = free_ports(1)[0]

        def broken(c):
            raise RuntimeError("disk on fire")

        server = _server(
            ctx,
            port,
            {HealthCommand: broken, StatusCommand: lambda c: CommandReply(event_id=c.event_id, ok=True)},
            on_error=lambda msg, e: errors.append(type(msg).__name__),
            on_bad_frame=bad.append,
        )
        client = RpcClient(ctx, f"tcp://127.0.0.1:{port}", command_reply_decoder, "worker 0")
        raw = ctx.socket(zmq.DEALER)
        raw.connect(f"tcp://127.0.0.1:{port}")
        try:
            with pytest.raises(RemoteError, match="disk on fire"):
                await client.request(HealthCommand(event_id="e1"), CommandReply, 5)
            await raw.send_multipart([b"x", b"\xc1not msgpack"])
            answer = command_reply_decoder.decode((await raw.recv_multipart())[1])
            assert not answer.ok and "undecodable" in answer.error
            # A request type this server has no handler for does not decode either.
            await raw.send_multipart([b"y", msgspec.msgpack.encode(ClearCommand(event_id="e", location="x"))])
            assert "undecodable" in command_reply_decoder.decode((await raw.recv_multipart())[1]).error
            assert (await client.request(StatusCommand(event_id="e2"), CommandReply, 5)).ok
        finally:
            raw.close(0)
            client.close()
            server.close()
            ctx.destroy(0)
        assert errors == ["HealthCommand"] and len(bad) == 2

    run(main())


def test_timeout_resets_and_a_late_answer_reaches_its_handler():
    late = []

    async def main():
        ctx = zmq.asyncio.Context()
        port = free_ports(1)[0]
        release = asyncio.Event()

        async def slow(c):
            await release.wait()
            return CommandReply(event_id=c.event_id, ok=True)

        server = _server(
            ctx,
            port,
            {HealthCommand: slow, StatusCommand: lambda c: CommandReply(event_id=c.event_id, ok=True)},
            concurrent=True,
        )
        client = RpcClient(ctx, f"tcp://127.0.0.1:{port}", command_reply_decoder, "worker 0")
        try:
            with pytest.raises(RequestFailed, match=r"no answer .* \(sent, not answered\)"):
                await client.request_frames(
                    HealthCommand(event_id="slow"), CommandReply, 0.3, on_late=lambda reply, frames: late.append(reply)
                )
            # concurrent: the slow request does not hold up the next one (on a fresh socket)
            assert (await client.request(StatusCommand(event_id="next"), CommandReply, 5)).event_id == "next"
            release.set()
            for _ in range(100):
                if late:
                    break
                await asyncio.sleep(0.02)
        finally:
            client.close()
            server.close()
            ctx.destroy(0)
        assert [r.event_id for r in late] == ["slow"]

    run(main())


def test_bulk_frames_ride_zero_copy_and_on_sent_runs_after_the_send():
    sent = []

    async def main():
        ctx = zmq.asyncio.Context()
        port = free_ports(1)[0]
        payload = bytearray(b"k" * 1_000_000)
        server = _server(
            ctx,
            port,
            {
                HealthCommand: lambda c: Answer(
                    CommandReply(event_id=c.event_id, ok=True), [memoryview(payload)], lambda: sent.append(1)
                )
            },
        )
        client = RpcClient(ctx, f"tcp://127.0.0.1:{port}", command_reply_decoder, "worker 0")
        try:
            reply, frames = await client.request_frames(HealthCommand(event_id="bulk"), CommandReply, 5)
            assert reply.ok and bytes(frames[0].buffer) == bytes(payload)
            # The server learns that ZMQ let go of the frames by polling its tracker, which may be
            # a moment after the client has the reply.
            for _ in range(200):
                if sent:
                    break
                await asyncio.sleep(0.01)
        finally:
            client.close()
            server.close()
            ctx.destroy(0)
        assert sent == [1]

    run(main())


def test_no_server_is_a_request_failed_within_the_timeout():
    async def main():
        ctx = zmq.asyncio.Context()
        client = RpcClient(ctx, f"tcp://127.0.0.1:{free_ports(1)[0]}", command_reply_decoder, "worker 0")
        try:
            # The error tells a holder we never reached from one that did not answer.
            with pytest.raises(RequestFailed, match="not sent: no connection came up"):
                await client.request(HealthCommand(event_id="e"), CommandReply, 0.3)
        finally:
            client.close()
            ctx.destroy(0)

    run(main())


def test_connect_opens_the_connection_before_the_first_request():
    """A warm peer's pull socket is connected at its hello: the first pull does not wait for it."""

    async def main():
        ctx = zmq.asyncio.Context()
        port = free_ports(1)[0]
        server = _server(ctx, port, {HealthCommand: lambda c: CommandReply(event_id=c.event_id, ok=True)})
        monitor = server.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        client = RpcClient(ctx, f"tcp://127.0.0.1:{port}", command_reply_decoder, "worker 0")
        try:
            assert not await monitor.poll(300), "a connection before connect()"
            client.connect()
            client.connect()  # once is enough: no second socket
            assert await monitor.poll(5000), "connect() did not bring the connection up"
            await monitor.recv_multipart()
            assert (await client.request(HealthCommand(event_id="e"), CommandReply, 5)).ok
            assert not await monitor.poll(300), "the request opened another connection"
        finally:
            client.close()
            server.sock.disable_monitor()
            monitor.close(0)
            server.close()
            ctx.destroy(0)

    run(main())


def test_every_failed_request_with_a_late_handler_gets_it_called_exactly_once(monkeypatch):
    """A request failed by another's timeout (its socket was reset) is owed its late handler too:
    a NIXL holder may still write into the pages it names."""
    import lmcache_p2p.rpc as rpc

    monkeypatch.setattr(rpc, "LATE_GRACE_S", 0.3)
    calls: dict[str, list] = {"timed_out": [], "reset_with_it": [], "answered_late": []}

    async def main():
        ctx = zmq.asyncio.Context()
        port = free_ports(1)[0]
        never = asyncio.Event()

        async def handle(c):
            if c.event_id == "answered_late":
                await asyncio.sleep(0.2)
            else:
                await never.wait()
            return CommandReply(event_id=c.event_id, ok=True)

        server = _server(ctx, port, {HealthCommand: handle}, concurrent=True)
        client = RpcClient(ctx, f"tcp://127.0.0.1:{port}", command_reply_decoder, "holder")

        def ask(name: str, timeout: float):
            return client.request_frames(
                HealthCommand(event_id=name), CommandReply, timeout, on_late=lambda r, f: calls[name].append(r)
            )

        try:
            results = await asyncio.gather(
                ask("timed_out", 0.1), ask("reset_with_it", 0.5), ask("answered_late", 0.5), return_exceptions=True
            )
            assert all(isinstance(r, RequestFailed) for r in results), results
            await asyncio.sleep(1.0)  # past the longest deadline (0.5 s) plus the grace period
        finally:
            client.close()
            server.close()
            ctx.destroy(0)

    run(main())
    assert calls["timed_out"] == [None] and calls["reset_with_it"] == [None]
    assert [r.event_id for r in calls["answered_late"]] == ["answered_late"]


# -- the mesh's security (issue 18) ------------------------------------------------------------------


def test_a_secured_server_answers_members_of_its_mesh_only():
    """Server and client on one secured context (the keys come from it); strangers on their own:
    a plain one, one from another secret, one that knows the mesh's public key but not its secret."""
    from lmcache_p2p.mesh_security import MeshSecurity, derive_keys, for_context

    secret = "the secret of this test mesh"

    async def main():
        ctx = zmq.asyncio.Context()
        security = MeshSecurity(secret)
        security.attach(ctx)
        port = free_ports(1)[0]
        server = _server(ctx, port, {HealthCommand: lambda c: CommandReply(event_id=c.event_id, ok=True)})
        member = RpcClient(ctx, f"tcp://127.0.0.1:{port}", command_reply_decoder, "member")
        strangers = zmq.asyncio.Context()
        other = MeshSecurity("the secret of another mesh")
        other.attach(strangers)
        try:
            assert server.security is security and member.security is security
            assert (await member.request(HealthCommand(event_id="m"), CommandReply, 5)).ok
            plain = zmq.asyncio.Context()
            for name, stranger_ctx in (("plain", plain), ("another mesh", strangers)):
                stranger = RpcClient(stranger_ctx, f"tcp://127.0.0.1:{port}", command_reply_decoder, name)
                assert stranger.security is (other if stranger_ctx is strangers else None)
                with pytest.raises(RequestFailed, match="no answer"):
                    await stranger.request(HealthCommand(event_id=name), CommandReply, 0.5)
                stranger.close()
            plain.destroy(0)
            sock = strangers.socket(zmq.DEALER)
            public, secret_key = zmq.curve_keypair()
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
                derive_keys(secret).public,
                public,
                secret_key,
            )
            sock.connect(f"tcp://127.0.0.1:{port}")
            await sock.send_multipart([b"\x01" * 8, b"\xc1"])
            assert not await sock.poll(500)
            sock.close(linger=0)
            refused = security.refused_by()
            assert refused.get("127.0.0.1", 0) >= 1, refused  # ZAP's refusals know the address
            assert refused.get("test server", 0) >= 2, refused  # failed handshakes: the socket
            assert (await member.request(HealthCommand(event_id="still"), CommandReply, 5)).ok
        finally:
            member.close()
            server.close()
            await asyncio.sleep(0.05)  # the monitor's watcher sees the socket close
            for c, s in ((ctx, security), (strangers, other)):
                s.detach(c)
                c.destroy(0)
        assert for_context(ctx) is None

    run(main())


def test_a_frame_over_max_message_bytes_ends_the_connection_unread():
    bad = []

    async def main():
        ctx = zmq.asyncio.Context()
        port = free_ports(1)[0]
        server = _server(
            ctx,
            port,
            {HealthCommand: lambda c: CommandReply(event_id=c.event_id, ok=True)},
            on_bad_frame=bad.append,
            max_message_bytes=2**20,
        )
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        client = RpcClient(ctx, f"tcp://127.0.0.1:{port}", command_reply_decoder, "worker 0")
        try:
            await sock.send_multipart([b"\x01" * 8, bytes(2**20 + 1)])
            assert not await sock.poll(1000)
            assert bad == []  # dropped by ZMQ, never read: not even a bad frame
            await sock.send_multipart([b"\x02" * 8, b"\xc1"])  # what fits is read (on a new connection)
            assert await sock.poll(5000) and len(bad) == 1
            assert (await client.request(HealthCommand(event_id="e"), CommandReply, 5)).ok
        finally:
            sock.close(linger=0)
            client.close()
            server.close()
            ctx.destroy(0)

    run(main())
    with pytest.raises(ValueError, match="max_message_bytes 0"):
        RpcServer(zmq.asyncio.Context.instance(), "bad", {HealthCommand: print}, max_message_bytes=0)
