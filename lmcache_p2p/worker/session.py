"""A rank's session with one controller: registration, liveness (heartbeats) and the warm set.

* Heartbeats run from the start. An "unknown" answer (the controller restarted or reaped us) or
  two missed answers mean: register again. Registering is retried until the controller is back;
  meanwhile the engine keeps using its own tiers and the event stream drops its events, because
  the re-sync that follows every registration sends the full key set anyway.
* A registration restarts the event stream (:class:`KeyStream`) and re-syncs the locations the
  controller asks for; so does a heartbeat reply that asks for some.
* Liveness also covers the controller's other answers: a peer lookup that goes unanswered marks
  the controller unanswered (:meth:`ControllerSession.note_unanswered`), and peer lookups are
  fast misses until a heartbeat hears it again.
* The warm set: with ``max_warm_peers`` set, the registration asks for the peers to keep
  connected, and each heartbeat echoes the version of the set it last got; a reply with a new
  set (on registration, or when the layout's membership changed) is handed to ``on_peers``,
  which only schedules work: the hellos never run on the session's time. A newcomer greets the
  ranks of its own warm set at once; :meth:`ControllerSession.beat_soon` lets such a rank ask
  for its new set right then (one early heartbeat, at most every ``EARLY_BEAT_MIN_S``) instead
  of up to a heartbeat interval later, when the newcomer may already be serving requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Protocol

import zmq.asyncio

from lmcache_p2p.mesh_security import MeshSecurity
from lmcache_p2p.protocol import (
    PROTOCOL_VERSION,
    EngineLoad,
    Heartbeat,
    HeartbeatReply,
    MeshPeer,
    Register,
    RegisterReply,
    Traffic,
    controller_reply_decoder,
)
from lmcache_p2p.rpc import RemoteError, RequestFailed, RpcClient
from lmcache_p2p.worker.adapters import ServedAdapters
from lmcache_p2p.worker.identity import WorkerIdentity

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 3.0  # a request on the controller's reply socket (register, re-sync, peer lookup)
EARLY_BEAT_MIN_S = 0.25  # beat_soon(): early heartbeats are at least this far apart
# After a controller restart, how long beyond one heartbeat interval its index may still lack
# live ranks: every rank hears "unknown" at its next heartbeat and registers again at once; this
# covers that round trip and its re-sync (a rank's full key set, batches of RESYNC_BATCH_KEYS).
SETTLE_MARGIN_S = 3.0


class KeyStream(Protocol):
    """What the session does to the rank's key events for its controller (``EventStream``)."""

    def restart(self) -> int:
        """Registered (again): the events waiting are dropped, superseded by the re-sync that
        follows; how many."""
        ...

    def resync(self, location: str) -> None:
        """Send ``location``'s full key set (the controller asked for it)."""
        ...

    def seqs_for_beat(self) -> dict[str, int] | None:
        """The last batch number per location sent before the previous heartbeat (surely
        arrived, if it is coming at all); None when none was."""
        ...


