"""The remote tier's stores for tests: ``lmcache_server`` as users start it (its console script);
Redis and Redis Cluster are in :mod:`redis_servers`. :func:`store_url` is any of them's URL."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from protocol_client import free_ports, wait_for

from lmcache_p2p.remote.store import open_store
from lmcache_p2p.remote.url import parse_remote_url


class LmServer:
    """``lmcache_server HOST PORT`` as users start it, on a free loopback port."""

    def __init__(self, max_size_gb: float = 0.5):
        self.port = free_ports(1)[0]
        self.max_size_gb = max_size_gb
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"lm://127.0.0.1:{self.port}"

    def start(self) -> LmServer:
        script = Path(sys.executable).with_name("lmcache_server")
        self.proc = subprocess.Popen(
            [str(script), "127.0.0.1", str(self.port), "--max-size-gb", str(self.max_size_gb)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        store = open_store(parse_remote_url(self.url), timeout_s=1.0)
        try:
            wait_for(lambda: _pings(store), timeout=20, what=f"lmcache_server on {self.port}")
        finally:
            store.close()
        return self

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def __enter__(self) -> LmServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()


def _pings(store) -> bool:
    try:
        store.ping()
        return True
    except Exception:
        return False


def restarted(server: LmServer) -> LmServer:
    """A fresh (empty) server on ``server``'s port."""
    fresh = LmServer(server.max_size_gb)
    fresh.port = server.port
    return fresh.start()


def store_url(store) -> str:
    """The remote_url of an LmServer, a RedisServer (whose url is a method) or a RedisCluster."""
    return store.url() if callable(store.url) else store.url
