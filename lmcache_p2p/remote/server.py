"""``lmcache_server HOST PORT [DEVICE]``: the single-box KV store behind ``remote_url: lm://HOST:PORT``.

As LMCache's command: ``lmcache_server localhost 65432`` (DEVICE, if given, must be ``cpu``: every
chunk is kept in this process's memory). ``--max-size-gb N`` caps what it holds (N GiB, 2**30
bytes, as LMCache's sizes; default 4): a put past the cap evicts the least recently used chunks,
and GET or EXISTS of a chunk makes it recent again. The protocol is :mod:`.wire`'s.

One asyncio loop serves every client; each connection is a task that reads a request and answers
it. Values are received straight into their own buffers (``sock_recv_into``) and sent straight
from them (``sock_sendall`` of memoryviews), so a 32 MiB chunk is copied only by the kernel.

What a client cannot do: make the server allocate past :mod:`.wire`'s bounds (every length is
checked before its buffer exists, and a value is allocated only once its frame passed), crash it
(a malformed frame closes that connection, with the reason logged), or hold a connection's memory
forever by stalling mid-frame (closed after :data:`STALL_S`) or trickling an upload (a request
arriving slower than ``--min-upload-rate`` over an ``--upload-window`` is closed), or keep others
out with connections (issue 61): at most ``--max-connections`` are open (lowered to what the
descriptor limit allows) and ``--max-connections-per-address`` from one client address; a
connection must complete the mesh-secret handshake (without a secret: send its first request)
within ``--handshake-timeout`` seconds; a newcomer past a cap, or one that finds no descriptor
left, closes the oldest connection that has not (of its own address, past the per-address cap),
so authenticated engines are never displaced by strangers and a stranger never waits for one,
and is refused at once only when every open connection has; every refusal and close is counted
(HEALTH) and logged at most once a minute. A connection with no request for ``--idle-timeout``
seconds is closed (a pooled client notices and reconnects). The server holds at most its
capacity plus, per connection, the one value being received (or the values of the reply being
sent, when they were evicted meanwhile).

With the mesh secret (``--mesh-secret-file PATH`` or ``LMCACHE_MESH_SECRET``, as the controller
takes it) a connection must complete :mod:`.wire`'s AUTH handshake before any command is served;
a stranger's first command is answered with an ERROR naming the mesh secret, the connection
closed, the refusal counted (HEALTH ``auth_refused``) and logged at most once a minute. Without a
secret whoever reaches the port can read, overwrite and clear every engine's chunks, so the
server then listens only on loopback addresses unless started with ``--insecure``.

Imports nothing heavy (no torch, numpy or vllm): it runs on a box with none of them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import ipaddress
import logging
import math
import mmap
import os
import signal
import socket
import sys
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import TypeAlias

from lmcache_p2p import version_line
from lmcache_p2p.connection_book import PER_ADDRESS, ConnectionBook
from lmcache_p2p.descriptors import OUT_OF_DESCRIPTORS, SpareDescriptor, connection_cap, descriptor_limit
from lmcache_p2p.logs import RateLimitedLog
from lmcache_p2p.mesh_security import MESH_SECRET_ENV, MeshSecretError, check_secret, read_secret_file
from lmcache_p2p.remote import wire
from lmcache_p2p.remote.auth import LmAuth

logger = logging.getLogger("lmcache_p2p.remote.server")

GiB = 1 << 30
STATS_EVERY_S = 10.0
# A connection that stops sending (or reading) in the middle of a frame for this long is closed:
# otherwise a stalled client would pin its half-received value, or a reply, indefinitely.
STALL_S = 30.0
# Connection bounds. Engines keep a small pool each (LmServerStore's max_connections), so 1,024
# serves hundreds of engines; the descriptor limit may lower it (DESCRIPTOR_RESERVE stay for the
# listeners, the log, and the spare used to refuse on EMFILE). An idle pooled connection closed
# after IDLE_S costs its client one reconnect (LmServerStore checks a pooled socket before use).
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_IDLE_S = 60.0
# An engine's store keeps a few connections per process (LmServerStore's max_connections), so one
# host of several engines needs tens; a quarter of the cap leaves the rest to the other hosts.
DEFAULT_MAX_PER_ADDRESS = 256
# An engine authenticates (two round trips) as soon as it connects: 5 s is for a loaded host and a
# slow link, and short enough that strangers who say nothing do not hold room for a minute.
DEFAULT_HANDSHAKE_S = 5.0
# A request (a PUT's values, mostly) must arrive at this rate over each window, or it is closed:
# a client trickling a byte every few seconds would otherwise pin its half-received value (and a
# connection) forever, since the stall rule sees progress. 64 KiB/s is far below any engine's
# link; a 32 MiB value at that rate would still take 8 minutes.
DEFAULT_MIN_UPLOAD_KIB_S = 64.0
DEFAULT_UPLOAD_WINDOW_S = 10.0
# Refused strangers are logged at most this often (with the count since), as the mesh's ZMQ
# sockets log theirs: a scanner hammering the port must not flood the log.
REFUSAL_LOG_PERIOD_S = 60.0
# Connections refused or closed by the listener's bounds: the same, one line a minute per reason.
DOOR_LOG_PERIOD_S = 60.0
# A refused client's request is drained for at most this long and this many bytes (see _refuse).
REFUSED_DRAIN_S = 1.0
REFUSED_DRAIN_BYTES = 64 << 20
DESCRIPTOR_RESERVE = 16
# Replies go out in slices this large so the stall watchdog sees progress on slow readers.
SEND_SLICE = 4 << 20
# Smaller values are gathered into one send: a GET of many small values is not a send each.
SMALL_VALUE = 64 << 10
# Values this large get a private anonymous mapping of their own, advised to use huge pages: it is
# not zero-filled first (bytearray is), the kernel faults it in 2 MiB at a time as recv writes it
# (allocating and filling 32 MiB: 1.3 GB/s as a bytearray, 1.6 as a plain mapping, 5 with huge
# pages on the 2-vCPU dev VM), and it goes back to the OS when evicted instead of leaving holes in
# the malloc heap of a long-running process. Smaller values, and any mapping the kernel refuses
# (vm.max_map_count), are bytearrays.
MMAP_MIN = 1 << 20
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)

Value: TypeAlias = "bytearray | mmap.mmap"


def _alloc(n: int) -> Value:
    if n >= MMAP_MIN:
        try:
            value = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError:
            return bytearray(n)
        if _MADV_HUGEPAGE is not None:
            with contextlib.suppress(OSError):  # THP off: 4 KiB pages, still correct
                value.madvise(_MADV_HUGEPAGE)
        return value
    return bytearray(n)


def _fmt_addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / (1 << 20):.1f} MiB"


class LruStore:
    """Key -> value under a byte cap (key and value lengths counted), least recently used out first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[bytes, Value] = OrderedDict()
        self.bytes = 0
        self.evictions = self.hits = self.misses = self.puts = self.refused = 0

    def __len__(self) -> int:
        return len(self._items)

    def fits(self, key_len: int, value_len: int) -> bool:
        return key_len + value_len <= self.capacity

    def put(self, key: bytes, value: Value) -> None:
        """Store ``value`` (it must :meth:`fit`), evicting the least recently used as needed."""
        size = len(key) + len(value)
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= len(key) + len(old)
        while self._items and self.bytes + size > self.capacity:
            k, v = self._items.popitem(last=False)
            self.bytes -= len(k) + len(v)
            self.evictions += 1
        self._items[key] = value
        self.bytes += size
        self.puts += 1

    def get(self, key: bytes) -> Value | None:
        value = self._items.get(key)
        if value is None:
            self.misses += 1
        else:
            self._items.move_to_end(key)
            self.hits += 1
        return value

    def exists(self, key: bytes) -> bool:
        if key in self._items:
            self._items.move_to_end(key)
            return True
        return False

    def clear(self) -> int:
        n = len(self._items)
        self._items.clear()
        self.bytes = 0
        return n


