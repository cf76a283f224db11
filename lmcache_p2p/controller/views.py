"""What the controller knows, read out: ``/lookup``, ``/route`` (ranked by routing.py), worker and
instance queries, key statistics, ``/check_finish``, the event log, the dashboard, and the gauges
``/metrics`` reads at scrape time.

Nothing here changes the registry or sends anything; each read that hands out an event id
records it in the :class:`ReadLog`, so ``/check_finish`` knows it.

The two views that describe every worker (``workers_steps``, ``dashboard_steps``) are written as
steps, generators that pause after each worker and return the view: at 10,000 ranks one such
walk takes 65-190 ms, and the API takes the steps a slice of the event loop at a time so that
heartbeats get their turns in between. A walk works on a list of the workers taken
when it starts; one that leaves meanwhile is still described, as of when it left.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Generator
from typing import Any, TypeVar

import numpy as np

from lmcache_p2p.controller.errors import UnknownEvent, UnknownInstance
from lmcache_p2p.controller.events import EventLog, ReadLog
from lmcache_p2p.controller.explain import explain
from lmcache_p2p.controller.identity import PLAIN, RequestIdentity, Variant, resolve
from lmcache_p2p.controller.metrics import Metrics
from lmcache_p2p.controller.registry import Registry, WorkerRecord
from lmcache_p2p.controller.routing import Router
from lmcache_p2p.controller.settings import ControllerSettings
from lmcache_p2p.controller.traffic import FleetTraffic
from lmcache_p2p.keys import chunk_hash_array

STATUS_ORDER = {"live": 0, "late": 1, "dead": 2}

T = TypeVar("T")
# A view built in steps: yields (None) where the builder may pause, returns the view.
Steps = Generator[None, None, T]
# What each entry of a view's long list becomes as it is built: the dict itself, or (the API) its
# JSON at once, so that 10,000 dicts never outlive their step. Kept to the end of a walk they
# would reach the garbage collector's oldest generation, whose full passes (~100 ms at 10,000
# ranks, every few builds) hold the event loop and every heartbeat behind it.
Entry = Callable[[dict], Any]


def _same(described: dict) -> Any:
    return described


# Ranks walked per step of the keys-held count (/metrics' key holders): ~1 ms at a time.
KEYS_HELD_STEP = 500


def _run(steps: Steps[T]) -> T:
    """A walk in steps, run through at once (where nothing else is waiting for the loop)."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


