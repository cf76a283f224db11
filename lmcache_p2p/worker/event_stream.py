"""A rank's key events to one controller, and the re-sync of a location's full key set.

* Storage events: the store queues them for the stream from whichever thread changed a tier (the
  engine's store path, the disk writer, peer pulls); the stream drains that queue on its loop
  into an :class:`EventBatcher`, which keeps only the last event per key and location, so a
  batch's admits and evicts can be applied in any order. Batches go out on the controller's pull
  socket every ``flush_interval`` seconds and before any other message, numbered per location.
  While the rank is not registered (the session's word) they are dropped: the re-sync that
  follows every registration sends the full key set anyway.
* A re-sync cuts the batch stream at a sequence number (``snapshot_seq``), then sends the
  location's keys in batches over the reply socket; the controller replays newer batches on top.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import cast

import numpy as np
import zmq
import zmq.asyncio

from lmcache_p2p.config import split_host_port
from lmcache_p2p.logs import RateLimitedLog
from lmcache_p2p.mesh_security import MeshSecurity, client_socket
from lmcache_p2p.protocol import Ack, KeyEvents, ResyncBatch, encode, pack_hashes
from lmcache_p2p.rpc import RemoteError, RequestFailed, RpcClient
from lmcache_p2p.storage.chunk_store import ChunkStore
from lmcache_p2p.vocab import StorageEvent
from lmcache_p2p.worker.identity import WorkerIdentity
from lmcache_p2p.worker.session import REQUEST_TIMEOUT_S

logger = logging.getLogger(__name__)
_reopen_log = RateLimitedLog(logger, every_s=60.0)

RESYNC_BATCH_KEYS = 65536
# A registered rank whose pull socket the controller refused opens it again, this long after it
# opened the refused one, doubling while refusals go on (up to REOPEN_MAX_S). A controller near
# its descriptor limit refuses a new connection (ZAP status 400), and libzmq mostly gives such a
# connection up for good, so a socket refused then would stay unconnected once there is room:
# every batch after it would go the long way, as a re-sync.
REOPEN_AFTER_S = 2.0
REOPEN_MAX_S = 60.0


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


class EventStream:
    """This rank's key events for one controller: its own queue of the store's admits and evicts,
    batched onto the controller's pull socket (which it owns; every other message to the
    controller goes through :meth:`send` too), and the re-syncs the controller asks for over the
    reply socket. ``registered`` says whether the controller knows this rank (the session's)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        identity: WorkerIdentity,
        store: ChunkStore,
        pull_url: str,
        reply: RpcClient,
        registered: Callable[[], bool],
        flush_interval: float = 0.05,
        security: MeshSecurity | None = None,
    ):
        self.me = identity
        self.store = store  # its key sets, for re-syncs
        self.reply = reply  # the controller's reply socket (the link's): re-sync batches go there
        self.registered = registered
        self.flush_interval = flush_interval
        pull_host, pull_port = split_host_port(pull_url)
        self._ctx = ctx
        self._security = security
        self._pull_address = f"tcp://{pull_host}:{pull_port}"
        self._reopen_after_s = REOPEN_AFTER_S
        self.push = self._open_push()
        # The store's admits and evicts for this stream, drained on the loop into the batcher (at
        # each flush, before a re-sync's cut and at registration).
        self.events = store.record_events()
        self.batcher = EventBatcher()
        self._resyncing: set[str] = set()
        self._sent_at_last_beat: dict[str, int] = {}  # EventBatcher.sent_seqs() at the last beat
        self._unsent: set[str] = set()  # locations with a batch the pull socket refused
        self._task: asyncio.Task | None = None
        self.stats = {
            "batches_sent": 0,
            "events_dropped": 0,
            "resyncs_sent": 0,
            "pull_socket_refused": 0,  # handshakes the controller refused (its ZAP gate or another mesh)
            "pull_socket_reopened": 0,
        }

    # -- lifecycle -------------------------------------------------------------------------------

    def _open_push(self) -> zmq.asyncio.Socket:
        push = self._ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.IMMEDIATE, 1)
        push.setsockopt(zmq.SNDHWM, 10000)
        # Watched: the one socket that lives as long as the link, so a controller that refuses our
        # handshake (another mesh secret, or one where we have none) is said here, in our log.
        client_socket(
            push,
            self._security,
            f"{self.me.describe()}: controller pull socket",
            watch=True,
            on_refused=lambda: self._refused(push),
        )
        push.connect(self._pull_address)
        self._push_opened_at = time.monotonic()
        self._push_refused = False
        return push

    def _refused(self, push: zmq.asyncio.Socket) -> None:
        if push is self.push:  # not a late event of a socket already replaced
            self._push_refused = True
            self.stats["pull_socket_refused"] += 1

    def _reopen_refused_push(self) -> None:
        """Registered, and the controller refused the pull socket's connection: open a new one
        (nothing is queued on the old one: with IMMEDIATE a send without a connection fails)."""
        age = time.monotonic() - self._push_opened_at
        if not self._push_refused or age < self._reopen_after_s:
            return
        self.push.close(linger=0)
        self.push = self._open_push()
        self._reopen_after_s = min(REOPEN_MAX_S, 2 * self._reopen_after_s)
        self.stats["pull_socket_reopened"] += 1
        _reopen_log.info(
            self.me.describe(),
            "%s: the controller refused the pull socket's connection (%.1f s ago it was opened; libzmq mostly "
            "gives a refused one up): opened it again (%d time(s); next no sooner than %.0f s after)",
            self.me.describe(),
            age,
            self.stats["pull_socket_reopened"],
            self._reopen_after_s,
        )

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._flush_loop())

    def close(self, linger: int = 0) -> None:
        if self._task is not None:
            self._task.cancel()
        self.push.close(linger=linger)

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

    # -- what the session does (session.KeyStream) -----------------------------------------------

    def restart(self) -> int:
        """Registered (again): the events waiting are superseded by the re-sync that follows; how many."""
        self._drain()
        return self.batcher.drop()

    def seqs_for_beat(self) -> dict[str, int] | None:
        """The last batch numbers sent before the previous beat (they have surely arrived if they
        are coming at all), for this beat; None when none was."""
        sent_before, self._sent_at_last_beat = self._sent_at_last_beat, self.batcher.sent_seqs()
        return sent_before or None

    def resync(self, location: str) -> None:
        """Send ``location``'s full key set behind a cut of the batch stream (once at a time)."""
        if location in self._resyncing:
            return
        self._resyncing.add(location)
        task = asyncio.ensure_future(self._resync(location))
        task.add_done_callback(lambda _: self._resyncing.discard(location))

    # -- events ----------------------------------------------------------------------------------

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
        if not self.registered():
            self.stats["events_dropped"] += self.batcher.drop()
            return
        self._reopen_refused_push()
        for location in self._unsent - self._resyncing:
            # A batch of it was refused (the pull socket had no connection): the re-sync, over
            # the request socket, tells the controller what that batch would have.
            self._unsent.discard(location)
            self.resync(location)
        for batch in self.batcher.cut(self.me.instance_id, self.me.rank):
            if self.send(batch):
                self.stats["batches_sent"] += 1
                self._reopen_after_s = REOPEN_AFTER_S
            else:
                self.stats["events_dropped"] += 1
                self._unsent.add(batch.location)

    async def _resync(self, location: str) -> None:
        me = self.me
        self._drain()  # what the store did before the snapshot goes before its cut
        for batch in self.batcher.cut(me.instance_id, me.rank, only=location):
            self.send(batch)
        snapshot_seq = self.batcher.last_seq(location)
        try:
            keys = self.store.held_hashes(location)
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
