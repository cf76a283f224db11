"""The controller's commands to one rank: move, copy, clear, pin, health, status.

The controller connects a DEALER to this rank's ROUTER (``lmcache_worker_ports[rank]``, an
:class:`~lmcache_p2p.rpc.RpcServer`) and sends ``[request_id, command]``; every command is
answered at once, in order of arrival. Move and copy answer "pending" and finish in the
background: this rank (the source) asks the destination rank to pull the chunks from it
(FetchChunks on the destination's p2p_lookup port), evicts what the destination now holds (move
only), and reports a CommandDone with the tokens that moved. Pins hold CPU pages; a disk file
cannot be held, so pinning on LocalDiskBackend is refused.

A command read after its deadline (``deadline_unix`` less the clock margin, protocol.py) is
refused unrun: the controller has already reported it as failed, and a /clear that wipes chunks
after a 504 (a worker stopped, then resumed) is worse than none.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from lmcache_p2p.logs import RateLimitedLog
from lmcache_p2p.protocol import (
    COMMAND_CLOCK_MARGIN_S,
    ClearCommand,
    CommandDone,
    CommandReply,
    FetchChunks,
    FetchReply,
    HealthCommand,
    MoveCommand,
    PeerAddress,
    PinCommand,
    StatusCommand,
    seconds_past_deadline,
    unpack_hashes,
)
from lmcache_p2p.rpc import Handler, RemoteError, RequestFailed, RpcServer
from lmcache_p2p.storage.chunk_store import ChunkStore
from lmcache_p2p.storage.cpu_tier import PinnedChunk
from lmcache_p2p.vocab import CPU
from lmcache_p2p.worker.identity import WorkerIdentity
from lmcache_p2p.worker.links import ControllerLinks
from lmcache_p2p.worker.p2p_client import P2PClient
from lmcache_p2p.worker.peer_links import Peer
from lmcache_p2p.worker.pull_batch import SLOWEST_RATE_BPS

logger = logging.getLogger(__name__)


class CommandServer:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        identity: WorkerIdentity,
        storage: ChunkStore,
        link: ControllerLinks,
        peers: P2PClient | None,
        status: Callable[[], dict],
    ):
        self.me = identity
        self.storage = storage
        self.link = link
        self.peers = peers  # None when enable_p2p is off: this rank can be no move/copy source
        self.status = status
        handlers: dict[type, Handler] = {
            MoveCommand: self._on_move,
            ClearCommand: self._on_clear,
            PinCommand: self._on_pin,
            HealthCommand: lambda c: CommandReply(event_id=c.event_id, ok=True, detail=self.storage.stats()),
            StatusCommand: lambda c: CommandReply(event_id=c.event_id, ok=True, detail=self.status()),
        }
        self.server = RpcServer(
            ctx,
            f"{identity.describe()} worker",
            {kind: self._unless_expired(handler) for kind, handler in handlers.items()},
            error_reply=lambda e: CommandReply(event_id="", ok=False, error=e),
        )
        self.expired = 0  # commands refused unrun because they came after their deadline
        # A stopped worker may find many commands waiting when it resumes: one line per kind per 10 s.
        self._expired_log = RateLimitedLog(logger, every_s=10.0)
        try:
            identity.bound("worker_port", self.server.bind(f"tcp://{identity.host}:{identity.worker_port}"))
        except zmq.ZMQError as e:
            raise OSError(
                f"{identity.describe()}: cannot bind lmcache_worker_ports port {identity.worker_port}: "
                f"{e.strerror} (give one free port per TP rank)"
            ) from None
        self._pins: dict[int, list[PinnedChunk]] = {}
        self._tasks: set[asyncio.Task] = set()

    def start(self) -> None:
        self.server.start()

    def close(self) -> None:
        self.server.close()
        for task in self._tasks:
            task.cancel()
        for pins in self._pins.values():
            for chunk in pins:
                chunk.release()
        self._pins.clear()

    # -- deadlines -------------------------------------------------------------------------------

    def _unless_expired(self, handler: Handler) -> Handler:
        def run(command: Any) -> Any:
            now = time.time()
            late = seconds_past_deadline(command, now)
            if late > 0:
                return self._refuse_expired(command, now, late)
            return handler(command)

        return run

    def _refuse_expired(self, command: Any, now: float, late: float) -> CommandReply:
        self.expired += 1
        kind = type(command).__name__
        self._expired_log.warning(
            kind,
            "%s: %s %s expired, not run: read %.3f s past its deadline (deadline_unix %.3f less the %.1f s "
            "clock margin; now %.3f here); the controller already reported it as failed. If fresh commands "
            "expire too, this host's clock is ahead of the controller's by about that much",
            self.me.describe(),
            kind,
            command.event_id,
            late,
            command.deadline_unix,
            COMMAND_CLOCK_MARGIN_S,
            now,
        )
        return CommandReply(
            event_id=command.event_id,
            ok=False,
            error=(
                f"expired: {self.me.describe()} read {kind} {late:.3f} s past its deadline "
                f"(less the {COMMAND_CLOCK_MARGIN_S:g} s clock margin) and did not run it"
            ),
        )

    def _check_location(self, event_id: str, location: str) -> CommandReply | None:
        if location not in self.storage.locations:
            return CommandReply(
                event_id=event_id,
                ok=False,
                error=f"{self.me.describe()} has no location {location!r} (it has {self.storage.locations})",
            )
        return None

    # -- move and copy ---------------------------------------------------------------------------

    def _on_move(self, command: MoveCommand) -> CommandReply:
        refused = self._check_location(command.event_id, command.location)
        if refused:
            return refused
        dest = command.destination
        if self.peers is None:
            return CommandReply(
                event_id=command.event_id,
                ok=False,
                error=f"{self.me.describe()} does not serve peers (enable_p2p is off)",
            )
        # A rank registers both p2p ports or neither (WorkerIdentity); _run_move needs both.
        if not dest.p2p_lookup_port or not dest.p2p_init_port:
            return CommandReply(
                event_id=command.event_id,
                ok=False,
                error=f"{dest.instance_id} rank {dest.rank} has no p2p_lookup port (enable_p2p is off there)",
            )
        task = asyncio.ensure_future(self._run_move(command))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return CommandReply(event_id=command.event_id, ok=True, pending=True)

    async def _run_move(self, command: MoveCommand) -> None:
        me, dest = self.me, command.destination
        kind = "copy" if command.copy else "move"
        hashes = unpack_hashes(command.hashes)
        ok, tokens = False, 0
        error: str | None = None
        assert self.peers is not None  # _on_move refuses a move without them
        init_port, lookup_port = dest.p2p_init_port, dest.p2p_lookup_port
        assert init_port and lookup_port  # _on_move refuses a destination without them
        # Serving a disk chunk promotes it into our CPU tier (a pin reads the pool): a move must
        # not leave behind a CPU copy that only its own pull made.
        in_cpu_before: set[int] = set()
        if not command.copy and command.location != CPU:
            in_cpu_before = {int(h) for h in hashes if self.storage.holds(int(h), CPU)}
        try:
            destination = self.peers.lookup_socket(Peer(dest.instance_id, dest.rank, dest.host, init_port, lookup_port))
            timeout = self.peers.setup.timeout_s + len(hashes) * self.storage.page_bytes / SLOWEST_RATE_BPS
            source = PeerAddress(
                instance_id=me.instance_id,
                rank=me.rank,
                location=command.location,
                host=me.host,
                p2p_init_port=me.p2p_init_port,
                p2p_lookup_port=me.p2p_lookup_port,
            )
            reply = await destination.request(
                FetchChunks(
                    event_id=command.event_id,
                    source=source,
                    location=dest.location,
                    hashes=command.hashes,
                    fingerprint=self.storage.fingerprint,
                ),
                FetchReply,
                timeout,
            )
            held = unpack_hashes(reply.held)
            if not command.copy:
                for h in held:
                    self._unpin(int(h))
                    self.storage.remove(int(h), command.location)
                    if command.location != CPU and int(h) not in in_cpu_before:
                        self.storage.remove(int(h), CPU)  # promoted by the pull (a no-op if not)
            tokens = len(held) * self.storage.chunk_size
            ok = len(held) > 0 or len(hashes) == 0
            error = None
            if not ok or len(held) < len(hashes):
                # The reason travels with a partial move too: /check_finish shows it beside the tokens.
                error = reply.error or f"the destination holds {len(held)} of the {len(hashes)} chunk(s) sent"
            logger.info(
                "%s: %s %s: %d of %d chunk(s) now at %s/%s%s",
                me.describe(),
                kind,
                command.event_id,
                len(held),
                len(hashes),
                dest.instance_id,
                dest.location,
                f" ({error})" if error else "",
            )
        except RequestFailed as e:
            error = f"destination {dest.instance_id} rank {dest.rank}: {e}"
        except RemoteError as e:  # the destination refused (no such location, another layout...)
            error = str(e)
        except Exception as e:
            logger.exception("%s: %s %s failed", me.describe(), kind, command.event_id)
            error = f"worker error: {e}"
        if error and not ok:
            logger.warning("%s: %s %s failed: %s", me.describe(), kind, command.event_id, error)
        # Sent to every controller; each EventStream.send puts the removals above (batched
        # events) ahead of the done: once a move is done, /lookup no longer lists its source.
        self.link.send(
            CommandDone(
                event_id=command.event_id,
                instance_id=me.instance_id,
                rank=me.rank,
                ok=ok,
                num_tokens=tokens,
                error=error,
            )
        )

    # -- clear and pin ---------------------------------------------------------------------------

    def _on_clear(self, command: ClearCommand) -> CommandReply:
        refused = self._check_location(command.event_id, command.location)
        if refused:
            return refused
        for chunk_hash in list(self._pins):
            if self.storage.holds(chunk_hash, command.location):
                self._unpin(chunk_hash)
        dropped = self.storage.clear(command.location)
        logger.info("%s: cleared %d chunk(s) from %s", self.me.describe(), dropped, command.location)
        return CommandReply(event_id=command.event_id, ok=True, num_tokens=dropped * self.storage.chunk_size)

    def _on_pin(self, command: PinCommand) -> CommandReply:
        refused = self._check_location(command.event_id, command.location)
        if refused:
            return refused
        if command.location != CPU:
            # A pin holds a CPU page against eviction; nothing holds a disk file, so a pin there
            # would report success for a chunk the disk may evict at any time.
            return CommandReply(
                event_id=command.event_id,
                ok=False,
                error=f"{self.me.describe()}: pinning is supported on {CPU} only, not {command.location}",
            )
        hashes = [int(h) for h in unpack_hashes(command.hashes)]
        count = 0
        for chunk_hash in hashes:  # a prompt's chunks: the run ends at the first one not held
            if command.unpin:
                if not self._unpin(chunk_hash):
                    break
            else:
                if not self.storage.holds(chunk_hash, command.location):
                    break
                chunk = self.storage.pin(chunk_hash)
                if chunk is None:
                    break
                self._pins.setdefault(chunk_hash, []).append(chunk)
            count += 1
        return CommandReply(event_id=command.event_id, ok=True, num_tokens=count * self.storage.chunk_size)

    def _unpin(self, chunk_hash: int) -> bool:
        pins = self._pins.pop(chunk_hash, None)
        for chunk in pins or ():
            chunk.release()
        return bool(pins)

    @property
    def pinned_chunks(self) -> int:
        return len(self._pins)
