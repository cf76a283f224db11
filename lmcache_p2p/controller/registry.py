"""Who is out there: instances, their workers (one per TP rank), and what each location holds.

The registry owns the :class:`ChunkIndex` and every rule about keeping it true:

* holder ids are stable per (instance, rank, location) for the controller's lifetime, so a
  worker that re-registers keeps its keys until its re-sync replaces them;
* each (worker, location) expects KeyEvents batches numbered 1, 2, 3...; a gap means a batch was
  lost, and the registry asks that worker for a full re-sync of that location;
* a re-sync is applied in one step, and events newer than its snapshot that arrived meanwhile on
  the other socket are re-applied on top, so nothing is lost or resurrected;
* nothing out of bounds gets in: :meth:`Registry.register` checks every field of the Register
  (admission.py) and raises :class:`RegisterRefused` naming the field and value;
* a worker silent for ``worker_timeout`` is reaped, and its keys leave lookups at once;
* each rank's latest engine load (``Heartbeat.load``: running and waiting requests, KV usage,
  measured prefill and pull rates) is kept on its record for POST /route, checked first
  (admission.py); an out-of-bounds one is dropped and logged, the heartbeat still counts;
* each P2P worker that asks for one gets a warm set: up to ``max_warm_peers`` live ranks of its
  layout, chosen by rendezvous hashing (each asker ranks the peers by a hash of the pair and takes
  the top ones), so N instances spread their connections instead of all picking the same peer,
  and a peer joining or leaving changes at most one pick per asker. Every membership change of a
  layout bumps its version; a heartbeat that echoes another version gets the new set.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import xxhash

from lmcache_p2p.controller.admission import (
    AdaptersRefused,
    LoadRefused,
    validate_adapters,
    validate_load,
    validate_register,
)
from lmcache_p2p.controller.compatibility import differences
from lmcache_p2p.controller.errors import UnknownInstance
from lmcache_p2p.controller.index import ChunkIndex
from lmcache_p2p.keys import LayoutFingerprint
from lmcache_p2p.logs import RateLimitedLog
from lmcache_p2p.protocol import EngineLoad, KeyEvents, MeshPeer, Register, ResyncBatch, unpack_hashes

logger = logging.getLogger(__name__)
# A rank that sends a bad load sends it every heartbeat: one line per field every 60 s.
_load_refusals = RateLimitedLog(logger, every_s=60.0)
_adapter_refusals = RateLimitedLog(logger, every_s=60.0)

WorkerKey = tuple[str, int]  # (instance_id, rank)
# A rank heard from within this long (two of the workers' default 5 s heartbeats) is live: another
# process registering its id from elsewhere is a second engine, not its restart.
LIVE_WITHIN_S = 10.0


@dataclass
class _Resync:
    """A full key set being received for one location, and the events to replay after it."""

    snapshot_seq: int = -1
    next_batch: int = 0
    staged: list[np.ndarray] = field(default_factory=list)
    # Bounded: a worker that never answers the re-sync request must not grow the controller.
    replay: deque = field(default_factory=lambda: deque(maxlen=65536))


@dataclass
class LocationState:
    holder: int
    next_seq: int = 1
    resync: _Resync | None = None  # set while a full key set is wanted or arriving


@dataclass
class WorkerRecord:
    info: Register
    registered_at: float  # wall clock, for display
    last_seen: float  # monotonic
    locations: dict[str, LocationState]
    # The engine's load as of this rank's last heartbeat (None: none reported, or refused), and
    # when it arrived (monotonic). A new registration starts without one.
    load: EngineLoad | None = None
    load_at: float = 0.0
    # The LoRA adapters its engine served: name -> lora_id (Register/Heartbeat.adapters).
    adapters: dict[str, str] = field(default_factory=dict)

    @property
    def key(self) -> WorkerKey:
        return (self.info.instance_id, self.info.rank)

    # Read on every /route for every rank: computed once (info never changes; a new Register
    # makes a new record).
    @functools.cached_property
    def bytes_per_token(self) -> int:
        return self.info.layout.bytes_per_token

    @functools.cached_property
    def peer_group(self) -> tuple[int, int]:
        """Ranks whose chunks this one can pull: the same layout digest and chunk size."""
        return (self.info.layout.digest, self.info.chunk_size)

    @property
    def serves_peers(self) -> bool:
        return bool(self.info.p2p_init_port and self.info.p2p_lookup_port)

    @property
    def wants_warm_set(self) -> bool:
        return self.serves_peers and bool(self.info.max_warm_peers)

    def wanted_resyncs(self) -> list[str]:
        return [loc for loc, st in self.locations.items() if st.resync is not None and st.resync.snapshot_seq < 0]


class Registry:
    def __init__(self) -> None:
        self.index = ChunkIndex()
        self.workers: dict[WorkerKey, WorkerRecord] = {}
        self._holder_ids: dict[tuple[str, int, str], int] = {}
        self.holders: list[tuple[str, int, str]] = []  # holder id -> (instance, rank, location)
        # Per layout (its digest): bumped whenever a P2P worker of it comes, comes back or goes,
        # so its warm sets are sent again. Starts at 1: a worker that never had a set echoes 0.
        self._mesh_versions: dict[int, int] = {}
        self.stats = {
            "seq_gaps": 0,
            "resyncs_requested": 0,
            "resyncs_applied": 0,
            "workers_reaped": 0,
            "events_from_unknown": 0,
            "keys_admitted": 0,
            "keys_evicted": 0,
            "worker_restarts": 0,  # a registration replaced a silent rank of its id, or one at its address
            "duplicate_registrations": 0,  # ... one still live at another address (two engines, one id)
        }
        # instance -> {another instance serving the same model: why they can never share KV}
        self.cannot_share: dict[str, dict[str, list[str]]] = {}
        self._mismatches_said: set[tuple[str, ...]] = set()  # pairs already warned about
        # instance -> its rank 0's Register: one layout per instance (ranks differ only in tp_rank),
        # so an arrival is compared once per instance, not once per rank against every rank
        self._first_ranks: dict[str, Register] = {}
        # adapter name -> worker -> the lora_id it reported: who keys an adapter's requests how
        self._adapters: dict[str, dict[WorkerKey, str]] = {}

    # -- membership ------------------------------------------------------------------------------

    def holder_id(self, instance_id: str, rank: int, location: str) -> int:
        ident = (instance_id, rank, location)
        hid = self._holder_ids.get(ident)
        if hid is None:
            hid = self._holder_ids[ident] = len(self.holders)
            self.holders.append(ident)
        return hid

    def register(self, msg: Register, live_within_s: float = LIVE_WITHIN_S) -> WorkerRecord:
        """Add or refresh a worker. Known keys stay; every location is asked for a full re-sync.
        :class:`RegisterRefused` (and the registry unchanged) when a field is out of bounds.
        A registration of a live (instance, rank) takes its place too (a restarted engine
        registers again under its id); one from another address while the old one was heard from
        within ``live_within_s`` is no restart, and is logged as a WARNING naming both."""
        validate_register(msg)
        old = self.workers.get((msg.instance_id, msg.rank))
        if old is not None:
            self._log_takeover(old, msg, live_within_s)
            self._set_adapters(old, {})
        locations = {}
        for loc in msg.locations:
            state = LocationState(self.holder_id(msg.instance_id, msg.rank, loc))
            state.resync = _Resync()
            locations[loc] = state
        if old is not None:
            for loc in set(old.locations) - set(msg.locations):  # a location it no longer has
                self.index.drop_holder(old.locations[loc].holder)
        record = WorkerRecord(msg, time.time(), time.monotonic(), locations)
        self.workers[record.key] = record
        self._set_adapters(record, msg.adapters or {})
        if msg.rank == 0:
            self._first_ranks[msg.instance_id] = msg
            self._check_compatibility(msg)
        if record.serves_peers or (old is not None and old.serves_peers):
            self._mesh_changed(msg.layout)
        self.stats["resyncs_requested"] += len(locations)
        logger.info(
            "worker %s rank %d registered from %s:%d (%s, tp=%d, chunk_size=%d)%s",
            msg.instance_id,
            msg.rank,
            msg.host,
            msg.worker_port,
            msg.layout.model,
            msg.layout.tp_size,
            msg.chunk_size,
            " again" if old else "",
        )
        return record

    def _check_compatibility(self, msg: Register) -> None:
        """Compare an arriving instance with the others serving its model: a pair that can never
        share is remembered both ways (the workers view shows it) and said once, in one WARNING."""
        for other_id, other in self._first_ranks.items():
            if other_id == msg.instance_id:
                continue
            found = differences(msg, other)
            pair = tuple(sorted((msg.instance_id, other_id)))
            if not found:
                self.cannot_share.get(msg.instance_id, {}).pop(other_id, None)
                self.cannot_share.get(other_id, {}).pop(msg.instance_id, None)
                continue
            self.cannot_share.setdefault(msg.instance_id, {})[other_id] = [str(d) for d in found]
            self.cannot_share.setdefault(other_id, {})[msg.instance_id] = [str(d.mirrored()) for d in found]
            if pair in self._mismatches_said:
                continue
            self._mismatches_said.add(pair)
            logger.warning(
                "instance %s cannot share KV with instance %s, which serves the same model: %s differ%s "
                "(%s). Neither will ever hit the other's chunks; start both with the same model argument, "
                "--dtype/--kv-cache-dtype, --tensor-parallel-size, --block-size and chunk_size if they should",
                msg.instance_id,
                other_id,
                ", ".join(d.field for d in found),
                "s" if len(found) == 1 else "",
                "; ".join(str(d) for d in found),
            )

    def _log_takeover(self, old: WorkerRecord, msg: Register, live_within_s: float) -> None:
        """Say why a registration replaces a known (instance, rank): the same process again, a
        restart (its address, or silence, says the old process is gone), or a second live engine
        under the same id."""
        was, now = f"{old.info.host}:{old.info.worker_port}", f"{msg.host}:{msg.worker_port}"
        quiet = time.monotonic() - old.last_seen
        if msg.session and msg.session == old.info.session:
            return  # the same process registering again: the INFO line says "again"
        if was == now or quiet > live_within_s:
            self.stats["worker_restarts"] += 1
            logger.info(
                "worker %s rank %d at %s replaces the one at %s: a restart (%s)",
                msg.instance_id,
                msg.rank,
                now,
                was,
                "the same address" if was == now else f"that one silent for {quiet:.1f} s, over {live_within_s:g} s",
            )
            return
        self.stats["duplicate_registrations"] += 1
        logger.warning(
            "worker %s rank %d registered from %s while the one registered from %s is live (heard from %.1f s ago, "
            "within %g s): two engines have lmcache_instance_id %r. The new one replaces it: commands go to %s "
            "only, lookups list the new one's keys once it re-syncs, and the old one's heartbeats and key events "
            "(which carry only the id) count as the new one's. Give each engine its own lmcache_instance_id "
            "(unset, it is {hostname}-{engine_id}), or stop the one at %s",
            msg.instance_id,
            msg.rank,
            now,
            was,
            quiet,
            live_within_s,
            msg.instance_id,
            now,
            was,
        )

    def remove_worker(self, key: WorkerKey, reason: str) -> WorkerRecord | None:
        record = self.workers.pop(key, None)
        if record is None:
            return None
        self._set_adapters(record, {})
        dropped = sum(self.index.drop_holder(st.holder) for st in record.locations.values())
        if record.serves_peers:
            self._mesh_changed(record.info.layout)
        if key[1] == 0:
            self._first_ranks.pop(key[0], None)
        # its instance's last rank gone: no pair left (the scan only for an instance in a pair)
        if key[0] in self.cannot_share and not any(k[0] == key[0] for k in self.workers):
            for other in self.cannot_share.pop(key[0], {}):
                self.cannot_share.get(other, {}).pop(key[0], None)
                self._mismatches_said.discard(tuple(sorted((key[0], other))))
        logger.warning(
            "worker %s rank %d removed (%s); %d keys dropped from the index", key[0], key[1], reason, dropped
        )
        return record

    def _location(self, record: WorkerRecord, location: str) -> LocationState:
        """A location's state; one the worker did not declare at registration is added on first use."""
        state = record.locations.get(location)
        if state is None:
            state = record.locations[location] = LocationState(self.holder_id(*record.key, location))
        return state

    def touch(self, key: WorkerKey) -> WorkerRecord | None:
        record = self.workers.get(key)
        if record is not None:
            record.last_seen = time.monotonic()
        return record

    def note_load(self, key: WorkerKey, load: EngineLoad | None) -> None:
        """Keep a heartbeat's engine load on its worker's record (None clears it: a sender that
        stopped reporting). One out of bounds is dropped, logged naming field and value, and
        never raised: the heartbeat it came with still counts."""
        record = self.workers.get(key)
        if record is None:
            return
        if load is not None:
            try:
                validate_load(load)
            except LoadRefused as e:
                _load_refusals.warning(e.field, "heartbeat from %s rank %d: %s; load dropped", *key, e.message)
                load = None
        record.load, record.load_at = load, time.monotonic()

    def note_adapters(self, key: WorkerKey, adapters: dict[str, str] | None) -> None:
        """A heartbeat's adapters map (None: unchanged). One out of bounds is dropped, logged, and
        the heartbeat still counts."""
        record = self.workers.get(key)
        if record is None or adapters is None:
            return
        try:
            validate_adapters(adapters, "Heartbeat")
        except AdaptersRefused as e:
            _adapter_refusals.warning(key, "heartbeat from %s rank %d: %s; adapters dropped", *key, e.message)
            return
        self._set_adapters(record, adapters)

    def _set_adapters(self, record: WorkerRecord, adapters: dict[str, str]) -> None:
        for name in record.adapters:
            reports = self._adapters.get(name)
            if reports is not None:
                reports.pop(record.key, None)
                if not reports:
                    del self._adapters[name]
        record.adapters = dict(adapters)
        for name, lora_id in record.adapters.items():
            self._adapters.setdefault(name, {})[record.key] = lora_id

    def adapter_reports(self, name: str) -> dict[str, str]:
        """instance -> the lora_id it reported for adapter ``name`` (rank 0's where ranks differ)."""
        out: dict[str, str] = {}
        for (instance_id, _rank), lora_id in sorted(self._adapters.get(name, {}).items(), key=lambda kv: -kv[0][1]):
            out[instance_id] = lora_id  # ranks in descending order: rank 0's is written last
        return out

    def adapter_of(self, instance_id: str, name: str) -> str | None:
        """The lora_id ``instance_id`` reported for adapter ``name``; None if it never did."""
        return self.adapter_reports(name).get(instance_id)

    def reap(self, timeout: float) -> list[WorkerRecord]:
        now = time.monotonic()
        dead = [k for k, w in self.workers.items() if now - w.last_seen > timeout]
        reaped = [r for r in (self.remove_worker(k, f"no message for {timeout:.1f}s") for k in dead) if r]
        self.stats["workers_reaped"] += len(reaped)
        return reaped

    def instances(self) -> dict[str, list[WorkerRecord]]:
        out: dict[str, list[WorkerRecord]] = {}
        for record in self.workers.values():
            out.setdefault(record.info.instance_id, []).append(record)
        for records in out.values():
            records.sort(key=lambda r: r.info.rank)
        return out

    def instance_workers(self, instance_id: str, field: str) -> list[WorkerRecord]:
        """One instance's workers by rank; :class:`UnknownInstance` (blaming ``field``) when none is registered."""
        instances = self.instances()
        workers = instances.get(instance_id)
        if not workers:
            # Only what was asked: one bad id must not hand a caller the fleet's instance ids.
            raise UnknownInstance(f"unknown instance {instance_id!r}", field)
        return workers

    # -- warm sets -------------------------------------------------------------------------------

    def _mesh_changed(self, layout: LayoutFingerprint) -> None:
        digest = layout.digest
        self._mesh_versions[digest] = self._mesh_versions.get(digest, 1) + 1

    def mesh_version(self, layout: LayoutFingerprint) -> int:
        return self._mesh_versions.get(layout.digest, 1)

    def warm_set(self, record: WorkerRecord) -> list[MeshPeer]:
        """The peers ``record`` should keep connected: up to its ``max_warm_peers`` live P2P ranks
        of its exact layout (other instances), by rendezvous hash of (asker, peer)."""
        me = record.info
        limit = me.max_warm_peers or 0
        if limit <= 0 or not record.serves_peers:
            return []
        asker = f"{me.instance_id}/{me.rank}>".encode()
        candidates = [
            peer
            for peer in self.workers.values()
            if peer.info.instance_id != me.instance_id and peer.serves_peers and peer.info.layout == me.layout
        ]
        candidates.sort(
            key=lambda p: xxhash.xxh3_64_intdigest(asker + f"{p.info.instance_id}/{p.info.rank}".encode()),
            reverse=True,
        )
        return [
            MeshPeer(
                instance_id=p.info.instance_id,
                rank=p.info.rank,
                host=p.info.host,
                p2p_init_port=p.info.p2p_init_port or 0,
                p2p_lookup_port=p.info.p2p_lookup_port or 0,
                channel=p.info.effective_channel or p.info.transfer_channel,
                session=p.info.session,
            )
            for p in candidates[:limit]
        ]

    # -- key events ------------------------------------------------------------------------------

    def apply_events(self, msg: KeyEvents) -> None:
        record = self.touch((msg.instance_id, msg.rank))
        if record is None:
            # The controller restarted or reaped this worker; its heartbeat will be told to
            # register again, and the re-sync brings these keys back.
            self.stats["events_from_unknown"] += 1
            return
        state = self._location(record, msg.location)
        if state.resync is not None:
            # A full key set is wanted or arriving: apply now to keep lookups fresh, and replay
            # on top of the snapshot if this batch is newer than it.
            state.resync.replay.append(msg)
            self._apply(state, msg)
            return
        if msg.seq < state.next_seq:
            return  # a duplicate, or older than the last re-sync snapshot
        if msg.seq > state.next_seq:
            self.stats["seq_gaps"] += 1
            logger.warning(
                "%s rank %d %s: batches %d..%d missing; asking for a full re-sync",
                msg.instance_id,
                msg.rank,
                msg.location,
                state.next_seq,
                msg.seq - 1,
            )
            self._want_resync(state).replay.append(msg)
        self._apply(state, msg)

    def check_sent(self, record: WorkerRecord, event_seqs: dict[str, int]) -> None:
        """A heartbeat's word on the batches its worker sent a heartbeat ago: a location that
        has not seen them lost them (a send dropped while the pull socket reconnected, say) and
        is asked for a re-sync, as a gap would be."""
        for location, sent in event_seqs.items():
            state = record.locations.get(location)
            if state is None or state.resync is not None or sent < state.next_seq:
                continue
            self.stats["seq_gaps"] += 1
            logger.warning(
                "%s rank %d %s: batches %d..%d were sent a heartbeat ago and never arrived; asking for a full re-sync",
                *record.key,
                location,
                state.next_seq,
                sent,
            )
            self._want_resync(state)

    def _apply(self, state: LocationState, msg: KeyEvents) -> None:
        admitted, evicted = unpack_hashes(msg.admitted), unpack_hashes(msg.evicted)
        self.index.add(state.holder, admitted)
        self.index.remove(state.holder, evicted)
        self.stats["keys_admitted"] += len(admitted)
        self.stats["keys_evicted"] += len(evicted)
        state.next_seq = msg.seq + 1

    def _want_resync(self, state: LocationState) -> _Resync:
        if state.resync is None or state.resync.snapshot_seq >= 0:
            state.resync = _Resync()
            self.stats["resyncs_requested"] += 1
        return state.resync

    def apply_resync(self, msg: ResyncBatch) -> str | None:
        """Take one batch of a full key set; returns an error string for a batch out of order."""
        record = self.touch((msg.instance_id, msg.rank))
        if record is None:
            return f"unknown worker {msg.instance_id} rank {msg.rank}: register first"
        state = self._location(record, msg.location)
        resync = state.resync
        if resync is None:
            resync = state.resync = _Resync()  # an unasked re-sync is still the truth
        if msg.batch == 0:
            resync.snapshot_seq, resync.next_batch, resync.staged = msg.snapshot_seq, 0, []
        if msg.batch != resync.next_batch or msg.snapshot_seq != resync.snapshot_seq:
            error = f"re-sync batch {msg.batch} of snapshot {msg.snapshot_seq} out of order; start again from batch 0"
            resync.snapshot_seq, resync.staged = -1, []
            return error
        resync.staged.append(unpack_hashes(msg.keys).copy())
        resync.next_batch += 1
        if msg.last:
            keys = np.concatenate(resync.staged) if resync.staged else np.zeros(0, np.uint64)
            self.index.replace_holder(state.holder, keys)
            state.resync = None
            state.next_seq = msg.snapshot_seq + 1
            for event in sorted(resync.replay, key=lambda e: e.seq):
                if event.seq >= state.next_seq:
                    self._apply(state, event)
            self.stats["resyncs_applied"] += 1
            logger.info(
                "%s rank %d %s: re-synced %d keys (snapshot seq %d, %d newer batches replayed)",
                msg.instance_id,
                msg.rank,
                msg.location,
                len(keys),
                msg.snapshot_seq,
                sum(1 for e in resync.replay if e.seq > msg.snapshot_seq),
            )
        return None