class ControllerSession:
    """Registration and liveness with one controller, and the warm set it hands out. The one
    owner of whether this rank is registered there (``registered``, ``epoch``) and of whether the
    controller answers (``unanswered_since``)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        identity: WorkerIdentity,
        reply: RpcClient,
        reply_host: str,
        heartbeat_time: float,
        locations: list[str],
        stream: KeyStream,
        traffic: Callable[[], Traffic] | None = None,
        security: MeshSecurity | None = None,
        load: Callable[[], EngineLoad | None] | None = None,
        adapters: ServedAdapters | None = None,
    ):
        self.ctx = ctx
        self.me = identity
        self.reply = reply  # the controller's reply socket (the link's): registrations go there
        self.reply_host = reply_host  # the heartbeat socket is on this host, at the port registration names
        self.locations = locations
        self.stream = stream
        self.security = security  # the mesh's CurveZMQ keys; None: plain sockets
        self.traffic = traffic  # this rank's totals, for the controller's dashboard
        self.load = load  # the engine's latest load, for /route (EngineLoadProbe.current)
        # The engine's adapters (name -> lora_id), reported whole at registration and again with
        # the heartbeat after a change; the version this controller has last acknowledged.
        self.adapters = adapters
        self._adapters_acked = -1
        self.heartbeat: RpcClient | None = None
        self.heartbeat_time = heartbeat_time
        self.interval = heartbeat_time
        self.registered = False
        self.epoch = ""
        self._settling_until = 0.0  # see settling
        # When a request of ours last went unanswered (a peer lookup's; None: the controller
        # answers): peer lookups are fast misses until a heartbeat reply clears it.
        self.unanswered_since: float | None = None
        # Reported at registration (the worker sets them before start()): the channel running
        # here and why it is not the configured one, and how many peers to keep warm.
        self.effective_channel: str | None = identity.transfer_channel
        self.channel_error: str | None = None
        self.max_warm_peers = 0
        # Called with each new warm set, and whether it came with a (re-)registration: a
        # restarted controller's first set lacks the peers that have not registered again yet.
        self.on_peers: Callable[[list[MeshPeer], bool], object] | None = None
        self.peers_version = 0
        self._beat_now = asyncio.Event()  # beat_soon(): heartbeat before the interval is up
        self._last_beat = 0.0
        self._task: asyncio.Task | None = None
        self.stats = {"registrations": 0, "heartbeats": 0, "heartbeat_misses": 0}

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._liveness_loop())

    def close(self) -> None:
        """Stop the liveness loop and close the heartbeat socket (``registered`` stays as it was,
        for the link's farewell)."""
        if self._task is not None:
            self._task.cancel()
        if self.heartbeat is not None:
            self.heartbeat.close()

    @property
    def settling(self) -> bool:
        """The controller restarted since this rank first registered, recently enough that other
        ranks may not have registered again yet: a miss it answers may be a key it has not heard
        of yet (a rank's own restart is no such case: the controller it meets knows the mesh)."""
        return time.monotonic() < self._settling_until

    def note_unanswered(self) -> None:
        """A request of ours went unanswered: the controller is away until a heartbeat hears it."""
        self.unanswered_since = time.monotonic()

    # -- registration and heartbeats -------------------------------------------------------------

    async def _liveness_loop(self) -> None:
        away_since: float | None = None  # when the controller stopped answering
        warned = False  # said so in the log, once per absence
        while True:
            try:
                if self.registered:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._beat_now.wait(), self.interval)
                    if self._beat_now.is_set():  # early: still no closer than EARLY_BEAT_MIN_S
                        await asyncio.sleep(max(0.0, self._last_beat + EARLY_BEAT_MIN_S - time.monotonic()))
                        self._beat_now.clear()
                    await self._beat()
                    if not self.registered:
                        away_since = time.monotonic()
                    continue
                if await self._register():
                    if away_since is not None:
                        logger.info(
                            "%s: controller back after %.1f s away; registered again",
                            self.me.describe(),
                            time.monotonic() - away_since,
                        )
                    away_since, warned = None, False
                    continue
                if not warned:
                    away_since = away_since or time.monotonic()
                    warned = True
                    logger.warning(
                        "%s: controller at %s unreachable; serving from local tiers and retrying",
                        self.me.describe(),
                        self.reply.address,
                    )
                await asyncio.sleep(min(1.0, self.interval))
            except asyncio.CancelledError:
                task = asyncio.current_task()
                assert task is not None  # this coroutine runs as a task (start() made it one)
                if task.cancelling():
                    raise
                logger.warning("%s: a controller request was cancelled under the liveness loop", self.me.describe())
            except Exception:
                logger.exception("%s: controller liveness loop error; retrying", self.me.describe())
                await asyncio.sleep(1.0)

    async def _register(self) -> bool:
        me = self.me
        adapters_version, adapters = self.adapters.snapshot() if self.adapters is not None else (-1, {})
        message = Register(
            version=PROTOCOL_VERSION,
            instance_id=me.instance_id,
            rank=me.rank,
            host=me.host,
            worker_port=me.worker_port,
            layout=me.layout,
            chunk_size=me.chunk_size,
            locations=self.locations,
            p2p_init_port=me.p2p_init_port,
            p2p_lookup_port=me.p2p_lookup_port,
            transfer_channel=me.transfer_channel,
            effective_channel=self.effective_channel,
            channel_error=self.channel_error,
            session=me.session,
            max_warm_peers=self.max_warm_peers or None,
            serve_url=me.serve_url,
            adapters=adapters or None,
        )
        try:
            reply = await self.reply.request(message, RegisterReply, REQUEST_TIMEOUT_S)
        except RequestFailed as e:
            logger.debug("%s: register: %s", me.describe(), e)
            return False
        except RemoteError as e:
            logger.error("%s: controller refused registration: %s", me.describe(), e)
            await asyncio.sleep(5.0)
            return False
        restarted = bool(self.epoch) and reply.controller_epoch != self.epoch
        self.epoch = reply.controller_epoch
        self._adapters_acked = adapters_version
        self.interval = min(self.heartbeat_time, reply.heartbeat_interval or self.heartbeat_time)
        if restarted:
            self._settling_until = time.monotonic() + self.interval + SETTLE_MARGIN_S
            logger.info(
                "%s: the controller at %s restarted; its index may lack ranks not registered again "
                "for %.1f s (one heartbeat interval and a re-sync)",
                me.describe(),
                self.reply.address,
                self.interval + SETTLE_MARGIN_S,
            )
        if self.heartbeat is not None:
            self.heartbeat.close()
        self.heartbeat = RpcClient(
            self.ctx,
            f"tcp://{self.reply_host}:{reply.heartbeat_port or 8082}",
            controller_reply_decoder,
            "controller heartbeat socket",
            security=self.security,
        )
        dropped = self.stream.restart()  # the re-sync below carries their effect
        self.registered = True
        self.unanswered_since = None
        self.stats["registrations"] += 1
        logger.info(
            "%s registered with the controller (epoch %s, heartbeat every %.2f s, %d queued events "
            "superseded by re-sync of %s)",
            me.describe(),
            self.epoch,
            self.interval,
            dropped,
            reply.resync,
        )
        for location in reply.resync:
            self.stream.resync(location)
        self._take_peers(reply.peers, reply.peers_version, registered=True)
        return True

    def _take_peers(self, peers: list[MeshPeer] | None, version: int, registered: bool) -> None:
        if peers is None:
            return
        self.peers_version = version
        if self.on_peers is None:
            return
        try:
            self.on_peers(peers, registered)
        except Exception:  # the session goes on whatever the warm-up does
            logger.exception("%s: taking the warm set of %d peer(s) failed", self.me.describe(), len(peers))

    def beat_soon(self, why: str) -> None:
        """Heartbeat now rather than at the next interval (the mesh changed, say ``why``), so a
        new warm set arrives within milliseconds. At most one early beat per EARLY_BEAT_MIN_S:
        a burst of greetings costs the controller one heartbeat."""
        if not self.registered or self._beat_now.is_set():
            return
        logger.info("%s: heartbeat now (%s): asking for the new warm set", self.me.describe(), why)
        self._beat_now.set()

    async def _beat(self) -> None:
        self._last_beat = time.monotonic()
        assert self.heartbeat is not None  # made by the registration that set self.registered
        event_seqs = self.stream.seqs_for_beat()
        adapters_version, adapters = self.adapters.snapshot() if self.adapters is not None else (-1, {})
        changed = adapters_version != self._adapters_acked
        try:
            reply = await self.heartbeat.request(
                Heartbeat(
                    instance_id=self.me.instance_id,
                    rank=self.me.rank,
                    controller_epoch=self.epoch,
                    traffic=self.traffic() if self.traffic else None,
                    peers_version=self.peers_version,
                    event_seqs=event_seqs,
                    load=self.load() if self.load else None,
                    adapters=adapters if changed else None,
                ),
                HeartbeatReply,
                timeout=max(1.0, 2 * self.interval),
            )
        except RequestFailed as e:
            self.stats["heartbeat_misses"] += 1
            logger.warning(
                "%s: heartbeat unanswered (%s); the controller looks away, serving locally", self.me.describe(), e
            )
            self.registered = False
            return
        except RemoteError as e:
            self.stats["heartbeats"] += 1
            logger.info("%s: controller refused our heartbeat (%s); registering again", self.me.describe(), e)
            self.registered = False
            return
        self.stats["heartbeats"] += 1
        if reply.status != "ok" or reply.controller_epoch != self.epoch:
            logger.info(
                "%s: controller does not know us (epoch %s -> %s); registering again",
                self.me.describe(),
                self.epoch,
                reply.controller_epoch,
            )
            self.registered = False
            return
        if self.unanswered_since is not None:
            logger.info(
                "%s: controller answering again; peer lookups resume after %.1f s of fast misses",
                self.me.describe(),
                time.monotonic() - self.unanswered_since,
            )
            self.unanswered_since = None
        self._adapters_acked = adapters_version
        for location in reply.resync:
            self.stream.resync(location)
        self._take_peers(reply.peers, reply.peers_version, registered=False)
