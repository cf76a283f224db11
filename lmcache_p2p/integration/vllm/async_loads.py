"""A rank's loads beside the steps (vLLM's asynchronous loads), run as jobs by id
(:mod:`~lmcache_p2p.integration.vllm.load_jobs` says what a job is and its phases).

vLLM holds a request out of its steps (WAITING_FOR_REMOTE_KVS) while its job pulls what a peer or
the remote store offered (on the worker's loop; the store's: on its fetch threads) and copies
its chunks into the request's blocks on the load stream (on CPU: at once), each landing of a pull
as it comes. get_finished hands the ended jobs to the connector, once each.

A job's copies start on the load stream after the point on vLLM's stream that its blocks wait for
(load_executor.GrantFences), not after whatever vLLM queued since, and a job is reported as soon
as its copies end: a step that computed nothing waits briefly for any pull or copy to end, a step
that computes waits (at most 2 ms) for a copy about to end. Each job's way through this rank is
one DEBUG line once reported (load_jobs.LoadTimeline).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable

import torch

from lmcache_p2p import layerwise
from lmcache_p2p.cache_engine import CacheEngine, LoadPlan, PinnedPrefix
from lmcache_p2p.integration.vllm.load_jobs import (
    LANDED_CHECK_TIMEOUT_S,
    CopyRates,
    JobEvent,
    JobPhase,
    Landed,
    LoadJob,
    LoadTimeline,
    Piece,
    Pull,
    SegmentPulls,
    Wakeup,
    copy_kind,
    log_landed_chunk_failed,
    pin_whole,
)
from lmcache_p2p.integration.vllm.metadata import LoadSpec
from lmcache_p2p.layerwise import LayerwiseLoad
from lmcache_p2p.miss_reasons import HOLDER_GONE, TIMEOUT, Miss, PulledChunks
from lmcache_p2p.peer_service import Offer
from lmcache_p2p.remote.offers import RemoteOffer
from lmcache_p2p.vocab import PEER_FETCH_TIMEOUT_S

logger = logging.getLogger(__name__)

# In a step that computed nothing while jobs pull or copy, how long get_finished waits for one of
# them to end: the step loop would otherwise spin, holding the interpreter the pulling thread
# needs, and a copy ending just after it returned would be reported only by the next step.
IDLE_STEP_WAIT_S = 0.005
# How often that wait looks at the copies: a CUDA event cannot be waited for with a timeout, so
# it is queried between sleeps (each gives the interpreter up).
IDLE_STEP_POLL_S = 0.0002
# In a step that computes, the longest get_finished waits for a copy that is about to end (its
# expected end within this), so that it is reported with this step and not the next (a forward
# pass later). Bounded because this is vLLM's model-runner thread: see
# AsyncLoads._wait_for_copies_about_to_end.
BUSY_STEP_COPY_WAIT_S = 0.002

# A job copies every plane in one launch: the layer-wise machinery with one "layer" spanning them all.
_ALL_PLANES = "all planes"


class AsyncLoads:
    """The loads beside the steps of one rank: ``jobs`` by id, each a granted request's."""

    def __init__(self, engine: CacheEngine, planes: list[torch.Tensor], staging: torch.Tensor | None = None):
        self.engine = engine
        self.planes = planes
        self.staging = staging  # a ring of chunk pages on the GPU that loads from host memory come through
        self.jobs: dict[int, LoadJob] = {}
        self._job_ids = itertools.count(1)
        self._by_request: dict[str, int] = {}  # the job of each request (one at a time)
        self._step_tokens = 0
        self._copy_rates = CopyRates()
        self._wakeup = Wakeup()  # a pull landed chunks (for the wait in a step computing nothing)
        self._reported_last_step = False  # the last finished() reported jobs: the next one does not wait
        # The rank's pulls before a grant (pull_before_grant; RankLookups.running_pulls): an idle
        # step waits for them too, and leaves their thread the interpreter meanwhile.
        self.lookup_pulls: Callable[[], list[concurrent.futures.Future]] = list

    def job_of(self, req_id: str) -> LoadJob | None:
        job_id = self._by_request.get(req_id)
        return None if job_id is None else self.jobs.get(job_id)

    def begin_step(self, step_tokens: int) -> None:
        self._step_tokens = step_tokens

    # -- grants -----------------------------------------------------------------------------------

    def _new_job(
        self, spec: LoadSpec, timeline: LoadTimeline | None, after: torch.cuda.Event | None, pull: Pull | None = None
    ) -> LoadJob:
        now = pull.started if pull is not None else time.monotonic()  # a pull starts as it is granted
        timeline = timeline or LoadTimeline(now)
        if timeline.granted is None:
            timeline.granted = now
        phase = JobPhase.PULLING if pull is not None else JobPhase.COPYING
        job = LoadJob(next(self._job_ids), spec, timeline, phase, pull, after=after)
        if spec.req_id in self._by_request:  # vLLM holds a request out of its steps until reported
            logger.error("request %s: a second load beside the steps while one is under way", spec.req_id)
        self.jobs[job.job_id] = job
        self._by_request[spec.req_id] = job.job_id
        return job

    def start(
        self,
        spec: LoadSpec,
        prefix: PinnedPrefix,
        after: torch.cuda.Event | None = None,
        timeline: LoadTimeline | None = None,
    ) -> LoadJob:
        """A granted load of the request's pinned chunks: its copy is queued on the load stream
        after ``after`` (GrantFences; on CPU: copied now); reported by :meth:`finished`."""
        job = self._new_job(spec, timeline, after)
        self._add_piece(job, prefix)
        return job

    def pull_then_load(
        self,
        spec: LoadSpec,
        offer: Offer,
        local: PinnedPrefix,
        then: Miss | None = None,
        after: torch.cuda.Event | None = None,
        timeline: LoadTimeline | None = None,
    ) -> LoadJob | None:
        """A granted load whose chunks past the local hit a peer or the remote store offered: a job
        that pulls them and copies each landing as it comes. None where nothing needs pulling
        (the engine's own cache covers the offered part)."""
        held = local.num_tokens
        needed = -(-(spec.end - held) // self.engine.chunk_size)
        if needed <= 0:
            return None
        offer = offer.first(min(needed, offer.chunks))
        now = time.monotonic()
        landed = Landed(self._wakeup)
        pull = Pull(local, self.engine.pull_offer_async(offer, landed), offer.chunks, now, landed, then, _origin(offer))
        job = self._new_job(spec, timeline, after, pull)
        job.timeline.pull_started = now
        # When the pull ended, not when a step noticed (the callback runs on the worker's loop).
        pull.future.add_done_callback(functools.partial(_stamp_pull_end, job.timeline))
        logger.info(
            "request %s: pulling %d chunk(s) %s offered (tokens [%d, %d)), then loading [%d, %d) beside the steps",
            spec.req_id,
            offer.chunks,
            pull.origin,
            held,
            held + offer.chunks * self.engine.chunk_size,
            spec.start,
            spec.end,
        )
        return job

    def pull_segments(
        self, spec: LoadSpec, offers: list[tuple[list[int], Offer]], timeline: LoadTimeline | None = None
    ) -> LoadJob:
        """A granted blended load's part beside the steps: a job that pulls the segments a peer or
        the remote store offered (``(keys, offer)`` each) and pins them, copying nothing. It
        ends DONE once every one is held (the step that first schedules the request blends
        them), FAILED where one is not (vLLM recomputes the prompt)."""
        if not offers:  # this rank holds every segment (another rank pulls): done at the next step
            job = self._new_job(spec, timeline, None)
            job.segments = SegmentPulls([])
            return job
        now = time.monotonic()
        landed = Landed(self._wakeup)
        future = _all_pulled([self.engine.pull_offer_async(offer) for _, offer in offers])
        offered = sum(offer.chunks for _, offer in offers)
        local = PinnedPrefix([], self.engine.chunk_size)
        pull = Pull(local, future, offered, now, landed, origin=" or ".join(sorted({_origin(o) for _, o in offers})))
        job = self._new_job(spec, timeline, None, pull)
        job.segments = SegmentPulls([keys for keys, _ in offers])
        job.timeline.pull_started = now
        future.add_done_callback(functools.partial(_stamp_pull_end, job.timeline))
        logger.info(
            "request %s: pulling %d segment(s) of %d chunk(s) %s offered, to blend tokens [0, %d) once they land",
            spec.req_id,
            len(offers),
            offered,
            pull.origin,
            spec.end,
        )
        return job

    def abort(self, req_id: str) -> None:
        """The request finished (an abort): a pull is given up now; what landed is still copied
        and the job is reported as usual, for vLLM to free the blocks."""
        job = self.job_of(req_id)
        if job is None:
            return
        if job.phase is JobPhase.PULLING:
            self._end_pull(job, JobEvent.ABORTED, time.monotonic())
        else:
            job.on(JobEvent.ABORTED)

    # -- pulls ------------------------------------------------------------------------------------

    def _advance_pulls(self) -> None:
        """Copy what every pull landed since; a pull that ended (or passed its deadline) gives way
        to copying the rest of what came (a pull cut short loads its part; vLLM recomputes the rest)."""
        now = time.monotonic()
        for job in list(self.jobs.values()):
            pull = job.pull
            if job.phase is not JobPhase.PULLING or pull is None:
                continue
            if pull.future.done():
                self._end_pull(job, JobEvent.PULL_ENDED, now)
            elif now - pull.started > PEER_FETCH_TIMEOUT_S:
                self._end_pull(job, JobEvent.PULL_LATE, now)
            elif job.segments is None:
                self._copy_landed(job)

    def _end_pull(self, job: LoadJob, event: JobEvent, now: float) -> None:
        pull = job.pull
        assert pull is not None
        pulled, miss = 0, pull.then
        if event is JobEvent.PULL_ENDED:
            try:
                outcome: PulledChunks = pull.future.result()
                pulled = outcome.chunks
                if pulled < pull.offered:
                    miss = outcome.miss
            except Exception as e:
                logger.exception("request %s: pulling the chunks %s offered failed", job.req_id, pull.origin)
                miss = Miss(HOLDER_GONE, f"the pull failed: {e}")
        else:
            pull.future.cancel()
            aborted = event is JobEvent.ABORTED
            why = "aborted while pulling" if aborted else f"pull past its {PEER_FETCH_TIMEOUT_S:.0f} s deadline"
            logger.warning(
                "request %s: %s after %.1f s: its blocks are recomputed", job.req_id, why, now - pull.started
            )
            miss = None if aborted else Miss(TIMEOUT, why)
        job.on(event)
        if job.segments is not None:
            self._pin_segments(job, pulled, event, now)
            return
        spec, engine = job.spec, self.engine
        prefix = engine.pin_prefix(spec.chunk_hashes, spec.end)
        pull.local.release()  # the lookup's pin of the local hit: the new pin holds it
        # (A request aborted meanwhile missed nothing it still wants.)
        engine.count_lookup(spec.num_tokens, prefix.num_tokens, miss, count_misses=not job.aborted)
        logger.info(
            "request %s: pulled %d of the %d chunk(s) %s offered in %.1f ms; %d of its tokens [%d, %d) held to load",
            job.req_id,
            pulled,
            pull.offered,
            pull.origin,
            (now - pull.started) * 1e3,
            max(0, min(prefix.num_tokens, spec.end) - spec.start),
            spec.start,
            spec.end,
        )
        self._add_piece(job, prefix)  # the rest after what landed earlier

    def _pin_segments(self, job: LoadJob, pulled: int, event: JobEvent, now: float) -> None:
        """A blended load's segment pull ended: pin each pulled segment, whole or not at all."""
        segments = job.segments
        assert segments is not None and job.pull is not None
        if event is JobEvent.PULL_ENDED:
            segments.missing = sum(not pin_whole(self.engine.storage, keys, segments.pins) for keys in segments.keys)
        else:  # given up: nothing it brought is blended
            segments.missing = len(segments.keys)
        logger.info(
            "request %s: pulled %d of the %d chunk(s) %s offered for %d segment(s) in %.1f ms; %d held whole",
            job.req_id,
            pulled,
            job.pull.offered,
            job.pull.origin,
            len(segments.keys),
            (now - job.pull.started) * 1e3,
            len(segments.keys) - segments.missing,
        )

    def _copy_landed(self, job: LoadJob) -> None:
        """Queue the copy of what a running pull landed since the job's last piece (its chunks are
        pinned and loadable once committed): the copies then overlap the pull, and only the last
        landing's remains once it ends."""
        pull = job.pull
        assert pull is not None
        landed_to = min(job.spec.end, pull.local.num_tokens + pull.landed.chunks * self.engine.chunk_size)
        if landed_to > job.copied_to:
            job.on(JobEvent.LANDED)
            self._add_piece(job, self.engine.pin_prefix(job.spec.chunk_hashes, landed_to))

    # -- copies -----------------------------------------------------------------------------------

    def _add_piece(self, job: LoadJob, prefix: PinnedPrefix) -> None:
        """Copy the pinned ``prefix``'s chunks past what the job's earlier pieces copy. A piece that
        cannot be planned or queued ends what the job loads there."""
        spec = job.spec
        start, end = job.copied_to, min(spec.end, prefix.num_tokens)
        if job.broken or end <= start:
            prefix.release()
            return
        try:
            plan = self.engine.plan_load(prefix, spec.block_ids, start, end, total_tokens=spec.num_tokens)
            copy = self._copy(plan, job.after)
            if not copy.on_device:  # a CPU engine, or pages the kernels cannot reach: the host copies now
                copy.wait(_ALL_PLANES)
        except Exception:
            logger.exception("request %s: loading tokens [%d, %d) beside the steps failed", spec.req_id, start, end)
            if self.planes and self.planes[0].is_cuda:  # copies queued before it failed read the pins
                layerwise.drain(self.planes[0].device)
            prefix.release()
            job.broken = True  # the pull goes on to its end; nothing it brings is loaded
            return
        job.pieces.append(Piece(prefix, plan, copy, copy_kind(copy, plan)))
        if job.timeline.queued is None:
            job.timeline.queued = copy.queued_at

    def _copy(self, plan: LoadPlan, after: torch.cuda.Event | None) -> LayerwiseLoad:
        """One piece's copy on the load stream: after ``after`` (None: everything on the current
        stream so far) and after the store copies still reading the blocks it writes (a
        preemption freed them without waiting for those)."""
        return LayerwiseLoad(
            [plan],
            self.planes,
            {_ALL_PLANES: range(len(self.planes))},
            fence=functools.partial(self.engine.order_stores_before, blocks=plan.written_blocks()),
            staging=self.staging,
            after=after,
        )

    # -- reports ----------------------------------------------------------------------------------

    def finished(self) -> list[LoadJob]:
        """The jobs that ended since the last call (DONE or FAILED, with ``loaded_to``), each once;
        their pins are released and their copies counted."""
        # After a step that reported loads, an idle step does not wait: vLLM processes a step's
        # report only after the next step is scheduled and run (async scheduling), so a wait here
        # would delay those requests' first tokens by as much.
        if self._step_tokens == 0 and not self._reported_last_step:
            self._wait_in_idle_step()
        else:
            self._advance_pulls()
            if self._step_tokens:
                self._wait_for_copies_about_to_end()
        ended: list[LoadJob] = []
        for job in list(self.jobs.values()):
            if job.phase is JobPhase.COPYING and job.copies_done():
                job.on(JobEvent.COPIES_DONE)
                self._count_copies(job)
            if job.phase is JobPhase.CHECKING:
                self._check(job)
            if job.phase.ended:
                del self.jobs[job.job_id]
                if self._by_request.get(job.req_id) == job.job_id:
                    del self._by_request[job.req_id]
                job.timeline.log_reported(job.req_id)
                ended.append(job)
        self._reported_last_step = bool(ended)
        return ended

    def _check(self, job: LoadJob) -> None:
        """Its copies are done: chunks a peer wrote into the GPU tier whose check was still running
        when they were pinned are waited for; the job ends where its good KV ends. A blended
        load's segment pull ends all or nothing: the blend needs every segment."""
        if job.segments is not None:
            whole = not job.segments.missing and not job.aborted
            if not whole:
                job.segments.release()
            job.end(job.spec.end if whole else job.spec.start, self.engine.layout.block_size)
            return
        plan = job.plan()
        loaded_to = plan.loaded_to
        if plan.unchecked:
            bad_at = self.engine.first_bad_chunk(plan, time.monotonic() + LANDED_CHECK_TIMEOUT_S)
            if bad_at is not None:
                log_landed_chunk_failed(job.spec, bad_at)
                good_to = min(max(bad_at, job.spec.start), loaded_to)
                self.engine.counters.retrieved_tokens -= loaded_to - good_to
                loaded_to = good_to
        job.end(loaded_to, self.engine.layout.block_size)

    def _count_copies(self, job: LoadJob) -> None:
        """A job whose copies are done: one line for all its pieces (their copy times summed), its
        copy rates, when its copies ran; its pins go."""
        pieces = job.pieces
        if not pieces:
            return
        how = "beside the steps"
        if any(piece.copy.staged for piece in pieces):
            how += ", through the copy engine"
        if len(pieces) > 1:
            how += f", in {len(pieces)} pieces as its pull landed them"
        self.engine.loaded(job.plan(), sum(piece.copy.seconds for piece in pieces), how)
        for piece in pieces:
            self._copy_rates.observe(piece.kind, piece.plan.nbytes, piece.copy.seconds)
            piece.prefix.release()
        timeline = job.timeline
        first, last = pieces[0].copy, pieces[-1].copy
        start, end = first.device_window(), last.device_window()
        timeline.copy_started = start[0] if start else first.queued_at
        timeline.copy_ended = end[1] if end else last.queued_at + last.seconds
        timeline.pieces = len(pieces)

    def _wait_in_idle_step(self) -> None:
        """In a step that computed nothing (vLLM runs them back to back while requests wait on
        their loads or their pulls before a grant): wait, up to IDLE_STEP_WAIT_S, until a pull or a
        copy ends, so that what
        ended is reported by this step rather than the next, and the step loop leaves the
        pulling thread the interpreter meanwhile. A pull that ends has its rest queued at once
        and the wait goes on for that copy (from the GPU tier, ~1 ms)."""
        deadline = time.monotonic() + IDLE_STEP_WAIT_S
        while True:
            self._wakeup.rearm()  # before looking: a landing after the look cuts the wait short
            self._advance_pulls()
            jobs = list(self.jobs.values())
            if any(job.phase is not JobPhase.PULLING and job.copies_done() for job in jobs):
                return
            pulls = [job.pull.future for job in jobs if job.phase is JobPhase.PULLING and job.pull is not None]
            pulls += self.lookup_pulls()
            copying = any(not job.copies_done() for job in jobs)
            if not pulls and not copying:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            # Pulls (and their landings) say when through futures; copies are looked at between sleeps.
            timeout = min(remaining, IDLE_STEP_POLL_S) if copying else remaining
            concurrent.futures.wait(
                [*pulls, self._wakeup.future()], timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED
            )

    def _wait_for_copies_about_to_end(self) -> None:
        """In a step that computes: wait, at most BUSY_STEP_COPY_WAIT_S, for the jobs whose copies
        are expected to end within it (running on the device, with a rate measured on earlier
        copies of their kind), so that they are reported by this step and not a forward pass later.

        This blocks vLLM's model-runner thread, hence the bound. get_finished runs once the
        step's forward pass is queued, which keeps the GPU busy for longer than that (a prefill
        takes tens of ms; with async scheduling the next step's host work is already overlapping
        this one), so the wait mostly costs host time the device does not miss; a copy that
        runs late only costs the bound, once per step, and only while one is due."""
        now = time.monotonic()
        due = [
            job
            for job in self.jobs.values()
            if job.phase is JobPhase.COPYING
            and not job.copies_done()
            and all(self._ends_within(piece, now, BUSY_STEP_COPY_WAIT_S) for piece in job.pieces)
        ]
        if not due:
            return
        deadline = now + BUSY_STEP_COPY_WAIT_S
        while not all(job.copies_done() for job in due):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            time.sleep(min(remaining, IDLE_STEP_POLL_S))
        waited_ms = (time.monotonic() - now) * 1e3
        for job in due:
            job.timeline.step_wait_ms += waited_ms
        logger.debug(
            "a computing step waited %.2f ms for %d load(s) beside the steps about to end; %d ended",
            waited_ms,
            len(due),
            sum(job.copies_done() for job in due),
        )

    def _ends_within(self, piece: Piece, now: float, seconds: float) -> bool:
        """Is the piece's copy done, or running and expected to end within ``seconds``? Expected
        from when the host first saw it running (no earlier than it began) and the rate of its
        kind; unknown (False) before it runs or before a copy of its kind was measured."""
        if piece.copy.done():
            return True
        if piece.running_since is None:
            if not piece.copy.started():
                return False  # still behind other work: its end cannot be told
            piece.running_since = now
        expected = self._copy_rates.expected_s(piece.kind, piece.plan.nbytes)
        return expected is not None and piece.running_since + expected - now <= seconds

    def close(self) -> None:
        """Give up on pulls, wait for copies still reading pins, give the pins back."""
        for job in self.jobs.values():
            if job.phase is JobPhase.PULLING and job.pull is not None:
                job.pull.future.cancel()
                job.pull.local.release()
            if job.segments is not None:
                job.segments.release()
            for piece in job.pieces:  # their pins go once their copies are done
                piece.copy.synchronize()
                piece.prefix.release()
        self.jobs.clear()
        self._by_request.clear()
        self.staging = None  # no copy reads it any more


def _origin(offer: Offer) -> str:
    return "the remote store" if isinstance(offer, RemoteOffer) else "a peer"


def _stamp_pull_end(timeline: LoadTimeline, _future: concurrent.futures.Future) -> None:
    timeline.pull_ended = time.monotonic()


def _all_pulled(pulls: list[concurrent.futures.Future]) -> concurrent.futures.Future:
    """One future for several pulls: done when all are, with the chunks they brought summed and
    the first one's reason for bringing fewer; cancelling it cancels them."""
    combined: concurrent.futures.Future = concurrent.futures.Future()
    left = [len(pulls)]
    lock = threading.Lock()

    def one_done(_: concurrent.futures.Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        chunks, miss = 0, None
        for pull in pulls:
            try:
                outcome: PulledChunks = pull.result(0)
            except concurrent.futures.CancelledError:
                miss = miss or Miss(TIMEOUT, "the pull was given up")
                continue
            except Exception as e:
                miss = miss or Miss(HOLDER_GONE, f"the pull failed: {e}")
                continue
            chunks += outcome.chunks
            miss = miss or outcome.miss
        with contextlib.suppress(concurrent.futures.InvalidStateError):  # given up meanwhile
            combined.set_result(PulledChunks(chunks, miss))

    def give_up(done: concurrent.futures.Future) -> None:
        if done.cancelled():
            for pull in pulls:
                pull.cancel()

    combined.add_done_callback(give_up)
    for pull in pulls:
        pull.add_done_callback(one_done)
    return combined
