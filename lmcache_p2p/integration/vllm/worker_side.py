"""The connector's worker half: one per TP rank, inside vLLM's worker process.

It owns the rank's :class:`CacheEngine` (tiers, controller worker, peer client; built by
``lmcache_p2p.worker.build_engine``), answers the scheduler's lookups (:class:`RankLookups`: its
local hit, and what a peer or the remote store offers beyond it), hands granted loads to its :class:`LoadExecutor` (in
the step, layer by layer, or beside the steps, pulling an offer first), and stores after the
forward pass (``wait_for_save``): whole chunks of whole blocks as opaque pages (DESIGN.md §4).
Prompts arrive as chunk hashes; a lookup is answered at once, never waiting for bytes.

Chunks a lookup promised are pinned until the load (or the request's end), so an eviction in
between cannot turn a promised hit into garbage; should a load still come up short, the blocks it
did not fill are reported to vLLM, which recomputes them.

It also times the forward passes that prefill (:class:`_StepClock`): the engine's prefill rate,
which the rank's pull policy weighs a peer pull against.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import torch

from lmcache_p2p.cache_engine import CacheEngine, LoadPlan, PinnedPrefix
from lmcache_p2p.config import LMCacheConfig
from lmcache_p2p.integration.vllm import compat, kv_layout
from lmcache_p2p.integration.vllm.engine_metrics import RankMetrics
from lmcache_p2p.integration.vllm.kv_events import StorageEventBuffer, kv_events_enabled
from lmcache_p2p.integration.vllm.load_executor import GrantFences, LoadExecutor
from lmcache_p2p.integration.vllm.load_jobs import LANDED_CHECK_TIMEOUT_S, LoadJob, LoadTimeline
from lmcache_p2p.integration.vllm.lookup_channel import (
    LookupServer,
    PullEndedSender,
    engine_socket_path,
    pull_ended_path,
)
from lmcache_p2p.integration.vllm.metadata import LoadSpec, P2PConnectorMetadata
from lmcache_p2p.integration.vllm.rank_lookups import RankLookups
from lmcache_p2p.transfer.gpu_staging import DEFAULT_SLOTS as DEFAULT_NIXL_STAGING_PAGES
from lmcache_p2p.worker import build_engine

logger = logging.getLogger(__name__)


class _StepClock:
    """Times the forward passes that prefill at least a chunk, for the engine's prefill rate: from
    the end of ``start_load_kv`` (loads done) to the start of ``wait_for_save`` (stores not begun),
    with the step's token counts from the scheduler. On a GPU the host runs ahead of the device, so
    the interval is taken between two CUDA events and read once the device has passed them
    (polled each step, never waited for); on CPU the forward pass is synchronous."""

    MAX_PENDING = 16  # steps whose events the device has not reached yet; older ones are dropped

    def __init__(self, engine: CacheEngine, device: torch.device | None):
        self.engine = engine
        self.device = device  # the KV's CUDA device, or None
        self._open: tuple[int, int, Any] | None = None  # (tokens, prompt tokens, start mark)
        self._pending: deque[tuple[int, int, Any, Any]] = deque()  # with their CUDA events

    def start(self, meta: P2PConnectorMetadata) -> None:
        self.poll()
        self._open = None
        if meta.prefill_tokens < self.engine.counters.prefill.min_tokens:
            return  # decodes, or too little prefill to say how fast prefill is
        if self.device is None:
            mark: Any = time.perf_counter()
        else:
            mark = torch.cuda.Event(enable_timing=True)
            mark.record(torch.cuda.current_stream(self.device))
        self._open = (meta.step_tokens, meta.prefill_tokens, mark)

    def stop(self) -> None:
        opened, self._open = self._open, None
        if opened is None:
            return
        tokens, prefill, mark = opened
        if self.device is None:
            self.engine.observe_prefill(tokens, time.perf_counter() - mark, prefill)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(self.device))
        self._pending.append((tokens, prefill, mark, end))
        while len(self._pending) > self.MAX_PENDING:
            self._pending.popleft()

    def poll(self) -> None:
        while self._pending and self._pending[0][3].query():
            tokens, prefill, start, end = self._pending.popleft()
            self.engine.observe_prefill(tokens, start.elapsed_time(end) / 1e3, prefill)


class WorkerSide:
    def __init__(self, vllm_config: Any, config: LMCacheConfig, kv_cache_config: Any = None):
        self.vllm_config = vllm_config
        self.config = config
        self.kv_cache_config = kv_cache_config
        self.engine: CacheEngine | None = None
        self.planes: list[torch.Tensor] = []
        self.layer_planes: dict[str, range] = {}  # each attention layer's planes (layer-wise loads)
        self.layerwise = config.use_layerwise and self._layerwise_possible(vllm_config)
        self.loads: LoadExecutor | None = None  # register_kv_caches makes it
        self._fences: GrantFences | None = None  # where loads beside the steps start (register_kv_caches)
        self.server: LookupServer | None = None
        self.lookups: RankLookups | None = None  # answers the lookup server (register_kv_caches)
        self.pull_ended: PullEndedSender | None = None  # pull_before_grant: its words to the scheduler
        self._saving: set[str] = set()  # requests we stored from (their blocks wait for finished_stores)
        self._finishing: set[str] = set()  # of those, finished in vLLM, store copies maybe in flight
        self._clock: _StepClock | None = None  # times prefill steps (register_kv_caches makes it)
        self.storage_events: StorageEventBuffer | None = None  # with --kv-events-config
        self.blender: Any = None  # blending.SegmentBlender, with enable_blending
        self.metrics: RankMetrics | None = None  # built with the engine (register_kv_caches)
        self.tp_rank, self.tp_size = self._tp_rank_and_size()

    @staticmethod
    def _layerwise_possible(vllm_config: Any) -> bool:
        """A speculative decoder's draft layers share the KV caches but run after the step's
        results are asked for, so they would count as never waited for and fail every load."""
        if getattr(vllm_config, "speculative_config", None) is not None:
            logger.warning("use_layerwise is ignored with speculative decoding: loads go whole before the forward")
            return False
        return True

    def _tp_rank_and_size(self) -> tuple[int, int]:
        size = int(self.vllm_config.parallel_config.tensor_parallel_size)
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            return int(get_tensor_model_parallel_rank()), size
        except Exception:  # not initialised (single process): rank 0
            return 0, size

    @property
    def _loads(self) -> LoadExecutor:
        """The rank's loads, which exist from register_kv_caches until close."""
        if self.loads is None:
            raise RuntimeError("lmcache-p2p: the worker side was used before register_kv_caches (or after close)")
        return self.loads

    @property
    def _rank_lookups(self) -> RankLookups:
        """The rank's lookups, which exist from register_kv_caches until close."""
        if self.lookups is None:
            raise RuntimeError("lmcache-p2p: the worker side was used before register_kv_caches (or after close)")
        return self.lookups

    @property
    def _engine(self) -> CacheEngine:
        """The rank's engine, which exists from register_kv_caches until close."""
        if self.engine is None:
            raise RuntimeError("lmcache-p2p: the worker side was used before register_kv_caches (or after close)")
        return self.engine

    # -- set-up ----------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        first = next(iter(kv_caches.values()))
        num_blocks = getattr(self.kv_cache_config, "num_blocks", None) or int(first.shape[0])
        self.planes = kv_layout.block_planes(kv_caches, num_blocks)
        self.layer_planes = kv_layout.planes_by_layer(kv_caches, num_blocks)
        block_size = int(self.vllm_config.cache_config.block_size)
        model = str(self.vllm_config.model_config.model)
        layout = kv_layout.fingerprint(self.planes, model, block_size, self.tp_size, self.tp_rank)
        if first.is_cuda:
            self._warn_device_buffers_after_kv_cache(layout.bytes_per_token * self.config.chunk_size)
        self.engine = build_engine(
            self.config,
            layout,
            rank=self.tp_rank,
            pin_memory=first.is_cuda,
            device=first.device if first.is_cuda else None,
        )
        self._clock = _StepClock(self.engine, first.device if first.is_cuda else None)
        staging = None
        if self.config.async_kv_loads is not False and first.is_cuda:  # True, or "auto": from host memory
            staging = self._make_load_staging(first.device, self.engine.storage.page_bytes)
        self.loads = LoadExecutor(self.engine, self.planes, self.layer_planes, staging)
        # Without a KV cache config saying otherwise, new blocks may be zeroed in the step.
        zeroes = self.kv_cache_config is None or getattr(self.kv_cache_config, "needs_kv_cache_zeroing", True)
        self._fences = GrantFences(first.device, block_size, zeroes_new_blocks=bool(zeroes))
        self.metrics = RankMetrics(self.engine.status, self.tp_rank)
        if kv_events_enabled(self.vllm_config):  # vLLM publishes KV events: ours go with them
            self.storage_events = StorageEventBuffer(self.tp_rank, self.engine.storage.record_events())
        if self.config.enable_blending:
            from lmcache_p2p.integration.vllm.blending import SegmentBlender

            self.blender = SegmentBlender(self.vllm_config, self.config, kv_caches, self.engine.storage, self.tp_rank)
        self.lookups = RankLookups(self.engine, first.is_cuda, self.blender)
        self.server = LookupServer(engine_socket_path(self.vllm_config, self.tp_rank), self.lookups.answer)
        # (as the scheduler side decides: with something to pull from, peers or the remote store)
        if self.config.pull_before_grant and (self.config.enable_p2p or self.config.remote_url is not None):
            self.pull_ended = PullEndedSender(pull_ended_path(self.vllm_config), self.tp_rank)
            self.lookups.on_pull_ended = self.pull_ended.send
        self.loads.jobs.lookup_pulls = self.lookups.running_pulls
        logger.info(
            "lmcache-p2p rank %d/%d: %d KV layers as %d block planes of %s %s, %d blocks of %d tokens "
            "on %s; chunk %d tokens = %.2f MiB",
            self.tp_rank,
            self.tp_size,
            len(kv_caches),
            len(self.planes),
            tuple(self.planes[0].shape[1:]),
            layout.dtype,
            num_blocks,
            block_size,
            first.device,
            self.config.chunk_size,
            self.engine.storage.page_bytes / 2**20,
        )

    def _device_buffers(self, page_bytes: int) -> list[str]:
        """The device memory this rank's configuration allocates beside vLLM's, as a user reads
        it (what it is, how big, which key sets it)."""
        config = self.config
        wanted = []
        if config.local_gpu:
            wanted.append(f"GPU tier {config.max_local_gpu_size:g} GB (max_local_gpu_size)")
        if config.async_kv_loads is not False and config.load_staging_mb >= page_bytes / 2**20:
            wanted.append(f"load staging {config.load_staging_mb:g} MiB (load_staging_mb)")
        if config.enable_p2p and config.transfer_channel != "tcp" and config.nixl_buffer_device != "cpu":
            mib = (config.nixl_buffer_size or DEFAULT_NIXL_STAGING_PAGES * page_bytes) / 2**20
            wanted.append(f"NIXL staging {mib:.0f} MiB (nixl_buffer_size)")
        return wanted

    def _warn_device_buffers_after_kv_cache(self, page_bytes: int) -> None:
        """vLLM 0.34 sizes its KV cache to the memory free after warm-up unless
        gpu_memory_utilization is set, caps torch's allocator, and only then builds this side:
        our device buffers get what its margin leaves (1 GiB or more), or fail to allocate."""
        wanted = self._device_buffers(page_bytes)
        if wanted and compat.kv_cache_fills_free_memory(self.vllm_config):
            logger.warning(
                "vLLM sized its KV cache to the GPU memory free after warm-up (extensible KV cache, "
                "gpu_memory_utilization unset); lmcache-p2p allocates after it: %s. Set --gpu-memory-utilization "
                "to leave them room (or --no-enable-extensible-kv-cache); a buffer that cannot be had is reported "
                "where it is allocated",
                ", ".join(wanted),
            )

    def _make_load_staging(self, device: torch.device, page_bytes: int) -> torch.Tensor | None:
        """The ring of chunk pages that loads beside the steps come through from host memory, in
        GPU memory beside vLLM's (load_staging_mb); None (the kernel reads host memory) where it
        is off, smaller than a page or cannot be had."""
        budget = int(self.config.load_staging_mb * 2**20)
        slots = budget // page_bytes
        if budget and not slots:
            logger.warning(
                "load_staging_mb %.0f is less than one chunk page (%.1f MiB): loads beside the steps read host "
                "memory with the copy kernel, on every SM",
                self.config.load_staging_mb,
                page_bytes / 2**20,
            )
        if not slots:
            return None
        try:
            staging = torch.empty((slots, page_bytes), dtype=torch.uint8, device=device)
        except torch.cuda.OutOfMemoryError:
            logger.warning(
                "no room on %s for load staging (%d chunk pages, %.0f MiB): loads beside the steps read host "
                "memory with the copy kernel, on every SM",
                device,
                slots,
                slots * page_bytes / 2**20,
            )
            return None
        logger.info(
            "loads beside the steps come from host memory through %d chunk pages (%.0f MiB) on %s, by the copy engine",
            slots,
            slots * page_bytes / 2**20,
            device,
        )
        return staging

    # -- per step (model runner thread) ----------------------------------------------------------

    def before_forward(self, meta: P2PConnectorMetadata) -> None:
        """Before the step's forward pass, in every vLLM release: after a preemption the forward
        may write blocks our store copies still read, so it is ordered after them; and where
        start_load_kv comes only after the forward (vLLM >= 0.32, no load in the step), the
        forward's clock starts here."""
        if self._fences is not None:  # before the fence below: loads wait for the stores they touch only
            self._fences.before_forward(meta)
        if meta.fence_stores and self.engine is not None and self.planes and self.planes[0].is_cuda:
            self.engine.order_stores_before(torch.cuda.current_stream(self.planes[0].device))
        if meta.load_after_forward and self._clock is not None:
            self._clock.start(meta)

    def start_load_kv(self, meta: P2PConnectorMetadata) -> None:
        engine, loads = self._engine, self._loads
        engine.poll_stores()
        if self.blender is not None:
            self.blender.poll_stores()
        loads.begin_step(meta)
        lookups = self._rank_lookups
        for req_id in meta.released:
            loads.abort(req_id)  # finished (aborted) while its load pulls: its blocks are freed once reported
            lookups.drop(req_id)
        layerwise: list[tuple[LoadSpec, PinnedPrefix, LoadPlan]] = []
        for spec in meta.loads:
            if spec.blend is not None and spec.beside_steps:
                # Segments offered by a peer or the remote store: pulled beside the steps; the
                # blend runs in the step that first schedules the request (below, next time).
                # Only the segments the blend uses: the job is all or nothing.
                used = {tuple(int(k) for k in s.keys) for s in spec.blend.segments if s.held}
                offers = [(o.keys, o.offer) for o in lookups.take_segment_offers(spec.req_id) if tuple(o.keys) in used]
                loads.jobs.pull_segments(spec, offers)
                continue
            if spec.blend is not None:
                self._load_blended(spec)
                continue
            if spec.beside_steps:
                # Stores from before a preemption read blocks freed then, and the scheduler side
                # forgot them: only this load's end is reported for the request's blocks.
                self._saving.discard(spec.req_id)
                self._finishing.discard(spec.req_id)
            state = lookups.take(spec.req_id)
            prefix = state.prefix if state is not None else None
            offer = state.offer if state is not None and spec.beside_steps else None
            then = state.miss if state is not None else None
            after, timeline = None, None
            if spec.beside_steps:
                after = self._fences.for_load(meta, spec) if self._fences is not None else None
                timeline = LoadTimeline(state.started, state.offered_at) if state is not None else None
            if (
                offer is not None
                and prefix is not None
                and loads.jobs.pull_then_load(spec, offer, prefix, then, after, timeline) is not None
            ):
                continue  # loaded once the pull ends (get_finished)
            if prefix is None:  # no pinned answer here (expired, or this rank restarted): pin now
                prefix = engine.pin_prefix(spec.chunk_hashes, spec.end)
            deferred = loads.load(
                spec, prefix, layerwise=self.layerwise and not spec.beside_steps, after=after, timeline=timeline
            )
            if deferred is not None:
                layerwise.append(deferred)
        if layerwise:
            loads.start_layerwise(layerwise)
        if self._clock is not None and not meta.load_after_forward:
            self._clock.start(meta)  # the forward pass starts now

    # -- pulls of a peer's offer, then their loads (beside the steps) ---------------------------

    # -- loads beside the steps (async_kv_loads) --------------------------------------------------

    # -- layer-wise loads ------------------------------------------------------------------------

    def _load_blended(self, spec) -> None:
        pins = self._rank_lookups.take_segments(spec.req_id).pins
        try:
            if self.blender is None:
                raise RuntimeError("a blended load reached a rank without enable_blending")
            self._drop_failed_landed_checks(spec.req_id, pins)
            loaded_to = self.blender.load(spec.req_id, spec.blend, spec.block_ids, pins)
        except Exception:
            logger.exception("request %s: blending tokens [0, %d) failed", spec.req_id, spec.end)
            loaded_to = 0
        finally:
            for chunk in pins.values():
                chunk.release()
        if loaded_to < spec.end:
            self._loads.report_short_load(spec, loaded_to)

    def _drop_failed_landed_checks(self, req_id: str, pins: dict[int, Any]) -> None:
        """Segments that a peer wrote into the GPU tier are blended only once their checksums
        are checked (a blend cannot be undone after the step): a chunk that failed its check, or
        was not checked in time, is dropped, and the blender recomputes its segment. Never
        raises: under TP every rank must run the blend (it computes through the model's layers,
        whose collectives the other ranks' blends wait on)."""
        for key, chunk in list(pins.items()):
            if chunk.check is None:
                continue
            try:
                bad = key in chunk.check.result(LANDED_CHECK_TIMEOUT_S)
            except Exception:  # not checked in time, or the check itself failed
                bad = True
            if bad:
                logger.error(
                    "request %s: segment chunk %016x failed its checksum check after landing in VRAM; "
                    "its segment is recomputed",
                    req_id,
                    key,
                )
                pins.pop(key).release()

    def wait_for_save(self, meta: P2PConnectorMetadata) -> None:
        """Launch this step's stores; on a GPU they copy beside the next forward pass, and the
        requests' blocks stay allocated until get_finished reports them done."""
        if self._clock is not None:
            self._clock.stop()  # the forward pass is over (on a GPU: queued)
        self._loads.end_layerwise()
        self._loads.check_landed()
        engine = self._engine
        engine.poll_stores()
        for segment_spec in meta.segment_stores:
            try:
                if self.blender is not None:
                    self.blender.store(segment_spec)
            except Exception:  # a failed store is a future miss, never a failed request
                logger.exception("request %s: storing its segments failed", segment_spec.req_id)
        for spec in meta.stores:
            self._saving.add(spec.req_id)  # reported finished as usual (no copy in flight)
            if self._loads.failed_this_step(spec.req_id):
                logger.info(
                    "request %s: its load failed this step, so its blocks are not stored (they are recomputed)",
                    spec.req_id,
                )
                continue
            try:
                engine.store_async(spec.chunk_hashes, self.planes, spec.block_ids, owner=spec.req_id)
            except Exception:  # a failed store is a future miss, never a failed request
                logger.exception(
                    "request %s: storing %d tokens failed", spec.req_id, len(spec.chunk_hashes) * engine.chunk_size
                )

    def finished_stores(self, finished_req_ids: set) -> set:
        """Of the finished requests we stored from, those whose store copies are done: vLLM frees
        their blocks now (the scheduler side delayed it)."""
        engine = self._engine
        engine.poll_stores()
        if self.blender is not None:
            self.blender.poll_stores()
        self._loads.poll_step_loads()
        self._finishing.update(r for r in finished_req_ids if r in self._saving)
        done = {r for r in self._finishing if not engine.stores_pending(r)}
        self._finishing -= done
        self._saving -= done
        return done

    def take_metrics(self, meta: P2PConnectorMetadata | None) -> dict | None:
        """For vLLM's /metrics (engine_metrics.py): this rank's counters' growth since its last
        report and its tiers' occupancy, at most every 50 ms, after a step that computed tokens
        (``meta``: the step's metadata); None between reports. Not after a step that computed
        nothing (every request waiting for its load, as while a peer's chunks are pulled): vLLM's
        offline engine (``LLM``) records a step's stats only when the step produced output, so a
        report there would be lost, and the growth it carried with it."""
        if meta is not None and meta.step_tokens == 0:
            return None
        return self.metrics.take() if self.metrics is not None and self.engine is not None else None

    def take_load_errors(self) -> set[int]:
        # Also here: vLLM asks for the errors before wait_for_save when it defers that call
        # (speculative decoding), and the step's output must be dropped in this step's report.
        return self._loads.take_errors()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.loads is not None:
            self.loads.wait_for_layer(layer_name)

    def finished_loads(self) -> list[LoadJob]:
        """The loads beside the steps that ended since the last call, each once (DONE or FAILED,
        with how far they loaded): see AsyncLoads.finished. A blended load's segments pulled in
        full are kept with its segment lookup for the step that blends them."""
        ended = self._loads.finished()
        for job in ended:
            if job.segments is not None and job.segments.pins:
                self._rank_lookups.add_segment_pins(job.req_id, job.segments.pins)
                job.segments.pins = {}
        return ended

    def recompute_blocks(self, blocks: list[int]) -> None:
        """Blocks a failed load beside the steps did not fill, reported to vLLM < 0.32 through
        get_block_ids_with_load_errors (take_load_errors)."""
        self._loads.add_errors(blocks)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.lookups is not None:
            self.lookups.close()
            self.lookups = None
        if self.pull_ended is not None:
            self.pull_ended.close()
            self.pull_ended = None
        if self.loads is not None:
            self.loads.close()
            self.loads = None
        if self.blender is not None:
            self.blender.close()  # its queued segment stores are written before the tiers close
            self.blender = None
        self._clock = None
        if self.engine is not None:
            self.engine.close()
            self.engine = None
