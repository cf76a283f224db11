"""A rank's loads: granted hits moved from our tiers (or first from a peer or the remote store)
into vLLM's blocks.

One executor, one load per request, with one of three fences (docs/architecture.md):

* **in the step**: copied in ``start_load_kv``, before the forward pass that reads them;
* **layer by layer** (``use_layerwise``): queued in ``start_load_kv``, each layer's copy waited for
  in ``wait_for_layer_load`` (on a GPU the forward pass overlaps the copies), pins released once
  the copies are done;
* **beside the steps** (vLLM's asynchronous loads): vLLM holds the request out of its steps
  (WAITING_FOR_REMOTE_KVS) while the copy runs on the load stream (on CPU: at once), and
  ``get_finished`` reports it done. A load whose chunks past the rank's local hit were offered (by
  a peer, or by the remote store) pulls them first (:meth:`LoadExecutor.pull_then_load`, a job
  keyed by request id, the pull on the worker's loop or the store's fetch threads), then loads
  what came, as it lands.

What a load did not fill is reported (``take_errors``, or as a failed receive) and vLLM
recomputes those blocks; a load never leaves wrong KV behind. Chunks a peer wrote into the GPU
tier whose checksum check was still running are checked before their step's output counts.

A load beside the steps starts on the load stream after the point on vLLM's stream that its
blocks wait for (:class:`GrantFences`), not after whatever vLLM queued since, and is reported as
soon as its copy ends: a step that computed nothing waits briefly for any pull or copy to end, a
step that computes waits (at most 2 ms) for a copy about to end. Each such load's way through
this rank is one DEBUG line once reported (:class:`LoadTimeline`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from lmcache_p2p import layerwise
from lmcache_p2p.cache_engine import CacheEngine, LoadPlan, PinnedPrefix
from lmcache_p2p.integration.vllm.metadata import LoadSpec, P2PConnectorMetadata
from lmcache_p2p.layerwise import LayerwiseLoad
from lmcache_p2p.miss_reasons import HOLDER_GONE, TIMEOUT, Miss, PulledChunks
from lmcache_p2p.peer_service import Offer
from lmcache_p2p.remote.offers import RemoteOffer
from lmcache_p2p.vocab import PEER_FETCH_TIMEOUT_S

logger = logging.getLogger(__name__)

# In a step that computed nothing while loads beside the steps pull or copy, how long
# get_finished waits for one of them to end: the step loop would otherwise spin, holding the
# interpreter the pulling thread needs, and a copy ending just after it returned would be
# reported only by the next step.
IDLE_STEP_WAIT_S = 0.005
# How often that wait looks at the copies: a CUDA event cannot be waited for with a timeout, so
# it is queried between sleeps (each gives the interpreter up).
IDLE_STEP_POLL_S = 0.0002
# In a step that computes, the longest get_finished waits for a copy beside the steps that is
# about to end (its expected end within this), so that it is reported with this step and not
# the next (a forward pass later). Bounded because this is vLLM's model-runner thread: see
# LoadExecutor._wait_for_copies_about_to_end.
BUSY_STEP_COPY_WAIT_S = 0.002
# How long the end of a step waits for the checksum check of chunks it loaded straight from a
# peer's write into the GPU tier; past it they count as bad (vLLM recomputes them).
LANDED_CHECK_TIMEOUT_S = 10.0

# A load beside the steps copies every plane in one launch: the layer-wise machinery with one
# "layer" spanning them all.
_ALL_PLANES = "all planes"


@dataclass
class _StepLoad:
    """A step's layer-wise load, its requests and their pins (released once its copies are done)."""

    load: LayerwiseLoad
    specs: list[LoadSpec]
    prefixes: list[PinnedPrefix]
    failed: bool = False


@dataclass
class _Piece:
    """Part of a request's load beside the steps: its pins, what it copies, and the copy (queued
    on the load stream; where the kernels cannot take it, done by the host at once)."""

    prefix: PinnedPrefix
    plan: LoadPlan
    copy: LayerwiseLoad
    kind: str  # which copy rate it goes at (_CopyRates): "staged", "device" or "host"
    running_since: float | None = None  # when the host first saw the device begin it


