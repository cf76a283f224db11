"""The worker's side of the controller protocol: register, key events, heartbeats, re-sync.

* Storage events: the store queues them for the link from whichever thread changed a tier (the
  engine's store path, the disk writer, peer pulls); the link drains that queue on its loop into
  an :class:`EventBatcher`, which keeps only the last event per key and location, so a batch's
  admits and evicts can be applied in any order. Batches go out every ``flush_interval`` seconds
  and before any other message, numbered per location.
* Heartbeats run from the start. An "unknown" answer (the controller restarted or reaped us) or
  two missed answers mean: register again. Registering is retried until the controller is back;
  meanwhile the engine keeps using its own tiers and events are dropped, because the re-sync
  that follows every registration sends the full key set anyway.
* A re-sync cuts the batch stream at a sequence number (``snapshot_seq``), then sends the
  location's keys in batches; the controller replays newer batches on top.
* The warm set: with ``max_warm_peers`` set, the registration asks for the peers to keep
  connected, and each heartbeat echoes the version of the set it last got; a reply with a new
  set (on registration, or when the layout's membership changed) is handed to ``on_peers``,
  which only schedules work: the hellos never run on this link's time. A newcomer greets the
  ranks of its own warm set at once; :meth:`ControllerLink.beat_soon` lets such a rank ask for
  its new set right then (one early heartbeat, at most every ``EARLY_BEAT_MIN_S``) instead of up
  to a heartbeat interval later, when the newcomer may already be serving requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import cast

import numpy as np
import zmq
import zmq.asyncio

from lmcache_p2p.config import split_host_port
from lmcache_p2p.mesh_security import MeshSecurity, client_socket
from lmcache_p2p.miss_reasons import TIMEOUT
from lmcache_p2p.protocol import (
    PROTOCOL_VERSION,
    Ack,
    Deregister,
    EngineLoad,
    Heartbeat,
    HeartbeatReply,
    KeyEvents,
    MeshPeer,
    P2PLookup,
    P2PLookupReply,
    Register,
    RegisterReply,
    ResyncBatch,
    Traffic,
    controller_reply_decoder,
    encode,
    pack_hashes,
)
from lmcache_p2p.rpc import RemoteError, RequestFailed, RpcClient
from lmcache_p2p.storage.chunk_store import ChunkStore
from lmcache_p2p.vocab import StorageEvent
from lmcache_p2p.worker.adapters import ServedAdapters
from lmcache_p2p.worker.identity import WorkerIdentity

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 3.0
RESYNC_BATCH_KEYS = 65536
EARLY_BEAT_MIN_S = 0.25  # beat_soon(): early heartbeats are at least this far apart
# After a controller restart, how long beyond one heartbeat interval its index may still lack
# live ranks: every rank hears "unknown" at its next heartbeat and registers again at once; this
# covers that round trip and its re-sync (a rank's full key set, batches of RESYNC_BATCH_KEYS).
SETTLE_MARGIN_S = 3.0


class EventBatcher:
    """Admit/evict events per location, coalesced to the last event per key. Used on the link's
    loop only (it drains the store's queue there)."""

    def __init__(self) -> None:
        self._pending: dict[str, dict[int, bool]] = {}  # location -> hash -> admitted?
        self.seq: dict[str, int] = {}  # last batch number sent per location

    def add(self, event: StorageEvent) -> None:
        self._pending.setdefault(event.location, {})[event.key.chunk_hash] = event.kind == "admit"

    def cut(self, instance_id: str, rank: int, only: str | None = None) -> list[KeyEvents]:
        """Everything waiting, as numbered batches (for one location or all)."""
        out = []
        for location in [only] if only else list(self._pending):
            events = self._pending.pop(location, None)
            if not events:
                continue
            seq = self.seq[location] = self.seq.get(location, 0) + 1
            admitted = [h for h, admit in events.items() if admit]
            evicted = [h for h, admit in events.items() if not admit]
            out.append(
                KeyEvents(
                    instance_id=instance_id,
                    rank=rank,
                    location=location,
                    seq=seq,
                    admitted=pack_hashes(admitted),
                    evicted=pack_hashes(evicted),
                )
            )
        return out

    def drop(self) -> int:
        """Forget everything waiting; returns how many distinct events that was (a key admitted
        and evicted in one window is one: what a cut would have sent)."""
        n = sum(len(events) for events in self._pending.values())
        self._pending.clear()
        return n

    def sent_seqs(self) -> dict[str, int]:
        """The last batch number cut per location."""
        return dict(self.seq)

    def last_seq(self, location: str) -> int:
        return self.seq.get(location, 0)


class ControllerLink:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        identity: WorkerIdentity,
        storage: ChunkStore,
        pull_url: str,
        reply_url: str,
        heartbeat_time: float,
        flush_interval: float = 0.05,
        traffic: Callable[[], Traffic] | None = None,
        security: MeshSecurity | None = None,
        load: Callable[[], EngineLoad | None] | None = None,
        adapters: ServedAdapters | None = None,
    ):
        self.ctx = ctx
        # The engine's adapters (name -> lora_id), reported whole at registration and again with
        # the heartbeat after a change; the version this controller has last acknowledged.
        self.adapters = adapters
        self._adapters_acked = -1
        self.security = security  # the mesh's CurveZMQ keys; None: plain sockets
        self.traffic = traffic  # this rank's totals, for the controller's dashboard
        self.load = load  # the engine's latest load, for /route (EngineLoadProbe.current)
        self.me = identity
        self.storage = storage
        # Either spelling of a controller URL (host:port, tcp://host:port) names the same socket.
        self.reply_host, reply_port = split_host_port(reply_url)
        pull_host, pull_port = split_host_port(pull_url)
        self.reply = RpcClient(
            ctx,
            f"tcp://{self.reply_host}:{reply_port}",
            controller_reply_decoder,
            "controller reply socket",
            security=security,
        )
        self.heartbeat: RpcClient | None = None
        self.push = ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.setsockopt(zmq.IMMEDIATE, 1)
        self.push.setsockopt(zmq.SNDHWM, 10000)
        # Watched: the one socket that lives as long as the link, so a controller that refuses our
        # handshake (another mesh secret, or one where we have none) is said here, in our log.
        client_socket(self.push, security, f"{identity.describe()}: controller pull socket", watch=True)
        self.push.connect(f"tcp://{pull_host}:{pull_port}")
        self.heartbeat_time = heartbeat_time
        self.interval = heartbeat_time
        self.flush_interval = flush_interval
        # The store's admits and evicts for this link, drained on the loop into the batcher (at
        # each flush, before a re-sync's cut and at registration).
        self.events = storage.record_events()
        self.batcher = EventBatcher()
        self.registered = False
        self.epoch = ""
        self._settling_until = 0.0  # see settling
        # Reported at registration (the worker sets them before start()): the channel running
        # here and why it is not the configured one, and how many peers to keep warm.
        self.effective_channel: str | None = identity.transfer_channel
        self.channel_error: str | None = None
        self.max_warm_peers = 0
        # Called with each new warm set, and whether it came with a (re-)registration: a
        # restarted controller's first set lacks the peers that have not registered again yet.
        self.on_peers: Callable[[list[MeshPeer], bool], object] | None = None
        self.peers_version = 0
        self._resyncing: set[str] = set()
        # When a peer lookup last went unanswered (None: the controller answers): lookups are
        # fast misses until a heartbeat reply clears it.
        self._lookups_failing_since: float | None = None
        self._beat_now = asyncio.Event()  # beat_soon(): heartbeat before the interval is up
        self._last_beat = 0.0
        self._sent_at_last_beat: dict[str, int] = {}  # EventBatcher.sent_seqs() at the last beat
        self._unsent: set[str] = set()  # locations with a batch the pull socket refused
        self._tasks: list[asyncio.Task] = []
        self.stats = {
            "registrations": 0,
            "heartbeats": 0,
            "heartbeat_misses": 0,
            "batches_sent": 0,
            "events_dropped": 0,
            "resyncs_sent": 0,
            "p2p_lookups": 0,
            "p2p_lookups_skipped": 0,  # fast misses while the controller did not answer
            "p2p_lookups_rechecked": 0,  # its short answers while settling, checked with the next one
        }

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._liveness_loop()), asyncio.ensure_future(self._flush_loop())]

    def close(self, deregister: bool = True) -> None:
        for task in self._tasks:
            task.cancel()
        if deregister and self.registered:
            self.send(Deregister(instance_id=self.me.instance_id, rank=self.me.rank))
        self.reply.close()
        if self.heartbeat is not None:
            self.heartbeat.close()
        self.push.close(linger=100 if deregister else 0)

    def send(self, message) -> bool:
        """Fire-and-forget on the pull socket; False when it could not be queued (controller away).
        Any other message goes after the storage events recorded before it (they are flushed
        first; the controller reads the socket in order): a CommandDone never overtakes the
        removals of the command it reports."""
        if not isinstance(message, KeyEvents):
            self.flush()
        # On an asyncio socket a non-blocking send completes at once and reports failure (the
        # queue is full or nobody is connected) through the returned future, not by raising.
        # (pyzmq's stubs type the async send as a plain Awaitable; zmq.asyncio returns this Future.)
        sent = cast("asyncio.Future[zmq.MessageTracker | None]", self.push.send(encode(message), flags=zmq.NOBLOCK))
        return not (sent.done() and sent.exception() is not None)

    @property
    def settling(self) -> bool:
        """The controller restarted since this rank first registered, recently enough that other
        ranks may not have registered again yet: a miss it answers may be a key it has not heard
        of yet (a rank's own restart is no such case: the controller it meets knows the mesh)."""
        return time.monotonic() < self._settling_until

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
            locations=self.storage.locations,
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
        self._drain()
        dropped = self.batcher.drop()  # the re-sync below carries their effect
        self.registered = True
        self._lookups_failing_since = None
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
            self._start_resync(location)
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
        except Exception:  # the link goes on whatever the warm-up does
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
        # Batches sent before the last beat have surely arrived if they are coming at all.
        sent_before, self._sent_at_last_beat = self._sent_at_last_beat, self.batcher.sent_seqs()
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
                    event_seqs=sent_before or None,
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
        if self._lookups_failing_since is not None:
            logger.info(
                "%s: controller answering again; peer lookups resume after %.1f s of fast misses",
                self.me.describe(),
                time.monotonic() - self._lookups_failing_since,
            )
            self._lookups_failing_since = None
        self._adapters_acked = adapters_version
        for location in reply.resync:
            self._start_resync(location)
        self._take_peers(reply.peers, reply.peers_version, registered=False)

    # -- events and re-sync ----------------------------------------------------------------------

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval)
            self.flush()

    def _drain(self) -> None:
        """Move the store's queued events into the batcher (on the loop: the batcher's only thread)."""
        for event in self.events.take_events():
            self.batcher.add(event)

    def flush(self) -> None:
        self._drain()
        if not self.registered:
            self.stats["events_dropped"] += self.batcher.drop()
            return
        for location in self._unsent - self._resyncing:
            # A batch of it was refused (the pull socket had no connection): the re-sync, over
            # the request socket, tells the controller what that batch would have.
            self._unsent.discard(location)
            self._start_resync(location)
        for batch in self.batcher.cut(self.me.instance_id, self.me.rank):
            if self.send(batch):
                self.stats["batches_sent"] += 1
            else:
                self.stats["events_dropped"] += 1
                self._unsent.add(batch.location)

    def _start_resync(self, location: str) -> None:
        if location in self._resyncing:
            return
        self._resyncing.add(location)
        task = asyncio.ensure_future(self._resync(location))
        task.add_done_callback(lambda _: self._resyncing.discard(location))

    async def _resync(self, location: str) -> None:
        me = self.me
        self._drain()  # what the store did before the snapshot goes before its cut
        for batch in self.batcher.cut(me.instance_id, me.rank, only=location):
            self.send(batch)
        snapshot_seq = self.batcher.last_seq(location)
        try:
            keys = self.storage.held_hashes(location)
        except ValueError:  # a location this rank does not have
            keys = np.zeros(0, dtype=np.uint64)
        t0 = time.perf_counter()
        count = max(1, -(-len(keys) // RESYNC_BATCH_KEYS))
        for i in range(count):
            part = keys[i * RESYNC_BATCH_KEYS : (i + 1) * RESYNC_BATCH_KEYS]
            message = ResyncBatch(
                instance_id=me.instance_id,
                rank=me.rank,
                location=location,
                snapshot_seq=snapshot_seq,
                batch=i,
                last=i == count - 1,
                keys=pack_hashes(part),
            )
            try:
                await self.reply.request(message, Ack, REQUEST_TIMEOUT_S)
            except RequestFailed as e:
                logger.warning("%s: re-sync of %s stopped at batch %d: %s", me.describe(), location, i, e)
                return
            except RemoteError as e:
                logger.warning("%s: controller rejected re-sync batch %d of %s: %s", me.describe(), i, location, e)
                return
        self.stats["resyncs_sent"] += 1
        logger.info(
            "%s: re-synced %d keys of %s with the controller in %.1f ms (snapshot seq %d)",
            me.describe(),
            len(keys),
            location,
            (time.perf_counter() - t0) * 1e3,
            snapshot_seq,
        )

    # -- peer lookup -----------------------------------------------------------------------------

    async def p2p_lookup(self, hashes: np.ndarray, timeout: float = REQUEST_TIMEOUT_S) -> P2PLookupReply:
        """Holders of a prefix of ``hashes`` (longest first) and why the rest is not offered
        (``miss_reason``: ``timeout`` when the controller is away)."""
        if not len(hashes):
            return P2PLookupReply(holders=[])
        if not self.registered:
            return _no_answer("not registered with the controller yet")
        if self._lookups_failing_since is not None:
            # The last lookup got no answer: until a heartbeat (sent now) hears the controller
            # again, a lookup is a miss at once instead of one more full timeout per request.
            self.stats["p2p_lookups_skipped"] += 1
            away = time.monotonic() - self._lookups_failing_since
            return _no_answer(f"controller unanswered for {away:.1f} s")
        self.stats["p2p_lookups"] += 1
        try:
            return await self.reply.request(
                P2PLookup(instance_id=self.me.instance_id, rank=self.me.rank, hashes=pack_hashes(hashes)),
                P2PLookupReply,
                timeout,
            )
        except RequestFailed as e:
            self._lookups_failing_since = time.monotonic()
            logger.warning(
                "%s: peer lookup of %d chunk(s) unanswered (%s); lookups are misses until a heartbeat "
                "hears the controller",
                self.me.describe(),
                len(hashes),
                e,
            )
            self.beat_soon("a peer lookup went unanswered")
            return _no_answer(f"holder lookup unanswered in {timeout} s")
        except RemoteError as e:
            logger.warning("%s: peer lookup of %d chunk(s) failed: %s", self.me.describe(), len(hashes), e)
            return _no_answer(f"holder lookup failed: {e}")


def _no_answer(why: str) -> P2PLookupReply:
    """A holder lookup the controller did not answer: no holders, and a ``timeout`` miss."""
    return P2PLookupReply(holders=[], miss_reason=TIMEOUT, miss_detail=why)
