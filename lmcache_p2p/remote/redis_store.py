"""Redis as the remote tier, through redis-py: standalone, TLS, Sentinel and Cluster.

:class:`RedisStore` serves ``redis://``, ``rediss://`` and ``redis-sentinel://``;
:class:`RedisClusterStore` serves ``redis-cluster://``. Both follow :mod:`.store`'s contract:
every call is a batch costing one round trip per server touched, and every failure is a
:class:`~.store.RemoteUnavailable` naming the URL (``url.describe()``, never the password).

Failing fast matters more than riding out a blip: the tier treats ``RemoteUnavailable`` as a
miss and backs off, so a call that sits in retries for seconds only stalls a prefill that could
have recomputed. Hence no backoff, and at most one immediate retry, and only where it buys
something (a pooled socket the server closed while it was idle).

TLS (``rediss://``) verifies the server's certificate against the system's trust store, with
hostname checking. ``LMCACHE_*`` environment variables are the instance config's namespace, so
no CA or client-certificate options are read from there. To trust a private CA, add it to the
system store (``update-ca-certificates`` on Debian) or point OpenSSL's own ``SSL_CERT_FILE`` /
``SSL_CERT_DIR`` at it; Python's default SSL context honours both. Client certificates (mutual
TLS) would need config keys of their own, passed on as redis-py's ``ssl_certfile`` /
``ssl_keyfile`` / ``ssl_ca_certs``; there are none yet.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from typing import Any, NoReturn, cast

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, PipelineCommand
from redis.cluster import RedisCluster as _RedisCluster
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    NoPermissionError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.retry import Retry
from redis.sentinel import Sentinel

from lmcache_p2p.remote.store import RemoteRefused, RemoteUnavailable
from lmcache_p2p.remote.url import RemoteUrl

# Exceptions redis-py raises for a server that cannot answer. RedisClusterException is not a
# RedisError (it is what the cluster client raises when no seed is reachable), hence both.
_REDIS_ERRORS = (RedisError, RedisClusterException)
_MAX_REASON = 300


def _fail(url: RemoteUrl, what: str, err: BaseException) -> NoReturn:
    # redis-py's messages carry host:port but never the password; the URL is described the
    # same way, so the message is safe for logs. Some embed whole client reprs (Sentinel's "no
    # master found" lists every sentinel's connection settings): the head says enough.
    reason = str(err)
    if len(reason) > _MAX_REASON:
        reason = reason[:_MAX_REASON] + "..."
    # An error reply (OOM under noeviction, a value over proto-max-bulk-len) is a server that
    # answered: a refusal, not an outage. The replies that mean it cannot serve at all (a
    # read-only replica, no permission, a cluster that is down) stay outages.
    cannot_serve = isinstance(err, (ReadOnlyError, NoPermissionError, ClusterDownError))
    kind = RemoteRefused if isinstance(err, ResponseError) and not cannot_serve else RemoteUnavailable
    raise kind(f"{url.describe()}: {what} failed: {type(err).__name__}: {reason}") from err


def _socket_options(timeout_s: float) -> dict[str, Any]:
    return {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        # The OS notices a peer that vanished without a FIN (a pulled cable) on idle pooled
        # sockets, instead of the first command after it waiting out socket_timeout.
        "socket_keepalive": True,
        # redis-py's own parser (no hiredis) receives into a buffer this much per recv; its 32 KiB
        # default costs a thousand calls per 32 MiB chunk, and 1 MiB measured ~1.3x faster GETs.
        "socket_read_size": 1 << 20,
    }


def _retry_on_reset() -> Retry:
    # One immediate retry on a ConnectionError covers a pooled socket that a restarted server
    # had closed (a reset on send). Timeouts are not retried: a server that did not answer
    # within timeout_s will not do better at once, and retrying would double the wait.
    return Retry(NoBackoff(), retries=1, supported_errors=(redis.ConnectionError,))


def _as_bytes_view(value: bytes | bytearray | memoryview) -> bytes | bytearray | memoryview:
    # redis-py writes len(value) as the bulk length, which for a memoryview counts items, not
    # bytes: a view of uint16/float data (or a 2-D one) would corrupt the stream.
    if isinstance(value, memoryview) and (value.itemsize != 1 or value.ndim != 1):
        return value.cast("B")
    return value


class RedisStore:
    """One Redis server (``redis://``, ``rediss://``) or a Sentinel-managed master.

    redis-py keeps a pool of connections and reconnects by itself, so after a failure the next
    call simply tries again; nothing here is left broken by a server that went away.
    """

    def __init__(self, url: RemoteUrl, timeout_s: float) -> None:
        if url.scheme not in ("redis", "rediss", "redis-sentinel"):
            raise ValueError(f"RedisStore serves redis://, rediss:// and redis-sentinel://, not {url.scheme}://")
        self.url = url
        self.timeout_s = timeout_s
        common: dict[str, Any] = {
            "username": url.username,
            "password": url.password,
            "db": url.db,
            "retry": _retry_on_reset(),
            **_socket_options(timeout_s),
        }
        self._sentinel: Sentinel | None = None
        if url.scheme == "redis-sentinel":
            assert url.master_name is not None  # parse_remote_url guarantees it
            # The URL's credentials are the data node's. Sentinels commonly run without auth
            # and answer an AUTH they did not ask for with an error, so they get none.
            self._sentinel = Sentinel(
                list(url.hosts),
                sentinel_kwargs={"retry": _retry_on_reset(), **_socket_options(timeout_s)},
                **common,
            )
            self._client: redis.Redis = self._sentinel.master_for(url.master_name)
        else:
            # Nothing connects here: the pool dials on the first command, so a server that is
            # down now is no error until the store is used.
            self._client = redis.Redis(host=url.host, port=url.port, ssl=url.tls, **common)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        try:
            # EXISTS with several keys answers a count, not which ones; one EXISTS per key in a
            # non-transactional pipeline is still a single write and a single read.
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return [bool(n) for n in pipe.execute()]
        except _REDIS_ERRORS as err:
            _fail(self.url, f"EXISTS of {len(keys)} keys", err)

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        try:
            # decode_responses is off, so values come back as bytes, whatever the stubs allow.
            return cast("list[bytes | None]", self._client.mget(keys))
        except _REDIS_ERRORS as err:
            _fail(self.url, f"MGET of {len(keys)} keys", err)

    def put(self, items: Sequence[tuple[bytes, bytes | bytearray | memoryview]]) -> None:
        if not items:
            return
        try:
            # redis-py's own packer sends values over buffer_cutoff (6 KB) as buffers of their
            # own, memoryviews included, so multi-MiB values are not copied into one packed
            # command. (With hiredis installed redis-py packs with hiredis, which does copy:
            # puts measured ~3x slower, gets ~1.6x faster.)
            pipe = self._client.pipeline(transaction=False)
            for key, value in items:
                pipe.set(key, _as_bytes_view(value))
            pipe.execute()
        except _REDIS_ERRORS as err:
            _fail(self.url, f"SET of {len(items)} keys", err)

    def ping(self) -> float:
        start = time.perf_counter()
        try:
            self._client.ping()
        except _REDIS_ERRORS as err:
            _fail(self.url, "PING", err)
        return time.perf_counter() - start

    def close(self) -> None:
        try:
            self._client.close()
            self._client.connection_pool.disconnect()
            if self._sentinel is not None:
                for sentinel in self._sentinel.sentinels:
                    sentinel.close()
        except _REDIS_ERRORS:
            pass  # closing sockets to a server that is gone cannot fail in a way that matters


class RedisClusterStore:
    """A Redis Cluster (``redis-cluster://seed,seed,...``), client created on first use.

    Keys are sent as they are: with no ``{hash tag}`` they hash to slots all over the cluster,
    so the chunks of one prefix spread over every master.

    How a batch travels (redis-py's ``ClusterPipeline``, ``PipelineStrategy._send_cluster_commands``
    in redis/cluster.py): the queued commands are grouped by the node owning each key's slot
    (from the client's cached slot table, no round trip); one pooled connection is taken per
    node; then the commands of every node are packed and written, node after node, before any
    reply is read, and only then are the replies read, node after node. So a batch costs one
    round per shard touched, the shards' rounds overlapping in flight (the writes and the reads
    are each sequential in this thread). Commands answered with MOVED/ASK/TRYAGAIN or a
    connection error are, by default, re-sent one at a time through the ordinary client, each
    with its own topology refresh. For a node that hangs that is one ``timeout_s`` per key, so
    we send with redirections off, raise at once on connection errors, and re-send only the
    redirected commands ourselves (few, and only while slots migrate).
    """

    def __init__(self, url: RemoteUrl, timeout_s: float) -> None:
        if url.scheme != "redis-cluster":
            raise ValueError(f"RedisClusterStore serves redis-cluster://, not {url.scheme}://")
        self.url = url
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._cluster: _RedisCluster | None = None

    def _client(self) -> _RedisCluster:
        with self._lock:
            if self._cluster is None:
                # Construction already talks to the cluster (CLUSTER SLOTS, COMMAND), which is
                # why it waits for the first call: a cluster down at start-up is no error.
                self._cluster = _RedisCluster(
                    startup_nodes=[ClusterNode(host, port) for host, port in self.url.hosts],
                    username=self.url.username,
                    password=self.url.password,
                    # Retries at the cluster level re-run whole commands after a topology
                    # refresh; we refresh by building a new client after a failure instead,
                    # which also recovers from a refresh that itself failed half-way.
                    retry=Retry(NoBackoff(), retries=0),
                    **_socket_options(self.timeout_s),
                )
            return self._cluster

    def _drop(self, broken: _RedisCluster | None) -> None:
        # The next call builds a new client from the seeds; only the one that failed is dropped
        # (another thread may already have replaced it).
        with self._lock:
            if broken is not None and self._cluster is broken:
                self._cluster = None
        if broken is not None:
            # A broken client may fail to close in any way; it is discarded either way.
            with contextlib.suppress(Exception):
                broken.close()

    def _batch(self, what: str, commands: list[tuple[Any, ...]]) -> list[Any]:
        cluster: _RedisCluster | None = None
        try:
            cluster = self._client()
            pipe = cluster.pipeline(transaction=False)
            stack = [PipelineCommand(args, {}, position) for position, args in enumerate(commands)]
            results = pipe.send_cluster_commands(stack, raise_on_error=False, allow_redirections=False)
            for i, result in enumerate(results):
                if isinstance(result, (MovedError, AskError, TryAgainError)):
                    # The ordinary client follows the redirection (and patches its slot table).
                    results[i] = cluster.execute_command(*commands[i])
                elif isinstance(result, Exception):
                    raise result
            return results
        except _REDIS_ERRORS as err:
            self._drop(cluster)
            _fail(self.url, what, err)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        results = self._batch(f"EXISTS of {len(keys)} keys", [("EXISTS", key) for key in keys])
        return [bool(n) for n in results]

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        # Not MGET: in a cluster it only works for keys of one slot.
        return self._batch(f"GET of {len(keys)} keys", [("GET", key) for key in keys])

    def put(self, items: Sequence[tuple[bytes, bytes | bytearray | memoryview]]) -> None:
        if items:
            self._batch(f"SET of {len(items)} keys", [("SET", key, _as_bytes_view(value)) for key, value in items])

    def ping(self) -> float:
        """Seconds to ping every master, one after the other."""
        cluster: _RedisCluster | None = None
        try:
            cluster = self._client()  # discovery on first use is not part of the round trip
            start = time.perf_counter()
            cluster.ping(target_nodes=_RedisCluster.PRIMARIES)
            return time.perf_counter() - start
        except _REDIS_ERRORS as err:
            self._drop(cluster)
            _fail(self.url, "PING", err)

    def close(self) -> None:
        with self._lock:
            cluster, self._cluster = self._cluster, None
        if cluster is not None:
            with contextlib.suppress(*_REDIS_ERRORS):
                cluster.close()
