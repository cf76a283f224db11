"""A rank's loads: granted hits moved from our tiers (or first from a peer or the remote store)
into vLLM's blocks.

One executor, one load per request, with one of three fences (docs/architecture.md):

* **in the step**: copied in ``start_load_kv``, before the forward pass that reads them;
* **layer by layer** (``use_layerwise``): queued in ``start_load_kv``, each layer's copy waited for
  in ``wait_for_layer_load`` (on a GPU the forward pass overlaps the copies), pins released once
  the copies are done;
* **beside the steps** (vLLM's asynchronous loads): a job of :class:`AsyncLoads` (jobs by id,
  async_loads.py), which pulls a peer's or the remote store's offer first where there is one and
  copies on the load stream, starting after the point of vLLM's stream its blocks wait for
  (:class:`GrantFences`); ``get_finished`` reports the jobs that ended.

What a load did not fill is reported (``take_errors``, or as a failed receive) and vLLM
recomputes those blocks; a load never leaves wrong KV behind. Chunks a peer wrote into the GPU
tier whose checksum check was still running are checked before their step's output counts.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from lmcache_p2p import layerwise
from lmcache_p2p.cache_engine import CacheEngine, LoadPlan, PinnedPrefix
from lmcache_p2p.integration.vllm.async_loads import AsyncLoads
from lmcache_p2p.integration.vllm.load_jobs import (
    LANDED_CHECK_TIMEOUT_S,
    LoadJob,
    LoadTimeline,
    blocks_past,
    log_landed_chunk_failed,
    log_short_load,
)
from lmcache_p2p.integration.vllm.metadata import LoadSpec, P2PConnectorMetadata
from lmcache_p2p.layerwise import LayerwiseLoad

logger = logging.getLogger(__name__)


@dataclass
class _StepLoad:
    """A step's layer-wise load, its requests and their pins (released once its copies are done)."""

    load: LayerwiseLoad
    specs: list[LoadSpec]
    prefixes: list[PinnedPrefix]
    failed: bool = False


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


class LoadExecutor:
    """The loads of one rank: its engine's pinned chunks into ``planes`` (vLLM's blocks). Loads in
    the step and layer by layer are run here; loads beside the steps are ``jobs``."""

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
        self.jobs = AsyncLoads(engine, planes, staging)
        self._step_load: _StepLoad | None = None  # this step's layer-wise load
        self._loads_in_flight: deque[_StepLoad] = deque()  # earlier steps', copies maybe running
        # This step's loads that used chunks landed in VRAM unchecked: checked at its end.
        self._unchecked: list[tuple[LoadSpec, LoadPlan]] = []
        # Requests whose load this step fell short or failed: vLLM recomputes from there, so their
        # blocks past it hold no KV worth storing this step.
        self._failed_loads: set[str] = set()
        self._load_errors: set[int] = set()  # blocks to report through take_errors

    # -- per step ---------------------------------------------------------------------------------

    def begin_step(self, meta: P2PConnectorMetadata) -> None:
        """A step's loads are about to be handed in: the last step's layer-wise load ends (if its
        wait_for_save never came), finished copies give back their pins."""
        if self._step_load is not None:
            self.end_layerwise()
        self._failed_loads.clear()
        self.poll_step_loads()
        self.jobs.begin_step(meta.step_tokens)

    def abort(self, req_id: str) -> None:
        """The request finished (an abort) while its load may still pull: the pull is given up and
        its job reported as usual, for vLLM to free its blocks."""
        self.jobs.abort(req_id)

    def failed_this_step(self, req_id: str) -> bool:
        """Did the request's load fall short this step (its blocks past it are recomputed)?"""
        return req_id in self._failed_loads

    def take_errors(self) -> set[int]:
        """Blocks loads did not fill, for vLLM to recompute (checked at the step's end first)."""
        self.end_layerwise()
        self.check_landed()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def add_errors(self, blocks: list[int]) -> None:
        """Blocks a job beside the steps did not fill, reported with take_errors (vLLM < 0.32)."""
        self._load_errors.update(blocks)

    def finished(self) -> list[LoadJob]:
        """The jobs beside the steps that ended (AsyncLoads.finished)."""
        return self.jobs.finished()

    def close(self) -> None:
        """Give up on pulls, wait for copies still reading pins, give the pins back."""
        self.jobs.close()
        self.end_layerwise()
        self.poll_step_loads(wait=True)

    # -- loads ------------------------------------------------------------------------------------

    def load(
        self,
        spec: LoadSpec,
        prefix: PinnedPrefix,
        layerwise: bool = False,
        after: torch.cuda.Event | None = None,
        timeline: LoadTimeline | None = None,
    ) -> tuple[LoadSpec, PinnedPrefix, LoadPlan] | None:
        """Load a request's pinned chunks into its blocks: as a job beside the steps
        (``spec.beside_steps``; starting after ``after``, GrantFences; ``timeline``: its way so
        far, its lookup's), returned for the step's layer-wise load (``layerwise``), or copied
        now. The pins go once the copy is done; what does not load is reported for recomputing."""
        if spec.beside_steps:
            self.jobs.start(spec, prefix, after, timeline)
            return None
        engine = self.engine
        try:
            plan = engine.plan_load(prefix, spec.block_ids, spec.start, spec.end, total_tokens=spec.num_tokens)
        except Exception:  # a bad spec fails its own load (recomputed), never the step
            logger.exception("request %s: planning the load of [%d, %d) failed", spec.req_id, spec.start, spec.end)
            prefix.release()
            self.report_short_load(spec, spec.start)
            return None
        if layerwise:  # copied during the forward pass; pins released after it
            return spec, prefix, plan
        try:
            engine.run_load(plan, self.planes)
            loaded_to = plan.loaded_to
            if plan.unchecked:
                self._unchecked.append((spec, plan))
        except Exception:
            logger.exception("request %s: loading tokens [%d, %d) failed", spec.req_id, spec.start, spec.end)
            loaded_to = spec.start
        finally:
            prefix.release()
        if loaded_to < spec.end:
            self.report_short_load(spec, loaded_to)
        return None

    # -- in the step, layer by layer --------------------------------------------------------------

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
        log_landed_chunk_failed(spec, bad_at)
        good_to = max(bad_at, spec.start)
        self.report_short_load(spec, min(good_to, plan.loaded_to))
        self.engine.counters.retrieved_tokens -= max(0, plan.loaded_to - good_to)

    def report_short_load(self, spec: LoadSpec, loaded_to: int) -> None:
        """A load in the step (or a blended one) filled ``[start, loaded_to)`` only: vLLM
        recomputes its blocks past that, and nothing past it is stored this step."""
        failed = blocks_past(spec, loaded_to, self.engine.layout.block_size)
        self._load_errors.update(failed)
        self._failed_loads.add(spec.req_id)
        log_short_load(spec, loaded_to, len(failed))
