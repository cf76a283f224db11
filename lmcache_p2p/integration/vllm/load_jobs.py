"""A rank's loads beside the steps (vLLM's asynchronous loads) as jobs, by id: what one job holds
and the phases it goes through. :class:`~lmcache_p2p.integration.vllm.async_loads.AsyncLoads`
runs them.

A job is made when its load is granted (start_load_kv) and lives until get_finished reports it:

    PULLING  a peer's (or the remote store's) offer is pulled; what lands is copied as it comes
             (a blended load's segments: pulled and pinned, for the step that blends them)
    COPYING  every piece is queued on the load stream (no piece is to come)
    CHECKING the copies are done; chunks a peer wrote into the GPU tier are checksum-checked
    DONE     loaded all it promised            } reported once, as (job id, loaded_to); vLLM
    FAILED   loaded less (``loaded_to``)       } recomputes the blocks past ``loaded_to``

Every copy goes the same way (a piece on the load stream; where the kernels cannot take it, the
host copies it at once). A piece that cannot be planned or queued ends what the job loads there;
the job still waits for its pull and for the copies before it (they write blocks vLLM must not
reuse before they end). An abort only gives the pull up: the blocks stay vLLM's until
the job is reported. :data:`TRANSITIONS` is the whole table; :meth:`LoadJob.on` refuses the rest.
"""

from __future__ import annotations

import concurrent.futures
import enum
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcache_p2p.cache_engine import LoadPlan, PinnedPrefix
from lmcache_p2p.integration.vllm.metadata import LoadSpec
from lmcache_p2p.layerwise import LayerwiseLoad
from lmcache_p2p.miss_reasons import Miss

logger = logging.getLogger(__name__)

# How long the end of a step waits for the checksum check of chunks it loaded straight from a
# peer's write into the GPU tier; past it they count as bad (vLLM recomputes them).
LANDED_CHECK_TIMEOUT_S = 10.0


class JobPhase(enum.Enum):
    PULLING = "pulling"
    COPYING = "copying"
    CHECKING = "checking"
    DONE = "done"
    FAILED = "failed"

    @property
    def ended(self) -> bool:
        return self in (JobPhase.DONE, JobPhase.FAILED)


class JobEvent(enum.Enum):
    LANDED = "a batch of the pull landed"
    PULL_ENDED = "the pull ended (all, part or none of the offer came)"
    PULL_LATE = "the pull passed its deadline"
    ABORTED = "the request was aborted"
    COPIES_DONE = "every piece's copy is done"
    LOADED_ALL = "it loaded all it promised"
    LOADED_SHORT = "it loaded less than it promised"


_P, _E = JobPhase, JobEvent
# (phase, event) -> the phase after it. An abort gives a pull up (what landed is still copied into
# blocks vLLM holds until the job is reported); once copying, it changes nothing.
TRANSITIONS: dict[tuple[JobPhase, JobEvent], JobPhase] = {
    (_P.PULLING, _E.LANDED): _P.PULLING,
    (_P.PULLING, _E.PULL_ENDED): _P.COPYING,
    (_P.PULLING, _E.PULL_LATE): _P.COPYING,
    (_P.PULLING, _E.ABORTED): _P.COPYING,
    (_P.COPYING, _E.ABORTED): _P.COPYING,
    (_P.COPYING, _E.COPIES_DONE): _P.CHECKING,
    (_P.CHECKING, _E.ABORTED): _P.CHECKING,
    (_P.CHECKING, _E.LOADED_ALL): _P.DONE,
    (_P.CHECKING, _E.LOADED_SHORT): _P.FAILED,
    (_P.DONE, _E.ABORTED): _P.DONE,
    (_P.FAILED, _E.ABORTED): _P.FAILED,
}


@dataclass
class LoadTimeline:
    """Where a request's load beside the steps spent its time on this rank: time.monotonic()
    (one clock for every process of the host) when it passed each point, None where it did not.
    Logged at DEBUG in one line once reported (benchmarks/gpu/e2e.py reads it)."""

    seen: float  # its lookup first reached this rank (or the load did, where no lookup was kept)
    offered: float | None = None  # a peer's offer was known (before the lookup answered)
    granted: float | None = None  # the load reached this rank (start_load_kv)
    pull_started: float | None = None
    pull_ended: float | None = None
    queued: float | None = None  # the copy was queued on the load stream (or began, on the host)
    copy_started: float | None = None  # on the device
    copy_ended: float | None = None
    reported: float | None = None  # returned by get_finished
    step_wait_ms: float = 0.0  # how long a computing step waited for its copy to end
    pieces: int = 0  # copies it took (one per landing of its pull, when loaded as they came)

    # The points in order, with the names the line gives them.
    NAMES = {
        "offered": "offer",
        "granted": "granted",
        "pull_started": "pull start",
        "pull_ended": "pull end",
        "queued": "load queued",
        "copy_started": "load start",
        "copy_ended": "load end",
        "reported": "reported",
    }

    def describe(self) -> str:
        """Each point's offset from ``seen`` in ms ("-": not passed), in order."""
        parts = []
        for point, name in self.NAMES.items():
            when = getattr(self, point)
            parts.append(f"{name} {'-' if when is None else f'{(when - self.seen) * 1e3:.1f}'}")
        return ", ".join(parts)

    def log_reported(self, req_id: str) -> None:
        self.reported = time.monotonic()
        logger.debug(
            "request %s timeline, ms from first seen: %s (first seen at %.6f s monotonic; %d piece(s); a "
            "computing step waited %.2f ms for its copy)",
            req_id,
            self.describe(),
            self.seen,
            self.pieces,
            self.step_wait_ms,
        )


