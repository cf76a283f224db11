"""Ray Serve LLM: the seed's ``kv_connector: LMCacheConnectorV1`` deploys lmcache-p2p, unedited.

Ray Serve LLM runs a set-up step per connector name in each replica before vLLM starts. Its
built-in step for ``LMCacheConnectorV1`` checks ``import lmcache`` (the original package) and
fails without it, before vLLM (and so our general plugin) runs. :func:`register` points that
name at :class:`P2PConnectorBackend` in the Ray cluster's registry, which Ray keeps in the
cluster's key-value store: once per cluster, every later deployment's replicas read it. In the
replica, vLLM then loads our general plugin (``plugin.py``), which resolves the connector name
to lmcache-p2p.

From a shell, after ``ray start --head``: ``lmcache-p2p ray-register --address HOST:PORT``. From a
Python driver: ``lmcache_p2p.integration.ray.register()``, before or after ``ray.init()`` (before,
Ray writes it when it connects).

Ray is imported here only: the rest of lmcache-p2p never needs it.
"""

from __future__ import annotations

import logging

from ray.llm._internal.serve.engines.vllm.kv_transfer.base import DefaultConnectorBackend
from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import KVConnectorBackendFactory

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "LMCacheConnectorV1"
BACKEND_PATH = "lmcache_p2p.integration.ray:P2PConnectorBackend"


class P2PConnectorBackend(DefaultConnectorBackend):
    """Ray's per-replica set-up for ``LMCacheConnectorV1`` when it means lmcache-p2p.

    Nothing to prepare: Ray's original step only makes the original's RPC port name unique per
    replica, which lmcache-p2p has no use for (replicas sharing one config get their own
    instance ids from vLLM's engine_id and their own ports from 0; see docs/ray_serve.md). The P/D
    protocol (decode learns the prefill's engine and blocks from its response) is Ray's default.
    """

    def setup(self) -> None:
        import lmcache_p2p  # the replica's runtime must have us, or vLLM would fail later

        logger.info(
            "Ray Serve replica: %s is lmcache-p2p %s (vLLM's general plugin resolves the name)",
            CONNECTOR_NAME,
            lmcache_p2p.__version__,
        )


def register() -> None:
    """Make ``LMCacheConnectorV1`` set up as lmcache-p2p in this Ray cluster (idempotent)."""
    # Importing the factory registers Ray's built-in backends where missing; ours replaces its
    # entry for the name, locally, in the pending writes and in the cluster's store.
    KVConnectorBackendFactory.unregister_backend(CONNECTOR_NAME)
    KVConnectorBackendFactory.register_backend(CONNECTOR_NAME, BACKEND_PATH)
    logger.info("Ray Serve LLM: %s now sets up as %s", CONNECTOR_NAME, BACKEND_PATH)


def registered_backend() -> str:
    """The class Ray Serve LLM would set ``LMCacheConnectorV1`` up with now, as module:name."""
    backend = KVConnectorBackendFactory.get_backend_class(CONNECTOR_NAME)
    return f"{backend.__module__}:{backend.__qualname__}"
