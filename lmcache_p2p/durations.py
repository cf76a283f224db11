"""The latest durations of an operation (pulls, loads), numbered, for a metrics reader that
takes the ones it has not seen (the engine's latency histograms): the writer appends, the
reader asks for what came after its last sequence number. Bounded: a reader that fell further
behind than the window loses the oldest, never blocks the writer. Torch-free."""

from __future__ import annotations

import threading
from collections import deque

WINDOW = 512  # durations kept (a reader reads every 50 ms: far more than a step's pulls)


class RecentDurations:
    def __init__(self, window: int = WINDOW):
        self._recent: deque[float] = deque(maxlen=window)
        self._seq = 0  # durations appended since start
        self._lock = threading.Lock()

    def add(self, ms: float) -> None:
        with self._lock:
            self._recent.append(ms)
            self._seq += 1

    def snapshot(self) -> dict:
        """``{"seq": durations so far, "recent_ms": the latest, oldest first}`` for status answers."""
        with self._lock:
            return {"seq": self._seq, "recent_ms": list(self._recent)}


def taken_since(snapshot: dict | None, last_seq: int) -> tuple[int, list[float]]:
    """The durations of ``snapshot`` after ``last_seq`` (what a reader has not seen) and the
    sequence number to ask from next time."""
    if not snapshot:
        return last_seq, []
    seq, recent = int(snapshot["seq"]), list(snapshot["recent_ms"])
    new = max(0, seq - last_seq)
    return seq, recent[-new:] if new else []
