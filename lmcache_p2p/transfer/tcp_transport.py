"""The tcp channel: chunk payloads over plain TCP connections of its own, straight into pool pages.

The request and its reply (which chunks, their checksums, errors) stay on the ZMQ request
socket. The payloads go over data connections the requester opens to the holder's data port
right after the hello (``ChannelHelloReply.data_port``; bound on the holder's p2p host, never on
all interfaces), several per holder (:data:`STREAMS`), each opening with the session's token.
The holder ``sendall``s each chunk from its pinned page, cut into segments spread over the
streams, each segment behind a 32-byte header (transfer id, chunk index, offset, length); a reader
thread per stream ``recv_into``s each segment straight into the page the requester reserved
for it. One copy on each side (the kernel's), no message buffers, no copy out of them, and the
streams land in parallel on several cores (``recv_into`` lets go of the GIL).

Why not ZMQ frames, as before (measured, BENCHMARKS.md): one ZMQ stream receives every 32 MiB
frame into a fresh allocation, which glibc maps anew and the kernel faults in page by page (on the
H200 host 1.7 GB/s, 3.3 with glibc told to keep freed buffers, as fast as one plain socket); the
channel then copied each frame into its pool page on the worker's loop (0.35-0.6 s per 2 GB) and
could use one connection only. Here nothing is allocated per transfer, the kernel's copy is the
only one, and streams add up: 64 chunks at 1.6 GB/s before, 12.9-14.3 GB/s over 8 streams on that
host.

A holder without a data port (older version, or its port could not be opened) offers none, and
payloads then ride the reply as ZMQ frames, one per chunk (:meth:`TcpTransport.send`), as before.

Safety of the requester's pages: only this process's reader threads write into them, and only
for a transfer that is still open (:class:`_Transfer`); once a request is closed (answered,
failed, timed out) later segments for it are read into a scratch buffer and dropped, and a
segment being written at that moment keeps the pages out of the pool until it is done
(``Landing.close`` then calls back). A stream that stalls mid-segment for :data:`STALL_S`, ends,
or breaks the protocol breaks its link: every open transfer on it fails at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lmcache_p2p.protocol import ChannelHello, ChannelHelloReply
from lmcache_p2p.storage.cpu_tier import PinnedChunk
from lmcache_p2p.storage.memory import PagePool
from lmcache_p2p.transfer.base import Landing, TransferError, Transport, check_hello_bounds

logger = logging.getLogger(__name__)

# Data connections a requester opens to each holder. More streams land on more cores at once
# (each has its own reader thread and the holder a writer each): on the 16-core H200 host 64
# chunks moved at 3.4 GB/s over 1 stream, 5.6 over 2, 9.3 over 4, 12.9-14.3 over 8 and 12.8 over
# 16; on the 2-vCPU VM every count from 2 to 8 matched a raw socket (BENCHMARKS.md).
STREAMS = 8
MAX_STREAMS_PER_SESSION = 16  # the holder refuses more
# A chunk is cut into segments of at least this many bytes, so a request of fewer chunks than
# streams still spreads over all of them.
MIN_SEGMENT_BYTES = 4 * 2**20
# A stream that delivers no byte of a segment for this long is dead (a frozen holder keeps its
# TCP connection open): its link breaks and whatever it was writing is released.
STALL_S = 5.0
CONNECT_TIMEOUT_S = 3.0  # connect + handshake of one data connection
# A link that broke while the session lives on (the request socket still answers) is opened again
# with the session's token, at most this often; its requests ride the replies meanwhile.
REOPEN_EVERY_S = 5.0
# 0: the kernel's buffer autotuning (up to net.ipv4.tcp_rmem's max, 32 MiB on the test VM), which
# moved as much as fixed 4 MiB buffers (setsockopt is capped at net.core.rmem_max, 4 MiB there).
SOCKET_BUFFER_BYTES = 0

_HANDSHAKE = struct.Struct("<8s16s")  # magic, session token
_HANDSHAKE_MAGIC = b"LMCP2PD1"
_ACK = b"\x01"
_HEADER = struct.Struct("<4sIQQQ")  # magic, chunk index, transfer, offset, length
_HEADER_MAGIC = b"LMCS"


def _tune(sock: socket.socket) -> None:
    # Segments are large, but each request's last bytes must not wait for a delayed ACK.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if SOCKET_BUFFER_BYTES:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


def _recv_exact(sock: socket.socket, view: memoryview, between: bool = False) -> bool:
    """Fill ``view`` from ``sock``. An end of stream is ConnectionError, except before the first
    byte when ``between`` (between segments: a clean close), which returns False."""
    got, size = 0, len(view)
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            if got == 0 and between:
                return False
            raise ConnectionError(f"stream ended {size - got} bytes short of a {size}-byte read")
        got += n
    return True


def _segments(count: int, page_bytes: int, streams: int) -> list[list[tuple[int, int, int]]]:
    """(chunk index, offset, length) per stream: whole chunks round-robin when there are at least
    as many chunks as streams; else each chunk cut in equal parts (of at least
    MIN_SEGMENT_BYTES) so every stream carries some."""
    parts = 1 if count >= streams else max(1, min(-(-streams // count), page_bytes // MIN_SEGMENT_BYTES))
    size = -(-page_bytes // parts)
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(streams)]
    k = 0
    for index in range(count):
        for offset in range(0, page_bytes, size):
            out[k % streams].append((index, offset, min(size, page_bytes - offset)))
            k += 1
    return [s for s in out if s]


# -- requester side ----------------------------------------------------------------------------------


class _Transfer(Landing):
    """One request's pages and how much of each has landed. Readers touch it under the
    transport's lock; the waiting side is on the worker's loop."""

    def __init__(self, transport: TcpTransport, link: _Link, transfer_id: int, pages: Sequence[int]):
        self.id = transfer_id
        self.transport = transport
        self.link = link
        self.pages = list(pages)
        self.remaining = [transport.pool.page_bytes] * len(self.pages)
        self.writing = 0  # segments being received into its pages right now
        self.open = True
        self.error: str | None = None
        self.loop = asyncio.get_running_loop()
        self._progress = asyncio.Event()
        self._on_idle: Callable[[], None] | None = None

    def wake(self) -> None:
        """From a reader thread, under the lock: a page completed, or the link broke."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            self.loop.call_soon_threadsafe(self._progress.set)

    def idle(self) -> None:
        """From a reader thread, under the lock: the last write into a closed transfer ended."""
        if self._on_idle is not None:
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self._on_idle)
            self._on_idle = None

    async def landed(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        lock = self.transport.lock
        while True:
            self._progress.clear()  # before looking: a wake-up after the look is not lost
            with lock:
                done = not any(self.remaining[:count])
                error = self.error
            if done:
                return
            if error is not None:
                raise TransferError(error)
            left = deadline - time.monotonic()
            if left <= 0:
                with lock:
                    missing = sum(self.remaining[:count])
                raise TransferError(
                    f"{missing} payload bytes of {count} chunk(s) not landed within {timeout:.1f}s of the reply"
                )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._progress.wait(), left)

    def close(self, on_idle: Callable[[], None]) -> bool:
        with self.transport.lock:
            if self.open:
                self.open = False
                self.transport.transfers.pop(self.id, None)
                self.link.transfers.discard(self)
            if self.writing == 0:
                return True
            self._on_idle = on_idle
            return False