class _PeerGone(Exception):
    """The client closed the connection or it broke: nothing to answer."""


class _Refused(Exception):
    """A client that did not prove it holds the mesh secret: answered ERROR (this message),
    counted, logged rate-limited, and its connection closed before anything was served."""


class _Connection:
    def __init__(self, server: Server, sock: socket.socket, peer: str):
        self.server = server
        self.sock = sock
        self.peer = peer
        self.loop = asyncio.get_running_loop()
        self.header = bytearray(wire.HEADER.size)
        self.busy = False  # between a frame's first byte and the end of its reply
        self.opened = self.last_progress = time.monotonic()
        # Between a frame's first byte and the first byte of its reply: the request is arriving,
        # and must bring window_bytes at --min-upload-rate since window_start.
        self.receiving = False
        self.window_start = 0.0
        self.window_bytes = 0
        self.task: asyncio.Task[None] | None = None
        self._scratch: bytearray | None = None
        # Without a secret every connection is served; with one, only after the AUTH handshake.
        self.authenticated = server.auth is None
        self._nonces: tuple[bytes, bytes] | None = None  # (client's, server's) once hello is answered

    async def run(self) -> None:
        store = self.server.store
        try:
            while await self._read_header():
                if self.server.auth is None:
                    self.server.book.proved(self)  # no handshake to wait for: a request proves it
                header = wire.unpack_header(self.header)
                op = wire.check_request(header)
                if op is wire.Op.AUTH:
                    await self._auth(header)
                elif not self.authenticated:
                    # Refused on the header alone: none of its sections is read, nothing served.
                    raise _Refused(
                        f"{op.name} before authenticating: this lmcache_server requires the mesh secret "
                        f"(give the engine the mesh secret: mesh_secret_file or {MESH_SECRET_ENV})"
                    )
                elif op is wire.Op.PUT:
                    await self._put(header)
                elif op is wire.Op.GET:
                    await self._get(header)
                elif op is wire.Op.EXISTS:
                    keys = wire.decode_keys(await self._recv_meta(header), header.count)
                    flags = wire.encode_flags([store.exists(k) for k in keys])
                    await self._send(wire.pack_header(wire.Status.OK, len(keys), len(flags)) + flags)
                elif op is wire.Op.HEALTH:
                    count, meta = wire.encode_health(self.server.stats())
                    await self._send(wire.pack_header(wire.Status.OK, count, len(meta)) + meta)
                else:
                    dropped = store.clear()
                    logger.info("CLEAR from %s dropped %d chunks", self.peer, dropped)
                    await self._send(wire.pack_header(wire.Status.OK, dropped))
                self.busy = False
        except _Refused as e:
            self.server.note_refusal(self.peer, str(e))
            await self._refuse(str(e))
        except wire.ProtocolError as e:
            self.server.malformed += 1
            self.server.bad_frames.warning("malformed", "closing the connection from %s: %s", self.peer, e)
            with contextlib.suppress(OSError):  # a courtesy: the client may be gone or still sending
                self.sock.send(wire.message_frame(wire.Status.ERROR, str(e)))
        except _PeerGone as e:
            logger.debug("connection from %s ended: %s", self.peer, e)
        except OSError as e:
            logger.debug("connection from %s failed: %s", self.peer, e)
        except asyncio.CancelledError:
            logger.debug("connection from %s closed by the server", self.peer)
        except Exception:  # a bug here must cost one connection, never the server
            logger.exception("closing the connection from %s after an internal error", self.peer)
        finally:
            self.sock.close()
            self.server.forget(self)
            logger.debug("disconnected %s (%d clients)", self.peer, len(self.server.connections))

    def close_now(self) -> None:
        """Close the socket here and now, not when the task next runs: a newcomer is waiting for
        this one's place (and, out of descriptors, for its descriptor). The loop's reader and
        writer on it go first, so that no callback touches the descriptor number once it is
        reused; the task, cancelled, then finds it closed."""
        fd = self.sock.fileno()
        if fd >= 0:
            self.loop.remove_reader(fd)
            self.loop.remove_writer(fd)
        self.sock.close()
        self.server.forget(self)
        if self.task is not None:
            self.task.cancel()

    async def _read_header(self) -> bool:
        """False when the client closed the connection between frames."""
        view = memoryview(self.header)
        got = 0
        while got < len(view):
            n = await self.loop.sock_recv_into(self.sock, view[got:])
            if n == 0:
                if got == 0:
                    return False
                raise wire.ProtocolError(f"the connection ended {got} bytes into a header")
            now = time.monotonic()
            if got == 0:  # a new frame: its upload's rate is measured from here
                self.receiving = True
                self.window_start, self.window_bytes = now, 0
            got += n
            self.window_bytes += n
            self.busy = True
            self.last_progress = now
        return True

    async def _recv_into(self, view: memoryview) -> None:
        while view:
            n = await self.loop.sock_recv_into(self.sock, view)
            if n == 0:
                raise _PeerGone(f"closed by the client {len(view)} bytes before the end of a frame")
            view = view[n:]
            self.window_bytes += n
            self.last_progress = time.monotonic()

    async def _recv_meta(self, header: wire.Header) -> bytearray:
        meta = bytearray(header.meta_len)
        await self._recv_into(memoryview(meta))
        return meta

    async def _discard(self, n: int) -> None:
        if self._scratch is None:
            self._scratch = bytearray(1 << 20)
        view = memoryview(self._scratch)
        while n:
            step = min(n, len(view))
            await self._recv_into(view[:step])
            n -= step

    async def _send(self, data: bytes | bytearray | memoryview) -> None:
        self.receiving = False  # the request is in: a slow reader is the stall rule's
        view = memoryview(data)
        for start in range(0, len(view), SEND_SLICE):
            await self.loop.sock_sendall(self.sock, view[start : start + SEND_SLICE])
            self.last_progress = time.monotonic()

    async def _refuse(self, why: str) -> None:
        """Answer ERROR, then read (and drop) what the client already sent, for a moment, before
        the connection closes: closing with a request's bytes unread makes the kernel send a
        reset, which can destroy the ERROR in the client's buffer, and the reason with it."""
        with contextlib.suppress(OSError, _PeerGone, TimeoutError):
            await self._send(wire.message_frame(wire.Status.ERROR, why))
            self.sock.shutdown(socket.SHUT_WR)
            await asyncio.wait_for(self._drain_until_closed(REFUSED_DRAIN_BYTES), REFUSED_DRAIN_S)

    async def _drain_until_closed(self, limit: int) -> None:
        if self._scratch is None:
            self._scratch = bytearray(1 << 20)
        view = memoryview(self._scratch)
        while limit > 0:
            n = await self.loop.sock_recv_into(self.sock, view[: min(limit, len(view))])
            if n == 0:
                return
            limit -= n

    async def _auth(self, header: wire.Header) -> None:
        """One step of the AUTH handshake (see :mod:`.wire`): hello gets the server's nonce, a
        matching proof gets the server's proof and opens the connection to every command."""
        received = bytes(await self._recv_meta(header))
        auth = self.server.auth
        if auth is None:
            raise _Refused(
                "this lmcache_server runs without a mesh secret and the client has one: start the server with "
                f"--mesh-secret-file PATH or {MESH_SECRET_ENV} (the engines' secret), or take it off the engines"
            )
        if self.authenticated:
            raise wire.ProtocolError("AUTH on a connection already authenticated")
        if header.count == wire.AUTH_HELLO:
            if self._nonces is not None:
                raise wire.ProtocolError("a second AUTH hello")
            self._nonces = (received, auth.nonce())
            reply = self._nonces[1]
        else:
            if self._nonces is None:
                raise wire.ProtocolError("an AUTH proof before the hello")
            if not auth.client_proved(*self._nonces, received):
                raise _Refused(
                    "authentication failed: the client's proof does not match this server's mesh secret "
                    "(the client runs with another mesh secret)"
                )
            self.authenticated = True
            self.server.book.proved(self)  # an engine: never displaced by a newcomer
            reply = auth.server_proof(*self._nonces)
            logger.debug("%s authenticated", self.peer)
        await self._send(wire.pack_header(wire.Status.OK, 0, len(reply)) + reply)

    async def _put(self, header: wire.Header) -> None:
        store = self.server.store
        keys, lens = wire.decode_put_meta(await self._recv_meta(header), header.count, header.data_len)
        stored = 0
        refused: list[str] = []
        for i, (key, n) in enumerate(zip(keys, lens, strict=True)):
            if not store.fits(len(key), n):
                # Read and dropped, so the stream stays in step and the other values still land.
                await self._discard(n)
                store.refused += 1
                refused.append(f"#{i} ({n} bytes)")
                continue
            value = _alloc(n)
            if n:
                await self._recv_into(memoryview(value))
            # Stored as it arrives: only one value per connection is ever held outside the cap.
            store.put(key, value)
            stored += 1
        if refused:
            text = (
                f"refused {len(refused)} of {len(keys)} values, larger than the server's whole capacity of "
                f"{store.capacity} bytes (lmcache_server --max-size-gb): {', '.join(refused[:8])}"
            )
            await self._send(wire.message_frame(wire.Status.REFUSED, text, stored))
        else:
            await self._send(wire.pack_header(wire.Status.OK, stored))

    async def _get(self, header: wire.Header) -> None:
        keys = wire.decode_keys(await self._recv_meta(header), header.count)
        # References taken now: a value evicted or replaced while it is sent stays whole.
        values = [self.server.store.get(k) for k in keys]
        total = 0
        for i, value in enumerate(values):
            if value is not None:
                total += len(value)
                if total > wire.MAX_DATA:  # past what one reply may carry: a miss (see wire)
                    values[i] = None
                    total -= len(value)
        lens = wire.encode_value_lengths([None if v is None else len(v) for v in values])
        data_len = sum(len(v) for v in values if v is not None)
        pending = bytearray(wire.pack_header(wire.Status.OK, len(keys), len(lens), data_len))
        pending += lens
        for value in values:
            if not value:
                continue
            if len(value) < SMALL_VALUE:
                pending += value
                continue
            await self._send(pending)
            pending = bytearray()
            await self._send(memoryview(value))
        if pending:
            await self._send(pending)


