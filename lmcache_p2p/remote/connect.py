""":func:`open_store`: the backend for a remote URL. Apart from the interface (:mod:`.store`), which
the backends import, so that no backend and the interface import each other."""

from __future__ import annotations

from lmcache_p2p.remote.lm_store import LmServerStore
from lmcache_p2p.remote.redis_store import RedisClusterStore, RedisStore
from lmcache_p2p.remote.store import RemoteStore
from lmcache_p2p.remote.url import RemoteUrl


def open_store(url: RemoteUrl, timeout_s: float = 5.0) -> RemoteStore:
    """A client for ``url`` (it connects lazily: a server that is down now is no error here).
    An lm:// client authenticates with ``url``'s mesh secret, when it carries one; Redis has its
    own password, and the tier MACs values whatever the store."""
    if url.scheme == "lm":
        return LmServerStore(url, timeout_s, mesh_secret=url.mesh_secret)
    if url.scheme == "redis-cluster":
        return RedisClusterStore(url, timeout_s)
    return RedisStore(url, timeout_s)