@dataclass
class _LoadBesideSteps:
    """A request's load beside the steps: one piece, or, for chunks a peer's pull brings, a piece
    per landing (copied while the rest arrive), in token order. Reported once ``complete`` (no
    piece is to come) and every copy is done. (One copied by the host in full runs at once, as a
    load in the step does, and never gets here.)"""

    spec: LoadSpec
    pieces: list[_Piece] = field(default_factory=list)
    complete: bool = False
    broken: bool = False  # a piece could not be queued: nothing after it loads

    @property
    def loaded_to(self) -> int:
        """Where what the pieces copy ends (the next piece starts there)."""
        return self.pieces[-1].plan.loaded_to if self.pieces else self.spec.start

    def done(self) -> bool:
        return self.complete and all(piece.copy.done() for piece in self.pieces)

    def plan(self) -> LoadPlan:
        """The pieces' plans as one load (what is counted, logged and checked)."""
        if len(self.pieces) == 1:
            return self.pieces[0].plan
        spec = self.spec
        if not self.pieces:
            return LoadPlan(start=spec.start, loaded_to=spec.start, total_tokens=spec.num_tokens)
        whole = LoadPlan(self.pieces[0].plan.start, self.loaded_to, self.pieces[0].plan.total_tokens)
        for piece in self.pieces:
            plan = piece.plan
            whole.pages += plan.pages
            whole.chunk_blocks += plan.chunk_blocks
            whole.skips += plan.skips
            whole.nbytes += plan.nbytes
            whole.from_gpu += plan.from_gpu
            whole.unchecked += plan.unchecked
        return whole


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


