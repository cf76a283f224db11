"""The tcp channel's data streams (lmcache_p2p.transfer.tcp_transport), holder and requester in one
process over real sockets on 127.0.0.1: bytes land exactly in the reserved pages, the data port is
bound on the configured host only, strangers are refused, late or stray segments never touch a
page, a page being written is kept out of use until the write ends, a dead holder fails its
transfers at once, and without a data port the payloads ride the reply."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import pytest

from lmcache_p2p.keys import ChunkKey
from lmcache_p2p.protocol import ChannelHello, ChannelHelloReply
from lmcache_p2p.storage.cpu_tier import PinnedChunk
from lmcache_p2p.storage.memory import PagePool
from lmcache_p2p.transfer import tcp_transport
from lmcache_p2p.transfer.base import TransferError
from lmcache_p2p.transfer.tcp_transport import TcpTransport

PAGE = 1 << 20  # 1 MiB pages keep the tests fast; segments are cut at MIN_SEGMENT_BYTES below that
PEER = ("127.0.0.1", 1)  # the (host, p2p_lookup port) a link is kept under


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


class Pair:
    """A holder with ``chunks`` random pages and a requester with an empty pool, hello done."""

    def __init__(self, chunks: int = 8, streams: int = 4, listen: bool = True):
        self.holder_pool = PagePool(PAGE, chunks * PAGE, pin_memory=False)
        self.requester_pool = PagePool(PAGE, (chunks + 2) * PAGE, pin_memory=False)
        rng = np.random.default_rng(7)
        self.holder_pool.buffer.numpy()[:] = rng.integers(0, 256, chunks * PAGE, dtype=np.uint8)
        self.requester_pool.buffer.numpy()[:] = 0
        self.chunks = [PinnedChunk(ChunkKey(1, i), self.holder_pool.page(i)) for i in range(self.holder_pool.num_pages)]
        self.holder = TcpTransport(self.holder_pool, "holder-session")
        self.requester = TcpTransport(self.requester_pool, "requester-session", streams=streams)
        self.listen = listen

    async def __aenter__(self) -> Pair:
        if self.listen:
            self.holder.listen("127.0.0.1")
        hello = self.requester.hello("requester", 0, 1)
        assert await self.holder.accept(hello) is False
        port, token = self.holder.offer(hello.session)
        await self.requester.connect(PEER, ChannelHelloReply(ok=True, data_port=port, data_token=token))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.requester.close()
        self.holder.close()

    def page(self, pool: PagePool, index: int) -> np.ndarray:
        return pool.page(index).numpy()


@pytest.mark.parametrize(("count", "streams"), [(1, 4), (3, 4), (8, 4), (8, 1)])
def test_streamed_payloads_land_bit_exact_in_the_reserved_pages(count, streams):
    async def main() -> None:
        async with Pair(streams=streams) as p:
            dst = [9 - i for i in range(count)]  # any pages, in any order
            landing = p.requester.begin(PEER, dst)
            assert landing is not None
            assert await p.holder.send_streamed("requester-session", p.chunks[:count], landing.id, 10) is not None
            await landing.landed(count, 10)
            assert landing.close(on_idle=lambda: None)
            for i, page in enumerate(dst):
                assert np.array_equal(p.page(p.requester_pool, page), p.page(p.holder_pool, i)), i
            untouched = set(range(p.requester_pool.num_pages)) - set(dst)
            assert all(not p.page(p.requester_pool, page).any() for page in untouched)
            assert p.holder.stats["streamed_requests"] == 1 and p.holder.stats["framed_requests"] == 0

    run(main())


def test_the_data_port_is_bound_on_the_configured_host_only():
    async def main() -> None:
        async with Pair() as p:
            listener = p.holder._listener
            assert listener is not None
            assert listener.getsockname()[0] == "127.0.0.1"  # never 0.0.0.0
            assert p.holder.data_port == listener.getsockname()[1] > 0

    run(main())


def test_a_connection_without_the_sessions_token_is_refused():
    async def main() -> None:
        async with Pair() as p:
            stranger = TcpTransport(PagePool(PAGE, 2 * PAGE, pin_memory=False), "stranger")
            try:
                reply = ChannelHelloReply(ok=True, data_port=p.holder.data_port, data_token=b"x" * 16)
                await stranger.connect(PEER, reply)
                assert stranger.begin(PEER, [0]) is None  # no link: its payloads would ride the replies
            finally:
                stranger.close()
            # The real requester's streams are unaffected.
            landing = p.requester.begin(PEER, [0])
            assert landing is not None
            assert await p.holder.send_streamed("requester-session", p.chunks[:1], landing.id, 10) is not None
            await landing.landed(1, 10)

    run(main())


def test_segments_for_a_closed_transfer_are_dropped_and_the_link_goes_on():
    async def main() -> None:
        async with Pair() as p:
            late = p.requester.begin(PEER, [0, 1])
            assert late is not None
            assert late.close(on_idle=lambda: None)  # the request failed before its payload came
            assert await p.holder.send_streamed("requester-session", p.chunks[:2], late.id, 10) is not None
            # A stray id (nothing of ours) too.
            assert await p.holder.send_streamed("requester-session", p.chunks[:2], 12345, 10) is not None
            landing = p.requester.begin(PEER, [2, 3])
            assert landing is not None
            assert await p.holder.send_streamed("requester-session", p.chunks[2:4], landing.id, 10) is not None
            await landing.landed(2, 10)
            assert not p.page(p.requester_pool, 0).any() and not p.page(p.requester_pool, 1).any()
            assert np.array_equal(p.page(p.requester_pool, 2), p.page(p.holder_pool, 2))

    run(main())


def test_a_page_being_written_stays_out_of_use_until_the_write_ends(monkeypatch):
    """close() while a segment is being received into the transfer's pages returns False, and
    on_idle runs only once that segment is done (here: the stream stalls and the link breaks)."""
    monkeypatch.setattr(tcp_transport, "STALL_S", 0.5)

    async def main() -> None:
        async with Pair(streams=1) as p:
            landing = p.requester.begin(PEER, [4])
            assert landing is not None
            (stream,) = p.holder._sessions["requester-session"].streams
            header = tcp_transport._HEADER.pack(tcp_transport._HEADER_MAGIC, 0, landing.id, 0, PAGE)
            sent = time.monotonic()
            stream.sock.sendall(header + b"\x07" * (PAGE // 2))  # half a segment, then silence
            await asyncio.sleep(0.2)
            idle = asyncio.Event()
            assert landing.close(on_idle=idle.set) is False  # a reader is writing into page 4
            await asyncio.wait_for(idle.wait(), 5)  # the stalled stream broke the link
            # Not before the stall timeout: the reader's clock starts at the last byte, after `sent`
            # (measured from there, not from close(), so a slow sleep on a busy host cannot fail it).
            assert time.monotonic() - sent > 0.45
            assert p.requester.begin(PEER, [5]) is None  # that link is gone: payloads ride replies

    run(main())


def test_a_dead_holder_fails_the_open_transfers_at_once():
    async def main() -> None:
        async with Pair() as p:
            landing = p.requester.begin(PEER, [0, 1])
            assert landing is not None
            p.holder.close()  # its streams close with it
            t0 = time.monotonic()
            with pytest.raises(TransferError, match="tcp data link to 127.0.0.1:.* broke"):
                await landing.landed(2, 20)
            assert time.monotonic() - t0 < 5
            assert landing.close(on_idle=lambda: None)

    run(main())


def test_a_slow_or_missing_payload_times_out_with_the_missing_bytes():
    async def main() -> None:
        async with Pair() as p:
            landing = p.requester.begin(PEER, [0])
            assert landing is not None
            with pytest.raises(TransferError, match=f"{PAGE} payload bytes of 1 chunk"):
                await landing.landed(1, 0.3)

    run(main())


def test_without_a_data_port_the_payloads_ride_the_reply():
    async def main() -> None:
        async with Pair(listen=False) as p:
            assert p.holder.offer("requester-session") == (0, b"")
            assert p.requester.begin(PEER, [0]) is None
            assert await p.holder.send_streamed("requester-session", p.chunks[:2], 1, 10) is None
            frames, staged = await p.holder.send("requester-session", p.chunks[:2], np.zeros(0), np.zeros(0), 10)
            assert not staged and len(frames) == 2
            await p.requester.land([_Frame(f) for f in frames], [3, 4], [])
            assert np.array_equal(p.page(p.requester_pool, 4), p.page(p.holder_pool, 1))

    run(main())


def test_a_new_hello_replaces_the_old_streams_on_both_sides():
    async def main() -> None:
        async with Pair() as p:
            old = p.holder._sessions["requester-session"]
            stale = p.requester.begin(PEER, [0])
            assert stale is not None
            hello = p.requester.hello("requester", 0, 1)
            await p.holder.accept(hello)  # the requester dropped us and says hello again
            assert not old.streams and p.holder._sessions["requester-session"] is not old
            port, token = p.holder.offer(hello.session)
            await p.requester.connect(PEER, ChannelHelloReply(ok=True, data_port=port, data_token=token))
            with pytest.raises(TransferError):
                await stale.landed(1, 5)  # it was on the old link
            landing = p.requester.begin(PEER, [1])
            assert landing is not None
            assert await p.holder.send_streamed("requester-session", p.chunks[:1], landing.id, 10) is not None
            await landing.landed(1, 10)

    run(main())


def test_the_holder_gives_up_on_a_requester_that_stops_reading():
    """A frozen requester: the holder's write times out, that stream is closed (it may be out of
    step), and send_streamed says so."""

    async def main() -> None:
        holder_pool = PagePool(PAGE, 64 * PAGE, pin_memory=False)
        holder = TcpTransport(holder_pool, "holder")
        holder.listen("127.0.0.1")
        try:
            hello = ChannelHello(instance_id="r", rank=0, fingerprint=1, channel="tcp", session="frozen")
            await holder.accept(hello)
            port, token = holder.offer("frozen")
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)  # a requester that never reads
            sock.sendall(tcp_transport._HANDSHAKE.pack(tcp_transport._HANDSHAKE_MAGIC, token))
            assert await asyncio.to_thread(sock.recv, 1) == tcp_transport._ACK  # the loop answers it
            await _until(lambda: bool(holder._sessions["frozen"].streams))
            chunks = [PinnedChunk(ChunkKey(1, i), holder_pool.page(i)) for i in range(64)]
            t0 = time.monotonic()
            with pytest.raises(TransferError, match="failed"):
                await holder.send_streamed("frozen", chunks, 1, 0.5)
            assert time.monotonic() - t0 < 3
            assert all(s.dead for s in holder._sessions["frozen"].streams)
            assert await holder.send_streamed("frozen", chunks[:1], 2, 0.5) is None  # no live stream left
            sock.close()
        finally:
            holder.close()

    run(main())


def test_a_link_broken_between_requests_is_opened_again(monkeypatch):
    monkeypatch.setattr(tcp_transport, "REOPEN_EVERY_S", 0.0)

    async def main() -> None:
        async with Pair() as p:
            old = p.requester._links[PEER]
            tcp_transport._kill(p.holder._sessions["requester-session"].streams[0])  # a reset, say
            await _until(lambda: old.broken is not None)
            assert p.requester.begin(PEER, [0]) is None  # this request rides the reply...
            await _until(lambda: p.requester._links[PEER] is not old)  # ...and the link comes back
            landing = p.requester.begin(PEER, [1])
            assert landing is not None
            assert await p.holder.send_streamed("requester-session", p.chunks[:3], landing.id, 10) is not None
            await landing.landed(1, 10)
            assert np.array_equal(p.page(p.requester_pool, 1), p.page(p.holder_pool, 0))
            assert len(p.holder._sessions["requester-session"].streams) == p.requester.streams  # dead ones pruned

    run(main())


def test_a_requester_that_hangs_up_costs_the_holder_no_sockets():
    async def main() -> None:
        async with Pair() as p:
            streams = list(p.holder._sessions["requester-session"].streams)
            assert len(streams) == p.requester.streams
            p.requester.close()
            await _until(lambda: all(s.dead for s in streams))
            assert all(s.sock.fileno() == -1 for s in streams)

    run(main())


class _Frame:
    """What ZMQ hands the requester for a frame (zero-copy ``zmq.Frame``): its buffer."""

    def __init__(self, data: np.ndarray):
        self.buffer = np.ascontiguousarray(data).data


async def _until(condition: Callable[[], bool], timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_segments_spread_small_requests_over_every_stream():
    plan = tcp_transport._segments(1, 32 * 2**20, 4)
    assert len(plan) == 4 and all(len(s) == 1 for s in plan)
    assert sum(length for s in plan for _, _, length in s) == 32 * 2**20
    plan = tcp_transport._segments(8, 32 * 2**20, 4)
    assert [[i for i, _, _ in s] for s in plan] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # Pages too small to cut: whole pages, on as many streams as there are pages.
    assert tcp_transport._segments(1, 2**20, 4) == [[(0, 0, 2**20)]]