class Wakeup:
    """Cuts get_finished's wait in a step that computed nothing short from the worker's thread (a
    pull landed a batch): a future to wait on beside the pulls', renewed once it fired."""

    def __init__(self) -> None:
        self._future: concurrent.futures.Future = concurrent.futures.Future()
        self._lock = threading.Lock()

    def future(self) -> concurrent.futures.Future:
        """What to wait on: done once :meth:`fire` was called since the last :meth:`rearm`."""
        return self._future

    def rearm(self) -> None:
        with self._lock:
            if self._future.done():
                self._future = concurrent.futures.Future()

    def fire(self) -> None:
        with self._lock:
            if not self._future.done():
                self._future.set_result(None)


class Landed:
    """A pull's progress hook (peer_service.Landed): how many leading chunks of its offer are held
    here so far, set on the worker's thread after each batch, read by the model-runner thread."""

    def __init__(self, wakeup: Wakeup):
        self.chunks = 0
        self._wakeup = wakeup

    def __call__(self, chunks: int) -> None:
        self.chunks = max(self.chunks, chunks)
        self._wakeup.fire()


@dataclass
class Pull:
    """A job's pull of chunks past the rank's local hit that a peer or the remote store offered:
    it runs on the worker's loop (the store's: its fetch threads)."""

    local: PinnedPrefix  # the local hit, held until the job pins the whole prefix
    future: concurrent.futures.Future  # of PulledChunks: how many chunks came, and why not more
    offered: int  # chunks asked for
    started: float
    landed: Landed  # the offer's leading chunks held so far
    then: Miss | None = None  # why the chunk after the offered ones is missed (the lookup's answer)
    origin: str = "a peer"  # who offered the chunks, for the log


@dataclass
class SegmentPulls:
    """A blended load's part beside the steps: the segments a peer or the remote store offered,
    pulled and pinned here. The blend itself runs in the step that first schedules the request
    (it computes through the model's layers, and every TP rank's step must run it), from these
    pins and those of the segments held when looked up."""

    keys: list[list[int]]  # each pulled segment's chunk keys
    pins: dict[int, Any] = field(default_factory=dict)  # key -> pinned chunk, once pulled
    missing: int = 0  # pulled segments not held whole once the pull ended

    def release(self) -> None:
        for chunk in self.pins.values():
            chunk.release()
        self.pins = {}


def pin_whole(storage: Any, keys: list[int], pins: dict[int, Any]) -> bool:
    """Pin a segment's chunks into ``pins`` (key -> pinned chunk) if every one is held, else none;
    a key pinned already (a segment repeated in the prompt) keeps its one pin. Whether it was whole."""
    chunks = [storage.pin(int(key), gpu=True) for key in keys]  # the blender copies them to its device
    whole = bool(keys) and all(chunk is not None for chunk in chunks)
    for key, chunk in zip(keys, chunks, strict=True):
        if chunk is None:
            continue
        if whole and int(key) not in pins:
            pins[int(key)] = chunk
        else:
            chunk.release()
    return whole


@dataclass
class Piece:
    """Part of a job's copies: its pins, what it copies, and the copy (queued on the load stream;
    where the kernels cannot take it, done by the host at once)."""

    prefix: PinnedPrefix
    plan: LoadPlan
    copy: LayerwiseLoad
    kind: str  # which copy rate it goes at (CopyRates): "staged", "device" or "host"
    running_since: float | None = None  # when the host first saw the device begin it


