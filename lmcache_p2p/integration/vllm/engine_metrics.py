"""The engine's lmcache-p2p metrics, in vLLM's own ``/metrics``, through vLLM's public hooks for
connector metrics.

vLLM asks each rank's connector for its stats after every step (``get_kv_connector_stats``),
sums them over the ranks (:meth:`ConnectorStats.aggregate`) and hands the sum to the metrics
object the connector class built in the API server's process (``build_prom_metrics``), which
records them in vLLM's Prometheus registry: the engine needs no port of its own, and the series
carry vLLM's labels (``model_name``, ``engine``). A rank reports the growth of its counters since
its last report (:class:`RankMetrics`) and its tiers' occupancy.

Names follow the original LMCache's where the quantity is the same (``lmcache:num_hit_tokens``,
``lmcache:local_cache_usage``, ...), so its dashboards carry over; the mesh's own are
``lmcache:p2p_*``. docs/vllm.md lists them all.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from lmcache_p2p.durations import taken_since

# (name, help, where a rank's status answer keeps the running total)
COUNTERS: list[tuple[str, str, Callable[[dict], float]]] = [
    (
        "lmcache:num_lookup_requests",
        "Prompts looked up (each once, when its hit is final)",
        lambda s: s["engine"]["lookups"],
    ),
    ("lmcache:num_lookup_tokens", "Tokens of the prompts looked up", lambda s: s["engine"]["lookup_tokens"]),
    (
        "lmcache:num_lookup_hits",
        "Of those, tokens found in the tiers or offered by a peer",
        lambda s: s["engine"]["hit_tokens"],
    ),
    ("lmcache:num_retrieve_requests", "Loads into vLLM's blocks", lambda s: s["engine"]["retrieves"]),
    (
        "lmcache:num_hit_tokens",
        "Tokens loaded into vLLM's blocks (not recomputed)",
        lambda s: s["engine"]["retrieved_tokens"],
    ),
    ("lmcache:num_stored_tokens", "Tokens stored from vLLM's blocks", lambda s: s["engine"]["stored_tokens"]),
    ("lmcache:p2p_pulls", "Pulls from peers", lambda s: _client(s, "pulls")),
    ("lmcache:p2p_chunks_pulled", "Chunks pulled from peers", lambda s: _client(s, "chunks_pulled")),
    ("lmcache:p2p_bytes_pulled", "Bytes pulled from peers", lambda s: _client(s, "bytes_pulled")),
    (
        "lmcache:p2p_pull_seconds",
        "Time pulls spent moving bytes (rate of bytes over this: GB/s)",
        lambda s: _client(s, "transfer_ms") / 1e3,
    ),
    (
        "lmcache:p2p_pull_failures",
        "Pulls that failed (a dead or stalled peer, a refused channel)",
        lambda s: _client(s, "pull_failures"),
    ),
    (
        "lmcache:p2p_checksum_mismatches",
        "Pulled chunks whose checksum differed (dropped, recomputed)",
        lambda s: _client(s, "checksum_mismatches"),
    ),
    (
        "lmcache:p2p_pulls_skipped",
        "Pull-or-recompute decisions that recomputed (the pull policy)",
        lambda s: _client(s, "pulls_skipped"),
    ),
    (
        "lmcache:p2p_chunks_skipped",
        "Chunks peers offered that were recomputed instead",
        lambda s: _client(s, "chunks_skipped"),
    ),
    ("lmcache:num_remote_read_bytes", "Bytes read from the remote store", lambda s: _remote(s, "bytes_read")),
    ("lmcache:num_remote_write_bytes", "Bytes written to the remote store", lambda s: _remote(s, "bytes_written")),
    (
        "lmcache:remote_errors",
        "Remote store operations that failed (an outage is a run of these)",
        lambda s: _remote(s, "errors"),
    ),
    (
        "lmcache:disk_writes_dropped",
        "Chunks the disk write-behind dropped (its queue full)",
        lambda s: float(s["storage"].get("disk_writes_dropped", 0)),
    ),
]

# Missed chunks by reason (miss_reasons.REASONS), one series per reason under the label
# ``reason``; a rank reports them as counters named MISSED|reason.
MISSED = "lmcache:num_missed_chunks"
MISSED_HELP = "Chunks of looked-up prompts not served, by reason (the first miss ends a prefix: later chunks share it)"

# Pulls, bytes and failed pulls per holder rank and channel: series with the labels ``peer``
# (instance and rank) and ``channel``; a rank reports them as counters named NAME|peer|channel.
PER_PEER: list[tuple[str, str, str]] = [
    ("lmcache:p2p_peer_pulls", "Pulls from each holder rank, per channel", "pulls"),
    ("lmcache:p2p_peer_bytes_pulled", "Bytes pulled from each holder rank, per channel", "bytes"),
    ("lmcache:p2p_peer_pull_failures", "Failed pulls from each holder rank, per channel", "failures"),
]

# (name, help, where a rank's status answer keeps its latest durations: durations.RecentDurations)
HISTOGRAMS: list[tuple[str, str, Callable[[dict], dict | None]]] = [
    (
        "lmcache:p2p_pull_duration_seconds",
        "A peer pull, start to end (connecting, the holder's reads, the wire, landing, checks)",
        lambda s: (s.get("p2p_client") or {}).get("pull_ms"),
    ),
    (
        "lmcache:load_duration_seconds",
        "A load of held chunks into vLLM's blocks (the copies; a load beside the steps: until done)",
        lambda s: s.get("engine", {}).get("load_ms"),
    ),
]
# From a loaded page (~0.3 ms) to a pull stuck behind a slow peer (seconds).
DURATION_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
MAX_OBSERVATIONS = 4096  # per histogram in one summed report (a rank keeps 512 at most)

# (name, help, the current value in a rank's status answer); summed over the ranks
GAUGES: list[tuple[str, str, Callable[[dict], float]]] = [
    ("lmcache:local_cache_usage", "Bytes held in the CPU pool", lambda s: _tier_bytes(s, "cpu")),
    (
        "lmcache:local_storage_usage",
        "Bytes held on the local disk",
        lambda s: float(s["storage"].get("disk", {}).get("used_bytes", 0)),
    ),
    ("lmcache:gpu_tier_usage", "Bytes held in the GPU tier", lambda s: _tier_bytes(s, "gpu")),
]


def _client(status: dict, key: str) -> float:
    return float((status.get("p2p_client") or {}).get(key, 0))


def _remote(status: dict, key: str) -> float:
    return float((status["storage"].get("remote") or {}).get(key, 0))


def _tier_bytes(status: dict, tier: str) -> float:
    stats = status["storage"].get(tier)
    if not stats:
        return 0.0
    page_bytes = int(status["storage"].get("page_bytes", 0))
    return float(stats.get("chunks", 0) * page_bytes)


class RankMetrics:
    """One rank's reports: its counters' growth since the last report and its gauges, read from
    the engine's status answer at most every ``interval_s`` (vLLM asks after every step)."""

    def __init__(self, read_status: Callable[[], dict], rank: int, interval_s: float = 0.05):
        self._read = read_status
        self._rank = rank
        self._interval_s = interval_s
        self._last: dict[str, float] = {}
        self._last_seq: dict[str, int] = {}  # per histogram, the durations already reported
        self._last_at = 0.0

    def take(self, now: float | None = None) -> dict[str, Any] | None:
        now = time.monotonic() if now is None else now
        if now - self._last_at < self._interval_s:
            return None
        self._last_at = now
        status = self._read()
        counters = {name: read(status) for name, _, read in COUNTERS}
        for reason, chunks in (status.get("engine", {}).get("missed_chunks") or {}).items():
            counters[f"{MISSED}|{reason}"] = float(chunks)
        for where, counts in ((status.get("p2p_client") or {}).get("by_peer") or {}).items():
            peer, _, channel = where.rpartition(" over ")
            for name, _, key in PER_PEER:
                counters[f"{name}|{peer}|{channel}"] = float(counts.get(key, 0))
        grown = {name: value - self._last.get(name, 0.0) for name, value in counters.items()}
        self._last = counters
        observed = {}
        for name, _, read_durations in HISTOGRAMS:
            self._last_seq[name], new = taken_since(read_durations(status), self._last_seq.get(name, 0))
            if new:
                observed[name] = new
        return {
            "counters": {name: delta for name, delta in grown.items() if delta > 0},
            "gauges": {str(self._rank): {name: read(status) for name, _, read in GAUGES}},
            "observed_ms": observed,
        }