class GrantFences:
    """Where on vLLM's stream a step's loads beside the steps may start.

    Such a load writes blocks that vLLM allocated to its request when it granted the load, in the
    step whose metadata carries it. From then on no work of vLLM's touches them: the request is
    out of the steps until get_finished reports it (an abort keeps its blocks until then), and
    only its own later steps will write them. Before then, the blocks' former owner may still be
    read or written by earlier steps' forward passes, and the granting step's preparation may
    zero them (vLLM >= 0.32, models that need it) or copy a partly cached block into one (a
    local prefix-cache hit ending inside a block). So a load must start after all of that, and
    needs nothing queued after it: not this step's forward pass, which vLLM >= 0.32 queues before
    start_load_kv when the step loads nothing in it, nor later steps' (a load that pulls first is
    queued in some later get_finished). Store copies that read the blocks are the load's own
    ``fence``.

    That point is an event on the current stream. In ``before_forward`` (vLLM's
    handle_preemptions) it is right before the forward pass in vLLM's model runner V2 (after
    update_requests), but before the step's block preparation (_update_states) in model runner
    V1, so it is used only where that preparation cannot touch the load's blocks: a KV cache
    config saying new blocks need no zeroing, and a load starting on a block boundary (no
    copy-on-write). Otherwise, and where start_load_kv runs before the forward pass (after the
    preparation), the event is recorded in start_load_kv: the point such a load always waited
    for, without the steps queued after it."""

    def __init__(self, device: torch.device | None, block_size: int, zeroes_new_blocks: bool):
        self.device = device if device is not None and device.type == "cuda" else None
        self.block_size = block_size
        self.zeroes_new_blocks = zeroes_new_blocks
        self._step: P2PConnectorMetadata | None = None
        self._before_forward: torch.cuda.Event | None = None
        self._at_load: torch.cuda.Event | None = None

    def before_forward(self, meta: P2PConnectorMetadata) -> None:
        """Mark the stream before the step's forward pass (only for steps granting such loads)."""
        self._step, self._before_forward, self._at_load = meta, None, None
        if self.device is not None and any(spec.beside_steps for spec in meta.loads):
            self._before_forward = self._record()

    def for_load(self, meta: P2PConnectorMetadata, spec: LoadSpec) -> torch.cuda.Event | None:
        """The event the step's load ``spec`` starts after (in start_load_kv); None on CPU."""
        if self.device is None:
            return None
        if meta is not self._step:  # no before_forward for this step
            self._step, self._before_forward, self._at_load = meta, None, None
        if (
            self._before_forward is not None
            and meta.load_after_forward
            and not self.zeroes_new_blocks
            and spec.start % self.block_size == 0
        ):
            return self._before_forward
        if self._at_load is None:
            self._at_load = self._record()
        return self._at_load

    def _record(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event


class _CopyRates:
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


@dataclass
class _PullJob:
    """A granted load whose chunks past the rank's local hit a peer offered: the pull runs on the
    worker's loop; what it has landed is loaded beside the steps as it comes, and the rest once it
    ends (or its deadline passes)."""

    spec: LoadSpec
    local: PinnedPrefix  # the local hit, held until the load pins the whole prefix
    pull: concurrent.futures.Future  # of PulledChunks: how many chunks came, and why not more
    offered: int  # chunks asked for
    started: float
    landed: _Landed  # the offer's leading chunks held so far
    then: Miss | None = None  # why the chunk after the offered ones is missed (the lookup's answer)
    aborted: bool = False  # the request finished meanwhile: the pull is given up
    after: torch.cuda.Event | None = None  # where its copy starts on vLLM's stream (GrantFences)
    origin: str = "a peer"  # who offered the chunks, for the log


class _Wakeup:
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


class _Landed:
    """A pull's progress hook (peer_service.Landed): how many leading chunks of its offer are held
    here so far, set on the worker's thread after each batch, read by the model-runner thread."""

    def __init__(self, wakeup: _Wakeup):
        self.chunks = 0
        self._wakeup = wakeup

    def __call__(self, chunks: int) -> None:
        self.chunks = max(self.chunks, chunks)
        self._wakeup.fire()


class LoadExecutor:
    """The loads of one rank: its engine's pinned chunks into ``planes`` (vLLM's blocks)."""

    def __init__(
        self,
        engine: CacheEngine,
        planes: list[torch.Tensor],
        layer_planes: dict[str, range],
        staging: torch.Tensor | None = None,
    ):
        self.engine = engine
        self.planes = planes
        self.layer_planes = layer_planes  # each attention layer's planes (layer-wise loads)
        self.staging = staging  # a ring of chunk pages on the GPU that loads from host memory come through
        self._step_load: _StepLoad | None = None  # this step's layer-wise load
        self._loads_in_flight: deque[_StepLoad] = deque()  # earlier steps', copies maybe running
        # This step's loads that used chunks landed in VRAM unchecked: checked at its end.
        self._unchecked: list[tuple[LoadSpec, LoadPlan]] = []
        # Requests whose load this step fell short or failed: vLLM recomputes from there, so their
        # blocks past it hold no KV worth storing this step.
        self._failed_loads: set[str] = set()
        # Loads beside the steps still copying, and requests to report as received; of those, the
        # ones that failed (in part or whole), with the blocks they left unloaded.
        self._beside_steps: dict[str, _LoadBesideSteps] = {}
        self._received: set[str] = set()
        self._failed_receives: dict[str, list[int]] = {}
        # Loads that pull a peer's offer first, by request id; and the last step's tokens.
        self._pull_jobs: dict[str, _PullJob] = {}
        self._step_tokens = 0
        self._load_errors: set[int] = set()  # blocks to report through take_errors
        self._copy_rates = _CopyRates()
        self._wakeup = _Wakeup()  # a pull landed chunks (for the wait in a step computing nothing)
        # Each load beside the steps' way through this rank, until reported (logged at DEBUG).
        self._timelines: dict[str, LoadTimeline] = {}

    # -- per step ---------------------------------------------------------------------------------

    def begin_step(self, meta: P2PConnectorMetadata) -> None:
        """A step's loads are about to be handed in: the last step's layer-wise load ends (if its
        wait_for_save never came), finished copies give back their pins."""
        if self._step_load is not None:
            self.end_layerwise()
        self._failed_loads.clear()
        self.poll_step_loads()
        self._step_tokens = meta.step_tokens

    def abort(self, req_id: str) -> None:
        """The request finished (an abort) while its load may still pull: the pull is given up at
        the next poll and its blocks are reported, for vLLM to free."""
        job = self._pull_jobs.get(req_id)
        if job is not None:
            job.aborted = True

    def failed_this_step(self, req_id: str) -> bool:
        """Did the request's load fall short this step (its blocks past it are recomputed)?"""
        return req_id in self._failed_loads

    def take_errors(self) -> set[int]:
        """Blocks loads did not fill, for vLLM to recompute (checked at the step's end first)."""
        self.end_layerwise()
        self.check_landed()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        """Wait for copies still reading pins, give the pins back, give up on pulls."""
        for job in self._pull_jobs.values():
            job.pull.cancel()
            job.local.release()
        self._pull_jobs.clear()
        self._timelines.clear()
        self.end_layerwise()
        self.poll_step_loads(wait=True)
        for load in self._beside_steps.values():  # their pins go once their copies are done
            for piece in load.pieces:
                piece.copy.synchronize()
                piece.prefix.release()
        self._beside_steps.clear()
        self.staging = None  # no copy reads it any more

    # -- loads ------------------------------------------------------------------------------------

    def load(
        self,
        spec: LoadSpec,
        prefix: PinnedPrefix,
        layerwise: bool = False,
        after: torch.cuda.Event | None = None,
        timeline: LoadTimeline | None = None,
    ) -> tuple[LoadSpec, PinnedPrefix, LoadPlan] | None:
        """Load a request's pinned chunks into its blocks: queued on the load stream (beside the
        steps, on a GPU, starting after ``after``: GrantFences), returned for the step's
        layer-wise load (``layerwise``), or copied now. The pins go once the copy is done; what
        does not load is reported for recomputing. ``timeline``: a load beside the steps' way
        so far (its lookup's), continued here."""
        engine = self.engine
        if spec.beside_steps:
            timeline = self._timelines.setdefault(spec.req_id, timeline or LoadTimeline(time.monotonic()))
            if timeline.granted is None:
                timeline.granted = time.monotonic()
        try:
            plan = engine.plan_load(prefix, spec.block_ids, spec.start, spec.end, total_tokens=spec.num_tokens)
        except Exception:  # a bad spec fails its own load (recomputed), never the step
            logger.exception("request %s: planning the load of [%d, %d) failed", spec.req_id, spec.start, spec.end)
            prefix.release()
            self.report_short_load(spec, spec.start)
            if spec.beside_steps:
                self._received.add(spec.req_id)
            return None
        # Its request waits outside the steps until get_finished reports it.
        if spec.beside_steps and self._queue_beside_steps(spec, prefix, plan, after):
            return None
        if layerwise:  # copied during the forward pass; pins released after it
            return spec, prefix, plan
        timeline = self._timelines.get(spec.req_id) if spec.beside_steps else None
        if timeline is not None:
            timeline.queued = timeline.copy_started = time.monotonic()
        try:
            engine.run_load(plan, self.planes)
            loaded_to = plan.loaded_to
            if plan.unchecked:
                self._unchecked.append((spec, plan))
        except Exception:
            logger.exception(
                "request %s: loading tokens [%d, %d)%s failed",
                spec.req_id,
                spec.start,
                spec.end,
                " beside the steps" if spec.beside_steps else "",
            )
            loaded_to = spec.start
        finally:
            prefix.release()
        if timeline is not None:
            timeline.copy_ended = time.monotonic()
        if loaded_to < spec.end:
            self.report_short_load(spec, loaded_to)
        if spec.beside_steps:  # loaded here, in full or failed: reported with this step
            self._received.add(spec.req_id)
        return None

    def pull_then_load(
        self,
        spec: LoadSpec,
        offer: Offer,
        local: PinnedPrefix,
        then: Miss | None = None,
        after: torch.cuda.Event | None = None,
        timeline: LoadTimeline | None = None,
    ) -> bool:
        """A granted load whose chunks past the local hit a peer or the remote store offered: start
        pulling them (on the worker's loop; the store's: on its fetch threads);
        :meth:`_advance_pull_jobs` loads them as they land, starting
        after ``after`` (GrantFences). False where nothing needs pulling (the engine's own cache
        covers the offered part)."""
        held = local.num_tokens
        needed = -(-(spec.end - held) // self.engine.chunk_size)
        if needed <= 0:
            return False
        offer = offer.first(min(needed, offer.chunks))
        now = time.monotonic()
        timeline = timeline or LoadTimeline(now)
        timeline.granted = timeline.pull_started = now
        landed = _Landed(self._wakeup)
        pull = self.engine.pull_offer_async(offer, landed)
        job = _PullJob(spec, local, pull, offer.chunks, now, landed, then, after=after, origin=_origin(offer))
        # When the pull ended, not when a step noticed (the callback runs on the worker's loop).
        job.pull.add_done_callback(functools.partial(_stamp_pull_end, timeline))
        self._timelines[spec.req_id] = timeline
        self._pull_jobs[spec.req_id] = job
        logger.info(
            "request %s: pulling %d chunk(s) %s offered (tokens [%d, %d)), then loading [%d, %d) beside the steps",
            spec.req_id,
            offer.chunks,
            job.origin,
            held,
            held + offer.chunks * self.engine.chunk_size,
            spec.start,
            spec.end,
        )
        return True

    def _advance_pull_jobs(self) -> None:
        """Load the chunks of every pull that ended (what came: a pull cut short loads its part,
        and vLLM recomputes the rest); a pull past its deadline is given up."""
        if not self._pull_jobs:
            return
        now = time.monotonic()
        for req_id, job in list(self._pull_jobs.items()):
            late = now - job.started > PEER_FETCH_TIMEOUT_S
            if not (job.pull.done() or late or job.aborted):
                self._load_landed(job)
                continue
            del self._pull_jobs[req_id]
            pulled, miss = 0, job.then
            if job.pull.done():
                try:
                    outcome: PulledChunks = job.pull.result()
                    pulled = outcome.chunks
                    if pulled < job.offered:
                        miss = outcome.miss
                except Exception as e:
                    logger.exception("request %s: pulling the chunks %s offered failed", req_id, job.origin)
                    miss = Miss(HOLDER_GONE, f"the pull failed: {e}")
            else:  # late, or aborted
                job.pull.cancel()
                why = "aborted while pulling" if job.aborted else f"pull past its {PEER_FETCH_TIMEOUT_S:.0f} s deadline"
                logger.warning("request %s: %s after %.1f s: its blocks are recomputed", req_id, why, now - job.started)
                miss = None if job.aborted else Miss(TIMEOUT, why)
            spec = job.spec
            engine = self.engine
            prefix = engine.pin_prefix(spec.chunk_hashes, spec.end)
            job.local.release()  # the lookup's pin of the local hit: the new pin holds it
            # (A request aborted meanwhile missed nothing it still wants.)
            engine.count_lookup(spec.num_tokens, prefix.num_tokens, miss, count_misses=not job.aborted)
            logger.info(
                "request %s: pulled %d of the %d chunk(s) %s offered in %.1f ms; "
                "%d of its tokens [%d, %d) held to load",
                req_id,
                pulled,
                job.offered,
                job.origin,
                (now - job.started) * 1e3,
                max(0, min(prefix.num_tokens, spec.end) - spec.start),
                spec.start,
                spec.end,
            )
            started = self._beside_steps.get(req_id)
            if started is None:
                self.load(spec, prefix, after=job.after)
            else:  # the rest after what landed earlier
                self._add_piece(started, prefix, job.after, last=True)

    def _load_landed(self, job: _PullJob) -> None:
        """Queue the copy of what a running pull landed since its last piece (its chunks are
        pinned and loadable once committed): the load's copies then overlap the pull, and only
        the last landing's remains once it ends."""
        if job.aborted:
            return
        spec = job.spec
        landed_to = min(spec.end, job.local.num_tokens + job.landed.chunks * self.engine.chunk_size)
        started = self._beside_steps.get(spec.req_id)
        if landed_to <= (started.loaded_to if started is not None else spec.start):
            return
        if started is None:
            started = self._beside_steps[spec.req_id] = _LoadBesideSteps(spec)
        self._add_piece(started, self.engine.pin_prefix(spec.chunk_hashes, landed_to), job.after, last=False)

    def _add_piece(
        self, load: _LoadBesideSteps, prefix: PinnedPrefix, after: torch.cuda.Event | None, last: bool
    ) -> None:
        """Copy the pinned ``prefix``'s chunks past what the load's earlier pieces copy; ``last``:
        no piece is to come. A piece that cannot be queued ends the load there (the blocks after
        it are recomputed)."""
        spec = load.spec
        load.complete = load.complete or last
        start, end = load.loaded_to, min(spec.end, prefix.num_tokens)
        if load.broken or end <= start:
            prefix.release()
            return
        timeline = self._timelines.get(spec.req_id)
        try:
            plan = self.engine.plan_load(prefix, spec.block_ids, start, end, total_tokens=spec.num_tokens)
            copy = self._copy_beside_steps(plan, after)
            if not copy.on_device:  # a CPU engine, or pages the kernels cannot reach: the host copies now
                copy.wait(_ALL_PLANES)
        except Exception:
            logger.exception(
                "request %s: loading tokens [%d, %d) beside the steps, as its pull landed them, failed",
                spec.req_id,
                start,
                end,
            )
            if self.planes and self.planes[0].is_cuda:  # copies queued before it failed read the pins
                layerwise.drain(self.planes[0].device)
            prefix.release()
            load.broken = True
            return
        load.pieces.append(_Piece(prefix, plan, copy, _copy_kind(copy, plan)))
        if timeline is not None and timeline.queued is None:
            timeline.queued = copy.queued_at

    def _copy_beside_steps(self, plan: LoadPlan, after: torch.cuda.Event | None) -> LayerwiseLoad:
        """One load's copy on the load stream: after ``after`` (None: everything on the current
        stream so far) and after the store copies still reading the blocks it writes."""
        return LayerwiseLoad(
            [plan],
            self.planes,
            {_ALL_PLANES: range(len(self.planes))},
            fence=functools.partial(self.engine.order_stores_before, blocks=plan.written_blocks()),
            staging=self.staging,
            after=after,
        )

    def _queue_beside_steps(
        self, spec: LoadSpec, prefix: PinnedPrefix, plan: LoadPlan, after: torch.cuda.Event | None
    ) -> bool:
        """Queue a request's whole load on the load stream, to be reported received by
        :meth:`finished` once done; False where the copy must run on the host (CPU, or pages
        the kernels cannot reach), as a load in the step does. It starts after ``after`` (None:
        everything queued on the current stream so far) and after the store copies still
        reading the blocks it writes (a preemption freed them without waiting for those)."""
        if not (self.planes and self.planes[0].is_cuda):
            return False
        try:
            copy = self._copy_beside_steps(plan, after)
        except Exception:
            logger.exception(
                "request %s: loading tokens [%d, %d) beside the steps failed", spec.req_id, spec.start, spec.end
            )
            layerwise.drain(self.planes[0].device)  # copies queued before it failed read the pins
            prefix.release()
            self.report_short_load(spec, spec.start)
            self._received.add(spec.req_id)
            return True
        if not copy.on_device:
            return False
        piece = _Piece(prefix, plan, copy, _copy_kind(copy, plan))
        self._beside_steps[spec.req_id] = _LoadBesideSteps(spec, [piece], complete=True)
        timeline = self._timelines.get(spec.req_id)
        if timeline is not None:
            timeline.queued = copy.queued_at
        return True

    def finished(self, report_failed_blocks: bool) -> tuple[set[str], set[str]]:
        """Requests whose load beside the steps is done, and those whose load failed (in part or
        whole): vLLM may schedule them now, or free the blocks of one it aborted. A failed one's
        unloaded blocks go to :meth:`take_errors` with ``report_failed_blocks`` (vLLM < 0.32,
        which recomputes from the first); without, vLLM is told of a failed receive (frees its
        blocks and asks about the request afresh)."""
        if self._step_tokens == 0:
            self._wait_in_idle_step()
        else:
            self._advance_pull_jobs()
            self._wait_for_copies_about_to_end()
        done, self._received = self._received, set()
        for req_id, load in list(self._beside_steps.items()):
            if not load.done():
                continue
            del self._beside_steps[req_id]
            spec, plan = load.spec, load.plan()
            if load.pieces:
                self._count_copies(load, plan)
            bad_at = None
            if plan.unchecked:  # chunks a peer wrote into the GPU tier, their check running when pinned
                bad_at = self.engine.first_bad_chunk(plan, time.monotonic() + LANDED_CHECK_TIMEOUT_S)
            if bad_at is not None:
                self._landed_chunk_failed(spec, plan, bad_at)
            elif plan.loaded_to < spec.end:
                self.report_short_load(spec, plan.loaded_to)
            done.add(req_id)
        failed = {req_id for req_id in done if req_id in self._failed_receives}
        for req_id in failed:
            blocks = self._failed_receives.pop(req_id)
            if report_failed_blocks:
                self._load_errors.update(blocks)
        self._log_timelines(done)
        return done - failed, failed

    def _count_copies(self, load: _LoadBesideSteps, plan: LoadPlan) -> None:
        """A finished load beside the steps (``plan``: its pieces' as one): one line for all its
        pieces (their copy times summed), its copy rates, when its copies ran; its pins go."""
        pieces = load.pieces
        how = "beside the steps"
        if any(piece.copy.staged for piece in pieces):
            how += ", through the copy engine"
        if len(pieces) > 1:
            how += f", in {len(pieces)} pieces as its pull landed them"
        self.engine.loaded(plan, sum(piece.copy.seconds for piece in pieces), how)
        for piece in pieces:
            self._copy_rates.observe(piece.kind, piece.plan.nbytes, piece.copy.seconds)
            piece.prefix.release()
        timeline = self._timelines.get(load.spec.req_id)
        if timeline is not None:
            first, last = pieces[0].copy, pieces[-1].copy
            start, end = first.device_window(), last.device_window()
            timeline.copy_started = start[0] if start else first.queued_at
            timeline.copy_ended = end[1] if end else last.queued_at + last.seconds
            timeline.pieces = len(pieces)

    def _wait_in_idle_step(self) -> None:
        """In a step that computed nothing (vLLM runs them back to back while requests wait on
        their loads): wait, up to IDLE_STEP_WAIT_S, until a pull or a copy ends, so that what
        ended is reported by this step rather than the next, and the step loop leaves the
        pulling thread the interpreter meanwhile. A pull that ends has its load queued at once
        and the wait goes on for that copy (from the GPU tier, ~1 ms)."""
        deadline = time.monotonic() + IDLE_STEP_WAIT_S
        while True:
            self._wakeup.rearm()  # before looking: a landing after the look cuts the wait short
            self._advance_pull_jobs()
            if self._received or any(load.done() for load in self._beside_steps.values()):
                return
            copying = any(not piece.copy.done() for load in self._beside_steps.values() for piece in load.pieces)
            if not self._pull_jobs and not copying:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            # Pulls (and their landings) say when through futures; copies are looked at between sleeps.
            waits = [job.pull for job in self._pull_jobs.values()] + [self._wakeup.future()]
            timeout = min(remaining, IDLE_STEP_POLL_S) if copying else remaining
            concurrent.futures.wait(waits, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def _wait_for_copies_about_to_end(self) -> None:
        """In a step that computes: wait, at most BUSY_STEP_COPY_WAIT_S, for the copies beside
        the steps expected to end within it (running on the device, with a rate measured on
        earlier copies of their kind), so that they are reported by this step and not a forward
        pass later.

        This blocks vLLM's model-runner thread, hence the bound. get_finished runs once the
        step's forward pass is queued, which keeps the GPU busy for longer than that (a prefill
        takes tens of ms; with async scheduling the next step's host work is already overlapping
        this one), so the wait mostly costs host time the device does not miss; a copy that
        runs late only costs the bound, once per step, and only while one is due."""
        now = time.monotonic()
        due = [
            load
            for load in self._beside_steps.values()
            if load.complete
            and not load.done()
            and all(self._ends_within(piece, now, BUSY_STEP_COPY_WAIT_S) for piece in load.pieces)
        ]
        if not due:
            return
        deadline = now + BUSY_STEP_COPY_WAIT_S
        while not all(load.done() for load in due):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            time.sleep(min(remaining, IDLE_STEP_POLL_S))
        waited_ms = (time.monotonic() - now) * 1e3
        for load in due:
            timeline = self._timelines.get(load.spec.req_id)
            if timeline is not None:
                timeline.step_wait_ms += waited_ms
        logger.debug(
            "a computing step waited %.2f ms for %d load(s) beside the steps about to end; %d ended",
            waited_ms,
            len(due),
            sum(load.done() for load in due),
        )

    def _ends_within(self, piece: _Piece, now: float, seconds: float) -> bool:
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

    def _log_timelines(self, reported: set[str]) -> None:
        """One DEBUG line per reported load beside the steps: when it passed each point."""
        now = time.monotonic()
        for req_id in reported:
            timeline = self._timelines.pop(req_id, None)
            if timeline is None:
                continue
            timeline.reported = now
            logger.debug(
                "request %s timeline, ms from first seen: %s (first seen at %.6f s monotonic; %d piece(s); a "
                "computing step waited %.2f ms for its copy)",
                req_id,
                timeline.describe(),
                timeline.seen,
                timeline.pieces,
                timeline.step_wait_ms,
            )

    def start_layerwise(self, loads: list[tuple[LoadSpec, PinnedPrefix, LoadPlan]]) -> None:
        """Queue (GPU) or plan (CPU) the step's loads layer by layer; what a plan does not cover
        is reported short now, as a whole load would."""
        engine = self.engine
        specs, prefixes, plans = (list(x) for x in zip(*loads, strict=True))
        try:
            load = LayerwiseLoad(plans, self.planes, self.layer_planes, fence=engine.order_stores_before)
        except Exception:
            logger.exception("a layer-wise load of %d request(s) could not start", len(specs))
            if self.planes and self.planes[0].is_cuda:  # copies queued before it failed read the pins
                layerwise.drain(self.planes[0].device)
            for spec, prefix in zip(specs, prefixes, strict=True):
                prefix.release()
                self.report_short_load(spec, spec.start)
            return
        self._step_load = _StepLoad(load, specs, prefixes)
        for spec, plan in zip(specs, plans, strict=True):
            if plan.loaded_to < spec.end:
                self.report_short_load(spec, plan.loaded_to)
            if plan.unchecked:
                self._unchecked.append((spec, plan))

    def wait_for_layer(self, layer_name: str) -> None:
        step = self._step_load
        if step is None or step.failed:
            return
        try:
            step.load.wait(layer_name)
        except Exception:  # the layer's blocks are not what was promised: vLLM recomputes them
            logger.exception("layer-wise load of layer %s failed", layer_name)
            step.failed = True

    def end_layerwise(self) -> None:
        """After the forward pass: a load some layer did not wait for (or that failed) is reported
        as failed, and vLLM recomputes its blocks; the pins wait for the copies to finish."""
        step, self._step_load = self._step_load, None
        if step is None:
            return
        step.load.order_before_current()  # whatever runs next (a recompute, new owners) after every copy
        skipped = step.load.not_waited()
        if skipped or step.failed:
            step.failed = True
            if skipped:
                logger.error(
                    "layer-wise load: %d layer(s) were not waited for (first %s); %d request(s) recompute",
                    len(skipped),
                    skipped[0],
                    len(step.specs),
                )
            for spec in step.specs:
                self.report_short_load(spec, spec.start)
            # Recomputed whole and never counted as retrieved: their landed chunks' checks no
            # longer decide anything here (the write-back still checks them for the CPU tier).
            self._unchecked = [(s, p) for s, p in self._unchecked if not any(p is q for q in step.load.plans)]
        self._loads_in_flight.append(step)
        self.poll_step_loads()

    def poll_step_loads(self, wait: bool = False) -> None:
        """Release the pins of layer-wise loads whose copies are done, and log them."""
        while self._loads_in_flight and (wait or self._loads_in_flight[0].load.done()):
            step = self._loads_in_flight.popleft()
            if wait:
                step.load.synchronize()
            seconds = step.load.seconds
            how = "layer by layer" + (f", one copy for {len(step.specs)} requests" if len(step.specs) > 1 else "")
            for plan, prefix in zip(step.load.plans, step.prefixes, strict=True):
                if not step.failed:  # a failed one was reported, and is recomputed: no hit
                    self.engine.loaded(plan, seconds, how)
                prefix.release()

    def check_landed(self) -> None:
        """At the end of a step: chunks it loaded that a peer wrote into the GPU tier and whose
        check was still running when they were pinned (on the device behind the pull, ~1 ms, or
        by their write-back to the CPU tier when the holder sent no device checksums) are waited
        for. One whose checksum failed, or whose check did not finish in time, fails its
        request's load from there: vLLM drops the step's output for it and recomputes."""
        checks, self._unchecked = self._unchecked, []
        if not checks:
            return
        t0 = time.monotonic()
        deadline = t0 + LANDED_CHECK_TIMEOUT_S  # one wait for the whole step
        bad = [(spec, plan, self.engine.first_bad_chunk(plan, deadline)) for spec, plan in checks]
        # The step's output waits for these checks: what that costs is the first token's time.
        logger.info(
            "step waited %.1f ms for the checksum checks of %d chunk(s) landed in VRAM (%d request(s))",
            (time.monotonic() - t0) * 1e3,
            sum(len(plan.unchecked) for _, plan in checks),
            len(checks),
        )
        for spec, plan, bad_at in bad:
            if bad_at is not None:
                self._landed_chunk_failed(spec, plan, bad_at)

    def _landed_chunk_failed(self, spec: LoadSpec, plan: LoadPlan, bad_at: int) -> None:
        """A load used a chunk a peer wrote into the GPU tier whose check failed (or did not end in
        time) at token ``bad_at``: the load counts up to there, and vLLM recomputes the rest."""
        logger.error(
            "request %s: the chunk at token %d, loaded from the GPU tier as a peer wrote it, failed its "
            "checksum check (or was not checked within %.0f s); it is recomputed",
            spec.req_id,
            bad_at,
            LANDED_CHECK_TIMEOUT_S,
        )
        good_to = max(bad_at, spec.start)
        self.report_short_load(spec, min(good_to, plan.loaded_to))
        self.engine.counters.retrieved_tokens -= max(0, plan.loaded_to - good_to)

    def report_short_load(self, spec, loaded_to: int) -> None:
        block_size = self.engine.layout.block_size
        first, last = loaded_to // block_size, -(-spec.end // block_size)
        failed = spec.block_ids[first:last]
        if spec.beside_steps:  # reported with its receive (finished)
            self._failed_receives[spec.req_id] = failed
        else:
            self._load_errors.update(failed)
        self._failed_loads.add(spec.req_id)
        logger.warning(
            "request %s: loaded tokens [%d, %d) of the promised [%d, %d); %d block(s) will be recomputed",
            spec.req_id,
            spec.start,
            loaded_to,
            spec.start,
            spec.end,
            len(failed),
        )


def _origin(offer: Offer) -> str:
    return "the remote store" if isinstance(offer, RemoteOffer) else "a peer"


def _stamp_pull_end(timeline: LoadTimeline, _pull: concurrent.futures.Future) -> None:
    timeline.pull_ended = time.monotonic()


def _copy_kind(copy: LayerwiseLoad, plan: LoadPlan) -> str:
    """Which rate a copy goes at: through the staging ring, device to device, from host memory."""
    if copy.staged:
        return "staged"
    return "device" if plan.from_gpu == len(plan.pages) else "host"
