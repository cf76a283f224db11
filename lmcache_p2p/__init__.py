"""lmcache-p2p: a peer-to-peer KV-cache mesh for vLLM."""

__version__ = "0.1.0"