@dataclass
class LoadJob:
    """One granted load beside the steps: what it loads (``spec``), its pull, its copies (one
    piece, or a piece per landing of its pull, in token order), and where it stands."""

    job_id: int
    spec: LoadSpec
    timeline: LoadTimeline
    phase: JobPhase = JobPhase.COPYING
    pull: Pull | None = None
    segments: SegmentPulls | None = None  # a blended load's: it pulls segments and copies nothing
    pieces: list[Piece] = field(default_factory=list)
    after: torch.cuda.Event | None = None  # where its copies start on vLLM's stream (GrantFences)
    aborted: bool = False
    broken: bool = False  # a piece could not be queued: nothing after it loads
    loaded_to: int | None = None  # set once ended: vLLM recomputes the blocks past it
    unloaded_blocks: list[int] = field(default_factory=list)  # those blocks

    @property
    def req_id(self) -> str:
        return self.spec.req_id

    def on(self, event: JobEvent) -> JobPhase:
        """Move to the phase ``event`` leads to (:data:`TRANSITIONS`); any other is a bug."""
        after = TRANSITIONS.get((self.phase, event))
        if after is None:
            raise RuntimeError(f"load job {self.job_id} ({self.req_id}): {event.value} while {self.phase.value}")
        if event is JobEvent.ABORTED:
            self.aborted = True
        self.phase = after
        return after

    def end(self, loaded_to: int, block_size: int) -> None:
        """It loaded ``[spec.start, loaded_to)``: DONE, or FAILED short of ``spec.end``."""
        self.loaded_to = loaded_to
        if loaded_to >= self.spec.end:
            self.on(JobEvent.LOADED_ALL)
            return
        self.unloaded_blocks = blocks_past(self.spec, loaded_to, block_size)
        self.on(JobEvent.LOADED_SHORT)
        log_short_load(self.spec, loaded_to, len(self.unloaded_blocks))

    @property
    def copied_to(self) -> int:
        """Where what the pieces copy ends (the next piece starts there)."""
        return self.pieces[-1].plan.loaded_to if self.pieces else self.spec.start

    def copies_done(self) -> bool:
        return all(piece.copy.done() for piece in self.pieces)

    def plan(self) -> LoadPlan:
        """The pieces' plans as one load (what is counted, logged and checked)."""
        if len(self.pieces) == 1:
            return self.pieces[0].plan
        spec = self.spec
        if not self.pieces:
            return LoadPlan(start=spec.start, loaded_to=spec.start, total_tokens=spec.num_tokens)
        whole = LoadPlan(self.pieces[0].plan.start, self.copied_to, self.pieces[0].plan.total_tokens)
        for piece in self.pieces:
            plan = piece.plan
            whole.pages += plan.pages
            whole.chunk_blocks += plan.chunk_blocks
            whole.skips += plan.skips
            whole.nbytes += plan.nbytes
            whole.from_gpu += plan.from_gpu
            whole.unchecked += plan.unchecked
        return whole


def by_outcome(ended: list[LoadJob]) -> tuple[set[str], set[str]]:
    """Ended jobs' requests: those that loaded all they promised, and those that failed."""
    return (
        {job.req_id for job in ended if job.phase is JobPhase.DONE},
        {job.req_id for job in ended if job.phase is JobPhase.FAILED},
    )


def blocks_past(spec: LoadSpec, loaded_to: int, block_size: int) -> list[int]:
    """The blocks of ``spec``'s tokens ``[loaded_to, end)``: a short load's, to recompute."""
    return spec.block_ids[loaded_to // block_size : -(-spec.end // block_size)]


def log_short_load(spec: LoadSpec, loaded_to: int, blocks: int) -> None:
    logger.warning(
        "request %s: loaded tokens [%d, %d) of the promised [%d, %d); %d block(s) will be recomputed",
        spec.req_id,
        spec.start,
        loaded_to,
        spec.start,
        spec.end,
        blocks,
    )


def log_landed_chunk_failed(spec: LoadSpec, bad_at: int) -> None:
    logger.error(
        "request %s: the chunk at token %d, loaded from the GPU tier as a peer wrote it, failed its "
        "checksum check (or was not checked within %.0f s); it is recomputed",
        spec.req_id,
        bad_at,
        LANDED_CHECK_TIMEOUT_S,
    )


class CopyRates:
    """How fast loads beside the steps have been copying, by kind (through the staging ring,
    device to device, the kernel reading host memory): what a copy's expected length is taken
    from when a computing step considers waiting for its end."""

    WEIGHT = 0.3  # of the newest copy in the moving average

    def __init__(self) -> None:
        self._bytes_per_s: dict[str, float] = {}

    def observe(self, kind: str, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        old = self._bytes_per_s.get(kind)
        self._bytes_per_s[kind] = rate if old is None else old + self.WEIGHT * (rate - old)

    def expected_s(self, kind: str, nbytes: int) -> float | None:
        """The copy's expected length; None before one of its kind was measured."""
        rate = self._bytes_per_s.get(kind)
        return None if rate is None else nbytes / rate


def copy_kind(copy: LayerwiseLoad, plan: LoadPlan) -> str:
    """Which rate a copy goes at: through the staging ring, device to device, from host memory."""
    if copy.staged:
        return "staged"
    return "device" if plan.from_gpu == len(plan.pages) else "host"
