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

Connections. A Register refused for want of room does not stop its rank from connecting: libzmq
accepts every connection to the monitor sockets, and at the descriptor limit its accept fails, the
connection stays in the backlog, and its I/O thread spins on the listener (100% of a core) while
HTTP, probes and command channels fail with EMFILE (issue 61: 1,500 ranks at ``ulimit -n 4096`` left
0 workers listed and /health unanswered). So every new connection to the monitor sockets is put to
:meth:`Capacity.admit_connection` first, by the context's ZAP handler (the mesh's, or a plain one:
``mesh_security.gate_connections``), and refused while it would leave fewer than :data:`GATE_MARGIN`
descriptors beyond the command channels' reserve (ZAP status 400: libzmq closes it at once, freeing
its descriptor). libzmq mostly takes that refusal as final for that socket's connection (under load
it sometimes reconnected by itself), so there is no storm of retries; a worker's request socket is
opened again at its next timeout (and its Register retried), and its pull socket, once registered, 2
s after opening the refused one, then at doubling intervals up to a minute while refusals go on
(``worker/event_stream.py``). Status 300 ("try later") would keep the connection open until the
handshake timeout, holding the descriptor the gate is there to save. The ranks held keep their
connections. Registrations stop :data:`REGISTER_BAND` descriptors before the gate does, so a rank
that cannot be registered still connects and hears "at capacity", and a registered one can still
open its heartbeat connection. A probe needs :data:`PROBE_FDS` descriptors beyond the reserve and
:data:`PROBE_SPARE`, or waits (:class:`NoDescriptors`). Refusals of both kinds are counted and
logged at most once a minute, with the descriptors in use. A burst of connections can still reach
the limit for a moment (libzmq accepts them before the gate answers); the gate then closes them as
it answers, and nothing else is refused meanwhile but sockets opened at that moment.

Reachability: :meth:`CommandBus.probe` completes one ZMQ handshake with a newly registered
worker's command port (with the mesh's keys, as the channel would), so the orchestration can
remove a worker that advertised an address the controller cannot reach.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import os
import resource
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from lmcache_p2p.controller.admission import RegisterRefused
from lmcache_p2p.controller.errors import WorkerUnreachable
from lmcache_p2p.controller.registry import WorkerKey
from lmcache_p2p.logs import RateLimitedLog
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
# Counting /proc/self/fd costs 20-50 ms at 20k descriptors (1-2 ms at 4k): at most once a second
# while there is room; while the estimate says full (a storm at capacity, or room freed by ranks
# gone), as soon as the count is FD_RECOUNT_COST_TIMES its own last cost old, at least
# FD_RECOUNT_MIN_S: counting then takes at most a tenth of the time, and a burst of connections
# counted twice (accepted before the count, admitted after it) is not refused for long.
FD_SAMPLE_EVERY_S = 1.0
FD_RECOUNT_COST_TIMES = 10
FD_RECOUNT_MIN_S = 0.02
PROBES_AT_ONCE = 32  # reachability probes in flight: 3 ZMQ sockets and 4 descriptors each
PROBE_FDS = 4  # a probe's DEALER (mailbox, TCP connection) and its monitor pair's mailboxes
# Beyond the channels' reserve, a new connection to a monitor socket is refused with fewer than
# this many descriptors left, a probe with fewer than PROBE_SPARE: what stays is for HTTP, the log,
# and each connection libzmq accepts before the gate refuses it (held only until then).
GATE_MARGIN = FD_MARGIN // 2
PROBE_SPARE = 64
# With the gate, a Register is refused once fewer than this many descriptors beyond GATE_MARGIN
# are left: room for its rank's last connections (a worker opens its heartbeat socket once
# registered) and for registered ranks reconnecting. Without one, FD_MARGIN (its connections
# are not counted as they come: every registration counts as three).
REGISTER_BAND = 64
# The monitor sockets' ZAP domains: the name each one's refusals are counted under.
GATED_SOCKETS = ("pull", "reply", "heartbeat")
CAPACITY_LOG_EVERY_S = 60.0  # refusals for want of room: one line per kind a minute, with the numbers
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


def _errno_name(e: OSError | zmq.ZMQError) -> str:
    """``EMFILE`` for an error's errno: our line names it, the OS's text is the reader's to look up."""
    return errno.errorcode.get(e.errno or 0, f"errno {e.errno}")


def fds_in_use() -> int | None:
    """Open descriptors of this process, where the OS lists them (Linux, macOS); None elsewhere.
    With none left to open the listing itself, all of them: the soft limit."""
    for path in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(path))
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
                return soft
    return None


