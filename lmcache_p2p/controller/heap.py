"""The controller's long-lived state kept out of the garbage collector's way.

CPython's collector walks every tracked object of a generation at each of its collections. The
controller's registry at 10,000 ranks is hundreds of thousands of long-lived objects (each rank's
record, layout, locations and traffic), so each full collection walked all of them, on the event
loop: pauses of 56-153 ms (issue 61) in the middle of heartbeats and lookups. None of it is
garbage, and very little of it ever takes part in a reference cycle.

So the controller freezes its heap (``gc.freeze()``: every object tracked now moves to a
permanent generation that no collection walks) once it has started, and again whenever the
registry's size has changed by :data:`FREEZE_CHANGE_SHARE` of what it was at the last freeze (at
least :data:`FREEZE_CHANGE_MIN` ranks): a fleet registering, or re-registering after a restart
(every rank's record and key set rebuilt). A young collection first (``gc.collect(1)``: cheap)
keeps the garbage made meanwhile from being frozen with it. What is frozen and later dropped is
still freed by its reference count; only a reference cycle formed before a freeze and dropped
after it stays until the process ends, and the registry's records hold no reference back to
what holds them.

Checked every :data:`FREEZE_CHECK_S` on the loop; each freeze is logged at INFO with its numbers
and counted (``lmcache_controller_gc_freezes_total``; ``lmcache_controller_gc_frozen_objects``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable

logger = logging.getLogger("lmcache_p2p.controller")

FREEZE_CHECK_S = 5.0
FREEZE_CHANGE_SHARE = 0.1
FREEZE_CHANGE_MIN = 500


class HeapKeeper:
    """Freezes the heap after start-up and after the registry grew or shrank a lot.
    ``size``: what is watched (the registered ranks)."""

    def __init__(self, size: Callable[[], int]):
        self.size = size
        self.frozen_at_size = 0
        self.freezes = 0
        self.frozen_objects = gc.get_freeze_count()
        self._task: asyncio.Task | None = None

    def freeze(self, why: str) -> None:
        t0 = time.perf_counter()
        before = self.frozen_objects
        gc.collect(1)
        gc.freeze()
        # Counted here, not at each scrape: counting walks the frozen list (16-25 ms at 10,000 ranks).
        self.frozen_objects = gc.get_freeze_count()
        self.frozen_at_size = self.size()
        self.freezes += 1
        logger.info(
            "gc: froze %d more objects (%d in all) %s, %d ranks registered, in %.1f ms",
            self.frozen_objects - before,
            self.frozen_objects,
            why,
            self.frozen_at_size,
            (time.perf_counter() - t0) * 1e3,
        )

    def due(self) -> bool:
        """Whether the registry changed enough since the last freeze to freeze again."""
        change = abs(self.size() - self.frozen_at_size)
        return change >= max(FREEZE_CHANGE_MIN, FREEZE_CHANGE_SHARE * self.frozen_at_size)

    def start(self) -> None:
        self.freeze("after start-up")
        self._task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(FREEZE_CHECK_S)
            try:
                if self.due():
                    self.freeze("after the registry changed size")
            except Exception:
                logger.exception("gc freeze failed")

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
