"""The engine's prefix pulls from one holder as one pipeline: a pull pump per holder.

Each prefix pull joins its holder's queue, first asked first served. The holder's pump keeps
``pipeline_depth`` batches in flight across pull boundaries, cutting each batch from the head of
the queue. Batches settle in the order they were cut, so each pull's chunks commit in order, and
a pull is done as soon as its own last chunk commits: the first is not held for later ones, and
the next one's first batch is on the wire while the one ahead still has batches out, instead of
waiting for its whole pull to end (the "turns" that cost a fourth request 71 ms on the H200).

A batch carries one pull's chunks (``span_pulls``: it may carry the tail of one pull and the head
of the next; a ``ChunkPull`` is a list of chunk hashes the holder serves in order, so the wire
does not know pulls). Spanning saves a request at each boundary, but holds the earlier pull's
last chunks until the later one's in the same batch have landed and been checked too: four
12-chunk pulls over tcp on the 2-vCPU machine ended the first at 368-392 ms spanning against
282-292 ms not (the last alike: 706-806 ms), and the request it saves is hidden by the pipeline
anyway.

A batch that stopped at a chunk fails only the pulls it must: the holder lacks the chunk, its
checksum differs or our pool is full: the pull that chunk belongs to is a miss from it (as a
pull alone would be), and later pulls' chunks that the batch carried (spanning pulls) are asked
again. The holder refused the batch or its bytes could not land: every pull whose chunks the
batch carried fails, and the connection is opened again for the others. The holder did not
answer at all (dead, or stalled past the timeout): its whole queue fails, and those requests
recompute. Each holder has its own pump, so none of this touches pulls from other holders.

Nothing here raises into the engine: a pull's result says what came and why not more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from lmcache_p2p.miss_reasons import HOLDER_GONE, Miss
from lmcache_p2p.peer_service import Landed
from lmcache_p2p.vocab import CPU
from lmcache_p2p.worker.peer_links import Peer
from lmcache_p2p.worker.pull_batch import Batch
from lmcache_p2p.worker.pull_job import (
    PullResult,
    PullRoute,
    PullSetup,
    PullTimes,
    RouteFailed,
    open_route,
    report_pull,
)

logger = logging.getLogger(__name__)

__all__ = ["Landed", "PullOverlap", "PullPump", "QueuedPull", "Segment"]


class PullOverlap:
    """Whether a prefix pull had this rank's pulls to itself, from its first batch out to its
    last commit: only such a pull measures the link for the pull policy (one that shared the
    link, or this rank's landing and checksums, would make the link look slower than it is).
    With one pull per holder queue and none from other holders meanwhile, a pull ran alone."""

    def __init__(self) -> None:
        self._running = 0  # prefix pulls with batches out now
        self._started = 0  # and started so far

    def begin(self) -> tuple[bool, int]:
        """A pull's first batch goes out: whether it started alone, and its number."""
        self._running += 1
        self._started += 1
        return self._running == 1, self._started

    def end(self, started_alone: bool, number: int) -> bool:
        """The pull ended: whether it ran alone (it started so, and none began meanwhile)."""
        self._running -= 1
        return started_alone and self._started == number


@dataclass(eq=False)
class QueuedPull:
    """One prefix pull in its holder's queue: what it asks for, how far its chunks are cut into
    batches and committed, and its result once done."""

    hashes: list[int]
    done: asyncio.Future  # its PullResult, set once: its last chunk committed, or it failed
    on_landed: Landed | None = None
    offered_at: float = 0.0  # perf_counter when its offer was made (logged)
    joined_at: float = field(default_factory=time.perf_counter)
    cut: int = 0  # leading chunks handed to batches (in this epoch)
    committed: int = 0  # leading chunks committed here
    # Bumped when its chunks after ``committed`` are asked again: batches cut before carry
    # copies of them that nothing commits.
    epoch: int = 0
    result: PullResult = field(default_factory=PullResult)
    times: PullTimes = field(default_factory=PullTimes)
    started_at: float | None = None  # its first batch went out
    channel: str = "?"  # as its log line names it
    alone: bool = False  # it ran with no other prefix pull's batches out (known once done)
    overlap: tuple[bool, int] | None = None  # its PullOverlap.begin, once started

    @property
    def finished(self) -> bool:
        return self.done.done()

    @property
    def uncut(self) -> int:
        return len(self.hashes) - self.cut


@dataclass(frozen=True)
class Segment:
    """Chunks ``[start, stop)`` of a pull, as one batch carries them (cut in ``epoch``)."""

    pull: QueuedPull
    start: int
    stop: int
    epoch: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass
class _Out:
    """A batch on its way: its request, the pulls' chunks it carries, and the route it went by."""

    task: asyncio.Task
    segments: list[Segment]
    route: PullRoute


class PullPump:
    """One holder's prefix pulls: its queue, the batches out, and the route to it.

    ``one_at_a_time`` (``p2p_prefix_pull_turns``): a pull's first batch goes out only once the
    pull ahead of it is done, each pull having the link to itself (the former turns, per holder).
    ``span_pulls``: a batch may carry chunks of two or more pulls (see the module's doc).
    ``on_idle`` is called when the queue is empty and no batch is out (the pump's task ends)."""

    def __init__(
        self,
        setup: PullSetup,
        peer: Peer,
        overlap: PullOverlap,
        one_at_a_time: bool = False,
        on_idle: Callable[[PullPump], object] | None = None,
        span_pulls: bool = False,
    ):
        self.setup = setup
        self.peer = peer
        self.overlap = overlap
        self.one_at_a_time = one_at_a_time
        self.span_pulls = span_pulls
        self.on_idle = on_idle
        self.queue: deque[QueuedPull] = deque()  # pulls not done yet, first asked first
        self.window: deque[_Out] = deque()  # batches out, in the order they were cut
        self.route: PullRoute | None = None
        self.channel = "?"  # the route's, as log lines name it
        self._opening: asyncio.Task | None = None  # the hello on its way, when there is no route
        self._task: asyncio.Task | None = None

    @property
    def idle(self) -> bool:
        return not self.queue and not self.window

    # -- the engine's side ----------------------------------------------------------------------

    def join(self, hashes: Iterable[int], offered_at: float = 0.0, on_landed: Landed | None = None) -> QueuedPull:
        """Queue a pull of ``hashes`` (in order); its ``done`` future gives its :class:`PullResult`."""
        loop = asyncio.get_running_loop()
        pull = QueuedPull([int(h) for h in hashes], loop.create_future(), on_landed, offered_at or time.perf_counter())
        self.queue.append(pull)
        if not pull.hashes:
            self._resolve(pull, report=False)
        elif self._task is None or self._task.done():
            self._task = loop.create_task(self._run(), name=f"pull pump {self.peer.describe()}")
        else:
            self._fill()
        return pull

    def leave(self, pull: QueuedPull) -> None:
        """The pull's caller gave up on it: its chunks not yet out are not asked for, and those
        out are given back when their batches settle (as a pull given up alone did)."""
        if not pull.finished:
            self._resolve(pull, "given up by its caller", report=False)
            self._fill()  # one at a time: the next pull's turn

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    # -- the pump ------------------------------------------------------------------------------

    async def _run(self) -> None:
        """Open the route, keep the window full, settle batches in order, until nothing is left."""
        try:
            while self.queue or self.window:
                if self.route is None and self._opening is None and any(p.uncut for p in self.queue):
                    self._opening = asyncio.ensure_future(open_route(self.setup, self.peer, into_gpu_tier=True))
                waits = [w for w in (self.window[0].task if self.window else None, self._opening) if w is not None]
                if not waits:  # nothing out and nothing to cut: no pull could ever end
                    self._fail_all("the pull pump had nothing to wait for", report=True)
                    break
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if self._opening is not None and self._opening.done():
                    opened, self._opening = self._opening.result(), None
                    self._opened(opened)
                while self.window and self.window[0].task.done():
                    out = self.window.popleft()
                    self._settle(out.task.result(), out.segments, out.route)
                self._fill()
        except asyncio.CancelledError:
            self._fail_all("the worker is closing", report=False)
            raise
        except Exception as e:  # a bug here must not leave the engine's pulls waiting forever
            logger.exception("%s: the pull pump for %s failed", self.setup.me.describe(), self.peer.describe())
            self._fail_all(f"the pull pump failed: {e}", report=True)
        finally:
            if self._opening is not None:
                self._opening.cancel()
                self._opening = None
            for out in self.window:  # nothing commits them now: their pages go back when they end
                out.task.add_done_callback(self.setup.pages.abandon_finished)
            self.window.clear()
            if self.on_idle is not None:
                self.on_idle(self)

    def _opened(self, opened: PullRoute | RouteFailed) -> None:
        if isinstance(opened, PullRoute):
            self.route, self.channel = opened, opened.channel
            return
        # No route: the pulls with chunks still to ask for cannot go on (as a pull whose hello
        # failed); those whose chunks are all out end with their batches.
        for pull in [p for p in self.queue if p.uncut]:
            self._resolve(pull, opened.error, opened.miss)

    def _fill(self) -> None:
        """Cut batches from the head of the queue while fewer than ``pipeline_depth`` are out."""
        route = self.route
        if route is not None and route.conn.closed.is_set():
            # Dropped meanwhile (a move's failed pull, the peer left the warm set): the run
            # loop opens a new one rather than sending batches into a closed socket.
            self.route = route = None
        while route is not None and len(self.window) < self.setup.pipeline_depth:
            segments = self._cut(route.batch_chunks)
            if not segments:
                return
            hashes = [h for s in segments for h in s.pull.hashes[s.start : s.stop]]
            task = asyncio.ensure_future(self._fetch(route, hashes))
            self.window.append(_Out(task, segments, route))

    def _cut(self, size: int) -> list[Segment]:
        """The next batch: up to ``size`` chunks of the first pull in the queue with chunks not yet
        out (and, spanning pulls, of the ones after it)."""
        segments: list[Segment] = []
        room = size
        for pull in self.queue:
            if room <= 0:
                break
            if pull.uncut:
                take = min(room, pull.uncut)
                if pull.started_at is None:
                    self._start(pull, segments)
                segments.append(Segment(pull, pull.cut, pull.cut + take, pull.epoch))
                pull.cut += take
                room -= take
                if not self.span_pulls:
                    break
            if self.one_at_a_time:  # only the pull at the head of the queue
                break
        return segments

    def _start(self, pull: QueuedPull, cut_so_far: list[Segment]) -> None:
        """The pull's first batch goes out: its time starts, and it says what it went out beside."""
        now = time.perf_counter()
        pull.started_at, pull.channel = now, self.channel
        pull.overlap = self.overlap.begin()
        ahead = [s for out in self.window for s in out.segments] + cut_so_far
        earlier = {id(s.pull) for s in ahead if s.pull is not pull}
        # tests/test_pull_pump.py reads this line: keep its wording.
        logger.info(
            "%s: pulling %d chunk(s) from %s (offered %.1f ms ago; waited %.1f ms in the holder's queue; "
            "%d chunk(s) of %d earlier pull(s) in flight)",
            self.setup.me.describe(),
            len(pull.hashes),
            self.peer.describe(),
            (now - pull.offered_at) * 1e3,
            (now - pull.joined_at) * 1e3,
            sum(s.size for s in ahead if s.pull is not pull),
            len(earlier),
        )

    async def _fetch(self, route: PullRoute, hashes: list[int]) -> Batch:
        """One batch; a failure of our own code is that batch's failure, not the pump's."""
        try:
            return await route.fetch.fetch(hashes)
        except Exception as e:
            logger.exception(
                "%s: a batch of %d chunk(s) from %s failed", self.setup.me.describe(), len(hashes), self.peer.describe()
            )
            batch = Batch(hashes, error=f"the batch failed here: {e}", peer_failed=True)
            batch.miss = Miss(HOLDER_GONE, f"{self.peer.describe()}: {batch.error}")
            return batch

    def _settle(self, batch: Batch, segments: list[Segment], route: PullRoute) -> None:
        """Commit what a batch brought for the pulls still waiting for it, in order, and decide
        for each pull it carried: more to come, done, failed, or its chunks asked again."""
        total = sum(s.size for s in segments)
        stop = min(batch.good, total)  # the batch's chunks landed and verified, in order
        error = batch.error or f"{self.peer.describe()} served {stop} of {total} chunks"
        miss = batch.miss or Miss(HOLDER_GONE, error)
        keep: list[int] = []
        landed: list[QueuedPull] = []
        failed: list[QueuedPull] = []
        again: list[QueuedPull] = []
        at = 0  # where the segment starts in the batch
        for seg in segments:
            pull = seg.pull
            # Batches settle in the order they were cut, so a live segment starts where the pull's
            # committed chunks end; one of an older epoch (asked again since) is a stale copy.
            if not pull.finished and seg.epoch == pull.epoch and seg.start == pull.committed:
                pull.times.add(batch)
                good = max(0, min(seg.size, stop - at))
                if good:
                    keep.extend(range(at, at + good))
                    pull.committed += good
                    in_gpu_tier = max(0, min(at + good, len(batch.gpu_pages)) - at)
                    pull.result.gpu_landed += in_gpu_tier
                    if batch.device_checksums is not None:
                        pull.result.gpu_checked_on_device += in_gpu_tier
                        self.setup.stats.gpu_landed_checked_on_device += in_gpu_tier
                    landed.append(pull)
                if good < seg.size:
                    # The batch stopped at one of its chunks (that pull fails there), or before
                    # them: a holder that failed the batch fails them too; one that lacked an
                    # earlier pull's chunk, or a full pool, leaves them to be asked again.
                    (failed if stop >= at or batch.peer_failed else again).append(pull)
            at += seg.size
        self.setup.pages.commit_some(batch, keep, CPU)
        for pull in again:
            pull.epoch += 1
            pull.cut = pull.committed
        for pull in landed:
            self._tell_landed(pull)
        for pull in failed:
            self._resolve(pull, error, miss)
        for pull in landed:
            if not pull.finished and pull.committed == len(pull.hashes):
                self._resolve(pull)
        if batch.peer_failed:
            self.setup.connections.drop(self.peer, route.conn)
            if self.route is route:
                self.route = None  # the pulls left open it again
            if batch.unanswered:  # dead or stalled: every pull queued for it would wait as long
                for pull in list(self.queue):
                    self._resolve(pull, error, miss)

    def _tell_landed(self, pull: QueuedPull) -> None:
        if pull.on_landed is None or pull.finished:
            return
        try:
            pull.on_landed(pull.committed)
        except Exception:  # the loader's hook: its failure is its own, the pull goes on
            logger.exception("%s: a pull's landed hook failed", self.setup.me.describe())

    def _resolve(self, pull: QueuedPull, error: str | None = None, miss: Miss | None = None, report: bool = True):
        """The pull is done: what it committed, and if it ended early, why; logged and counted."""
        if pull.finished:
            return
        result = pull.result
        if error is not None and result.error is None:
            result.error, result.miss = error, miss or Miss(HOLDER_GONE, error)
        result.held = pull.hashes[: pull.committed]
        if pull.started_at is not None:
            pull.times.elapsed_s = time.perf_counter() - pull.started_at
        if pull.overlap is not None:
            pull.alone = self.overlap.end(*pull.overlap)
        with contextlib.suppress(ValueError):  # not queued: it was never, or is done
            self.queue.remove(pull)
        pull.done.set_result(result)
        if report:
            report_pull(self.setup, self.peer, pull.channel, len(pull.hashes), result, pull.times)

    def _fail_all(self, why: str, report: bool) -> None:
        for pull in list(self.queue):
            self._resolve(pull, why, Miss(HOLDER_GONE, f"{self.peer.describe()}: {why}"), report=report)
