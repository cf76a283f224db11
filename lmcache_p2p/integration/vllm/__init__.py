"""vLLM integration: ``"kv_connector_module_path": "lmcache_p2p.integration.vllm"``.

vLLM looks the connector class up on this module. It is imported on first access, so that
importing a submodule (the offline driver, the lookup channel) does not import vLLM; the rest of
lmcache_p2p, the controller above all, never does.
"""

__all__ = ["LMCacheConnectorV1"]


def __getattr__(name: str):
    if name == "LMCacheConnectorV1":
        from lmcache_p2p.integration.vllm.connector import LMCacheConnectorV1

        return LMCacheConnectorV1
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
