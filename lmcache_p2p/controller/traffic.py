"""The fleet's traffic for the dashboard: totals summed from the workers' heartbeats, sampled
every few seconds into a short history from which rates are read.

Workers report totals since their own start (``protocol.Traffic``), not rates, so a lost or late
heartbeat loses nothing: the next one carries the difference. A worker that was already running
when the controller started is taken as a baseline on its first report; otherwise that report
would show hours of traffic as one spike.

Totals are checked before they count (a worker once reported 2^64-1 bytes, and the dashboard
showed it): a total must be a whole number in 0..2^53 (past that a float sum is no longer
exact), and what it grew by since the last report must be something a rank could do in that
time (``RATE_BOUNDS`` over the interval, plus ``SLACK_S``). A total that is refused adds nothing,
is logged (at most once per field per 10 s) and counted in ``refused``; the last good value stays
the baseline, so one corrupt heartbeat costs nothing and a total stuck at nonsense never counts.
A total that goes backwards without a new ``started_at`` is a restart nobody announced: it becomes
the new baseline and adds nothing (never a negative rate, nor invented traffic).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass

from lmcache_p2p.logs import RateLimitedLog
from lmcache_p2p.protocol import Traffic

logger = logging.getLogger("lmcache_p2p.controller")

FIELDS = tuple(f for f in Traffic.__struct_fields__ if f != "started_at")
WorkerKey = tuple[str, int]

MAX_TOTAL = 2**53
# What one rank can do per second, far beyond any real one: bytes over two 400 Gb/s links
# (100 GB/s), a million lookups or pulls, ten billion tokens asked about. Only corrupt or
# hostile totals come near these.
MAX_BYTES_PER_S = 100e9
MAX_EVENTS_PER_S = 1e6
MAX_TOKENS_PER_S = 1e10


def _rate_bound(name: str) -> float:
    if name.endswith("_bytes"):
        return MAX_BYTES_PER_S
    return MAX_TOKENS_PER_S if name.endswith("_tokens") else MAX_EVENTS_PER_S


RATE_BOUNDS = {name: _rate_bound(name) for name in FIELDS}
# Added to every interval: heartbeat jitter, a beat delayed behind a busy loop, clock skew.
SLACK_S = 10.0


@dataclass
class _Seen:
    """The last accepted totals of one worker: the baseline the next report is measured from."""

    started_at: float
    at: float  # time.monotonic() when that report arrived
    totals: dict[str, int]


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
        self._last: dict[WorkerKey, _Seen] = {}
        self.samples: deque[Sample] = deque(maxlen=int(history_s / sample_every_s) + self.rate_window + 1)
        self.refused = 0  # totals refused as impossible (out of range, or grown faster than any rank)
        self._refusals = RateLimitedLog(logger, every_s=10.0)

    def report(self, worker: WorkerKey, traffic: Traffic, now: float | None = None) -> None:
        """Add what a worker did since its previous heartbeat (``now``: time.monotonic(), for tests)."""
        now = time.monotonic() if now is None else now
        wall = time.time()
        started_at = traffic.started_at if math.isfinite(traffic.started_at) else 0.0
        prev = self._last.get(worker)
        if prev is None and started_at < self.started_at:
            # Running before we started: its totals so far are a baseline, not traffic now.
            baseline = {name: self._checked(worker, name, getattr(traffic, name)) for name in FIELDS}
            self._last[worker] = _Seen(started_at, now, {k: v for k, v in baseline.items() if v is not None})
            return
        if prev is None:  # started after us: everything it did, at most over our own lifetime
            restarted, elapsed, old_totals = True, max(0.0, wall - max(started_at, self.started_at)), {}
        else:
            restarted, elapsed, old_totals = prev.started_at != started_at, now - prev.at, prev.totals
        seen = _Seen(started_at, now, {})
        for name in FIELDS:
            old = 0 if restarted else old_totals.get(name)  # None: no good value yet to measure from
            new = self._checked(worker, name, getattr(traffic, name))
            if new is None:  # refused: the last good value stays the baseline
                if old is not None and not restarted:
                    seen.totals[name] = old
                continue
            seen.totals[name] = new
            if old is None:
                continue  # the first good value is a baseline, like a worker's first report
            grown = new - old
            if grown < 0:
                continue  # a restart nobody announced: the new value is the baseline, adding nothing
            limit = RATE_BOUNDS[name] * (elapsed + SLACK_S)
            if grown > limit:
                seen.totals[name] = old
                self._refuse(worker, name, new, f"it grew by {grown} in {elapsed:.1f} s (at most {limit:.3g})", "jump")
                continue
            self.totals[name] += grown
        self._last[worker] = seen

    def _checked(self, worker: WorkerKey, name: str, value: object) -> int | None:
        """``value`` when it can be a total at all; None (refused and logged) when it cannot."""
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOTAL:
            self._refuse(worker, name, value, f"expected a whole number 0..{MAX_TOTAL}", "range")
            return None
        return value

    def _refuse(self, worker: WorkerKey, name: str, value: object, why: str, kind: str) -> None:
        self.refused += 1
        self._refusals.warning(
            (name, kind),
            "heartbeat from %s rank %d: traffic total %s=%r refused: %s",
            worker[0],
            worker[1],
            name,
            value,
            why,
        )

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