class NoDescriptors(Exception):
    """Not enough descriptors free to open this socket now; nothing was opened."""


class Capacity:
    """How many command channels may be open at once, whether another rank fits, and whether
    another connection may be accepted. Asked on the event loop (registrations, probes) and on
    the ZAP thread (connections): the descriptor count is shared, under a lock."""

    def __init__(self, fd_limit: int, socket_limit: int):
        self.fd_limit = fd_limit
        by_fds = int(fd_limit * CHANNEL_SHARE) // FDS_PER_CHANNEL
        self.max_channels = max(16, min(by_fds, socket_limit - SPARE_SOCKETS))
        self.max_sockets = self.max_channels + SPARE_SOCKETS
        # Set by the bus and the orchestration, read by the ZAP thread for its decisions and lines.
        self.open_channels: Callable[[], int] = lambda: 0
        self.registered: Callable[[], int] = lambda: 0
        # True once a gate counts every connection it admits: a registration then adds none.
        self.gated = False
        self._lock = threading.Lock()
        self._sampled_at = float("-inf")
        self._sampled = 0
        self._added_since = 0  # descriptors assumed taken since the sample
        self._count_cost = 0.0  # seconds the last count took
        self.connections_refused = dict.fromkeys(GATED_SOCKETS, 0)
        self.probes_deferred = 0
        self._log = RateLimitedLog(logger, every_s=CAPACITY_LOG_EVERY_S)

    def ranks_estimate(self, in_use: int) -> int:
        """Ranks that fit with ``in_use`` descriptors open now, each with its own three
        connections and, at worst, an open command channel beyond the channel limit's reserve."""
        free = self.fd_limit - in_use - FD_MARGIN - FDS_PER_CHANNEL * self.max_channels
        return max(0, min(MAX_WORKERS, free // FDS_PER_RANK))

    def needed_for(self, ranks: int) -> int:
        """The descriptor limit to ask for ``ranks`` ranks (each channel open, as a fleet of
        that size under the default channel share would have them)."""
        return int((ranks * (FDS_PER_RANK + FDS_PER_CHANNEL) + FD_MARGIN + 64) * 1.2)

    def channel_reserve(self) -> int:
        """Descriptors the closed (or not yet opened) channels may need back at any command."""
        return FDS_PER_CHANNEL * max(0, self.max_channels - self.open_channels())

    def in_use(self, room: int) -> int | None:
        """Descriptors in use, estimated: the last count plus what was taken since. Counted again
        when the count is a second old, and sooner (see FD_RECOUNT_COST_TIMES) when the estimate
        leaves fewer than ``room`` free. None where the OS lists no descriptors."""
        now = time.monotonic()
        with self._lock:
            age, estimate = now - self._sampled_at, self._sampled + self._added_since
            recount_after = max(FD_RECOUNT_MIN_S, FD_RECOUNT_COST_TIMES * self._count_cost)
        if age < FD_SAMPLE_EVERY_S and (estimate + room <= self.fd_limit or age < recount_after):
            return estimate
        counted = fds_in_use()
        if counted is None:
            return None
        with self._lock:
            self._sampled, self._sampled_at, self._added_since = counted, now, 0
            self._count_cost = time.monotonic() - now
        return counted

    def _took(self, fds: int) -> None:
        with self._lock:
            self._added_since += fds

    def check_room(self, registered: int, open_channels: int) -> None:
        """Raise :class:`RegisterRefused` unless one more rank fits. Descriptors are counted at
        most once a second; in between, each connection the gate admitted counts as one (without
        a gate, each registration as a rank's three connections: ranks connect just before they
        register, possibly after the count). An estimate that says "full" is checked against a
        fresh count first (:meth:`in_use`)."""
        if registered >= MAX_WORKERS:
            raise RegisterRefused(
                f"controller at capacity: {registered} ranks registered, the most one controller takes "
                f"({MAX_WORKERS}); run another controller for more"
            )
        # Channels closed (or not opened yet) may need their descriptors back at any command.
        reserve = FDS_PER_CHANNEL * max(0, self.max_channels - open_channels)
        margin = GATE_MARGIN + REGISTER_BAND if self.gated else FD_MARGIN
        need = reserve + margin + FDS_PER_RANK
        in_use = self.in_use(need)
        if in_use is None:
            return  # nothing to count with: the channel limit still bounds the sockets
        if in_use + need > self.fd_limit:
            raise RegisterRefused(
                f"controller at capacity: {in_use} of its {self.fd_limit} file descriptors in use "
                f"({registered} ranks registered, {reserve} descriptors kept for command channels, "
                f"{margin} spare); raise the controller's open-file limit (ulimit -n / LimitNOFILE; "
                f"about {self.needed_for(registered + 1000)} for {registered + 1000} ranks)"
            )
        if not self.gated:
            self._took(FDS_PER_RANK)

    def admit_connection(self, socket: str, address: str) -> str | None:
        """The ZAP thread's question for each new connection to a monitor socket (a
        :data:`~lmcache_p2p.mesh_security.ConnectionGate`): None to admit it (counted as one
        descriptor until the next count), or why it is refused: it would leave fewer than
        :data:`GATE_MARGIN` descriptors beyond the channels' reserve."""
        reserve = self.channel_reserve()
        need = reserve + GATE_MARGIN + 1
        in_use = self.in_use(need)
        if in_use is None or in_use + need <= self.fd_limit:
            self._took(1)
            return None
        name = socket if socket in self.connections_refused else "other"
        with self._lock:
            self.connections_refused[name] = self.connections_refused.get(name, 0) + 1
            refused = dict(self.connections_refused)
        why = (
            f"controller at capacity: {in_use} of its {self.fd_limit} file descriptors in use "
            f"({self.registered()} ranks registered, {reserve} kept for command channels, {GATE_MARGIN} spare)"
        )
        self._log.warning(
            "connection",
            "refused a connection to the %s socket from %s: %s; connections refused so far: %s. Raise the "
            "controller's open-file limit (ulimit -n / LimitNOFILE) or run another controller",
            name,
            address,
            why,
            ", ".join(f"{k} {v}" for k, v in refused.items() if v),
        )
        return why

    def check_probe_room(self) -> None:
        """Raise :class:`NoDescriptors` unless a probe's sockets fit beyond the channels' reserve
        and :data:`PROBE_SPARE`."""
        reserve = self.channel_reserve()
        need = reserve + PROBE_SPARE + PROBE_FDS
        in_use = self.in_use(need)
        if in_use is not None and in_use + need > self.fd_limit:
            raise NoDescriptors(
                f"{in_use} of {self.fd_limit} file descriptors in use ({reserve} kept for command channels, "
                f"a probe needs {PROBE_FDS} and leaves {PROBE_SPARE})"
            )

    def note_probe_deferred(self, worker: str, why: str, waited_s: float, gave_up: bool) -> None:
        """Count a probe put off for want of descriptors; a line a minute at most."""
        with self._lock:
            self.probes_deferred += 1
            deferred = self.probes_deferred
        self._log.warning(
            "probe",
            "probe of %s's command port %s: %s; %d probes put off for want of descriptors so far",
            worker,
            f"skipped after {waited_s:.0f} s (its first command will tell whether it is reachable)"
            if gave_up
            else "put off",
            why,
            deferred,
        )


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
        self.capacity.open_channels = self._open.__len__
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
                if e.errno == errno.EMFILE and self._out_of_descriptors():
                    # The process's limit, not ZMQ's socket table: the channel limit stays as it
                    # is, and this command fails; the next one finds room once the moment passes.
                    raise WorkerUnreachable(
                        f"{type(command).__name__} to {worker[0]} rank {worker[1]}: cannot open a command channel "
                        f"now: controller at capacity, {fds_in_use()} of its {self.capacity.fd_limit} file "
                        f"descriptors in use"
                    ) from None
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

    def _out_of_descriptors(self) -> bool:
        """EMFILE from the process's descriptor limit (within PROBE_SPARE of it), not ZMQ's table."""
        counted = fds_in_use()
        return counted is not None and counted + PROBE_SPARE >= self.capacity.fd_limit

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
        keys when the context has them, as the command channel would); else why not;
        :class:`NoDescriptors` (nothing tried) when its sockets would not fit now. A real
        handshake, not a bare TCP connect: the worker's server sees a member come and go, not a
        stranger that dropped out of its handshake (which it would count and log as refused)."""
        async with self._probes:
            self.capacity.check_probe_room()
            try:
                sock = self.ctx.socket(zmq.DEALER)
            except zmq.ZMQError as e:  # past the count: descriptors (or ZMQ's socket table) ran out meanwhile
                raise NoDescriptors(f"no socket for a probe ({_errno_name(e)})") from None
            try:
                sock.setsockopt(zmq.LINGER, 0)
                client_socket(sock, resolve(self.ctx, None), f"probe of {host}:{port}")
                try:
                    monitor = sock.get_monitor_socket(PROBE_EVENTS)
                except zmq.ZMQError as e:
                    raise NoDescriptors(f"no monitor socket for a probe ({_errno_name(e)})") from None
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