class Server:
    def __init__(
        self,
        listeners: list[socket.socket],
        capacity: int,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        idle_s: float = DEFAULT_IDLE_S,
        auth: LmAuth | None = None,
        *,
        max_per_address: int = DEFAULT_MAX_PER_ADDRESS,
        handshake_s: float = DEFAULT_HANDSHAKE_S,
        min_upload_rate: float = DEFAULT_MIN_UPLOAD_KIB_S * 1024,  # bytes/s; 0: no minimum
        upload_window_s: float = DEFAULT_UPLOAD_WINDOW_S,
    ):
        self.listeners = listeners
        self.auth = auth  # None: no mesh secret, every connection is served
        self.store = LruStore(capacity)
        self.connections: set[_Connection] = set()
        self.max_connections = max_connections
        self.book: ConnectionBook[_Connection] = ConnectionBook(
            max_connections, min(max_per_address, max_connections), counted_as="clients"
        )
        self.idle_s = idle_s
        self.handshake_s = handshake_s
        self.min_upload_rate = min_upload_rate
        self.upload_window_s = upload_window_s
        # On accept: refused at once. After it: closed by a deadline, or to admit a newcomer.
        self.refused = {"at_cap": 0, "per_address": 0, "no_descriptors": 0}
        self.closed = {
            "handshake_timeout": 0,
            "slow_upload": 0,
            "evicted_at_cap": 0,
            "evicted_per_address": 0,
            "evicted_no_descriptors": 0,
        }
        self.door_log = RateLimitedLog(logger, every_s=DOOR_LOG_PERIOD_S)
        self.idle_closed = 0
        self.spare = SpareDescriptor()
        self.malformed = 0
        self.bad_frames = RateLimitedLog(logger)
        self.auth_refused = 0
        self._refusals = RateLimitedLog(logger, every_s=REFUSAL_LOG_PERIOD_S)
        self.started = time.monotonic()

    def note_refusal(self, peer: str, why: str) -> None:
        """Count a client turned away for want of the mesh secret; one WARNING a minute at most."""
        self.auth_refused += 1
        self._refusals.warning(
            "auth",
            "refused the connection from %s: %s (%d refused in all; nothing was read, written or cleared)",
            peer,
            why,
            self.auth_refused,
        )

    def stats(self) -> dict[str, int]:
        s = self.store
        return {
            "chunks": len(s),
            "bytes": s.bytes,
            "capacity": s.capacity,
            "evictions": s.evictions,
            "clients": len(self.connections),
            "hits": s.hits,
            "misses": s.misses,
            "puts": s.puts,
            "refused": s.refused,
            "malformed": self.malformed,
            "uptime_s": int(time.monotonic() - self.started),
            "auth_refused": self.auth_refused,
            "connections_refused": sum(self.refused.values()),
            "connections_evicted": sum(v for k, v in self.closed.items() if k.startswith("evicted_")),
            "handshake_timeouts": self.closed["handshake_timeout"],
            "slow_uploads": self.closed["slow_upload"],
        }

    def forget(self, conn: _Connection) -> None:
        """``conn`` is closed: it no longer counts against any cap."""
        self.connections.discard(conn)
        self.book.remove(conn)

    def stats_line(self) -> str:
        s = self.store
        return (
            f"{len(s)} chunks, {_gib(s.bytes)} of {_gib(s.capacity)}, {s.hits} hits / {s.misses} misses, "
            f"{s.evictions} evictions, {len(self.connections)} clients, "
            f"{self.refused['at_cap']} refused at the cap of {self.max_connections}, "
            f"{self.refused['per_address']} at the cap of {self.book.per_address} per address, "
            f"{self.refused['no_descriptors']} for want of a descriptor, "
            f"{sum(v for k, v in self.closed.items() if k.startswith('evicted_'))} closed to admit a newcomer, "
            f"{self.closed['handshake_timeout']} for no handshake in {self.handshake_s:g} s, "
            f"{self.closed['slow_upload']} for a slow upload, {self.idle_closed} closed idle"
            + (f", {self.auth_refused} refused without the mesh secret" if self.auth is not None else "")
        )

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, addr = await loop.sock_accept(listener)
            except OSError as e:
                if e.errno not in OUT_OF_DESCRIPTORS:
                    logger.debug("accept failed: %s", e)  # e.g. ECONNABORTED: that client is gone
                    continue
                victim = self.book.oldest_unproved()
                if victim is not None:  # its descriptor, freed at once, takes the newcomer
                    self._evict(victim, "evicted_no_descriptors", "to free a descriptor (limit %d", descriptor_limit())
                    continue
                # Refused rather than left in the backlog, where it would wait for nothing.
                self.refused["no_descriptors"] += 1
                self.door_log.warning(
                    "no_descriptors",
                    "refused a connection: no file descriptor left (limit %d, %d clients, each past its handshake "
                    "or first request; %d refused so far)",
                    descriptor_limit(),
                    len(self.connections),
                    self.refused["no_descriptors"],
                )
                if not self.spare.refuse_one(listener):
                    await asyncio.sleep(0.05)  # nothing could be shed: wait, rather than spin
                continue
            host = str(addr[0])
            refused = self.book.make_room(host, self._evict)
            if refused is not None:
                sock.close()
                self._refuse_at_accept(refused, host)
                continue
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(self, sock, _fmt_addr(host, addr[1]))
            self.connections.add(conn)
            self.book.add(conn, host)
            conn.task = asyncio.create_task(conn.run())
            logger.debug("connection from %s (%d clients)", conn.peer, len(self.connections))

    def _refuse_at_accept(self, reason: str, host: str) -> None:
        self.refused[reason] += 1
        held, flag, cap = self.book.bound(reason, host)
        what = "it holds %d, its cap" if reason == PER_ADDRESS else "%d clients, the cap"
        self.door_log.warning(
            reason,
            "refused a connection from %s: " + what + " (%s %d), each past its handshake or first request "
            "(%d refused so far)",
            host,
            held,
            flag,
            cap,
            self.refused[reason],
        )

    def _evict(self, victim: _Connection, reason: str, why: str, *args: object) -> None:
        age = time.monotonic() - victim.opened
        victim.close_now()
        self.closed[reason] += 1
        self.door_log.warning(
            reason,
            "closed the oldest connection without a handshake or request, from %s (open %.1f s), " + why + "; "
            "%d closed so far)",
            victim.peer,
            age,
            *args,
            self.closed[reason],
        )

    def _close_slow(self, conn: _Connection, reason: str, why: str, *args: object) -> None:
        conn.close_now()
        self.closed[reason] += 1
        self.door_log.warning(
            reason,
            "closed the connection from %s: " + why + "; %d closed so far)",
            conn.peer,
            *args,
            self.closed[reason],
        )

    def _check_deadlines(self, now: float) -> None:
        for conn in list(self.connections):
            if conn.task is None:
                continue
            if now - conn.opened > self.handshake_s and not self.book.is_proved(conn):
                self._close_slow(
                    conn,
                    "handshake_timeout",
                    "no %s within %g s (--handshake-timeout",
                    "mesh-secret handshake" if self.auth is not None else "request",
                    self.handshake_s,
                )
            elif conn.receiving and self.min_upload_rate > 0 and now - conn.window_start >= self.upload_window_s:
                rate = conn.window_bytes / (now - conn.window_start)
                if rate < self.min_upload_rate:
                    self._close_slow(
                        conn,
                        "slow_upload",
                        "its request arrived at %.0f bytes/s over %.1f s (under --min-upload-rate %g KiB/s",
                        rate,
                        now - conn.window_start,
                        self.min_upload_rate / 1024,
                    )
                else:  # the next window starts here
                    conn.window_start, conn.window_bytes = now, 0
            elif conn.busy and now - conn.last_progress > STALL_S:
                logger.warning("closing the connection from %s: stalled mid-frame for %.0f s", conn.peer, STALL_S)
                conn.task.cancel()
            elif not conn.busy and now - conn.last_progress > self.idle_s:
                self.idle_closed += 1
                logger.debug("closing the connection from %s: no request for %.0f s", conn.peer, self.idle_s)
                conn.task.cancel()

    async def _tick(self) -> None:
        last_line = ""
        next_stats = time.monotonic() + STATS_EVERY_S
        # Often enough that a deadline is kept to within a quarter of itself (and a second).
        every = min(1.0, self.handshake_s / 4, self.upload_window_s / 4)
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            self._check_deadlines(now)
            if now >= next_stats:
                next_stats = now + STATS_EVERY_S
                line = self.stats_line()
                if line != last_line:
                    logger.info("%s", line)
                    last_line = line

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        received: list[str] = []

        def on_signal(sig: signal.Signals) -> None:
            received.append(sig.name)
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        tasks = [asyncio.create_task(self._accept(listener)) for listener in self.listeners]
        tasks.append(asyncio.create_task(self._tick()))
        await stop.wait()
        logger.info("%s: shutting down with %s", "/".join(received), self.stats_line())
        for task in tasks:
            task.cancel()
        conn_tasks = [c.task for c in self.connections if c.task is not None]
        for task in conn_tasks:
            task.cancel()
        await asyncio.gather(*tasks, *conn_tasks, return_exceptions=True)
        for listener in self.listeners:
            listener.close()
        self.spare.close()


