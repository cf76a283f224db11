"""Command orchestration: move, copy, clear, pin, health and status across an instance's ranks.

Each command becomes an event in the :class:`EventLog`, is checked against the registry before
anything is sent, goes to every rank at once (:meth:`Orchestrator._fan_out`), and finishes when
every rank has reported: at once for most commands, through a ``CommandDone`` on the pull
socket for move and copy, or as failed when a rank refuses, does not answer, or leaves.
Problems are raised as the typed errors of ``errors.py``; api.py gives them their status codes.

Admission is decided here too, because it is about reaching the worker: :meth:`Orchestrator.admit`
refuses a Register whose fields are out of bounds (admission.py), whose host does not resolve, that
would not fit in the command bus's capacity, or whose command port was found unreachable a moment
ago. A registered worker's command port is then probed once (a ZMQ handshake, within the command
timeout); one that does not answer is removed like a silent worker ("command port unreachable")
and its address refused for ``worker_timeout``, so a worker that advertises an address the
controller cannot reach is never left listed with no way to command it, and does not flap in and
out at every heartbeat either. A probe whose sockets would not fit in the descriptors left
(commands.py, ``NoDescriptors``) waits and tries again for up to :data:`PROBE_WAIT_MAX_S`, then
is skipped, counted and logged: the rank stays, and its first command says whether it is reachable.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from lmcache_p2p.controller.admission import HostCheck, RegisterRefused, Resolver, shown, validate_register
from lmcache_p2p.controller.commands import CAPACITY_LOG_EVERY_S, CommandBus, NoDescriptors
from lmcache_p2p.controller.errors import CommandRefused, Conflict, InvalidRequest
from lmcache_p2p.controller.events import CommandEvent, EventLog
from lmcache_p2p.controller.identity import PLAIN, RequestIdentity, instance_identity
from lmcache_p2p.controller.metrics import Metrics
from lmcache_p2p.controller.registry import Registry, WorkerKey, WorkerRecord
from lmcache_p2p.controller.settings import ControllerSettings
from lmcache_p2p.keys import chunk_hash_array
from lmcache_p2p.logs import RateLimitedLog
from lmcache_p2p.protocol import (
    ClearCommand,
    Command,
    CommandDone,
    CommandReply,
    HealthCommand,
    MoveCommand,
    PeerAddress,
    PinCommand,
    Register,
    StatusCommand,
    pack_hashes,
)
from lmcache_p2p.vocab import CPU

logger = logging.getLogger("lmcache_p2p.controller")

# Pins are handles on CPU pages. A disk file has no pin: "pinning" one would pin a promoted CPU
# copy (evicting other chunks for it) while the file itself stays evictable, so it is refused.
PINNABLE_LOCATION = CPU

# Addresses whose command port did not accept a connection, remembered this long at most.
UNREACHABLE_KEPT = 4096
# A probe put off for want of descriptors tries again after PROBE_RETRY_S, doubling to 5 s, and
# is skipped once it has waited PROBE_WAIT_MAX_S (a controller held at its limit that long).
PROBE_RETRY_S = 0.25
PROBE_WAIT_MAX_S = 60.0


class Orchestrator:
    def __init__(
        self,
        settings: ControllerSettings,
        registry: Registry,
        events: EventLog,
        bus: CommandBus,
        metrics: Metrics,
        resolver: Resolver | None = None,
    ):
        self.settings = settings
        self.registry = registry
        self.events = events
        self.bus = bus
        self.metrics = metrics
        metrics.counter("lmcache_controller_commands_sent_total", "Commands sent to worker ranks, by kind")
        metrics.counter("lmcache_controller_commands_total", "Finished commands, by kind and outcome")
        metrics.gauge(
            "lmcache_controller_commands_in_flight", "Commands still pending", lambda: [({}, events.in_flight())]
        )
        metrics.counter(
            "lmcache_controller_registrations_refused_total", "Register messages refused, by the field at fault"
        )
        metrics.counter(
            "lmcache_controller_workers_unreachable_total", "Workers removed: their command port could not be reached"
        )
        capacity = bus.capacity
        capacity.registered = registry.workers.__len__
        metrics.read_counter(
            "lmcache_controller_connections_refused_total",
            "Connections to the monitor sockets refused on arrival: the controller at its descriptor limit, by socket",
            lambda: [({"socket": name}, float(n)) for name, n in capacity.connections_refused.copy().items()],
        )
        metrics.read_counter(
            "lmcache_controller_probes_deferred_total",
            "Reachability probes put off for want of descriptors",
            lambda: [({}, float(capacity.probes_deferred))],
        )
        metrics.counter(
            "lmcache_controller_completions_unknown_total",
            "CommandDone for an event this controller did not issue or no longer keeps (with several controllers, "
            "every worker reports each completion to all of them)",
        )
        self.hosts = HostCheck(resolver)  # None: the system resolver, on threads of its own
        # (host, worker_port) -> (when its probe failed, why): registrations from it are refused meanwhile.
        self._unreachable: OrderedDict[tuple[str, int], tuple[float, str]] = OrderedDict()
        self._probes: set[asyncio.Task] = set()
        # A hostile or broken sender may register thousands of times a second: one line per field per 10 s;
        # a fleet past capacity, one line a minute (it goes on until someone raises the limit).
        self._refusals = RateLimitedLog(logger, every_s=10.0)
        self._capacity_refusals = RateLimitedLog(logger, every_s=CAPACITY_LOG_EVERY_S)
        self._task_failures = RateLimitedLog(logger, every_s=CAPACITY_LOG_EVERY_S)

    def close(self) -> None:
        for task in self._probes:
            task.cancel()
        self.hosts.close()
        self.bus.close()

    # -- workers coming and going ------------------------------------------------------------------

    async def admit(self, msg: Register) -> None:
        """Raise :class:`RegisterRefused` (naming the field and value) unless ``msg`` may register:
        its fields in bounds, its host resolving, room for it, its command port not found
        unreachable within ``worker_timeout``. Counted and logged (rate-limited) when refused."""
        try:
            validate_register(msg)
            if (msg.instance_id, msg.rank) not in self.registry.workers:  # a re-registration takes nothing new
                self.bus.check_room(len(self.registry.workers))
            self._check_not_unreachable(msg.host, msg.worker_port)
            await self.hosts.check(msg.host)
        except RegisterRefused as e:
            self.metrics.inc("lmcache_controller_registrations_refused_total", field=e.field or "capacity")
            log = self._refusals if e.field else self._capacity_refusals
            log.warning(
                e.field,
                "refused Register of %s rank %s from %s: %s",
                shown(msg.instance_id),
                shown(msg.rank),
                shown(msg.host),
                e.message,
            )
            raise

    def _check_not_unreachable(self, host: str, port: int) -> None:
        failed = self._unreachable.get((host, port))
        if failed is None:
            return
        ago = time.monotonic() - failed[0]
        hold = self.settings.worker_timeout
        if ago >= hold:
            del self._unreachable[(host, port)]
            return
        raise RegisterRefused(
            f"Register field host={shown(host)} refused: its command port {host}:{port} could not be reached "
            f"from the controller {ago:.1f} s ago ({failed[1]}); advertise an address the controller can reach "
            f"(p2p_host, lmcache_worker_ports, firewall); registering again is accepted in {hold - ago:.0f} s",
            "host",
            f"{host}:{port}",
        )

    def worker_registered(
        self, record: WorkerRecord, on_unreachable: Callable[[WorkerKey, str], None] | None = None
    ) -> None:
        """Open ``record``'s command channel; with ``on_unreachable`` (and a running loop), probe its
        command port and call it (key, reason) if no handshake completes there."""
        self.bus.connect(record.key, record.info.host, record.info.worker_port)
        if on_unreachable is not None:
            task = asyncio.ensure_future(self._probe(record, on_unreachable))
            self._probes.add(task)
            task.add_done_callback(self._probe_done)

    def _probe_done(self, task: asyncio.Task) -> None:
        """Every probe's outcome is taken here: one that raised is logged (a line a minute, the
        rank named), never left for asyncio to report as an exception nobody retrieved."""
        self._probes.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        e = task.exception()
        self._task_failures.log(logging.ERROR, "probe", "a reachability probe failed: %s: %s", type(e).__name__, e)

    async def _probe(self, record: WorkerRecord, on_unreachable: Callable[[WorkerKey, str], None]) -> None:
        host, port = record.info.host, record.info.worker_port
        started, delay = time.monotonic(), PROBE_RETRY_S
        while True:
            if self.registry.workers.get(record.key) is not record:
                return  # this registration was replaced (or ended) meanwhile
            try:
                why = await self.bus.probe(host, port, self.settings.command_timeout)
                break
            except NoDescriptors as e:
                waited = time.monotonic() - started
                gave_up = waited + delay > PROBE_WAIT_MAX_S
                self.bus.capacity.note_probe_deferred(f"{record.key[0]} rank {record.key[1]}", str(e), waited, gave_up)
                if gave_up:
                    return
                await asyncio.sleep(delay)
                delay = min(5.0, 2 * delay)
        if why is None or self.registry.workers.get(record.key) is not record:
            return  # reachable, or this registration was replaced (or ended) meanwhile
        self._unreachable[(host, port)] = (time.monotonic(), why)
        self._unreachable.move_to_end((host, port))
        while len(self._unreachable) > UNREACHABLE_KEPT:
            self._unreachable.popitem(last=False)
        self.metrics.inc("lmcache_controller_workers_unreachable_total")
        on_unreachable(record.key, f"command port unreachable: {why}")

    def worker_gone(self, record: WorkerRecord, reason: str) -> None:
        """A worker left: its channel closes, and every pending command that waits on it fails."""
        self.bus.disconnect(record.key)
        instance_id, rank = record.key
        for event in self.events.pending():
            if event.instance_id == instance_id and rank in event.ranks:
                self._fail(event, f"{instance_id} rank {rank} {reason}")

    def command_done(self, msg: CommandDone) -> None:
        """A rank finished a command it had accepted as pending."""
        event = self.events.get(msg.event_id)
        if event is None:
            # Not an error: with several controllers a worker reports each completion to all of
            # them (it cannot tell which one issued the command), so the others' events arrive
            # here too. Counted, and kept for /check_finish's answer; a DEBUG line only.
            self.metrics.inc("lmcache_controller_completions_unknown_total")
            self.events.elsewhere.note(msg.event_id, msg.instance_id, msg.rank, msg.ok, msg.num_tokens, msg.error)
            logger.debug(
                "completion for event %s from %s rank %d: not one of ours (another controller's, or forgotten)",
                shown(msg.event_id),
                shown(msg.instance_id),
                msg.rank,
            )
            return
        self._rank_done(event, msg.rank, msg.ok, msg.num_tokens, msg.error)

    # -- commands ----------------------------------------------------------------------------------

    async def move(
        self,
        old_position: tuple[str, str],
        new_position: tuple[str, str],
        tokens: list[int] | None,
        copy: bool,
        ident: RequestIdentity = PLAIN,
    ) -> dict:
        """``tokens``' chunks (keyed with ``ident``: the salt, and the adapter as the source keys
        it) from one instance's location to another's; every chunk there without tokens."""
        (src_id, src_loc), (dst_id, dst_loc) = old_position, new_position
        sources = self.registry.instance_workers(src_id, "old_position")
        dests = {w.info.rank: w for w in self.registry.instance_workers(dst_id, "new_position")}
        _check_location(sources, src_loc, "old_position")
        _check_location(list(dests.values()), dst_loc, "new_position")
        if (src_id, src_loc) == (dst_id, dst_loc):
            raise InvalidRequest("old_position and new_position are the same place", "new_position")
        for src in sources:
            dst = dests.get(src.info.rank)
            if dst is None:
                raise Conflict(
                    f"{dst_id} has no rank {src.info.rank} to receive {src_id} rank {src.info.rank}'s chunks"
                )
            if src.info.layout.key_format != dst.info.layout.key_format:
                raise Conflict(
                    f"{src_id} and {dst_id} key chunks by different rules (key_format {src.info.layout.key_format} "
                    f"vs {dst.info.layout.key_format}: one runs an lmcache-p2p from before tenant-safe keys); "
                    "their chunks are not interchangeable"
                )
            if src.info.layout != dst.info.layout:
                raise Conflict(
                    f"{src_id} and {dst_id} store KV in different layouts "
                    f"({src.info.layout.model}/{src.info.layout.dtype}/tp{src.info.layout.tp_size} vs "
                    f"{dst.info.layout.model}/{dst.info.layout.dtype}/tp{dst.info.layout.tp_size}); "
                    "their chunks are not interchangeable"
                )
        per_rank = self._chunks_to_move(sources, src_loc, tokens, ident)
        chunk_size = sources[0].info.chunk_size
        num_tokens = min(len(h) for h in per_rank.values()) * chunk_size
        kind = "copy" if copy else "move"
        event = self.events.create(kind, src_id, set(per_rank), f"{src_id}/{src_loc} -> {dst_id}/{dst_loc}")
        if num_tokens == 0:
            for rank in per_rank:
                self._rank_done(event, rank, True, 0, None)
            return {"num_tokens": 0, "event_id": event.event_id}

        def command(src: WorkerRecord) -> MoveCommand:
            dst = dests[src.info.rank]
            return MoveCommand(
                event_id=event.event_id,
                location=src_loc,
                hashes=pack_hashes(per_rank[src.info.rank]),
                copy=copy,
                destination=PeerAddress(
                    instance_id=dst_id,
                    rank=dst.info.rank,
                    location=dst_loc,
                    host=dst.info.host,
                    p2p_init_port=dst.info.p2p_init_port,
                    p2p_lookup_port=dst.info.p2p_lookup_port,
                ),
            )

        await self._fan_out(event, sources, command)
        return {"num_tokens": num_tokens, "event_id": event.event_id}

    def _chunks_to_move(
        self, sources: list[WorkerRecord], location: str, tokens: list[int] | None, ident: RequestIdentity = PLAIN
    ) -> dict[int, np.ndarray]:
        holders = {w.info.rank: w.locations[location].holder for w in sources}  # location checked by the caller
        if tokens is None:  # everything the source holds there
            return {rank: self.registry.index.holder_keys(hid) for rank, hid in holders.items()}
        identity = instance_identity(self.registry, ident, sources[0].info.instance_id)
        hashes = chunk_hash_array(tokens, sources[0].info.chunk_size, identity=identity, mm=ident.mm)
        held = self.registry.index.prefix_holders(hashes) if len(hashes) else {}
        count = min(held.get(hid, 0) for hid in holders.values())  # a chunk moves when every rank has it
        return {rank: hashes[:count] for rank in holders}

    async def clear(self, instance_id: str, location: str) -> dict:
        workers = self.registry.instance_workers(instance_id, "instance_id")
        _check_location(workers, location, "location")
        event = self.events.create("clear", instance_id, {w.info.rank for w in workers}, location)
        await self._fan_out(event, workers, lambda w: ClearCommand(event_id=event.event_id, location=location))
        return {"event_id": event.event_id, "num_tokens": event.num_tokens}

    async def pin(
        self, instance_id: str, location: str, tokens: list[int], unpin: bool, ident: RequestIdentity = PLAIN
    ) -> dict:
        workers = self.registry.instance_workers(instance_id, "instance_id")
        kind = "unpin" if unpin else "pin"
        if location != PINNABLE_LOCATION:
            # Unpin too: nothing there was ever pinned, and a success would say otherwise.
            raise InvalidRequest(
                f"{kind}ning is supported on {PINNABLE_LOCATION} only, not {location!r} "
                "(a pin holds CPU pages; files on disk stay evictable)",
                "location",
            )
        _check_location(workers, location, "location")
        identity = instance_identity(self.registry, ident, instance_id)
        hashes = pack_hashes(chunk_hash_array(tokens, workers[0].info.chunk_size, identity=identity, mm=ident.mm))
        event = self.events.create(kind, instance_id, {w.info.rank for w in workers}, location)
        await self._fan_out(
            event, workers, lambda w: PinCommand(event_id=event.event_id, location=location, hashes=hashes, unpin=unpin)
        )
        return {"event_id": event.event_id, "num_tokens": event.num_tokens}

    async def health(self, instance_id: str) -> dict:
        workers = self.registry.instance_workers(instance_id, "instance_id")
        event = self.events.create("health", instance_id, {w.info.rank for w in workers})
        replies = await self._fan_out(
            event, workers, lambda w: HealthCommand(event_id=event.event_id), raise_on_refusal=False
        )
        return {
            "event_id": event.event_id,
            "error_codes": {str(rank): 0 if r.ok else 1 for rank, r in replies.items()},
            "errors": {str(rank): r.error for rank, r in replies.items() if not r.ok},
        }

    async def status(self, instance_id: str) -> dict:
        """Each rank's own account: tiers, controller link, peer traffic, pins."""
        workers = self.registry.instance_workers(instance_id, "instance_id")
        event = self.events.create("status", instance_id, {w.info.rank for w in workers})
        replies = await self._fan_out(
            event, workers, lambda w: StatusCommand(event_id=event.event_id), raise_on_refusal=False
        )
        return {"event_id": event.event_id, "workers": {str(rank): r.detail for rank, r in replies.items()}}

    async def _fan_out(
        self,
        event: CommandEvent,
        workers: list[WorkerRecord],
        make_command: Callable[[WorkerRecord], Command],
        raise_on_refusal: bool = True,
    ) -> dict[int, CommandReply]:
        """Send one command to every rank at once and return their answers by rank. A rank that does
        not answer in time fails the event (:class:`WorkerUnreachable`); with ``raise_on_refusal`` a
        rank's refusal does too (:class:`CommandRefused`, with the rank's error)."""
        self.metrics.inc("lmcache_controller_commands_sent_total", len(workers), kind=event.kind)
        results = await asyncio.gather(
            *(self.bus.request(w.key, make_command(w), self.settings.command_timeout) for w in workers),
            return_exceptions=True,
        )  # every rank's outcome, even when one of them has none
        replies: dict[int, CommandReply] = {}
        for w, result in zip(workers, results, strict=True):
            if isinstance(result, BaseException):
                self._fail(event, str(result))
                raise result
            replies[w.info.rank] = result
            if not result.pending:
                self._rank_done(event, w.info.rank, result.ok, result.num_tokens, result.error)
        # Only a refusal in a reply is raised: a command accepted and then failed (its CommandDone can
        # overtake the reply) is the event's outcome, read through /check_finish like any other.
        refused = [r for r in replies.values() if not r.pending and not r.ok]
        if raise_on_refusal and refused:
            raise CommandRefused(f"{event.kind} refused by {event.instance_id}: {event.error or refused[0].error}")
        return replies

    # An event finishes once, however many ways it can (a reply, a CommandDone, a rank leaving,
    # a timeout); its outcome is counted at that moment and never again.

    def _rank_done(self, event: CommandEvent, rank: int, ok: bool, num_tokens: int, error: str | None) -> None:
        if self.events.rank_done(event, rank, ok, num_tokens, error):
            self._count_outcome(event)

    def _fail(self, event: CommandEvent, error: str) -> None:
        if self.events.fail(event, error):
            self._count_outcome(event)

    def _count_outcome(self, event: CommandEvent) -> None:
        self.metrics.inc("lmcache_controller_commands_total", kind=event.kind, outcome=event.status)


def _check_location(workers: list[WorkerRecord], location: str, field: str) -> None:
    for w in workers:
        if location not in w.info.locations:
            raise InvalidRequest(
                f"{w.info.instance_id} rank {w.info.rank} has no location {location!r} (it has {w.info.locations})",
                field,
            )
