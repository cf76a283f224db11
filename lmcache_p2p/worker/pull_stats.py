"""A rank's pull counters: what /status shows under ``p2p_client`` and heartbeats sum up.

One record shared by the parts of a pull (the offer, the pull job or the holder's pull pump, the
engine's wait for it), each counting its own fields; only the worker's loop writes it.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

from lmcache_p2p.durations import RecentDurations


@dataclass
class PullStats:
    pulls: int = 0
    chunks_pulled: int = 0
    bytes_pulled: int = 0
    pull_failures: int = 0
    prefix_hit_chunks: int = 0  # pulled for the engine (not for a move or copy)
    checksum_mismatches: int = 0
    # Pages a holder may still write into (its request timed out, or a streamed segment is still
    # landing): out of the pool until that write ends.
    pages_quarantined: int = 0
    gpu_landed_chunks: int = 0
    gpu_landed_checked_on_device: int = 0  # of those, checked on the device (the rest by their write-back)
    transfer_ms: float = 0.0
    verify_ms: float = 0.0
    # The pull policy's skips: prefix pulls not made (slower than recomputing), the chunks peers
    # offered that were recomputed instead (skips, and the rest of a re-measuring pull), and the
    # skips per peer; its estimates as of its last decision.
    pulls_skipped: int = 0
    chunks_skipped: int = 0
    pulls_skipped_by_peer: dict[str, int] = field(default_factory=dict)
    pull_policy: dict | None = None
    # Per holder rank and channel ("instance rank R over CHANNEL"): pulls, bytes, failures (the
    # engine's lmcache:p2p_peer_* series; bounded by the fleet's size).
    by_peer: dict[str, dict[str, int]] = field(default_factory=dict)
    # Each pull's time, start to end (the engine's lmcache:p2p_pull_duration_seconds histogram).
    durations: RecentDurations = field(default_factory=RecentDurations, compare=False)

    def as_dict(self) -> dict:
        """A copy for /status (read from the engine's thread too)."""
        out = {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "durations"}
        out["pull_ms"] = self.durations.snapshot()
        return out
