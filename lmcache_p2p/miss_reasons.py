"""Why a chunk of a prompt was not served: one reason code per missed chunk, counted per engine
rank and logged with the numbers behind it (docs/vllm.md, "Misses").

A prompt is reused as a prefix, so the first chunk the connector cannot serve ends the hit and
every chunk after it is recomputed too: all of a lookup's missed chunks take the reason of the
first one. The codes are stable (dashboards and alerts key on them):

* ``never_stored``: no tier here and no live peer holds it, and this rank did not evict it;
* ``evicted``: this rank held it and evicted it (the detail says from which tier, how long ago);
* ``layout_mismatch``: only instances whose KV layout differs hold it (the detail names the
  instance and the field: model, dtype, block shape, TP size, chunk size);
* ``partial_tp``: a peer instance holds it on some of its TP ranks only;
* ``below_break_even``: a peer holds it, and the pull policy judged recomputing it faster (the
  detail has both estimates);
* ``timeout``: the controller did not answer the holder lookup, or the pull passed its deadline;
* ``holder_gone``: the pull failed (the holder died, or closed its channel, mid-pull);
* ``pool_full``: no free page to land the pulled chunk in (every page pinned);
* ``checksum_failed``: the pulled chunk's checksum differed (dropped);
* ``refused``: the holder refused the channel (mesh authentication).

Torch-free.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

NEVER_STORED = "never_stored"
EVICTED = "evicted"
LAYOUT_MISMATCH = "layout_mismatch"
PARTIAL_TP = "partial_tp"
BELOW_BREAK_EVEN = "below_break_even"
TIMEOUT = "timeout"
HOLDER_GONE = "holder_gone"
POOL_FULL = "pool_full"
CHECKSUM_FAILED = "checksum_failed"
REFUSED = "refused"
REASONS = (
    NEVER_STORED,
    EVICTED,
    LAYOUT_MISMATCH,
    PARTIAL_TP,
    BELOW_BREAK_EVEN,
    TIMEOUT,
    HOLDER_GONE,
    POOL_FULL,
    CHECKSUM_FAILED,
    REFUSED,
)
# The controller's answer when no live instance holds the chunk at all: the rank then tells
# never_stored from evicted by its own memory of evictions (the controller forgets a chunk once
# its last holder evicts it).
NOT_HELD = "not_held"

LOG_INTERVAL_S = 60.0  # per reason, at most one line this often (with the count since the last)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Miss:
    """Why the first chunk a lookup could not serve was missed."""

    reason: str
    detail: str = ""

    def describe(self) -> str:
        return f"{self.reason} ({self.detail})" if self.detail else self.reason


@dataclass(frozen=True)
class PulledChunks:
    """What a pull of a peer's offer brought: the leading chunks now held here, and when fewer
    than offered, why the next one did not come."""

    chunks: int
    miss: Miss | None = None


class MissTally:
    """A rank's missed chunks by reason since start, and their log lines: a reason's first miss
    is logged at once, later ones at most once a :data:`LOG_INTERVAL_S` with the count since."""

    def __init__(self, who: str = "", log_interval_s: float = LOG_INTERVAL_S):
        self.who = who
        self.log_interval_s = log_interval_s
        self._lock = threading.Lock()  # the lookup thread and the step thread both count
        self._chunks = dict.fromkeys(REASONS, 0)
        self._unlogged = dict.fromkeys(REASONS, 0)
        self._logged_at: dict[str, float] = {}

    def count(self, chunks: int, miss: Miss, prompt_chunks: int, hit_chunks: int) -> None:
        """``chunks`` of a prompt of ``prompt_chunks`` missed for ``miss`` after a hit of ``hit_chunks``."""
        if chunks <= 0:
            return
        reason = miss.reason if miss.reason in self._chunks else NEVER_STORED
        now = time.monotonic()
        with self._lock:
            self._chunks[reason] += chunks
            self._unlogged[reason] += chunks
            last = self._logged_at.get(reason)
            if last is not None and now - last < self.log_interval_s:
                return
            since, self._unlogged[reason] = self._unlogged[reason], 0
            self._logged_at[reason] = now
        logger.info(
            "%smissed %d of %d chunk(s) after a hit of %d: %s%s",
            f"{self.who}: " if self.who else "",
            chunks,
            prompt_chunks,
            hit_chunks,
            Miss(reason, miss.detail).describe(),
            f" ({since} chunk(s) missed for {reason} since this line last came)" if since != chunks else "",
        )

    def totals(self) -> dict[str, int]:
        with self._lock:
            return dict(self._chunks)


class EvictionMemory:
    """Chunks this rank evicted from the last tier holding them, newest last, bounded: tells an
    ``evicted`` miss from a ``never_stored`` one, with where and how long ago. Fed by its own
    queue of the store's admits and evicts (``ChunkStore.record_events``), drained when asked
    and after each store (:meth:`note`), so that a rank that stores and never looks up keeps
    no backlog."""

    def __init__(self, events: Any, capacity: int = 1 << 17):
        self._events = events  # a StorageEventQueue, ours alone
        self.capacity = capacity
        self._evicted: OrderedDict[int, tuple[str, float]] = OrderedDict()
        self._lock = threading.Lock()  # the lookup thread asks, the step thread notes

    def note(self) -> None:
        with self._lock:
            self._drain()

    def miss_for(self, chunk_hash: int) -> Miss:
        with self._lock:
            self._drain()
            found = self._evicted.get(chunk_hash)
        if found is None:
            return Miss(NEVER_STORED)
        location, at = found
        return Miss(EVICTED, f"from {location} {time.monotonic() - at:.1f} s ago")

    def _drain(self) -> None:
        for event in self._events.take_events():
            chunk_hash = event.key.chunk_hash
            self._evicted.pop(chunk_hash, None)
            if event.kind == "evict":
                self._evicted[chunk_hash] = (event.location, time.monotonic())
                if len(self._evicted) > self.capacity:
                    self._evicted.popitem(last=False)
