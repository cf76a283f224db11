"""The controller's side of the workers' command sockets: one :class:`RpcClient` per worker.

Each client's DEALER connects to the ROUTER the worker binds on its ``lmcache_worker_ports``
entry; framing, request ids, timeouts and the reset after a timeout are the RPC layer's. This
module decides what an outcome means to the orchestration: an answer is a
:class:`CommandReply` (a refusal is one with ``ok`` False), and no answer is
:class:`WorkerUnreachable`. Every command leaves with ``deadline_unix`` set to now plus its
timeout, so a worker that reads it after the controller gave up refuses it unrun (protocol.py).

Capacity. A DEALER costs two file descriptors (its mailbox's eventfd and its TCP connection) and
one of the ZMQ context's sockets (1,024 by default), and every worker rank also holds three
connections into the controller (pull, reply, heartbeat). With one socket per worker held open
for good, the controller stopped at about 1,020 ranks. So at start-up (:func:`raise_fd_limit`)
the soft RLIMIT_NOFILE is raised to the hard limit, and :class:`Capacity` splits it: at most
``CHANNEL_SHARE`` of it for command channels (the context's MAX_SOCKETS is set to match), the
rest for the workers' own connections. A channel's socket opens at its first command and stays
open; past the channel limit the least recently used idle one is closed (its next command opens
it again: one TCP connect). Registrations are refused (:meth:`Capacity.check_room`) while the
descriptors in use, plus those the closed channels may still need, come within a margin of the
limit, so a worker is never half-registered: listed but with no way to reach it.

Reachability: :meth:`CommandBus.probe` completes one ZMQ handshake with a newly registered
worker's command port (with the mesh's keys, as the channel would), so the orchestration can
remove a worker that advertised an address the controller cannot reach.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import os
import resource
import time
from collections import OrderedDict
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from lmcache_p2p.controller.admission import RegisterRefused
from lmcache_p2p.controller.errors import WorkerUnreachable
from lmcache_p2p.controller.registry import WorkerKey
from lmcache_p2p.mesh_security import client_socket, resolve
from lmcache_p2p.protocol import COMMAND_CLOCK_MARGIN_S, Ack, Command, CommandReply
from lmcache_p2p.rpc import RemoteError, RequestFailed, RpcClient

logger = logging.getLogger("lmcache_p2p.controller")

# An Ack decodes too: a worker whose server fails before it can build a CommandReply answers
# with one, and that is a refusal with the worker's reason, not an undecodable reply.
_reply_decoder = msgspec.msgpack.Decoder(CommandReply | Ack)

# Don't queue without bound for a worker that is gone: a full queue fails the send.
SEND_HWM = 1000

FDS_PER_CHANNEL = 2  # a DEALER's mailbox (an eventfd) and its TCP connection
FDS_PER_RANK = 3  # a worker rank's connections into the controller: pull, reply, heartbeat
CHANNEL_SHARE = 0.4  # of the descriptor limit that open command channels may take
FD_MARGIN = 512  # kept free: HTTP clients, the log, reachability probes, a reconnect burst
# ZMQ sockets besides the channels: the monitor's three, the mesh's ZAP handler, the probes (a
# socket and a monitor pair each), and room to spare.
SPARE_SOCKETS = 256
MAX_WORKERS = 100_000  # registered ranks, whatever the descriptors allow: bounds the memory one sender can take
# Counting /proc/self/fd costs 20-50 ms at 20k descriptors: at most once a second while there is
# room, at most four times a second while refusing (a registration storm at capacity).
FD_SAMPLE_EVERY_S = 1.0
FD_RESAMPLE_FULL_S = 0.25
PROBES_AT_ONCE = 32  # reachability probes in flight: 3 ZMQ sockets and 4 descriptors each
PROBE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


@dataclass(frozen=True)
class FdLimit:
    soft: int  # what this process may open now
    hard: int
    was: int  # the soft limit before raise_fd_limit


def raise_fd_limit() -> FdLimit:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (an unprivileged process may)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return FdLimit(soft, hard, soft)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as e:
        logger.warning("could not raise the open-file limit from %d to %d: %s", soft, target, e)
        return FdLimit(soft, hard, soft)
    return FdLimit(target, hard, soft)


def fds_in_use() -> int | None:
    """Open descriptors of this process, where the OS lists them (Linux, macOS); None elsewhere."""
    for path in ("/proc/self/fd", "/dev/fd"):
        with contextlib.suppress(OSError):
            return len(os.listdir(path))
    return None


class Capacity:
    """How many command channels may be open at once, and whether another rank fits."""

    def __init__(self, fd_limit: int, socket_limit: int):
        self.fd_limit = fd_limit
        by_fds = int(fd_limit * CHANNEL_SHARE) // FDS_PER_CHANNEL
        self.max_channels = max(16, min(by_fds, socket_limit - SPARE_SOCKETS))
        self.max_sockets = self.max_channels + SPARE_SOCKETS
        self._sampled_at = float("-inf")
        self._sampled = 0
        self._added_since = 0  # registrations since the sample

    def ranks_estimate(self, in_use: int) -> int:
        """Ranks that fit with ``in_use`` descriptors open now, each with its own three
        connections and, at worst, an open command channel beyond the channel limit's reserve."""
        free = self.fd_limit - in_use - FD_MARGIN - FDS_PER_CHANNEL * self.max_channels
        return max(0, min(MAX_WORKERS, free // FDS_PER_RANK))

    def needed_for(self, ranks: int) -> int:
        """The descriptor limit to ask for ``ranks`` ranks (each channel open, as a fleet of
        that size under the default channel share would have them)."""
        return int((ranks * (FDS_PER_RANK + FDS_PER_CHANNEL) + FD_MARGIN + 64) * 1.2)

    def check_room(self, registered: int, open_channels: int) -> None:
        """Raise :class:`RegisterRefused` unless one more rank fits. Descriptors are counted at
        most once a second; in between, each registration counts as a rank's three connections
        (ranks connect just before they register, possibly after the count). An estimate that
        says "full" is checked against a fresh count first, at most four times a second."""
        if registered >= MAX_WORKERS:
            raise RegisterRefused(
                f"controller at capacity: {registered} ranks registered, the most one controller takes "
                f"({MAX_WORKERS}); run another controller for more"
            )
        now = time.monotonic()
        if now - self._sampled_at >= FD_SAMPLE_EVERY_S and not self._sample(now):
            return  # nothing to count with: the channel limit still bounds the sockets
        # Channels closed (or not opened yet) may need their descriptors back at any command.
        reserve = FDS_PER_CHANNEL * max(0, self.max_channels - open_channels)
        in_use = self._sampled + FDS_PER_RANK * self._added_since
        if in_use + reserve + FD_MARGIN + FDS_PER_RANK > self.fd_limit and now - self._sampled_at >= FD_RESAMPLE_FULL_S:
            self._sample(now)
            in_use = self._sampled
        if in_use + reserve + FD_MARGIN + FDS_PER_RANK > self.fd_limit:
            raise RegisterRefused(
                f"controller at capacity: {in_use} of its {self.fd_limit} file descriptors in use "
                f"({registered} ranks registered, {reserve} descriptors kept for command channels, "
                f"{FD_MARGIN} spare); raise the controller's open-file limit (ulimit -n / LimitNOFILE; "
                f"about {self.needed_for(registered + 1000)} for {registered + 1000} ranks)"
            )
        self._added_since += 1

    def _sample(self, now: float) -> bool:
        counted = fds_in_use()
        if counted is None:
            return False
        self._sampled, self._sampled_at, self._added_since = counted, now, 0
        return True


class CommandBus:
    def __init__(self, ctx: zmq.asyncio.Context, fd_limit: FdLimit | None = None):
        """``ctx`` must have no socket yet: ZMQ sizes its socket table at the first one."""
        self.ctx = ctx
        self.fd_limit = fd_limit or raise_fd_limit()
        self.capacity = Capacity(self.fd_limit.soft, ctx.get(zmq.SOCKET_LIMIT))
        ctx.set(zmq.MAX_SOCKETS, self.capacity.max_sockets)
        self._clients: dict[WorkerKey, RpcClient] = {}
        # Channels whose socket is (or may be) open, least recently used first.
        self._open: OrderedDict[WorkerKey, None] = OrderedDict()
        self._probes = asyncio.Semaphore(PROBES_AT_ONCE)
        self._warned_short_timeout = False
        self.stats = {"channels_closed_idle": 0, "channels_failed_to_open": 0}
        # Said with the first registration, not here: a controller that fails to bind must
        # still end with its one line.
        self._capacity_told = False

    def capacity_summary(self) -> str:
        """The descriptor limit, the channel limit and about how many ranks fit, in one line."""
        limit = self.fd_limit
        raised = f"raised from {limit.was}" if limit.soft > limit.was else "not raised"
        return (
            f"open-file limit {limit.soft} ({raised}; hard limit {limit.hard}); ZMQ MAX_SOCKETS "
            f"{self.capacity.max_sockets}; up to {self.capacity.max_channels} command channels open at once; room "
            f"for about {self.capacity.ranks_estimate(fds_in_use() or 0)} worker ranks ({FDS_PER_RANK} connections "
            f"each; ranks that share connections fit more); 10000 ranks need a limit of about "
            f"{self.capacity.needed_for(10_000)}"
        )

    @property
    def open_channels(self) -> int:
        return len(self._open)

    def check_room(self, registered: int) -> None:
        """:class:`RegisterRefused` when another rank would not fit (see :class:`Capacity`)."""
        self.capacity.check_room(registered, len(self._open))

    def connect(self, worker: WorkerKey, host: str, port: int) -> None:
        """Point ``worker``'s channel at its command port; a worker that came back elsewhere gets a new one.
        The socket opens at the first command."""
        if not self._capacity_told:
            self._capacity_told = True
            logger.info("command bus: %s", self.capacity_summary())
        address = f"tcp://{host}:{port}"
        old = self._clients.get(worker)
        if old is not None and old.address == address:
            return
        if old is not None:
            old.close()
            self._open.pop(worker, None)
        self._clients[worker] = RpcClient(
            self.ctx, address, _reply_decoder, f"{worker[0]} rank {worker[1]}", send_hwm=SEND_HWM
        )

    def disconnect(self, worker: WorkerKey) -> None:
        client = self._clients.pop(worker, None)
        self._open.pop(worker, None)
        if client is not None:
            client.close()  # a command still waiting on it fails as unreachable

    async def request(self, worker: WorkerKey, command: Command, timeout: float) -> CommandReply:
        """The worker's answer, a refusal included; :class:`WorkerUnreachable` when none came."""
        client = self._clients.get(worker)
        if client is None:
            raise WorkerUnreachable(f"no command channel to {worker[0]} rank {worker[1]}")
        if timeout <= 2 * COMMAND_CLOCK_MARGIN_S and not self._warned_short_timeout:
            self._warned_short_timeout = True
            logger.warning(
                "command timeout %.2f s leaves workers under %.2f s to start a command: they refuse one read "
                "later than its deadline less the %.1f s clock margin",
                timeout,
                timeout - COMMAND_CLOCK_MARGIN_S,
                COMMAND_CLOCK_MARGIN_S,
            )
        learned = False
        for attempt in range(4):
            self._use(worker)
            # When the controller stops waiting; a worker reading it later refuses it unrun.
            command.deadline_unix = time.time() + timeout
            try:
                return await client.request(command, CommandReply, timeout)
            except RequestFailed as e:
                raise WorkerUnreachable(f"{type(command).__name__} to {e}") from None
            except RemoteError as e:
                if isinstance(e.reply, CommandReply):
                    return e.reply
                return CommandReply(event_id=command.event_id, ok=False, error=str(e))
            except zmq.ZMQError as e:  # the socket could not be opened (nothing was sent)
                self.stats["channels_failed_to_open"] += 1
                self._open.pop(worker, None)
                if e.errno == errno.EMFILE and attempt < 3 and (learned or self._learn_limit()):
                    # Idle channels were closed for it; ZMQ frees a closed socket's slot a moment
                    # later, on its reaper thread.
                    learned = True
                    await asyncio.sleep(0.02 * 2**attempt)
                    continue
                raise WorkerUnreachable(
                    f"{type(command).__name__} to {worker[0]} rank {worker[1]}: cannot open a command channel "
                    f"({e.strerror}; {len(self._open)} open, at most {self.capacity.max_channels}, open-file "
                    f"limit {self.capacity.fd_limit})"
                ) from None
        raise AssertionError("unreachable")  # the loop returns or raises

    def _learn_limit(self) -> bool:
        """ZMQ (or the OS) refused a socket below the channel limit: the context's socket table was
        sized before MAX_SOCKETS was set (a socket opened before this bus), or descriptors ran out.
        Take the channels open now, less a few, as the limit; True when that closed an idle one."""
        learned = max(1, len(self._open) - 8)
        if learned >= self.capacity.max_channels:
            return False
        logger.warning(
            "no socket for a new command channel with %d open (limit was %d): keeping at most %d open; "
            "create the CommandBus before any socket of its context, and check the open-file limit",
            len(self._open),
            self.capacity.max_channels,
            learned,
        )
        self.capacity.max_channels = learned
        before = self.stats["channels_closed_idle"]
        self._use_limit()
        return self.stats["channels_closed_idle"] > before

    def _use(self, worker: WorkerKey) -> None:
        """Mark ``worker``'s channel as just used; close the least recently used idle ones beyond the limit."""
        self._open[worker] = None
        self._open.move_to_end(worker)
        self._use_limit()

    def _use_limit(self) -> None:
        excess = len(self._open) - self.capacity.max_channels
        if excess <= 0:
            return
        for key in list(itertools.islice(self._open, excess + 64)):  # a few busy ones may have to be skipped
            client = self._clients.get(key)
            if client is not None and client.in_flight:
                continue
            del self._open[key]
            if client is not None:
                client.reset("closed: the least recently used command channel, past the limit")
                self.stats["channels_closed_idle"] += 1
            excess -= 1
            if excess <= 0:
                return

    async def probe(self, host: str, port: int, timeout: float) -> str | None:
        """None when a ZMQ handshake with ``host:port`` completes within ``timeout`` (with the mesh's
        keys when the context has them, as the command channel would); else why not. A real
        handshake, not a bare TCP connect: the worker's server sees a member come and go, not a
        stranger that dropped out of its handshake (which it would count and log as refused)."""
        async with self._probes:
            sock = self.ctx.socket(zmq.DEALER)
            try:
                sock.setsockopt(zmq.LINGER, 0)
                client_socket(sock, resolve(self.ctx, None), f"probe of {host}:{port}")
                monitor = sock.get_monitor_socket(PROBE_EVENTS)
                try:
                    sock.connect(f"tcp://{host}:{port}")
                    return await self._handshake(monitor, host, port, timeout)
                finally:
                    sock.disable_monitor()
                    monitor.close(linger=0)
            finally:
                sock.close(linger=0)

    @staticmethod
    async def _handshake(monitor: zmq.asyncio.Socket, host: str, port: int, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                frames = await asyncio.wait_for(monitor.recv_multipart(), max(0.0, left))
            except asyncio.TimeoutError:
                return f"no ZMQ handshake with {host}:{port} within {timeout:g} s"
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return None
            if event == zmq.EVENT_CONNECT_RETRIED:  # the connect failed: nothing listens there
                return f"cannot connect to {host}:{port}: connection refused"
            if event in (
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                zmq.EVENT_HANDSHAKE_FAILED_AUTH,
            ):
                return f"{host}:{port} refused the ZMQ handshake (another mesh secret, or not a worker's port)"

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        self._open.clear()
