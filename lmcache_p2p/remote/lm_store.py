"""The client of ``lmcache_server`` (``remote_url: lm://host:port``), speaking :mod:`.wire`.

Blocking sockets, a few of them (:data:`MAX_CONNECTIONS`): one call holds one connection for its
round trip, so a long write-behind PUT does not hold up a lookup's EXISTS on another thread.
Connections open on first use; one that failed is dropped along with the idle ones (they went to
the same server), so the next call connects afresh and a restarted server is picked up without
anyone recreating the store. An idle connection the server closed meanwhile is seen before it is
used (a zero-wait peek), so the first call after a restart does not fail on it.

Timeouts are the kernel's (``SO_RCVTIMEO``/``SO_SNDTIMEO`` on a blocking socket, ``timeout_s``
with no progress), which lets a value be read with one ``recv(n, MSG_WAITALL)``: the kernel
copies it straight into the ``bytes`` the caller gets, with no buffer to assemble and copy out of.

With the mesh secret (``mesh_secret``; the engine's config) every new connection runs
:mod:`.wire`'s AUTH handshake before its first request, and a server that cannot prove it holds
the same secret (another secret, none, an impostor on the address) is unavailable, with the
reason: the engine never sends its KV to it or takes values from it.
"""

from __future__ import annotations

import errno
import functools
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from lmcache_p2p.remote import wire
from lmcache_p2p.remote.auth import LmAuth
from lmcache_p2p.remote.store import RemoteRefused, RemoteUnavailable
from lmcache_p2p.remote.url import RemoteUrl

MAX_CONNECTIONS = 4
_IOV_MAX = 1000  # sendmsg's buffer count limit is 1024 on Linux (IOV_MAX)

T = TypeVar("T")


class _ServerError(Exception):
    """An ERROR reply: the server did not serve the request and closes the connection."""


class _NotAMember(Exception):
    """The server's AUTH proof does not match this client's mesh secret."""


def _timeval(seconds: float) -> bytes:
    sec = int(seconds)
    usec = int(round((seconds - sec) * 1e6))
    if sec == 0 and usec == 0:
        usec = 1  # a zero timeval means "wait forever"
    return struct.pack("@ll", sec, usec)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    if n == 0:
        return b""
    parts: list[bytes] = []
    got = 0
    while got < n:
        # Returns short only when the timeout passed with some bytes in (then we go on: it was
        # progress) or a signal came; no bytes within the timeout raises EAGAIN instead.
        data = sock.recv(n - got, socket.MSG_WAITALL)
        if not data:
            raise ConnectionError(f"the server closed the connection {n - got} bytes before the end of its reply")
        if len(data) == n:
            return data
        parts.append(data)
        got += len(data)
    return b"".join(parts)


def _send_all(sock: socket.socket, buffers: list[memoryview]) -> None:
    views = [b for b in buffers if len(b)]
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i : i + _IOV_MAX], [], socket.MSG_NOSIGNAL)
        while sent:
            size = len(views[i])
            if sent >= size:
                sent -= size
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0


