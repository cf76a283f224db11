"""The controller (installed as ``lmcache_p2p.controller``): FastAPI app, ZMQ monitor, chunk
index and command orchestration. It must never import torch or vLLM: it starts fast and small."""
