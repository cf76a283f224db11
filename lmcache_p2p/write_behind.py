"""WriteBehind: chunk keys queued by the engine's store path and written by one thread.

The disk tier and the remote tier both copy what the CPU tier admitted somewhere slower, and
both must never make the engine wait: the store path only appends a key to a bounded queue
(:meth:`WriteBehind.submit`; a full queue drops the key and counts it), and one thread hands the
keys to ``write`` in batches of up to ``batch`` (what one round trip to a store can carry; 1 for
the disk). The queue holds keys, not pins: the writer pins a chunk only while it writes it, so a
slow destination never ties up CPU pages.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from lmcache_p2p.keys import ChunkKey

logger = logging.getLogger(__name__)


class WriteBehind:
    def __init__(self, name: str, depth: int, write: Callable[[list[ChunkKey]], None], batch: int = 1):
        self.name = name  # the destination, for logs
        self.dropped = 0  # keys refused by a full queue
        self.stopping = False  # close() began: ``write`` should give up on what it has
        self._write = write
        self._batch = max(1, batch)
        self._queue: queue.Queue[ChunkKey | None] = queue.Queue(maxsize=max(1, depth))
        self._thread = threading.Thread(target=self._run, name=f"lmcache-writer-{name}", daemon=True)
        self._thread.start()

    def submit(self, key: ChunkKey) -> bool:
        """Queue ``key``; never blocks. False (counted in :attr:`dropped`) when the queue is full."""
        try:
            self._queue.put_nowait(key)
            return True
        except queue.Full:
            self.dropped += 1
            logger.debug("%s write-behind queue full; %s is not written", self.name, key)
            return False

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < self._batch:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            keys = [k for k in batch if k is not None]
            try:
                if keys:
                    self._write(keys)
            except Exception:  # a bug here must not end write-behind for the engine's lifetime
                logger.exception("%s write-behind failed for %d chunk(s)", self.name, len(keys))
            finally:
                for _ in batch:
                    self._queue.task_done()
            if len(keys) < len(batch):  # the stop marker
                return

    def flush(self, timeout: float) -> bool:
        """Wait until every queued key was handed to ``write``; False after ``timeout``."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout: float = 30.0) -> int:
        """Write what is queued within half of ``timeout``, drop the rest, stop the thread, all
        within ``timeout``; returns the keys dropped here."""
        deadline = time.monotonic() + timeout
        self.flush(timeout / 2)
        self.stopping = True
        dropped = 0
        while True:  # what is still queued is dropped, so the stop marker always fits
            try:
                if self._queue.get_nowait() is not None:
                    dropped += 1
                self._queue.task_done()
            except queue.Empty:
                break
        self._queue.put(None)
        self._thread.join(timeout=max(0.1, deadline - time.monotonic()))
        if self._thread.is_alive():
            logger.warning("%s write-behind did not stop within %.0f s", self.name, timeout)
        return dropped
