"""The controller: ZMQ monitor loops, liveness, lookups and command orchestration.

HTTP routes (api.py) call into :class:`Controller`; workers talk to it over the three monitor
sockets. Everything runs on one asyncio loop, so index updates and lookups never interleave
mid-operation. Each loop catches and counts whatever one bad message does, and goes on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import deque
from typing import Optional

import numpy as np
import zmq
import zmq.asyncio

from lmcache_p2p.controller.commands import CommandBus, WorkerUnreachable
from lmcache_p2p.controller.events import CommandEvent, EventLog
from lmcache_p2p.controller.metrics import Metrics
from lmcache_p2p.controller.registry import Registry, WorkerRecord
from lmcache_p2p.controller.settings import ControllerSettings, SettingsError
from lmcache_p2p.controller.traffic import FleetTraffic
from lmcache_p2p.keys import chunk_hash_array
from lmcache_p2p.protocol import (
    PROTOCOL_VERSION, Ack, ClearCommand, CommandDone, CommandReply, DecodeError, Deregister, HealthCommand,
    Heartbeat, HeartbeatReply, KeyEvents, MoveCommand, P2PLookup, P2PLookupReply, PeerAddress, PeerHolder,
    PinCommand, Register, StatusCommand, RegisterReply, ResyncBatch, encode, pack_hashes, unpack_hashes, worker_message_decoder,
)

logger = logging.getLogger("lmcache_p2p.controller")


class ApiError(Exception):
    """An HTTP error with a message that names what was wrong (api.py renders it)."""

    def __init__(self, status: int, message: str, field: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.field = status, message, field


class Controller:
    def __init__(self, settings: ControllerSettings):
        self.settings = settings
        # A new epoch on every start: a worker that heartbeats with another epoch re-registers.
        self.epoch = f"{int(time.time())}-{uuid.uuid4().hex[:8]}"
        self.started_at = time.time()
        self.registry = Registry()
        self.events = EventLog()
        self.ctx = zmq.asyncio.Context()
        self.bus = CommandBus(self.ctx)
        self._sockets: dict[str, zmq.asyncio.Socket] = {}
        self._tasks: list[asyncio.Task] = []
        self._lookup_ids = itertools.count(1)
        self.metrics = self._make_metrics()
        self.traffic = FleetTraffic(self.started_at)
        # Workers that left (reaped or deregistered), newest last, so the dashboard can show
        # an operator what went away and why instead of a row that silently vanished.
        self.departed: deque[dict] = deque(maxlen=100)

    # -- start and stop ----------------------------------------------------------------------------

    def bind(self) -> None:
        """Bind the monitor sockets; a port in use is a SettingsError naming it."""
        kinds = {"pull": zmq.PULL, "reply": zmq.ROUTER, "heartbeat": zmq.ROUTER}
        for name, kind in kinds.items():
            port = self.settings.monitor_ports[name]
            sock = self.ctx.socket(kind)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.bind(f"tcp://{self.settings.monitor_host}:{port}")
            except zmq.ZMQError as e:
                sock.close(linger=0)
                self.close()
                raise SettingsError(f"--monitor-ports: cannot bind {name} port {port} "
                                    f"on {self.settings.monitor_host}: {e.strerror}") from None
            self._sockets[name] = sock
        logger.info("monitor sockets bound: pull %d, reply %d, heartbeat %d (epoch %s)",
                    *(self.settings.monitor_ports[k] for k in ("pull", "reply", "heartbeat")), self.epoch)

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(c) for c in (
            self._pull_loop(), self._router_loop("reply", self._on_request),
            self._router_loop("heartbeat", self._on_heartbeat), self._reaper_loop(), self._sampler_loop())]

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.bus.close()
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()

    # -- monitor loops -----------------------------------------------------------------------------

    def _bad_frame(self, socket: str, why: str) -> None:
        self.metrics.inc("lmcache_controller_bad_frames_total", socket=socket)
        logger.warning("bad frame on %s socket: %s", socket, why)

    async def _pull_loop(self) -> None:
        sock = self._sockets["pull"]
        while True:
            frames = await sock.recv_multipart()
            try:
                msg = worker_message_decoder.decode(frames[-1])
            except DecodeError as e:
                self._bad_frame("pull", f"{e} ({len(frames[-1])} bytes)")
                continue
            self.metrics.inc("lmcache_controller_messages_total", type=type(msg).__name__)
            try:
                if isinstance(msg, KeyEvents):
                    self.registry.apply_events(msg)
                elif isinstance(msg, CommandDone):
                    self._on_command_done(msg)
                elif isinstance(msg, Deregister):
                    self._remove_worker((msg.instance_id, msg.rank), "deregistered")
                else:
                    self._bad_frame("pull", f"{type(msg).__name__} belongs on the reply socket")
            except Exception:
                self.metrics.inc("lmcache_controller_handler_errors_total", socket="pull")
                logger.exception("handling %s failed", type(msg).__name__)

    async def _router_loop(self, name: str, handle) -> None:
        sock = self._sockets[name]
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3:
                self._bad_frame(name, f"{len(frames)} frames, expected [identity, request id, payload]")
                continue
            identity, request_id, payload = frames
            try:
                msg = worker_message_decoder.decode(payload)
            except DecodeError as e:
                self._bad_frame(name, f"{e} ({len(payload)} bytes)")
                reply = Ack(ok=False, error=f"undecodable message: {e}")
            else:
                self.metrics.inc("lmcache_controller_messages_total", type=type(msg).__name__)
                try:
                    reply = handle(msg)
                except Exception as e:
                    self.metrics.inc("lmcache_controller_handler_errors_total", socket=name)
                    logger.exception("handling %s failed", type(msg).__name__)
                    reply = Ack(ok=False, error=f"controller error: {e}")
            await sock.send_multipart([identity, request_id, encode(reply)])

    def _on_request(self, msg):
        if isinstance(msg, Register):
            return self._on_register(msg)
        if isinstance(msg, ResyncBatch):
            error = self.registry.apply_resync(msg)
            return Ack(ok=error is None, error=error)
        if isinstance(msg, P2PLookup):
            return self._on_p2p_lookup(msg)
        return Ack(ok=False, error=f"{type(msg).__name__} is not a request for the reply socket")

    def _on_register(self, msg: Register) -> RegisterReply:
        if msg.version != PROTOCOL_VERSION:
            return RegisterReply(ok=False, error=f"protocol version {msg.version} not supported; "
                                                  f"this controller speaks {PROTOCOL_VERSION}", controller_epoch=self.epoch)
        record = self.registry.register(msg)
        self.bus.connect(record.key, msg.host, msg.worker_port)
        return RegisterReply(ok=True, controller_epoch=self.epoch, resync=list(record.locations),
                             heartbeat_interval=self.settings.heartbeat_interval,
                             heartbeat_port=self.settings.monitor_ports["heartbeat"])

    def _on_heartbeat(self, msg) -> HeartbeatReply:
        if not isinstance(msg, Heartbeat):
            return HeartbeatReply(status="unknown", controller_epoch=self.epoch)
        record = self.registry.touch((msg.instance_id, msg.rank))
        if record is None or msg.controller_epoch != self.epoch:
            return HeartbeatReply(status="unknown", controller_epoch=self.epoch)
        if msg.traffic is not None:
            self.traffic.report(record.key, msg.traffic)
        return HeartbeatReply(status="ok", controller_epoch=self.epoch, resync=record.wanted_resyncs())

    def _on_p2p_lookup(self, msg: P2PLookup) -> P2PLookupReply:
        asker = self.registry.workers.get((msg.instance_id, msg.rank))
        hashes = unpack_hashes(msg.hashes)
        if asker is None or not len(hashes):
            return P2PLookupReply(holders=[])
        self.registry.touch(asker.key)
        holders = []
        for hid, matched in self.registry.index.prefix_holders(hashes).items():
            instance_id, rank, location = self.registry.holders[hid]
            peer = self.registry.workers.get((instance_id, rank))
            # Only a peer whose pages have our exact layout (same model, dtype, block shape, TP
            # rank...) can serve us; never ourselves.
            if peer is None or instance_id == msg.instance_id or peer.info.layout != asker.info.layout:
                continue
            holders.append(PeerHolder(instance_id=instance_id, rank=rank, location=location, matched_chunks=matched,
                                      host=peer.info.host, p2p_init_port=peer.info.p2p_init_port,
                                      p2p_lookup_port=peer.info.p2p_lookup_port,
                                      transfer_channel=peer.info.transfer_channel))
        holders.sort(key=lambda h: -h.matched_chunks)
        self.metrics.inc("lmcache_controller_p2p_lookups_total")
        return P2PLookupReply(holders=holders)

    def _on_command_done(self, msg: CommandDone) -> None:
        event = self.events.get(msg.event_id)
        if event is None:
            logger.warning("completion for unknown event %s from %s rank %d", msg.event_id, msg.instance_id, msg.rank)
            return
        self.events.rank_done(event, msg.rank, msg.ok, msg.num_tokens, msg.error)
        if event.status != "pending":
            self._count_outcome(event)

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

    def _remove_worker(self, key: tuple[str, int], reason: str) -> None:
        record = self.registry.remove_worker(key, reason)
        if record is not None:
            self._forget_worker(record, reason)

    def _forget_worker(self, record: WorkerRecord, reason: str) -> None:
        self.bus.disconnect(record.key)
        instance_id, rank = record.key
        self.departed.append({"instance_id": instance_id, "worker_id": rank, "host": record.info.host,
                              "reason": reason, "at": time.time()})
        for event in self.events.pending():
            if event.instance_id == instance_id and rank in event.ranks:
                self.events.fail(event, f"{instance_id} rank {rank} {reason}")
                self._count_outcome(event)

    # -- lookups -----------------------------------------------------------------------------------

    def lookup(self, tokens: "list[int] | np.ndarray", model: Optional[str] = None) -> dict:
        """Every holder of a prefix of ``tokens`` with its matched tokens, and LMCache's per-instance
        ``layout_info`` ({instance: [location, tokens]}), counting a chunk for an instance only when
        all its TP ranks hold it."""
        self.metrics.inc("lmcache_controller_lookups_total")
        self.metrics.inc("lmcache_controller_lookup_tokens_total", len(tokens))
        event_id = f"lookup-{next(self._lookup_ids)}"
        workers = {k: w for k, w in self.registry.workers.items() if model is None or w.info.layout.model == model}
        if not len(tokens) or not workers:
            return {"event_id": event_id, "layout_info": {}, "holders": []}
        holders = []
        by_instance: dict[tuple[str, str], dict[int, int]] = {}  # (instance, location) -> rank -> tokens
        tp_sizes: dict[str, int] = {}
        for chunk_size in sorted({w.info.chunk_size for w in workers.values()}):
            hashes = chunk_hash_array(tokens, chunk_size)
            if not len(hashes):
                continue
            for hid, matched in self.registry.index.prefix_holders(hashes).items():
                instance_id, rank, location = self.registry.holders[hid]
                worker = workers.get((instance_id, rank))
                if worker is None or worker.info.chunk_size != chunk_size:
                    continue
                holders.append({"instance_id": instance_id, "worker_id": rank, "location": location,
                                "matched_tokens": matched * chunk_size, "model": worker.info.layout.model})
                by_instance.setdefault((instance_id, location), {})[rank] = matched * chunk_size
                tp_sizes[instance_id] = worker.info.layout.tp_size
        layout_info: dict[str, list] = {}
        for (instance_id, location), by_rank in by_instance.items():
            matched_tokens = min(by_rank.get(r, 0) for r in range(tp_sizes[instance_id]))
            if matched_tokens > layout_info.get(instance_id, [None, 0])[1]:
                layout_info[instance_id] = [location, matched_tokens]
        best = max((v[1] for v in layout_info.values()), default=0)
        self.metrics.inc("lmcache_controller_lookup_hit_tokens_total", best)
        holders.sort(key=lambda h: (-h["matched_tokens"], h["instance_id"], h["worker_id"]))
        return {"event_id": event_id, "layout_info": layout_info, "holders": holders}

    # -- commands ----------------------------------------------------------------------------------

    def instance_workers(self, instance_id: str, field: str) -> list[WorkerRecord]:
        workers = self.registry.instances().get(instance_id)
        if not workers:
            known = sorted(self.registry.instances())
            raise ApiError(404, f"unknown instance {instance_id!r} (registered: {known or 'none'})", field)
        return workers

    @staticmethod
    def _check_location(workers: list[WorkerRecord], location: str, field: str) -> None:
        for w in workers:
            if location not in w.info.locations:
                raise ApiError(422, f"{w.info.instance_id} rank {w.info.rank} has no location {location!r} "
                                    f"(it has {w.info.locations})", field)

    async def move(self, old_position: tuple[str, str], new_position: tuple[str, str],
                   tokens: Optional[list[int]], copy: bool) -> dict:
        (src_id, src_loc), (dst_id, dst_loc) = old_position, new_position
        sources = self.instance_workers(src_id, "old_position")
        dests = {w.info.rank: w for w in self.instance_workers(dst_id, "new_position")}
        self._check_location(sources, src_loc, "old_position")
        self._check_location(list(dests.values()), dst_loc, "new_position")
        if (src_id, src_loc) == (dst_id, dst_loc):
            raise ApiError(422, "old_position and new_position are the same place", "new_position")
        for src in sources:
            dst = dests.get(src.info.rank)
            if dst is None:
                raise ApiError(409, f"{dst_id} has no rank {src.info.rank} to receive {src_id} rank {src.info.rank}'s chunks")
            if src.info.layout != dst.info.layout:
                raise ApiError(409, f"{src_id} and {dst_id} store KV in different layouts "
                                    f"({src.info.layout.model}/{src.info.layout.dtype}/tp{src.info.layout.tp_size} vs "
                                    f"{dst.info.layout.model}/{dst.info.layout.dtype}/tp{dst.info.layout.tp_size}); "
                                    "their chunks are not interchangeable")
        per_rank = self._chunks_to_move(sources, src_loc, tokens)
        chunk_size = sources[0].info.chunk_size
        num_tokens = min(len(h) for h in per_rank.values()) * chunk_size
        kind = "copy" if copy else "move"
        event = self.events.create(kind, src_id, set(per_rank), f"{src_id}/{src_loc} -> {dst_id}/{dst_loc}")
        if num_tokens == 0:
            for rank in per_rank:
                self.events.rank_done(event, rank, True, 0, None)
            self._count_outcome(event)
            return {"num_tokens": 0, "event_id": event.event_id}

        def command(src: WorkerRecord) -> MoveCommand:
            dst = dests[src.info.rank]
            return MoveCommand(event_id=event.event_id, location=src_loc, hashes=pack_hashes(per_rank[src.info.rank]),
                               copy=copy, destination=PeerAddress(
                                   instance_id=dst_id, rank=dst.info.rank, location=dst_loc, host=dst.info.host,
                                   p2p_init_port=dst.info.p2p_init_port, p2p_lookup_port=dst.info.p2p_lookup_port))

        await self._fan_out(event, sources, command)
        return {"num_tokens": num_tokens, "event_id": event.event_id}

    def _chunks_to_move(self, sources: list[WorkerRecord], location: str, tokens: Optional[list[int]]) -> dict[int, np.ndarray]:
        holders = {w.info.rank: w.locations[location].holder for w in sources}  # location checked by the caller
        if tokens is None:  # everything the source holds there
            return {rank: self.registry.index.holder_keys(hid) for rank, hid in holders.items()}
        hashes = chunk_hash_array(tokens, sources[0].info.chunk_size)
        held = self.registry.index.prefix_holders(hashes) if len(hashes) else {}
        count = min(held.get(hid, 0) for hid in holders.values())  # a chunk moves when every rank has it
        return {rank: hashes[:count] for rank in holders}

    async def clear(self, instance_id: str, location: str) -> dict:
        workers = self.instance_workers(instance_id, "instance_id")
        self._check_location(workers, location, "location")
        event = self.events.create("clear", instance_id, {w.info.rank for w in workers}, location)
        await self._fan_out(event, workers, lambda w: ClearCommand(event_id=event.event_id, location=location))
        return {"event_id": event.event_id, "num_tokens": event.num_tokens}

    async def pin(self, instance_id: str, location: str, tokens: list[int], unpin: bool) -> dict:
        workers = self.instance_workers(instance_id, "instance_id")
        self._check_location(workers, location, "location")
        hashes = pack_hashes(chunk_hash_array(tokens, workers[0].info.chunk_size))
        event = self.events.create("unpin" if unpin else "pin", instance_id, {w.info.rank for w in workers}, location)
        await self._fan_out(event, workers, lambda w: PinCommand(event_id=event.event_id, location=location,
                                                                 hashes=hashes, unpin=unpin))
        return {"event_id": event.event_id, "num_tokens": event.num_tokens}

    async def health(self, instance_id: str) -> dict:
        workers = self.instance_workers(instance_id, "instance_id")
        event = self.events.create("health", instance_id, {w.info.rank for w in workers})
        replies = await self._fan_out(event, workers, lambda w: HealthCommand(event_id=event.event_id),
                                      raise_on_refusal=False)
        return {"event_id": event.event_id,
                "error_codes": {str(rank): 0 if r.ok else 1 for rank, r in replies.items()},
                "errors": {str(rank): r.error for rank, r in replies.items() if not r.ok}}

    async def status(self, instance_id: str) -> dict:
        """Each rank's own account: tiers, controller link, peer traffic, pins."""
        workers = self.instance_workers(instance_id, "instance_id")
        event = self.events.create("status", instance_id, {w.info.rank for w in workers})
        replies = await self._fan_out(event, workers, lambda w: StatusCommand(event_id=event.event_id),
                                      raise_on_refusal=False)
        return {"event_id": event.event_id, "workers": {str(rank): r.detail for rank, r in replies.items()}}

    async def _fan_out(self, event: CommandEvent, workers: list[WorkerRecord], make_command,
                       raise_on_refusal: bool = True) -> dict[int, CommandReply]:
        """Send one command to every rank at once; a rank that does not answer in time is a 504."""
        self.metrics.inc("lmcache_controller_commands_sent_total", len(workers), kind=event.kind)
        results = await asyncio.gather(
            *(self.bus.request(w.key, make_command(w), self.settings.command_timeout) for w in workers),
            return_exceptions=True)
        replies: dict[int, CommandReply] = {}
        for w, result in zip(workers, results):
            if isinstance(result, BaseException):
                message = str(result) if isinstance(result, WorkerUnreachable) else f"{type(result).__name__}: {result}"
                self.events.fail(event, message)
                self._count_outcome(event)
                raise ApiError(504, message)
            replies[w.info.rank] = result
            if not result.pending:
                self.events.rank_done(event, w.info.rank, result.ok, result.num_tokens, result.error)
        if event.status != "pending":
            self._count_outcome(event)
        if raise_on_refusal and event.status == "failed":
            raise ApiError(409, f"{event.kind} refused by {event.instance_id}: {event.error}")
        return replies

    def _count_outcome(self, event: CommandEvent) -> None:
        self.metrics.inc("lmcache_controller_commands_total", kind=event.kind, outcome=event.status)

    # -- views -------------------------------------------------------------------------------------

    def worker_status(self, record: WorkerRecord) -> tuple[str, float]:
        age = time.monotonic() - record.last_seen
        live_within = self.status_thresholds()["live_within_s"]
        return ("live" if age <= live_within else "late" if age <= self.settings.worker_timeout else "dead"), age

    def describe_worker(self, record: WorkerRecord) -> dict:
        info = record.info
        status, age = self.worker_status(record)
        return {"instance_id": info.instance_id, "worker_id": info.rank, "host": info.host,
                "worker_port": info.worker_port, "p2p_init_port": info.p2p_init_port,
                "p2p_lookup_port": info.p2p_lookup_port, "transfer_channel": info.transfer_channel,
                "model": info.layout.model, "dtype": info.layout.dtype, "tp_size": info.layout.tp_size,
                "block_size": info.layout.block_size, "num_layers": info.layout.num_layers,
                "chunk_size": info.chunk_size, "fingerprint": f"{info.layout.digest:016x}",
                "status": status, "last_heartbeat_ago_s": round(age, 3), "registered_at": record.registered_at,
                "keys": {loc: self.registry.index.holder_count(st.holder) for loc, st in record.locations.items()}}

    def status_thresholds(self) -> dict:
        return {"live_within_s": 2 * self.settings.heartbeat_interval,
                "reaped_after_s": self.settings.worker_timeout}

    def key_stats(self) -> dict:
        instances: dict[str, dict[str, int]] = {}
        for record in self.registry.workers.values():
            per = instances.setdefault(record.info.instance_id, {})
            for loc, st in record.locations.items():
                per[loc] = per.get(loc, 0) + self.registry.index.holder_count(st.holder)
        return {"total_keys": self.registry.index.live_keys, "instances": instances,
                "index_capacity": self.registry.index.capacity, "index_bytes": self.registry.index.nbytes}

    def dashboard(self, events_limit: int = 50) -> dict:
        """Everything the WebUI shows, in one answer (it polls this every 2 s)."""
        order = {"live": 0, "late": 1, "dead": 2}
        keys_held = self.key_stats()["instances"]
        instances = []
        for instance_id, records in sorted(self.registry.instances().items()):
            workers = [self.describe_worker(r) for r in records]
            first = workers[0]
            instances.append({
                "instance_id": instance_id, "workers": workers, "keys": keys_held.get(instance_id, {}),
                "status": max((w["status"] for w in workers), key=order.__getitem__),
                "hosts": sorted({w["host"] for w in workers}),
                "locations": [loc for loc in records[0].info.locations if all(loc in r.info.locations for r in records)],
                "last_heartbeat_ago_s": max(w["last_heartbeat_ago_s"] for w in workers),
                **{k: first[k] for k in ("model", "dtype", "tp_size", "chunk_size", "fingerprint")}})
        by_status = {s: 0 for s in order}
        for inst in instances:
            for w in inst["workers"]:
                by_status[w["status"]] += 1
        keys_by_location: dict[str, int] = {}
        for per_location in keys_held.values():
            for loc, n in per_location.items():
                keys_by_location[loc] = keys_by_location.get(loc, 0) + n
        registered = set(self.registry.workers)
        return {
            "controller": {"epoch": self.epoch, "started_at": self.started_at, "uptime_s": time.time() - self.started_at,
                           "heartbeat_interval_s": self.settings.heartbeat_interval,
                           "sample_every_s": self.traffic.sample_every_s,
                           "rate_window_s": self.traffic.rate_window * self.traffic.sample_every_s},
            "thresholds": self.status_thresholds(),
            "overview": {"instances": len(instances), "workers": len(self.registry.workers), "workers_by_status": by_status,
                         "total_keys": self.registry.index.live_keys, "keys_by_location": keys_by_location,
                         "commands_in_flight": self.events.in_flight(),
                         "bad_frames": self.metrics.total("lmcache_controller_bad_frames_total"),
                         "traffic_totals": dict(self.traffic.totals), **self.traffic.current()},
            "series": self.traffic.series(),
            "instances": instances,
            "departed": [d for d in reversed(self.departed) if (d["instance_id"], d["worker_id"]) not in registered],
            "events": [e.to_json() for e in self.events.newest(events_limit)],
        }

    # -- metrics -----------------------------------------------------------------------------------

    def _make_metrics(self) -> Metrics:
        m = Metrics()
        for name, text in [
            ("lmcache_controller_messages_total", "Worker messages decoded, by type"),
            ("lmcache_controller_bad_frames_total", "Frames that did not decode, by socket"),
            ("lmcache_controller_handler_errors_total", "Messages whose handling raised, by socket"),
            ("lmcache_controller_lookups_total", "HTTP /lookup calls"),
            ("lmcache_controller_lookup_tokens_total", "Tokens asked about in /lookup"),
            ("lmcache_controller_lookup_hit_tokens_total", "Longest instance prefix found per /lookup, summed"),
            ("lmcache_controller_p2p_lookups_total", "Peer lookups from workers"),
            ("lmcache_controller_commands_sent_total", "Commands sent to worker ranks, by kind"),
            ("lmcache_controller_commands_total", "Finished commands, by kind and outcome"),
        ]:
            m.counter(name, text)
        reg = self.registry
        m.gauge("lmcache_controller_keys", "Distinct chunk keys with at least one holder",
                lambda: [({}, reg.index.live_keys)])
        m.gauge("lmcache_controller_key_holders", "Keys held, by instance and location",
                lambda: [({"instance_id": i, "location": loc}, n) for i, per in self.key_stats()["instances"].items()
                         for loc, n in per.items()])
        m.gauge("lmcache_controller_workers", "Registered workers", lambda: [({}, len(reg.workers))])
        m.gauge("lmcache_controller_instances", "Registered instances", lambda: [({}, len(reg.instances()))])
        m.gauge("lmcache_controller_commands_in_flight", "Commands still pending", lambda: [({}, self.events.in_flight())])
        m.gauge("lmcache_controller_index_bytes", "Memory of the chunk index tables", lambda: [({}, reg.index.nbytes)])
        m.gauge("lmcache_controller_uptime_seconds", "Seconds since start", lambda: [({}, time.time() - self.started_at)])
        for stat in ("seq_gaps", "resyncs_requested", "resyncs_applied", "workers_reaped", "events_from_unknown",
                     "keys_admitted", "keys_evicted"):
            m.gauge(f"lmcache_controller_{stat}_total", stat.replace("_", " "), lambda s=stat: [({}, reg.stats[s])])
        return m