def _byte_view(value: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(value)
    if not view.c_contiguous:
        raise ValueError("a value must be one contiguous buffer")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _stale(sock: socket.socket) -> bool:
    """Whether an idle connection was closed (or, impossibly, written to) by the server."""
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False
    except OSError:
        return True
    return True


class LmServerStore:
    """:class:`~lmcache_p2p.remote.store.RemoteStore` on an ``lmcache_server``; safe to share between threads."""

    def __init__(
        self,
        url: RemoteUrl,
        timeout_s: float = 5.0,
        max_connections: int = MAX_CONNECTIONS,
        mesh_secret: str | None = None,
    ):
        if url.scheme != "lm":
            raise ValueError(f"LmServerStore serves lm:// URLs, not {url.describe()}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, not {timeout_s}")
        self.url = url
        self.timeout_s = timeout_s
        self.max_connections = max(1, max_connections)
        self._where = url.describe()
        self._auth = LmAuth(mesh_secret) if mesh_secret else None  # None: no handshake
        self._cond = threading.Condition()
        self._idle: list[socket.socket] = []
        self._open = 0  # idle and checked out
        # Bumped on a failure and on close(): connections checked out before are dropped when
        # they come back instead of going idle.
        self._generation = 0

    # -- RemoteStore --------------------------------------------------------------------------

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        out: list[bool] = []
        for part in _batches(keys, wire.MAX_BATCH):
            meta = wire.encode_keys(part)
            head = wire.pack_header(wire.Op.EXISTS, len(part), len(meta))
            out += self._round_trip("EXISTS", [head + meta], functools.partial(self._read_exists, n=len(part)))
        return out

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for part in _batches(keys, wire.MAX_BATCH):
            meta = wire.encode_keys(part)
            head = wire.pack_header(wire.Op.GET, len(part), len(meta))
            out += self._round_trip("GET", [head + meta], functools.partial(self._read_get, n=len(part)))
        return out

    def put(self, items: Sequence[tuple[bytes, bytes | bytearray | memoryview]]) -> None:
        views = [_byte_view(v) for _, v in items]
        for view in views:
            if len(view) > wire.MAX_VALUE:
                raise ValueError(f"a value of {len(view)} bytes (lm:// takes values up to {wire.MAX_VALUE})")
        start = 0
        while start < len(items):
            # As many items as one frame may carry (count and data bounds), at least one.
            end, size = start, 0
            while end < len(items) and end - start < wire.MAX_BATCH and size + len(views[end]) <= wire.MAX_DATA:
                size += len(views[end])
                end += 1
            keys = [k for k, _ in items[start:end]]
            lens = [len(v) for v in views[start:end]]
            meta = wire.encode_put_meta(keys, lens)
            head = wire.pack_header(wire.Op.PUT, len(keys), len(meta), size)
            bufs: list[bytes | memoryview] = [head + meta, *views[start:end]]
            self._round_trip("PUT", bufs, self._read_put, payload=size)
            start = end

    def ping(self) -> float:
        t0 = time.perf_counter()
        self.health()
        return time.perf_counter() - t0

    def close(self) -> None:
        """Close the idle connections now and the busy ones when their calls end. A later call
        connects again (the store stays usable)."""
        with self._cond:
            self._drop_idle_locked()

    # -- beyond RemoteStore -------------------------------------------------------------------

    def health(self) -> dict[str, int]:
        """The server's counters, by :data:`~lmcache_p2p.remote.wire.HEALTH_FIELDS` name."""
        return self._round_trip("HEALTH", [wire.pack_header(wire.Op.HEALTH)], self._read_health)

    def clear(self) -> int:
        """Drop everything the server holds; the number of chunks dropped."""
        return self._round_trip("CLEAR", [wire.pack_header(wire.Op.CLEAR)], self._read_clear)

    # -- replies ------------------------------------------------------------------------------

    def _reply_header(self, sock: socket.socket, op: wire.Op) -> wire.Header:
        h = wire.unpack_header(_recv_exact(sock, wire.HEADER.size))
        if h.kind == wire.Status.OK:
            return h
        if h.kind in (wire.Status.ERROR, wire.Status.REFUSED) and h.meta_len <= wire.MAX_MESSAGE and not h.data_len:
            text = wire.decode_message(_recv_exact(sock, h.meta_len))
            if h.kind == wire.Status.REFUSED and op is wire.Op.PUT:
                raise RemoteRefused(f"{self._where}: {text}")
            raise _ServerError(text)
        raise wire.ProtocolError(f"a reply to {op.name} with status {h.kind}")

    def _read_exists(self, sock: socket.socket, n: int) -> list[bool]:
        h = self._reply_header(sock, wire.Op.EXISTS)
        if h.count != n or h.data_len:
            raise wire.ProtocolError(f"an EXISTS reply of {h.count} items to {n} keys")
        return wire.decode_flags(_recv_exact(sock, h.meta_len), n)

    def _read_get(self, sock: socket.socket, n: int) -> list[bytes | None]:
        h = self._reply_header(sock, wire.Op.GET)
        if h.count != n:
            raise wire.ProtocolError(f"a GET reply of {h.count} items to {n} keys")
        lens = wire.decode_value_lengths(_recv_exact(sock, h.meta_len), n, h.data_len)
        return [None if size is None else _recv_exact(sock, size) for size in lens]

    def _read_put(self, sock: socket.socket) -> None:
        h = self._reply_header(sock, wire.Op.PUT)
        if h.meta_len or h.data_len:
            raise wire.ProtocolError("a PUT reply with sections")

    def _read_health(self, sock: socket.socket) -> dict[str, int]:
        h = self._reply_header(sock, wire.Op.HEALTH)
        if h.data_len:
            raise wire.ProtocolError("a HEALTH reply with a data section")
        return wire.decode_health(_recv_exact(sock, h.meta_len), h.count)

    def _read_auth(self, sock: socket.socket) -> bytes:
        h = self._reply_header(sock, wire.Op.AUTH)
        if h.meta_len != wire.AUTH_BYTES or h.data_len:
            raise wire.ProtocolError(f"an AUTH reply with {h.meta_len} bytes of meta (expected {wire.AUTH_BYTES})")
        return _recv_exact(sock, h.meta_len)

    def _authenticate(self, sock: socket.socket, auth: LmAuth) -> None:
        """The client's side of AUTH on a new connection (see :mod:`.wire`): hello, proof, and
        the server's proof checked; raises when the server refuses or cannot prove itself."""
        client_nonce = auth.nonce()
        hello = wire.pack_header(wire.Op.AUTH, wire.AUTH_HELLO, len(client_nonce)) + client_nonce
        _send_all(sock, [memoryview(hello)])
        server_nonce = self._read_auth(sock)
        proof = auth.client_proof(client_nonce, server_nonce)
        _send_all(sock, [memoryview(wire.pack_header(wire.Op.AUTH, wire.AUTH_PROOF, len(proof)) + proof)])
        if not auth.server_proved(client_nonce, server_nonce, self._read_auth(sock)):
            raise _NotAMember(
                "the server's proof does not match this engine's mesh secret: it is not a member of this mesh"
            )

    def _read_clear(self, sock: socket.socket) -> int:
        h = self._reply_header(sock, wire.Op.CLEAR)
        if h.meta_len or h.data_len:
            raise wire.ProtocolError("a CLEAR reply with sections")
        return h.count

    # -- connections --------------------------------------------------------------------------

    def _round_trip(
        self, what: str, send: Sequence[bytes | memoryview], receive: Callable[[socket.socket], T], payload: int = 0
    ) -> T:
        sock, generation = self._checkout()
        healthy = False
        try:
            _send_all(sock, [memoryview(b) for b in send])
            result = receive(sock)
            healthy = True
            return result
        except RemoteRefused:
            healthy = True  # the reply was read whole: the connection is in step
            raise
        except (OSError, wire.ProtocolError, _ServerError) as e:
            size = f" of {payload} bytes" if payload else ""
            raise RemoteUnavailable(f"{self._where}: {what}{size} failed: {self._explain(e)}") from e
        finally:
            self._checkin(sock, generation, healthy)

    def _explain(self, e: BaseException) -> str:
        if isinstance(e, (BlockingIOError, TimeoutError)) or getattr(e, "errno", None) in (
            errno.EAGAIN,
            errno.ETIMEDOUT,
        ):
            return f"timed out: nothing moved for {self.timeout_s:g} s"
        if isinstance(e, wire.ProtocolError):
            return f"protocol error: {e}"
        if isinstance(e, _ServerError):
            return f"the server refused the request: {e}"
        if isinstance(e, _NotAMember):
            return str(e)
        if isinstance(e, socket.gaierror):
            return f"cannot resolve {self.url.host!r}: {e.strerror}"
        if isinstance(e, OSError) and e.strerror:
            return e.strerror
        return str(e) or type(e).__name__

    def _connect(self) -> socket.socket:
        try:
            sock = socket.create_connection((self.url.host, self.url.port), timeout=self.timeout_s)
        except OSError as e:
            raise RemoteUnavailable(f"{self._where}: cannot connect: {self._explain(e)}") from e
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(None)
            tv = _timeval(self.timeout_s)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        except OSError as e:
            sock.close()
            raise RemoteUnavailable(f"{self._where}: cannot set up the connection: {self._explain(e)}") from e
        if self._auth is not None:
            try:
                self._authenticate(sock, self._auth)
            except (OSError, wire.ProtocolError, _ServerError, _NotAMember) as e:
                sock.close()
                raise RemoteUnavailable(f"{self._where}: cannot authenticate: {self._explain(e)}") from e
        return sock

    def _checkout(self) -> tuple[socket.socket, int]:
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while True:
                while self._idle:
                    sock = self._idle.pop()
                    if not _stale(sock):
                        return sock, self._generation
                    sock.close()
                    self._open -= 1
                if self._open < self.max_connections:
                    self._open += 1
                    generation = self._generation
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RemoteUnavailable(
                        f"{self._where}: all {self.max_connections} connections stayed busy for {self.timeout_s:g} s"
                    )
                self._cond.wait(left)
        try:
            return self._connect(), generation
        except BaseException:
            with self._cond:
                self._open -= 1
                self._cond.notify()
            raise

    def _checkin(self, sock: socket.socket, generation: int, healthy: bool) -> None:
        with self._cond:
            keep = healthy and generation == self._generation
            if keep:
                self._idle.append(sock)
            else:
                self._open -= 1
                if not healthy:
                    self._drop_idle_locked()
            self._cond.notify()
        if not keep:
            sock.close()

    def _drop_idle_locked(self) -> None:
        self._generation += 1
        for sock in self._idle:
            sock.close()
        self._open -= len(self._idle)
        self._idle.clear()


def _batches(keys: Sequence[bytes], size: int) -> Iterator[Sequence[bytes]]:
    for start in range(0, len(keys), size):
        yield keys[start : start + size]