@dataclass(eq=False)
class _Link:
    """The data connections to one holder, with one reader thread each."""

    peer: tuple[str, int]
    port: int
    token: bytes
    socks: list[socket.socket] = field(default_factory=list)
    transfers: set[_Transfer] = field(default_factory=set)
    broken: str | None = None  # why it stopped; its transfers failed with it
    closing: bool = False  # its streams are being shut
    reopen_at: float = 0.0  # time.monotonic() before which it is not opened again

    def describe(self) -> str:
        return f"{self.peer[0]}:{self.port}"


# -- holder side ---------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Stream:
    sock: socket.socket
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one request's segments at a time, in order
    dead: bool = False
    watched: bool = False  # registered with the loop for its hang-up (only on the loop's thread)


def _kill(stream: _Stream) -> None:
    """On the loop: the stream is done (out of step, hung up, or its session went)."""
    stream.dead = True
    if stream.watched:
        stream.watched = False
        with contextlib.suppress(Exception):  # the loop closing, or it was never registered
            asyncio.get_running_loop().remove_reader(stream.sock.fileno())
    _shut(stream.sock)


@dataclass(eq=False)
class _Session:
    """A requester's data connections to us (holder side)."""

    session: str
    instance: tuple[str, int]
    token: bytes
    streams: list[_Stream] = field(default_factory=list)

    def close(self) -> None:
        for stream in self.streams:
            _kill(stream)
        self.streams.clear()


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, pool: PagePool, session: str, streams: int | None = None):
        super().__init__(pool, session)
        self.streams = STREAMS if streams is None else streams
        # The pool as one writable buffer: a segment's destination is a slice of it (no torch
        # call on the reader threads).
        self._memory = pool.buffer.numpy().data if pool.num_pages else memoryview(b"")
        # requester side
        self.lock = threading.Lock()
        self.transfers: dict[int, _Transfer] = {}
        self._ids = itertools.count(1)
        self._links: dict[tuple[str, int], _Link] = {}
        # holder side
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._sessions: dict[str, _Session] = {}
        self._tokens: dict[bytes, _Session] = {}
        self._writers: ThreadPoolExecutor | None = None
        self._tasks: set[asyncio.Task] = set()
        self.stats = {"streamed_requests": 0, "framed_requests": 0, "links_broken": 0}

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- requester side --------------------------------------------------------------------------

    async def connect(self, peer: tuple[str, int], reply: ChannelHelloReply) -> None:
        old = self._links.pop(peer, None)
        if old is not None:
            self._break(old, "replaced by a new session with the holder")
        if not reply.data_port or not reply.data_token or self.streams <= 0 or not self.pool.num_pages:
            return  # payloads ride the replies
        link = await self._open_link(peer, reply.data_port, reply.data_token)
        if link is not None:
            self._links[peer] = link

    async def _open_link(self, peer: tuple[str, int], port: int, token: bytes) -> _Link | None:
        """The streams to a holder's data port, each with its reader running; None (logged)
        when any could not be opened."""
        link = _Link(peer, port, token)
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(self._open_stream(peer[0], port, token) for _ in range(self.streams)), return_exceptions=True
        )
        socks = [r for r in results if isinstance(r, socket.socket)]
        errors = [r for r in results if not isinstance(r, socket.socket)]
        if errors:
            for sock in socks:
                _shut(sock)
            logger.warning(
                "tcp data connection to %s failed (%r); payloads from it ride the replies instead",
                link.describe(),
                errors[0],
            )
            return None
        link.socks = socks
        for i, sock in enumerate(socks):
            threading.Thread(
                target=self._read, args=(link, sock), name=f"lmcache-tcp-rx-{peer[1]}-{i}", daemon=True
            ).start()
        logger.info(
            "tcp data link to %s: %d streams in %.1f ms", link.describe(), len(socks), (time.perf_counter() - t0) * 1e3
        )
        return link

    async def _reopen(self, link: _Link) -> None:
        """A broken link, opened again with its session's token (still valid while the holder
        keeps the session); it takes the place of the broken one unless a new hello came first."""
        fresh = await self._open_link(link.peer, link.port, link.token)
        if fresh is None:
            return
        if self._links.get(link.peer) is link:
            self._links[link.peer] = fresh
        else:
            self._break(fresh, "a new session with the holder came first")

    async def _open_stream(self, host: str, port: int, token: bytes) -> socket.socket:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            _tune(sock)

            async def handshake() -> None:
                await loop.sock_connect(sock, address)
                await loop.sock_sendall(sock, _HANDSHAKE.pack(_HANDSHAKE_MAGIC, token))
                if await loop.sock_recv(sock, 1) != _ACK:
                    raise ConnectionError("the holder refused the data connection")

            await asyncio.wait_for(handshake(), CONNECT_TIMEOUT_S)
            sock.setblocking(True)
            return sock
        except BaseException:
            sock.close()
            raise

    def begin(self, peer: tuple[str, int], pages: Sequence[int]) -> _Transfer | None:
        link = self._links.get(peer)
        if link is None:
            return None
        if link.broken is not None:
            # A failed request makes the puller say hello again (a new link); a link that broke
            # between requests is opened again here, in the background.
            if time.monotonic() >= link.reopen_at:
                link.reopen_at = time.monotonic() + REOPEN_EVERY_S
                self._background(self._reopen(link))
            return None
        transfer = _Transfer(self, link, next(self._ids), pages)
        with self.lock:
            self.transfers[transfer.id] = transfer
            link.transfers.add(transfer)
        return transfer

    def _read(self, link: _Link, sock: socket.socket) -> None:
        """A reader thread: segments from one stream into the pages of their transfers."""
        header = bytearray(_HEADER.size)
        scratch: memoryview | None = None
        page_bytes = self.pool.page_bytes
        why = "closed"
        try:
            while True:
                sock.settimeout(None)  # idle between requests for as long as it takes
                if not _recv_exact(sock, memoryview(header), between=True):
                    why = "the holder closed it"
                    break
                magic, index, transfer_id, offset, length = _HEADER.unpack(header)
                if magic != _HEADER_MAGIC or length == 0 or offset + length > page_bytes:
                    raise ConnectionError(f"bad segment header {bytes(header[:32]).hex()}")
                sock.settimeout(STALL_S)
                with self.lock:
                    transfer = self.transfers.get(transfer_id)
                    wanted = (
                        transfer is not None
                        and transfer.link is link
                        and index < len(transfer.pages)
                        and transfer.remaining[index] >= length
                    )
                    if wanted:
                        assert transfer is not None
                        transfer.writing += 1
                if not wanted or transfer is None:  # closed (late, failed) or not ours: drop it
                    if scratch is None:
                        scratch = memoryview(bytearray(min(page_bytes, 4 * 2**20)))
                    left = length
                    while left:
                        step = min(left, len(scratch))
                        _recv_exact(sock, scratch[:step])
                        left -= step
                    continue
                start = transfer.pages[index] * page_bytes + offset
                try:
                    _recv_exact(sock, self._memory[start : start + length])
                except BaseException as e:
                    with self.lock:  # the link is marked broken before the pages can be let go
                        self._mark(link, f"tcp data link to {link.describe()} broke: {_why(e)}")
                        transfer.writing -= 1
                        if not transfer.open and transfer.writing == 0:
                            transfer.idle()
                    raise
                with self.lock:
                    transfer.writing -= 1
                    transfer.remaining[index] -= length
                    if transfer.remaining[index] == 0:
                        transfer.wake()
                    if not transfer.open and transfer.writing == 0:
                        transfer.idle()
        except (OSError, ValueError) as e:
            why = _why(e)
        finally:
            _shut(sock)
            self._fail(link, f"tcp data link to {link.describe()} broke: {why}")

    def _mark(self, link: _Link, why: str) -> bool:
        """Under the lock: ``link`` is done (new requests ride the replies) and its open transfers
        fail now. True the first time."""
        first = link.broken is None
        if first:
            link.broken = why
            self.stats["links_broken"] += 1
        for transfer in link.transfers:
            if transfer.error is None:
                transfer.error = link.broken
            transfer.wake()
        return first

    def _fail(self, link: _Link, why: str) -> None:
        """A stream of ``link`` ended (or we closed it): the link is done, and so are its other streams."""
        with self.lock:
            self._mark(link, why)
            first = not link.closing
            link.closing = True
        if first:
            for sock in link.socks:  # the other streams' readers end too
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            if "closed by us" not in (link.broken or ""):
                logger.warning("%s", link.broken)

    def _break(self, link: _Link, why: str) -> None:
        self._fail(link, f"tcp data link to {link.describe()} closed by us: {why}")

    async def land(self, frames: list, pages: Sequence[int], slots: Sequence[int]) -> None:
        """Payloads that rode the reply (the holder has no data port for us): one copy each."""
        if len(frames) < len(pages):
            raise TransferError(f"reply carried {len(frames)} payload frame(s) for {len(pages)} chunk(s)")
        # Too few frames is an error (above); frames past the pages asked for are ignored.
        for frame, page in zip(frames, pages, strict=False):
            data = np.frombuffer(frame.buffer, dtype=np.uint8)
            if data.size != self.pool.page_bytes:
                raise TransferError(f"payload frame of {data.size} bytes; pages are {self.pool.page_bytes}")
            self.pool.page(page).numpy()[:] = data

    # -- holder side -----------------------------------------------------------------------------

    def listen(self, host: str) -> None:
        family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(address)  # the configured p2p host only; the port goes out in hello replies
            listener.listen(64)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self._writers = ThreadPoolExecutor(32, thread_name_prefix="lmcache-tcp-tx")
        self._accepting = asyncio.ensure_future(self._accept_loop(listener))
        logger.info("tcp data port %s:%d", host, listener.getsockname()[1])

    @property
    def data_port(self) -> int:
        return self._listener.getsockname()[1] if self._listener is not None else 0

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except asyncio.CancelledError:
                raise
            except OSError as e:
                logger.warning("tcp data port: accept failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            self._background(self._handshake(sock))

    async def _handshake(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        sock.setblocking(False)
        try:
            data = b""
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                while len(data) < _HANDSHAKE.size:
                    more = await loop.sock_recv(sock, _HANDSHAKE.size - len(data))
                    if not more:
                        raise ConnectionError("closed during the handshake")
                    data += more
                magic, token = _HANDSHAKE.unpack(data)
                session = self._tokens.get(token) if magic == _HANDSHAKE_MAGIC else None
                if session is not None:
                    session.streams = [s for s in session.streams if not s.dead]  # a link opened again
                if session is None or len(session.streams) >= MAX_STREAMS_PER_SESSION:
                    raise ConnectionError("unknown token" if session is None else "too many streams")
                _tune(sock)
        except (OSError, TimeoutError) as e:
            logger.debug("tcp data port: connection refused: %s", e)
            sock.close()
            return
        # Attached before the ack: the requester sends pulls once every stream is acked. Held
        # locked until the ack is out, so no writer shares the socket with it.
        stream = _Stream(sock)
        async with stream.lock:
            session.streams.append(stream)
            try:
                await asyncio.wait_for(loop.sock_sendall(sock, _ACK), CONNECT_TIMEOUT_S)
            except (OSError, TimeoutError) as e:
                logger.debug("tcp data port: handshake ack failed: %s", e)
                session.streams.remove(stream)
                stream.dead = True
                sock.close()
                return
            sock.setblocking(True)
            # The requester never writes on it: readable means it hung up (or broke the protocol).
            loop.add_reader(sock.fileno(), self._hung_up, stream)
            stream.watched = True

    def _hung_up(self, stream: _Stream) -> None:
        """On the loop: a requester's stream became readable. Unless a writer holds it, it is
        closed now, so a requester that is gone costs no sockets here."""
        try:
            data = stream.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            logger.warning("tcp data port: a requester wrote on its data stream; closing it")
        _kill(stream)

    async def accept(self, hello: ChannelHello) -> bool:
        check_hello_bounds(hello)  # the same bounds on every channel, though tcp sizes nothing by them
        if hello.page_bytes and hello.page_bytes != self.pool.page_bytes:
            raise TransferError(f"requester pages are {hello.page_bytes} bytes, ours {self.pool.page_bytes}")
        instance = (hello.instance_id, hello.rank)
        for old in [s for s in self._sessions.values() if s.session == hello.session or s.instance == instance]:
            # The same requester again (it dropped us), or it restarted: its old streams go.
            self._forget(old)
        if self._listener is not None:
            session = _Session(hello.session, instance, os.urandom(16))
            self._sessions[hello.session] = session
            self._tokens[session.token] = session
        return False

    def _forget(self, session: _Session) -> None:
        self._sessions.pop(session.session, None)
        self._tokens.pop(session.token, None)
        session.close()

    def offer(self, session: str) -> tuple[int, bytes]:
        known = self._sessions.get(session)
        return (self.data_port, known.token) if known is not None else (0, b"")

    async def send_streamed(
        self, session: str, chunks: Sequence[PinnedChunk], transfer: int, timeout: float
    ) -> float | None:
        known = self._sessions.get(session)
        streams = [s for s in known.streams if not s.dead] if known is not None else []
        if not streams or self._writers is None:
            return None
        deadline = time.monotonic() + timeout
        page_bytes = self.pool.page_bytes
        views = [chunk.data.numpy().data for chunk in chunks]
        plan = _segments(len(chunks), page_bytes, len(streams))
        results = await asyncio.gather(
            *(
                self._write(stream, segments, views, transfer, deadline)
                for stream, segments in zip(streams, plan, strict=False)
            ),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise TransferError(f"writing {len(chunks)} chunk(s) to the data streams failed: {errors[0]!r}")
        self.stats["streamed_requests"] += 1
        return max(r for r in results if isinstance(r, float))

    async def _write(
        self,
        stream: _Stream,
        segments: list[tuple[int, int, int]],
        views: list[memoryview],
        transfer: int,
        deadline: float,
    ) -> float:
        """Write one request's segments to one stream; returns the seconds it waited for the
        stream (behind the session's earlier requests)."""
        assert self._writers is not None
        t0 = time.monotonic()
        async with stream.lock:  # requests write their segments one after another
            waited = time.monotonic() - t0
            if stream.dead:
                raise ConnectionError("stream closed")
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(self._writers, _sendall, stream.sock, segments, views, transfer, deadline)
            except _Late:
                raise TimeoutError("deadline passed before its segments went out") from None
            except BaseException:
                # Part of a segment may be out (or still going out, when we were cancelled): the
                # stream is out of step for good.
                _kill(stream)
                raise
        return waited

    async def send(
        self, session: str, chunks: Sequence[PinnedChunk], dst_pages: np.ndarray, dst_slots: np.ndarray, timeout: float
    ) -> tuple[list, bool]:
        # Zero-copy: ZMQ reads straight from the pinned pages (the caller holds the pins until
        # the send is tracked as done).
        self.stats["framed_requests"] += 1
        return [chunk.data.numpy() for chunk in chunks], False

    def close(self) -> None:
        for link in list(self._links.values()):
            self._break(link, "shutting down")
        self._links.clear()
        for task in [self._accepting, *self._tasks]:
            if task is not None:
                task.cancel()
        for session in list(self._sessions.values()):
            self._forget(session)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._writers is not None:
            self._writers.shutdown(wait=False, cancel_futures=True)


class _Late(Exception):
    """The deadline passed between two segments: the stream is still in step."""


def _sendall(
    sock: socket.socket, segments: list[tuple[int, int, int]], views: list[memoryview], transfer: int, deadline: float
) -> None:
    """On a writer thread: each segment's header and bytes, within the deadline."""
    for index, offset, length in segments:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _Late
        sock.settimeout(left)  # sendall's timeout bounds the whole call
        sock.sendall(_HEADER.pack(_HEADER_MAGIC, index, transfer, offset, length))
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        sock.sendall(views[index][offset : offset + length])