@dataclass
class ConnectorStats(KVConnectorStats):
    """Counter growth summed over ranks and steps; gauges per rank (the newest wins). At module
    level: vLLM pickles it from the ranks' processes to the scheduler's."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: Any) -> Any:
        counters = dict(self.data.get("counters", {}))
        for name, delta in other.data.get("counters", {}).items():
            counters[name] = counters.get(name, 0.0) + delta
        gauges = {**self.data.get("gauges", {}), **other.data.get("gauges", {})}
        observed = {name: list(values) for name, values in self.data.get("observed_ms", {}).items()}
        for name, values in other.data.get("observed_ms", {}).items():
            observed[name] = (observed.get(name, []) + list(values))[-MAX_OBSERVATIONS:]
        self.data = {"counters": counters, "gauges": gauges, "observed_ms": observed}
        return self

    def reduce(self) -> dict[str, int | float]:
        counters = self.data.get("counters", {})
        return {name.split(":", 1)[1]: round(value, 3) for name, value in counters.items()}

    def is_empty(self) -> bool:
        return not self.data.get("counters") and not self.data.get("observed_ms")


def build_stats(data: dict[str, Any] | None) -> ConnectorStats:
    """vLLM's ``build_kv_connector_stats``: our stats object around ``data``."""
    return ConnectorStats(data=dict(data or {}))


