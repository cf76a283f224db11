"""The fleet's traffic for the dashboard: totals summed from the workers' heartbeats, sampled
every few seconds into a short history from which rates are read.

Workers report totals since their own start (``protocol.Traffic``), not rates, so a lost or late
heartbeat loses nothing: the next one carries the difference. A worker that was already running
when the controller started is taken as a baseline on its first report; otherwise that report
would show hours of traffic as one spike.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from lmcache_p2p.protocol import Traffic

FIELDS = tuple(f for f in Traffic.__struct_fields__ if f != "started_at")
WorkerKey = tuple[str, int]


@dataclass
class Sample:
    at: float  # wall clock
    totals: dict[str, float]


class FleetTraffic:
    def __init__(
        self, started_at: float, sample_every_s: float = 2.0, history_s: float = 300.0, rate_window_s: float = 10.0
    ):
        self.started_at = started_at
        self.sample_every_s = sample_every_s
        # Rates are taken over a window longer than a heartbeat (5 s by default), or every other
        # point would be zero and the next one double.
        self.rate_window = max(1, round(rate_window_s / sample_every_s))
        self.totals: dict[str, float] = dict.fromkeys(FIELDS, 0)
        self._last: dict[WorkerKey, Traffic] = {}
        self.samples: deque[Sample] = deque(maxlen=int(history_s / sample_every_s) + self.rate_window + 1)

    def report(self, worker: WorkerKey, traffic: Traffic) -> None:
        """Add what a worker did since its previous heartbeat."""
        prev = self._last.get(worker)
        self._last[worker] = traffic
        if prev is None and traffic.started_at < self.started_at:
            return  # running before we started: its totals so far are a baseline, not traffic now
        restarted = prev is None or prev.started_at != traffic.started_at
        for name in FIELDS:
            new = getattr(traffic, name)
            old = 0 if restarted else getattr(prev, name)
            self.totals[name] += max(0, new - old)

    def sample(self, extra: dict[str, float], now: float | None = None) -> None:
        """Record the totals (plus the controller's own counters in ``extra``) at ``now``."""
        self.samples.append(Sample(now if now is not None else time.time(), {**self.totals, **extra}))

    def series(self) -> list[dict]:
        """Rates over the trailing window at each sample, oldest first."""
        points = list(self.samples)
        out = []
        for i in range(1, len(points)):
            out.append(_rates(points[max(0, i - self.rate_window)], points[i]))
        return out

    def current(self) -> dict:
        return self.series()[-1] if len(self.samples) > 1 else _rates(None, None)


def _rates(a: Sample | None, b: Sample | None) -> dict:
    if a is None or b is None or b.at <= a.at:
        return {
            "t": b.at if b else time.time(),
            "lookups_per_s": 0.0,
            "hit_ratio": None,
            "p2p_bytes_per_s": 0.0,
            "p2p_transfers_per_s": 0.0,
            "peer_lookups_per_s": 0.0,
            "pulls_skipped_per_s": 0.0,
        }
    dt = b.at - a.at

    def delta(name: str) -> float:
        return b.totals.get(name, 0) - a.totals.get(name, 0)

    asked = delta("lookup_tokens")
    hits = delta("hit_tokens")
    return {
        "t": b.at,
        "lookups_per_s": delta("lookups") / dt,
        # None, not 0, when nothing was asked: an idle fleet has no hit ratio.
        "hit_ratio": min(1.0, hits / asked) if asked > 0 else None,
        # Bytes moved between peers, counted once, on the pulling side.
        "p2p_bytes_per_s": delta("pulled_bytes") / dt,
        "p2p_transfers_per_s": delta("pulls") / dt,
        "peer_lookups_per_s": delta("peer_lookups") / dt,
        # Prefix pulls the ranks' pull policy skipped: recomputing was estimated faster.
        "pulls_skipped_per_s": delta("pulls_skipped") / dt,
    }
