"""The controller's three monitor sockets and what arrives on them: who is alive, and what they hold.

* pull (PULL): ``KeyEvents`` into the registry's index, ``CommandDone`` to the orchestration,
  ``Deregister``; fire-and-forget, so a plain receive loop.
* reply (an :class:`RpcServer`): ``Register``, ``ResyncBatch``, ``P2PLookup``.
* heartbeat (an :class:`RpcServer`): ``Heartbeat``, answered with the worker's standing (and any
  re-sync the registry wants), its traffic totals going to :class:`FleetTraffic`.

Peers are connected before they are needed: a P2P worker that asks (``Register.max_warm_peers``)
gets its warm set (live ranks of its layout it should keep a channel open to, chosen by the
registry) in its RegisterReply, and again in a HeartbeatReply whenever its layout's membership
changed since the version its heartbeat echoes. No extra socket: a worker hears of a newcomer
within one heartbeat (the newcomer warms towards the others at once, from its RegisterReply).

Two background loops go with them: the reaper (a worker silent for ``worker_timeout`` leaves)
and the traffic sampler. A bad frame or a failing handler is counted, logged and answered (on
the request/reply sockets); no loop ever stops for one message.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

import zmq
import zmq.asyncio

from lmcache_p2p.controller.admission import RegisterRefused
from lmcache_p2p.controller.compatibility import Difference, differences, model_name
from lmcache_p2p.controller.metrics import Metrics
from lmcache_p2p.controller.orchestration import Orchestrator
from lmcache_p2p.controller.registry import Registry, WorkerKey, WorkerRecord
from lmcache_p2p.controller.routing import held_prefixes
from lmcache_p2p.controller.settings import MONITOR_MAX_MESSAGE_BYTES, ControllerSettings, SettingsError
from lmcache_p2p.controller.traffic import FleetTraffic
from lmcache_p2p.logs import RateLimitedLog
from lmcache_p2p.mesh_security import MeshSecurity, server_socket
from lmcache_p2p.miss_reasons import LAYOUT_MISMATCH, NOT_HELD, PARTIAL_TP
from lmcache_p2p.protocol import (
    Ack,
    CommandDone,
    DecodeError,
    Deregister,
    Heartbeat,
    HeartbeatReply,
    KeyEvents,
    MeshPeer,
    P2PLookup,
    P2PLookupReply,
    PeerHolder,
    Register,
    RegisterReply,
    ResyncBatch,
    unpack_hashes,
    worker_message_decoder,
)
from lmcache_p2p.rpc import FairShare, Handler, RpcServer

logger = logging.getLogger("lmcache_p2p.controller")

# Workers that left (reaped or deregistered) kept for the dashboard, so an operator sees what
# went away and why instead of a row that silently vanished.
DEPARTED_KEPT = 100

# Bad frames are counted in full (lmcache_controller_bad_frames_total) but logged at most once per
# socket per 10 s: a flood of 300k once wrote 37 MB of identical warnings.
_bad_frames = RateLimitedLog(logger, every_s=10.0)


class Monitor:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        settings: ControllerSettings,
        epoch: str,
        registry: Registry,
        traffic: FleetTraffic,
        orchestrator: Orchestrator,
        metrics: Metrics,
        security: MeshSecurity | None = None,
    ):
        self.ctx = ctx
        self.security = security  # the mesh's CurveZMQ keys; None: plain sockets
        self.settings = settings
        self.epoch = epoch
        self.registry = registry
        self.traffic = traffic
        self.orchestrator = orchestrator
        self.metrics = metrics
        self.departed: deque[dict] = deque(maxlen=DEPARTED_KEPT)  # newest last
        for name, text in [
            ("lmcache_controller_messages_total", "Worker messages decoded, by type"),
            ("lmcache_controller_bad_frames_total", "Frames that did not decode, by socket"),
            ("lmcache_controller_handler_errors_total", "Messages whose handling raised, by socket"),
            ("lmcache_controller_p2p_lookups_total", "Peer lookups from workers"),
        ]:
            metrics.counter(name, text)
        self._pull: zmq.asyncio.Socket | None = None
        self._servers: dict[str, RpcServer] = {}
        self._tasks: list[asyncio.Task] = []

    # -- start and stop ----------------------------------------------------------------------------

    def bind(self) -> None:
        """Bind the three sockets; a port in use is a SettingsError naming it (and nothing stays bound)."""
        self._pull = self.ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        # Each socket's name as its ZAP domain: libzmq then puts every plain connection to the
        # context's gate too (commands.py, Capacity.admit_connection), which counts by that name.
        self._pull.setsockopt(zmq.ZAP_DOMAIN, b"pull")
        server_socket(self._pull, self.security, "controller pull socket", MONITOR_MAX_MESSAGE_BYTES["pull"])
        self._bind("pull", self._pull.bind)
        self._servers = {
            # Concurrent: a Register waiting on its host's name (up to HostCheck.timeout_s) answers
            # in a task of its own, and the lookups and re-syncs behind it are not held (issue 47:
            # eight Registers whose DNS never answered held this socket 16 s). ResyncBatch and
            # P2PLookup handlers never await, so each runs whole in its task's first step, and
            # tasks start in the order they were made: they are still applied in arrival order.
            "reply": self._server(
                "reply",
                {Register: self._on_register, ResyncBatch: self._on_resync, P2PLookup: self._on_p2p_lookup},
                concurrent=True,
            ),
            "heartbeat": self._server("heartbeat", {Heartbeat: self._on_heartbeat}),
        }
        for name, server in self._servers.items():
            server.sock.setsockopt(zmq.ZAP_DOMAIN, name.encode())
            self._bind(name, server.bind)
        logger.info(
            "monitor sockets bound: pull %d, reply %d, heartbeat %d (epoch %s)",
            *(self.settings.monitor_ports[k] for k in ("pull", "reply", "heartbeat")),
            self.epoch,
        )

    def _server(self, socket: str, handlers: dict[type, Handler], concurrent: bool = False) -> RpcServer:
        return RpcServer(
            self.ctx,
            f"controller {socket} socket",
            handlers,
            concurrent=concurrent,
            on_message=self._count_message,
            on_bad_frame=lambda why: self._count_bad_frame(socket),
            on_error=lambda msg, e: self._count_handler_error(socket),
            security=self.security,
            max_message_bytes=MONITOR_MAX_MESSAGE_BYTES[socket],
        )

    def _bind(self, name: str, bind: Callable[[str], object]) -> None:
        port = self.settings.monitor_ports[name]
        try:
            bind(f"tcp://{self.settings.monitor_host}:{port}")
        except zmq.ZMQError as e:
            self.close()
            host = self.settings.monitor_host
            why = (
                "the port is already in use (another lmcache_controller running?)"
                if e.errno == zmq.EADDRINUSE
                else e.strerror
            )
            raise SettingsError(f"--monitor-ports: cannot bind {name} port {port} on {host}: {why}") from None

    def start(self) -> None:
        for server in self._servers.values():
            server.start()
        self._tasks = [asyncio.ensure_future(c) for c in (self._pull_loop(), self._reaper_loop(), self._sampler_loop())]

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for server in self._servers.values():
            server.close()
        self._servers.clear()
        if self._pull is not None:
            self._pull.close(linger=0)
            self._pull = None

    # -- counting (the RPC servers log what they count) -------------------------------------------

    def _count_message(self, msg: object) -> None:
        self.metrics.inc("lmcache_controller_messages_total", type=type(msg).__name__)

    def _count_bad_frame(self, socket: str) -> None:
        self.metrics.inc("lmcache_controller_bad_frames_total", socket=socket)

    def _count_handler_error(self, socket: str) -> None:
        self.metrics.inc("lmcache_controller_handler_errors_total", socket=socket)

    # -- pull socket -------------------------------------------------------------------------------

    async def _pull_loop(self) -> None:
        sock = self._pull
        assert sock is not None, "bind() first"
        fair = FairShare()  # a flood here must leave heartbeats and HTTP their turns
        while True:
            await fair.turn()
            frames = await sock.recv_multipart()
            try:
                msg = worker_message_decoder.decode(frames[-1])
            except DecodeError as e:
                self._count_bad_frame("pull")
                _bad_frames.warning("pull", "bad frame on pull socket: %s (%d bytes)", e, len(frames[-1]))
                continue
            self._count_message(msg)
            try:
                if isinstance(msg, KeyEvents):
                    self.registry.apply_events(msg)
                elif isinstance(msg, CommandDone):
                    self.orchestrator.command_done(msg)
                elif isinstance(msg, Deregister):
                    self._remove_worker((msg.instance_id, msg.rank), "deregistered")
                else:
                    self._count_bad_frame("pull")
                    _bad_frames.warning(
                        "pull misplaced", "bad frame on pull socket: %s belongs on a request socket", type(msg).__name__
                    )
            except Exception:
                self._count_handler_error("pull")
                logger.exception("handling %s failed", type(msg).__name__)

    # -- reply socket ------------------------------------------------------------------------------

    async def _on_register(self, msg: Register) -> RegisterReply:
        # Every field in bounds, the host resolving, room for it: or a refusal naming what is
        # wrong, and nothing registered (a bad chunk_size once made every /lookup a 500).
        try:
            await self.orchestrator.admit(msg)
        except RegisterRefused as e:
            return RegisterReply(ok=False, controller_epoch=self.epoch, error=e.message)
        # Heard from within two beats: live (a restarted engine takes far longer to come back).
        record = self.registry.register(msg, live_within_s=2 * self.settings.heartbeat_interval)
        # Its command port is probed; one that accepts nothing is removed as unreachable.
        self.orchestrator.worker_registered(record, on_unreachable=self._remove_worker)
        reply = RegisterReply(
            ok=True,
            controller_epoch=self.epoch,
            resync=list(record.locations),
            heartbeat_interval=self.settings.heartbeat_interval,
            heartbeat_port=self.settings.monitor_ports["heartbeat"],
        )
        if record.wants_warm_set:
            reply.peers, reply.peers_version = self._warm_set(record)
        return reply

    def _on_resync(self, msg: ResyncBatch) -> Ack:
        error = self.registry.apply_resync(msg)
        return Ack(ok=error is None, error=error)

    def _on_p2p_lookup(self, msg: P2PLookup) -> P2PLookupReply:
        asker = self.registry.workers.get((msg.instance_id, msg.rank))
        hashes = unpack_hashes(msg.hashes)
        if asker is None or not len(hashes):
            return P2PLookupReply(holders=[])
        self.registry.touch(asker.key)
        # (instance, rank) -> (leading chunks it holds in any of its tiers, the runs each tier
        # serves, fastest first): a rank serves a pull from whichever tier has each chunk, so a
        # prefix split across its CPU and disk counts whole. The same walk /route makes.
        held = held_prefixes(self.registry, hashes, self.registry.workers)
        # Each of the asker's TP ranks pulls from the same rank of a peer, and its scheduler
        # loads only what every rank got; so a peer instance offers only the prefix all its ranks
        # hold (one rank evicted, or gone): the asker's ranks then pull the same chunks, and none
        # pulls what another rank cannot match.
        holders = []
        for (instance_id, rank), (_, runs) in held.items():
            peer = self.registry.workers.get((instance_id, rank))
            # Only a peer whose pages have our exact layout (same model, dtype, block shape, TP
            # rank...) can serve us; never ourselves.
            if peer is None or instance_id == msg.instance_id or peer.info.layout != asker.info.layout:
                continue
            offered = min(held.get((instance_id, r), (0, []))[0] for r in range(peer.info.layout.tp_size))
            if offered == 0:
                continue
            holders.append(
                PeerHolder(
                    instance_id=instance_id,
                    rank=rank,
                    location=runs[0][2],  # the tier serving the first chunk
                    matched_chunks=offered,
                    host=peer.info.host,
                    p2p_init_port=peer.info.p2p_init_port,
                    p2p_lookup_port=peer.info.p2p_lookup_port,
                    transfer_channel=peer.info.effective_channel or peer.info.transfer_channel,
                )
            )
        holders.sort(key=lambda h: -h.matched_chunks)
        self.metrics.inc("lmcache_controller_p2p_lookups_total")
        offered = holders[0].matched_chunks if holders else 0
        if offered >= len(hashes):
            return P2PLookupReply(holders=holders)
        reason, detail = self._why_not_offered(asker, held, offered)
        return P2PLookupReply(holders=holders, miss_reason=reason, miss_detail=detail)

    def _why_not_offered(self, asker: WorkerRecord, held: dict, chunk: int) -> tuple[str, str]:
        """Why no peer offers the asker chunk ``chunk`` of its prompt (miss_reasons): the other
        instances holding it either lay their KV out otherwise, or hold it on some TP ranks only;
        nobody at all: not_held (the asking rank knows whether it evicted it)."""
        holding: dict[str, list[int]] = {}
        for (instance_id, rank), (prefix, _) in held.items():
            if prefix > chunk and instance_id != asker.info.instance_id:
                holding.setdefault(instance_id, []).append(rank)
        for instance_id, ranks in sorted(holding.items()):
            records = [r for r in (self.registry.workers.get((instance_id, rank)) for rank in ranks) if r is not None]
            if not records:
                continue
            peer = records[0]
            found = differences(asker.info, peer.info)
            if not found and model_name(asker.info.layout.model) != model_name(peer.info.layout.model):
                found = [Difference("model", asker.info.layout.model, peer.info.layout.model)]
            if found:
                return LAYOUT_MISMATCH, f"held by {instance_id}: {', '.join(map(str, found))}"
            # The same layout: the rank matching the asker's, or another of its ranks, lacks it.
            return PARTIAL_TP, f"held by {instance_id} on rank(s) {sorted(ranks)} of {peer.info.layout.tp_size}"
        # Nobody holds it at all; an instance of the same model that can never share with the
        # asker (another chunk size cuts other keys) is worth naming.
        never = self.registry.cannot_share.get(asker.info.instance_id, {})
        if never:
            other, fields = sorted(never.items())[0]
            return NOT_HELD, f"{other} serves the same model but can never share with it: {', '.join(fields)}"
        return NOT_HELD, ""

    # -- heartbeat socket --------------------------------------------------------------------------

    def _on_heartbeat(self, msg: Heartbeat) -> HeartbeatReply:
        record = self.registry.touch((msg.instance_id, msg.rank))
        if record is None or msg.controller_epoch != self.epoch:
            return HeartbeatReply(status="unknown", controller_epoch=self.epoch)
        if msg.traffic is not None:
            self.traffic.report(record.key, msg.traffic)
        self.registry.note_load(record.key, msg.load)  # for /route; a bad load is dropped there
        self.registry.note_adapters(record.key, msg.adapters)  # None: unchanged
        if msg.event_seqs:
            self.registry.check_sent(record, msg.event_seqs)
        reply = HeartbeatReply(status="ok", controller_epoch=self.epoch, resync=record.wanted_resyncs())
        if record.wants_warm_set and msg.peers_version != self.registry.mesh_version(record.info.layout):
            reply.peers, reply.peers_version = self._warm_set(record)
        return reply

    def _warm_set(self, record: WorkerRecord) -> tuple[list[MeshPeer], int]:
        peers = self.registry.warm_set(record)
        version = self.registry.mesh_version(record.info.layout)
        logger.debug(
            "warm set v%d for %s rank %d: %d peer(s) %s",
            version,
            *record.key,
            len(peers),
            [f"{p.instance_id}/{p.rank}" for p in peers],
        )
        return peers, version

    # -- liveness ----------------------------------------------------------------------------------

    async def _reaper_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_check_interval)
            try:
                for record in self.registry.reap(self.settings.worker_timeout):
                    self._forget_worker(record, f"reaped: no heartbeat for {self.settings.worker_timeout:g} s")
            except Exception:
                logger.exception("liveness sweep failed")

    async def _sampler_loop(self) -> None:
        while True:
            try:
                self.traffic.sample({"peer_lookups": self.metrics.total("lmcache_controller_p2p_lookups_total")})
            except Exception:
                logger.exception("traffic sample failed")
            await asyncio.sleep(self.traffic.sample_every_s)

    def _remove_worker(self, key: WorkerKey, reason: str) -> None:
        record = self.registry.remove_worker(key, reason)
        if record is not None:
            self._forget_worker(record, reason)

    def _forget_worker(self, record: WorkerRecord, reason: str) -> None:
        self.orchestrator.worker_gone(record, reason)
        instance_id, rank = record.key
        self.departed.append(
            {
                "instance_id": instance_id,
                "worker_id": rank,
                "host": record.info.host,
                "reason": reason,
                "at": time.time(),
            }
        )