class PromMetrics(KVConnectorPromMetrics):
    """The series above in vLLM's registry, with its labels (vLLM's ``build_prom_metrics``
    builds it in the API server's process, :class:`ConnectorStats` sums reach :meth:`observe`)."""

    def __init__(
        self, vllm_config: Any, metric_types: dict, labelnames: list[str], per_engine_labelvalues: dict
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # (vLLM hands the classes to build with: prometheus-client's, or its multiprocess ones)
        counter: Any = self._counter_cls
        gauge: Any = self._gauge_cls
        self._counters = {
            name: counter(name=name, documentation=text, labelnames=labelnames) for name, text, _ in COUNTERS
        }
        histogram: Any = self._histogram_cls
        self._histograms = {
            name: histogram(name=name, documentation=text, labelnames=labelnames, buckets=DURATION_BUCKETS_S)
            for name, text, _ in HISTOGRAMS
        }
        self._per_peer = {
            name: counter(name=name, documentation=text, labelnames=[*labelnames, "peer", "channel"])
            for name, text, _ in PER_PEER
        }
        self._missed = counter(name=MISSED, documentation=MISSED_HELP, labelnames=[*labelnames, "reason"])
        self._gauges = {
            name: gauge(name=name, documentation=text, labelnames=labelnames, multiprocess_mode="mostrecent")
            for name, text, _ in GAUGES
        }
        # Each rank's newest gauge values: ranks report on their own clocks, so one step's sum may
        # carry only some of them.
        self._ranks: dict[int, dict[str, dict[str, float]]] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, delta in transfer_stats_data.get("counters", {}).items():
            if delta <= 0:
                continue
            if name in self._counters:
                self._counters[name].labels(*labels).inc(delta)
            elif name.startswith(f"{MISSED}|"):
                self._missed.labels(*labels, name.split("|", 1)[1]).inc(delta)
            elif name.count("|") == 2 and name.split("|", 1)[0] in self._per_peer:
                family, peer, channel = name.split("|")
                self._per_peer[family].labels(*labels, peer, channel).inc(delta)
        for name, values in transfer_stats_data.get("observed_ms", {}).items():
            if name in self._histograms:
                for ms in values:
                    self._histograms[name].labels(*labels).observe(ms / 1e3)
        reported = transfer_stats_data.get("gauges", {})
        if reported:
            ranks = self._ranks.setdefault(engine_idx, {})
            ranks.update(reported)
            for name in self._gauges:
                self._gauges[name].labels(*labels).set(sum(r.get(name, 0.0) for r in ranks.values()))
