"""The per-rank worker (installed as ``lmcache_p2p.worker``): it registers its rank with the
controller, reports admits and evicts, heartbeats, answers the controller's commands, serves
chunks to peers and pulls chunks from them; ``build_engine`` puts a rank's cache engine together
with it. See worker.py for how the pieces fit together."""

from lmcache_p2p.worker.worker import Worker, build_engine

__all__ = ["Worker", "build_engine"]