class BindError(Exception):
    """One line for the user: what could not be bound and why."""


def bind(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on every address ``host`` resolves to (only those), non-blocking."""
    where = _fmt_addr(host, port)
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise BindError(f"cannot listen on {where}: cannot resolve host {host!r} ({e.strerror})") from None
    listeners: list[socket.socket] = []
    skipped: list[str] = []
    seen = set()
    for family, kind, proto, _name, sockaddr in infos:
        ip = str(sockaddr[0])
        if sockaddr[:2] in seen:
            continue
        seen.add(sockaddr[:2])
        if port == 0 and listeners:  # every address on the port the first one got
            sockaddr = (sockaddr[0], listeners[0].getsockname()[1], *sockaddr[2:])
        sock = socket.socket(family, kind, proto)
        try:
            # Lets a restarted server bind at once while its old connections sit in TIME_WAIT;
            # on Linux it never lets two listeners share the port.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(sockaddr)
            sock.listen(512)
            sock.setblocking(False)
        except OSError as e:
            sock.close()
            if e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):  # e.g. ::1 on a host without IPv6
                skipped.append(f"{_fmt_addr(ip, port)} ({e.strerror})")
                continue
            for listener in listeners:
                listener.close()
            if e.errno == errno.EADDRINUSE:
                raise BindError(
                    f"cannot listen on {where}: port {port} is already in use on {ip} (another lmcache_server running?)"
                ) from None
            raise BindError(f"cannot listen on {where} ({ip}): {e.strerror or e}") from None
        listeners.append(sock)
    if not listeners:
        raise BindError(f"cannot listen on {where}: no address of {host!r} can be bound: {'; '.join(skipped)}")
    for text in skipped:
        logger.debug("not listening on %s", text)
    return listeners


class SecretError(Exception):
    """One line for the user: which source of the mesh secret is wrong and why (never the value)."""


def resolve_mesh_secret(path: str | None, env: Mapping[str, str]) -> str | None:
    """The mesh secret from its one source, ``--mesh-secret-file`` or ``LMCACHE_MESH_SECRET``,
    as the controller takes it; None from neither. :class:`SecretError` naming the source when
    both are given, or the file or value cannot be used."""
    from_env = env.get(MESH_SECRET_ENV) or None
    if path is not None and from_env is not None:
        raise SecretError(
            f"the mesh secret is given 2 times (--mesh-secret-file, {MESH_SECRET_ENV}); give it in one place only"
        )
    if path is not None:
        try:
            return read_secret_file(path)
        except MeshSecretError as e:
            raise SecretError(f"--mesh-secret-file {path} {e}") from None
    if from_env is not None:
        try:
            return check_secret(from_env)
        except MeshSecretError as e:  # the message never holds the value
            raise SecretError(f"{MESH_SECRET_ENV} {e}") from None
    return None


def exposed_addresses(listeners: list[socket.socket]) -> list[str]:
    """The listeners' addresses other hosts could reach (anything but loopback)."""
    out = []
    for sock in listeners:
        host, port = sock.getsockname()[:2]
        if not ipaddress.ip_address(host).is_loopback:
            out.append(_fmt_addr(host, port))
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmcache_server",
        description="The KV-chunk store that instances reach with remote_url: lm://HOST:PORT.",
    )
    parser.add_argument("--version", action="version", version=version_line("lmcache_server"))
    parser.add_argument("host", help="the address to listen on (only there), e.g. localhost or 0.0.0.0")
    parser.add_argument("port", type=int, help="the TCP port, e.g. 65432")
    parser.add_argument("device", nargs="?", default="cpu", help="where chunks are kept: cpu (the only choice)")
    parser.add_argument(
        "--max-size-gb",
        type=float,
        default=4.0,
        metavar="N",
        help="hold at most N GiB (2**30 bytes) of keys and values; past it the least recently used go (default 4)",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help=f"open client connections at most (default {DEFAULT_MAX_CONNECTIONS}, lowered to what the file "
        "descriptor limit allows); a newcomer past it closes the oldest connection that has not completed the "
        "handshake (without a mesh secret: sent a request), or is closed at once when every one has",
    )
    parser.add_argument(
        "--max-connections-per-address",
        type=int,
        default=DEFAULT_MAX_PER_ADDRESS,
        metavar="N",
        help=f"open connections from one client address at most (default {DEFAULT_MAX_PER_ADDRESS}); past it a "
        "newcomer closes that address's oldest connection without a handshake, or is closed at once",
    )
    parser.add_argument(
        "--handshake-timeout",
        type=float,
        default=DEFAULT_HANDSHAKE_S,
        metavar="S",
        help=f"close a connection that has not completed the mesh-secret handshake (without a secret: sent its "
        f"first request) S seconds after connecting (default {DEFAULT_HANDSHAKE_S:g})",
    )
    parser.add_argument(
        "--min-upload-rate",
        type=float,
        default=DEFAULT_MIN_UPLOAD_KIB_S,
        metavar="KIB_S",
        help=f"close a connection whose request arrives slower than KIB_S KiB/s over an --upload-window "
        f"(default {DEFAULT_MIN_UPLOAD_KIB_S:g}; 0: no minimum)",
    )
    parser.add_argument(
        "--upload-window",
        type=float,
        default=DEFAULT_UPLOAD_WINDOW_S,
        metavar="S",
        help=f"the seconds over which --min-upload-rate is measured (default {DEFAULT_UPLOAD_WINDOW_S:g})",
    )
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=DEFAULT_IDLE_S,
        metavar="S",
        help=f"close a connection that sends no request for S seconds (default {DEFAULT_IDLE_S:g})",
    )
    parser.add_argument(
        "--mesh-secret-file",
        metavar="PATH",
        help=f"file holding the mesh secret (16+ characters) the engines have; or set {MESH_SECRET_ENV}. Clients "
        "must then prove they hold it before any command. Without one anyone who reaches the port can read, "
        "overwrite and clear every chunk",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="listen on a non-loopback address without a mesh secret (refused otherwise)",
    )
    parser.add_argument(
        "--log-level",
        type=str.upper,
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="DEBUG adds a line per connect and disconnect (default INFO)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"port {args.port} is outside 0-65535")
    if not (math.isfinite(args.max_size_gb) and args.max_size_gb > 0):
        parser.error(f"--max-size-gb {args.max_size_gb} is not a positive size")
    if args.max_connections < 1:
        parser.error(f"--max-connections {args.max_connections}: expected a number >= 1")
    if args.max_connections_per_address < 1:
        parser.error(f"--max-connections-per-address {args.max_connections_per_address}: expected a number >= 1")
    for flag, value in (
        ("--idle-timeout", args.idle_timeout),
        ("--handshake-timeout", args.handshake_timeout),
        ("--upload-window", args.upload_window),
    ):
        if not (math.isfinite(value) and value > 0):
            parser.error(f"{flag} {value}: expected seconds > 0")
    if not (math.isfinite(args.min_upload_rate) and args.min_upload_rate >= 0):
        parser.error(f"--min-upload-rate {args.min_upload_rate}: expected KiB/s >= 0 (0: no minimum)")
    if args.device.lower() != "cpu":
        print(
            f"lmcache_server: DEVICE {args.device!r} is not supported: this server keeps every chunk in CPU "
            f"memory; pass cpu or leave DEVICE out (lmcache_server {args.host} {args.port} cpu)",
            file=sys.stderr,
        )
        return 2
    try:
        secret = resolve_mesh_secret(args.mesh_secret_file, os.environ)
    except SecretError as e:
        print(f"lmcache_server: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level, format="[%(asctime)s] lmcache_server %(levelname)s: %(message)s")
    capacity = max(1, int(args.max_size_gb * GiB))
    try:
        listeners = bind(args.host, args.port)
    except BindError as e:
        print(f"lmcache_server: {e}", file=sys.stderr)
        return 2
    exposed = exposed_addresses(listeners)
    if exposed and secret is None and not args.insecure:
        for listener in listeners:
            listener.close()
        print(
            f"lmcache_server: refusing to listen on {', '.join(exposed)} without a mesh secret: whoever reaches it "
            f"could read, overwrite and clear every engine's KV chunks. Start it with --mesh-secret-file PATH "
            f"(or {MESH_SECRET_ENV}), the engines' mesh secret, or pass --insecure to listen there anyway",
            file=sys.stderr,
        )
        return 2
    max_connections = connection_cap(args.max_connections, 1.0, DESCRIPTOR_RESERVE)
    server = Server(
        listeners,
        capacity,
        max_connections,
        args.idle_timeout,
        LmAuth(secret) if secret else None,
        max_per_address=args.max_connections_per_address,
        handshake_s=args.handshake_timeout,
        min_upload_rate=args.min_upload_rate * 1024,
        upload_window_s=args.upload_window,
    )
    if secret is None:
        logger.warning(
            "unauthenticated: anyone who can reach this port can read, overwrite and clear every engine's chunks. "
            "Give it the engines' mesh secret: --mesh-secret-file PATH or %s",
            MESH_SECRET_ENV,
        )
    else:
        logger.info("clients must prove they hold the mesh secret before any command")
    addrs = ", ".join(_fmt_addr(*s.getsockname()[:2]) for s in listeners)
    logger.info(
        "listening on %s (device cpu, capacity %s; at most %d connections of --max-connections %d under a "
        "descriptor limit of %d, %d per client address, handshake within %g s, uploads at %g KiB/s or more "
        "over %g s, idle ones closed after %g s)",
        addrs,
        _gib(capacity),
        max_connections,
        args.max_connections,
        descriptor_limit(),
        server.book.per_address,
        args.handshake_timeout,
        args.min_upload_rate,
        args.upload_window,
        args.idle_timeout,
    )
    with contextlib.suppress(KeyboardInterrupt):  # a Ctrl-C before the loop's own handler was in place
        asyncio.run(server.serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