class Views:
    def __init__(
        self,
        settings: ControllerSettings,
        epoch: str,
        started_at: float,
        registry: Registry,
        events: EventLog,
        traffic: FleetTraffic,
        departed: deque[dict],
        metrics: Metrics,
    ):
        self.settings = settings
        self.epoch = epoch
        self.started_at = started_at
        self.registry = registry
        self.events = events
        self.reads = ReadLog()
        self.traffic = traffic
        self.departed = departed  # the monitor's: workers that left, newest last
        self.metrics = metrics
        self.router = Router(registry, settings)
        self._register_metrics()

    # -- lookups -----------------------------------------------------------------------------------

    def lookup(self, tokens: list[int] | np.ndarray, model: str | None = None, ident: RequestIdentity = PLAIN) -> dict:
        """Every holder of a prefix of ``tokens`` with its matched tokens, and LMCache's per-instance
        ``layout_info`` ({instance: [location, tokens]}), counting a chunk for an instance only when
        all its TP ranks hold it. ``ident``: the request's salt, adapter and multimodal items
        (identity.py); the answer then says how they were resolved, under ``identity``."""
        self.metrics.inc("lmcache_controller_lookups_total")
        self.metrics.inc("lmcache_controller_lookup_tokens_total", len(tokens))
        resolved = None if ident.empty else resolve(self.registry, ident)
        extra = {"identity": resolved.describe()} if resolved is not None else {}
        workers = {k: w for k, w in self.registry.workers.items() if model is None or w.info.layout.model == model}
        if not len(tokens) or not workers:
            return {"event_id": self.reads.record("lookup"), "layout_info": {}, "holders": [], **extra}
        variants = resolved.variants if resolved is not None else [Variant(None)]
        found: dict[tuple[str, int, str], dict[str, Any]] = {}  # (instance, rank, location) -> holder
        by_instance: dict[tuple[str, str], dict[int, int]] = {}  # (instance, location) -> rank -> tokens
        tp_sizes: dict[str, int] = {}
        for chunk_size in sorted({w.info.chunk_size for w in workers.values()}):
            for variant in variants:
                hashes = chunk_hash_array(tokens, chunk_size, identity=variant.identity, mm=ident.mm)
                if not len(hashes):
                    continue
                for hid, matched in self.registry.index.prefix_holders(hashes).items():
                    instance_id, rank, location = self.registry.holders[hid]
                    worker = workers.get((instance_id, rank))
                    if worker is None or worker.info.chunk_size != chunk_size:
                        continue
                    known = found.get((instance_id, rank, location))
                    if known is not None and known["matched_tokens"] >= matched * chunk_size:
                        continue
                    found[(instance_id, rank, location)] = {
                        "instance_id": instance_id,
                        "worker_id": rank,
                        "location": location,
                        "matched_tokens": matched * chunk_size,
                        "model": worker.info.layout.model,
                    }
                    by_instance.setdefault((instance_id, location), {})[rank] = matched * chunk_size
                    tp_sizes[instance_id] = worker.info.layout.tp_size
        holders = list(found.values())
        layout_info: dict[str, list] = {}
        for (instance_id, location), by_rank in by_instance.items():
            matched_tokens = min(by_rank.get(r, 0) for r in range(tp_sizes[instance_id]))
            if matched_tokens > layout_info.get(instance_id, [None, 0])[1]:
                layout_info[instance_id] = [location, matched_tokens]
        best = max((v[1] for v in layout_info.values()), default=0)
        self.metrics.inc("lmcache_controller_lookup_hit_tokens_total", best)
        holders.sort(key=lambda h: (-h["matched_tokens"], h["instance_id"], h["worker_id"]))
        return {
            "event_id": self.reads.record("lookup", best),
            "layout_info": layout_info,
            "holders": holders,
            **extra,
        }

    def explain(
        self,
        tokens: list[int] | np.ndarray,
        instance_id: str | None,
        chunk_size: int | None,
        ident: RequestIdentity = PLAIN,
    ) -> dict:
        """Chunk by chunk, who holds ``tokens`` and why ``instance_id`` would miss the rest (explain.py)."""
        resolved = None if ident.empty else resolve(self.registry, ident)
        answer = explain(self.registry, tokens, instance_id, chunk_size, resolved)
        return {"event_id": self.reads.record("explain", answer["usable_tokens"] or 0), **answer}

    def route(
        self,
        tokens: list[int] | np.ndarray,
        model: str | None,
        candidates: list[str] | None,
        ident: RequestIdentity = PLAIN,
    ) -> dict:
        """Instances ranked by expected time to first token for ``tokens`` (routing.py)."""
        resolved = None if ident.empty else resolve(self.registry, ident)
        return self.router.route(tokens, model, candidates, resolved)

    def query_worker_info(self, instance_id: str, worker_ids: list[int] | None) -> dict:
        """The workers of one instance (``"all"``: of every instance), optionally only these ranks."""
        records = (
            list(self.registry.workers.values())
            if instance_id == "all"
            else self.registry.instance_workers(instance_id, "instance_id")
        )
        if worker_ids is not None:
            records = [r for r in records if r.info.rank in worker_ids]
        return {
            "event_id": self.reads.record("query_worker_info"),
            "worker_infos": [self.describe_worker(r) for r in records],
        }

    def query_instance(self, ip: str) -> dict:
        """The instance(s) whose workers registered from host ``ip``; ``res`` is the first, as LMCache answers."""
        found = sorted({r.info.instance_id for r in self.registry.workers.values() if r.info.host == ip})
        if not found:
            raise UnknownInstance(f"no instance registered from host {ip!r}", "ip")
        return {"event_id": self.reads.record("query_instance"), "res": found[0], "instances": found}

    def check_finish(self, event_id: str) -> dict:
        """Where a command stands, or that a read is done; any event id the API handed out, while kept."""
        event = self.events.get(event_id)
        if event is not None:
            return {
                "event_id": event.event_id,
                "status": event.status,
                "num_tokens": event.num_tokens,
                "error": event.error,
            }
        read = self.reads.get(event_id)
        if read is not None:
            return {"event_id": read.event_id, "status": "done", "num_tokens": read.num_tokens, "error": None}
        reports = self.events.elsewhere.get(event_id)
        if reports is not None:
            # With several controllers each knows only the commands it issued; its ranks still
            # told this one how it ended (the issuing controller may be gone with its record).
            raise UnknownEvent(
                f"event_id {event_id!r} was not issued by this controller (a command's status is kept by the "
                f"controller that issued it); its ranks reported: {'; '.join(reports)}",
                "event_id",
            )
        raise UnknownEvent(
            f"unknown event_id {event_id!r}: not issued by this controller since it started, or older than "
            f"the last {self.events.capacity} commands and {self.reads.capacity} reads it keeps",
            "event_id",
        )

    # -- workers and keys --------------------------------------------------------------------------

    def worker_status(self, record: WorkerRecord) -> tuple[str, float]:
        age = time.monotonic() - record.last_seen
        live_within = self.status_thresholds()["live_within_s"]
        return ("live" if age <= live_within else "late" if age <= self.settings.worker_timeout else "dead"), age

    def describe_worker(self, record: WorkerRecord) -> dict:
        info = record.info
        status, age = self.worker_status(record)
        return {
            "instance_id": info.instance_id,
            "worker_id": info.rank,
            "host": info.host,
            "worker_port": info.worker_port,
            "p2p_init_port": info.p2p_init_port,
            "p2p_lookup_port": info.p2p_lookup_port,
            "transfer_channel": info.transfer_channel,  # as configured
            # What it runs: tcp where the configured channel could not start (the error says why
            # and how to fix it). A worker that does not report it runs what it was configured.
            "effective_channel": info.effective_channel or info.transfer_channel,
            "channel_error": info.channel_error,
            "max_warm_peers": info.max_warm_peers or 0,
            "model": info.layout.model,
            "dtype": info.layout.dtype,
            "tp_size": info.layout.tp_size,
            "block_size": info.layout.block_size,
            "num_layers": info.layout.num_layers,
            "chunk_size": info.chunk_size,
            "fingerprint": f"{info.layout.digest:016x}",
            "status": status,
            "last_heartbeat_ago_s": round(age, 3),
            "registered_at": record.registered_at,
            "keys": {loc: self.registry.index.holder_count(st.holder) for loc, st in record.locations.items()},
            # Where a router forwards requests for this instance (None: the worker does not say),
            # and the engine's load as of its last heartbeat (None: not reported).
            "serve_url": info.serve_url,
            "load": self._describe_load(record),
            # instances serving the same model whose KV this one can never use, and why
            "cannot_share_with": dict(self.registry.cannot_share.get(info.instance_id, {})),
        }

    @staticmethod
    def _describe_load(record: WorkerRecord) -> dict | None:
        load = record.load
        if load is None:
            return None
        return {
            "running": load.running,
            "waiting": load.waiting,
            "kv_usage": load.kv_usage,
            "prefill_tokens_per_s": load.prefill_tokens_per_s,
            "pull_bytes_per_s": load.pull_bytes_per_s,
            "pull_fixed_ms": load.pull_fixed_ms,
            "age_s": round(time.monotonic() - record.load_at, 3),
        }

    def status_thresholds(self) -> dict:
        return {"live_within_s": 2 * self.settings.heartbeat_interval, "reaped_after_s": self.settings.worker_timeout}

    def workers_steps(self, entry: Entry = _same) -> Steps[dict]:
        """Every worker, described (``entry``: what each description becomes in the list)."""
        described = []
        for record in list(self.registry.workers.values()):
            described.append(entry(self.describe_worker(record)))
            yield
        return {"workers": described, "thresholds": self.status_thresholds()}

    def key_stats(self) -> dict:
        instances = _run(self.keys_held_steps())
        return {
            "total_keys": self.registry.index.live_keys,
            "instances": instances,
            "index_capacity": self.registry.index.capacity,
            "index_bytes": self.registry.index.nbytes,
        }

    def keys_held_steps(self) -> Steps[dict[str, dict[str, int]]]:
        """Keys held per instance and location, walked :data:`KEYS_HELD_STEP` ranks at a time (a
        yield between: 13-23 ms in one go at 10,000 ranks), over the ranks registered when it began."""
        instances: dict[str, dict[str, int]] = {}
        records = list(self.registry.workers.values())
        index = self.registry.index
        for start in range(0, len(records), KEYS_HELD_STEP):
            for record in records[start : start + KEYS_HELD_STEP]:
                per = instances.setdefault(record.info.instance_id, {})
                for loc, st in record.locations.items():
                    per[loc] = per.get(loc, 0) + index.holder_count(st.holder)
            yield
        return instances

    def _key_holder_series(self) -> Steps[list[tuple[dict[str, str], float]]]:
        instances = yield from self.keys_held_steps()
        return [({"instance_id": i, "location": loc}, n) for i, per in instances.items() for loc, n in per.items()]

    # -- events and the dashboard ------------------------------------------------------------------

    def uptime_s(self) -> float:
        return time.time() - self.started_at

    def recent_events(self, limit: int) -> list[dict]:
        """Command events, newest first."""
        return [e.to_json() for e in self.events.newest(limit)]

    def dashboard_steps(self, events_limit: int = 50, entry: Entry = _same) -> Steps[dict]:
        """Everything the WebUI shows, in one answer (it polls this every 2 s); ``entry``: what each
        instance's part becomes in the list."""
        instances = []
        by_status = {s: 0 for s in STATUS_ORDER}
        keys_by_location: dict[str, int] = {}
        for instance_id, records in sorted(self.registry.instances().items()):
            workers = []
            keys: dict[str, int] = {}  # the instance's keys per location: its ranks' summed
            for record in records:
                workers.append(self.describe_worker(record))
                by_status[workers[-1]["status"]] += 1
                for loc, n in workers[-1]["keys"].items():
                    keys[loc] = keys.get(loc, 0) + n
                    keys_by_location[loc] = keys_by_location.get(loc, 0) + n
                yield
            first = workers[0]
            instances.append(
                entry(
                    {
                        "instance_id": instance_id,
                        "workers": workers,
                        "keys": keys,
                        "status": max((w["status"] for w in workers), key=STATUS_ORDER.__getitem__),
                        "hosts": sorted({w["host"] for w in workers}),
                        "locations": [
                            loc for loc in records[0].info.locations if all(loc in r.info.locations for r in records)
                        ],
                        "last_heartbeat_ago_s": max(w["last_heartbeat_ago_s"] for w in workers),
                        **{k: first[k] for k in ("model", "dtype", "tp_size", "chunk_size", "fingerprint")},
                        # instances serving the same model whose KV this one can never use, and why
                        "cannot_share_with": dict(self.registry.cannot_share.get(instance_id, {})),
                    }
                )
            )
        registered = set(self.registry.workers)
        return {
            "controller": {
                "epoch": self.epoch,
                "started_at": self.started_at,
                "uptime_s": self.uptime_s(),
                "heartbeat_interval_s": self.settings.heartbeat_interval,
                "sample_every_s": self.traffic.sample_every_s,
                "rate_window_s": self.traffic.rate_window * self.traffic.sample_every_s,
            },
            "thresholds": self.status_thresholds(),
            "overview": {
                "instances": len(instances),
                "workers": len(self.registry.workers),
                "workers_by_status": by_status,
                "total_keys": self.registry.index.live_keys,
                "keys_by_location": keys_by_location,
                "commands_in_flight": self.events.in_flight(),
                "bad_frames": self.metrics.total("lmcache_controller_bad_frames_total"),
                "traffic_totals": dict(self.traffic.totals),
                **self.traffic.current(),
            },
            "series": self.traffic.series(),
            "instances": instances,
            "departed": [d for d in reversed(self.departed) if (d["instance_id"], d["worker_id"]) not in registered],
            "events": self.recent_events(events_limit),
        }

    # -- metrics read at scrape time ---------------------------------------------------------------

    def _register_metrics(self) -> None:
        m, reg = self.metrics, self.registry
        m.counter("lmcache_controller_lookups_total", "HTTP /lookup calls")
        m.counter("lmcache_controller_lookup_tokens_total", "Tokens asked about in /lookup")
        m.counter("lmcache_controller_lookup_hit_tokens_total", "Longest instance prefix found per /lookup, summed")
        m.gauge(
            "lmcache_controller_keys",
            "Distinct chunk keys with at least one holder",
            lambda: [({}, reg.index.live_keys)],
        )
        m.gauge("lmcache_controller_key_holders", "Keys held, by instance and location", self._key_holder_series)
        m.gauge("lmcache_controller_workers", "Registered workers", lambda: [({}, len(reg.workers))])
        # Counted from the keys alone: grouping every record by instance took 5 ms at 10,000 ranks.
        m.gauge(
            "lmcache_controller_instances", "Registered instances", lambda: [({}, len({k[0] for k in reg.workers}))]
        )
        m.gauge("lmcache_controller_index_bytes", "Memory of the chunk index tables", lambda: [({}, reg.index.nbytes)])
        m.gauge("lmcache_controller_uptime_seconds", "Seconds since start", lambda: [({}, self.uptime_s())])
        for stat in (
            "seq_gaps",
            "resyncs_requested",
            "resyncs_applied",
            "workers_reaped",
            "worker_restarts",
            "duplicate_registrations",
            "events_from_unknown",
            "keys_admitted",
            "keys_evicted",
        ):
            m.read_counter(
                f"lmcache_controller_{stat}_total", stat.replace("_", " "), functools.partial(_registry_stat, reg, stat)
            )
        # The fleet's traffic, summed from the workers' heartbeats (protocol.Traffic): what the
        # WebUI's overview charts, as counters for Prometheus (hit ratio: rate(hit) / rate(lookup)).
        for name, help_text in FLEET_COUNTERS.items():
            m.read_counter(
                f"lmcache_controller_fleet_{name}_total", help_text, functools.partial(_fleet_total, self.traffic, name)
            )


# Traffic field -> what its counter counts, summed over every rank that ever reported.
FLEET_COUNTERS = {
    "lookups": "Prefix lookups engines asked their ranks",
    "lookup_tokens": "Prompt tokens those lookups covered",
    "hit_tokens": "Tokens found for lookups: in a rank's own tiers or pulled from peers",
    "peer_hit_tokens": "Tokens pulled from peers for lookups (part of hit tokens)",
    "pulls": "Peer pulls that brought chunks",
    "pull_failures": "Peer pulls that failed",
    "pulled_bytes": "Bytes pulled from peers",
    "served_bytes": "Bytes sent to peers that pulled",
    "pulls_skipped": "Prefix pulls not made: recomputing was estimated faster",
    "skipped_tokens": "Tokens peers offered that were recomputed instead",
}


def _fleet_total(traffic: FleetTraffic, name: str) -> list[tuple[dict[str, str], float]]:
    return [({}, traffic.totals.get(name, 0))]


def _registry_stat(registry: Registry, stat: str) -> list[tuple[dict[str, str], float]]:
    return [({}, registry.stats[stat])]
