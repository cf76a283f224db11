"""A rank's loads: granted hits moved from our tiers (or first from a peer) into vLLM's blocks.

One executor, one load per request, with one of three fences (docs/architecture.md):

* **in the step**: copied in ``start_load_kv``, before the forward pass that reads them;
* **layer by layer** (``use_layerwise``): queued in ``start_load_kv``, each layer's copy waited for
  in ``wait_for_layer_load`` (on a GPU the forward pass overlaps the copies), pins released once
  the copies are done;
* **beside the steps** (vLLM's asynchronous loads): vLLM holds the request out of its steps
  (WAITING_FOR_REMOTE_KVS) while the copy runs on the load stream (on CPU: at once), and
  ``get_finished`` reports it done. A load whose chunks past the rank's local hit a peer offered
  pulls them first (:meth:`LoadExecutor.pull_then_load`, a job keyed by request id, the pull on
  the worker's loop), then loads what came.

What a load did not fill is reported (``take_errors``, or as a failed receive) and vLLM
recomputes those blocks; a load never leaves wrong KV behind. Chunks a peer wrote into the GPU
tier whose checksum check was still running are checked before their step's output counts.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from lmcache_p2p import layerwise
from lmcache_p2p.cache_engine import CacheEngine, LoadPlan, PinnedPrefix
from lmcache_p2p.integration.vllm.metadata import LoadSpec, P2PConnectorMetadata
from lmcache_p2p.layerwise import LayerwiseLoad
from lmcache_p2p.miss_reasons import HOLDER_GONE, TIMEOUT, Miss, PulledChunks
from lmcache_p2p.peer_service import Offer
from lmcache_p2p.vocab import PEER_FETCH_TIMEOUT_S

logger = logging.getLogger(__name__)

# In a step that computed nothing while pulls run, how long get_finished waits for one to end
# (the step loop would otherwise spin, holding the interpreter the pulling thread needs).
IDLE_STEP_PULL_WAIT_S = 0.005
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
class _LoadBesideSteps:
    """A request's load beside the steps queued on the load stream, and its pins. (One copied by
    the host runs at once, as a load in the step does.)"""

    spec: LoadSpec
    prefix: PinnedPrefix
    plan: LoadPlan
    copy: LayerwiseLoad


@dataclass
class _PullJob:
    """A granted load whose chunks past the rank's local hit a peer offered: the pull runs on the
    worker's loop; once it ends (or its deadline passes) what came is loaded beside the steps."""

    spec: LoadSpec
    local: PinnedPrefix  # the local hit, held until the load pins the whole prefix
    pull: concurrent.futures.Future  # of PulledChunks: how many chunks came, and why not more
    offered: int  # chunks asked for
    started: float
    then: Miss | None = None  # why the chunk after the offered ones is missed (the lookup's answer)
    aborted: bool = False  # the request finished meanwhile: the pull is given up


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
        self.end_layerwise()
        self.poll_step_loads(wait=True)
        for load in self._beside_steps.values():  # their pins go once their copies are done
            load.copy.synchronize()
            load.prefix.release()
        self._beside_steps.clear()
        self.staging = None  # no copy reads it any more

    # -- loads ------------------------------------------------------------------------------------

    def load(
        self, spec: LoadSpec, prefix: PinnedPrefix, layerwise: bool = False
    ) -> tuple[LoadSpec, PinnedPrefix, LoadPlan] | None:
        """Load a request's pinned chunks into its blocks: queued on the load stream (beside the
        steps, on a GPU), returned for the step's layer-wise load (``layerwise``), or copied now.
        The pins go once the copy is done; what does not load is reported for recomputing."""
        engine = self.engine
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
        if spec.beside_steps and self._queue_beside_steps(spec, prefix, plan):
            return None
        if layerwise:  # copied during the forward pass; pins released after it
            return spec, prefix, plan
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
        if loaded_to < spec.end:
            self.report_short_load(spec, loaded_to)
        if spec.beside_steps:  # loaded here, in full or failed: reported with this step
            self._received.add(spec.req_id)
        return None

    def pull_then_load(self, spec: LoadSpec, offer: Offer, local: PinnedPrefix, then: Miss | None = None) -> bool:
        """A granted load whose chunks past the local hit a peer offered: start pulling them (on
        the worker's loop); :meth:`_advance_pull_jobs` loads them once they are here. False
        where nothing needs pulling (the engine's own cache covers the offered part)."""
        held = local.num_tokens
        needed = -(-(spec.end - held) // self.engine.chunk_size)
        if needed <= 0:
            return False
        offer = offer.first(min(needed, offer.chunks))
        job = _PullJob(spec, local, self.engine.pull_offer_async(offer), offer.chunks, time.monotonic(), then)
        self._pull_jobs[spec.req_id] = job
        logger.info(
            "request %s: pulling %d chunk(s) a peer offered (tokens [%d, %d)), then loading [%d, %d) beside the steps",
            spec.req_id,
            offer.chunks,
            held,
            held + offer.chunks * self.engine.chunk_size,
            spec.start,
            spec.end,
        )
        return True

    def _advance_pull_jobs(self, idle_step: bool) -> None:
        """Load the chunks of every pull that ended (what came: a pull cut short loads its part,
        and vLLM recomputes the rest); a pull past its deadline is given up. In a step that
        computed nothing (vLLM runs them while requests wait on their loads) this waits for a
        pull briefly: the step loop then leaves the pulling thread the interpreter."""
        if not self._pull_jobs:
            return
        if idle_step and not any(job.pull.done() for job in self._pull_jobs.values()):
            concurrent.futures.wait(
                [job.pull for job in self._pull_jobs.values()],
                timeout=IDLE_STEP_PULL_WAIT_S,
                return_when=concurrent.futures.FIRST_COMPLETED,
            )
        now = time.monotonic()
        for req_id, job in list(self._pull_jobs.items()):
            late = now - job.started > PEER_FETCH_TIMEOUT_S
            if not (job.pull.done() or late or job.aborted):
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
                    logger.exception("request %s: pulling the chunks a peer offered failed", req_id)
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
                "request %s: pulled %d of the %d chunk(s) offered in %.1f ms; %d of its tokens [%d, %d) held to load",
                req_id,
                pulled,
                job.offered,
                (now - job.started) * 1e3,
                max(0, min(prefix.num_tokens, spec.end) - spec.start),
                spec.start,
                spec.end,
            )
            self.load(spec, prefix)

    def _queue_beside_steps(self, spec: LoadSpec, prefix: PinnedPrefix, plan: LoadPlan) -> bool:
        """Queue a request's whole load on the load stream, to be reported received by
        :meth:`finished` once done; False where the copy must run on the host (CPU, or pages
        the kernels cannot reach), as a load in the step does."""
        if not (self.planes and self.planes[0].is_cuda):
            return False
        try:
            copy = LayerwiseLoad(
                [plan],
                self.planes,
                {_ALL_PLANES: range(len(self.planes))},
                fence=self.engine.order_stores_before,
                staging=self.staging,
            )
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
        self._beside_steps[spec.req_id] = _LoadBesideSteps(spec, prefix, plan, copy)
        return True

    def finished(self, report_failed_blocks: bool) -> tuple[set[str], set[str]]:
        """Requests whose load beside the steps is done, and those whose load failed (in part or
        whole): vLLM may schedule them now, or free the blocks of one it aborted. A failed one's
        unloaded blocks go to :meth:`take_errors` with ``report_failed_blocks`` (vLLM < 0.32,
        which recomputes from the first); without, vLLM is told of a failed receive (frees its
        blocks and asks about the request afresh)."""
        self._advance_pull_jobs(idle_step=self._step_tokens == 0)
        done, self._received = self._received, set()
        for req_id, load in list(self._beside_steps.items()):
            if not load.copy.done():
                continue
            del self._beside_steps[req_id]
            spec, plan = load.spec, load.plan
            how = "beside the steps, through the copy engine" if load.copy.staged else "beside the steps"
            self.engine.loaded(plan, load.copy.seconds, how)
            load.prefix.release()
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
        return done - failed, failed

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
