"""The Redis backends of the remote tier against real redis-server processes (tests/redis_servers.py):
standalone, password, db, TLS, Sentinel and a three-master Cluster; failures and reconnects."""

from __future__ import annotations

import functools
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import redis.connection
from redis_servers import RedisCluster, RedisSentinel, RedisServer, redis_sentinel  # noqa: F401

from lmcache_p2p.remote.connect import open_store
from lmcache_p2p.remote.redis_store import RedisClusterStore, RedisStore
from lmcache_p2p.remote.store import RemoteUnavailable
from lmcache_p2p.remote.url import parse_remote_url

MiB = 1 << 20
TIMEOUT_S = 0.5  # short, so the failure tests measure fail-fast in well under a second


def store_for(url: str, timeout_s: float = 5.0):
    return open_store(parse_remote_url(url), timeout_s)


def keys_of(prefix: str, n: int) -> list[bytes]:
    # The shape of the tier's keys: no {hash tag}, so they hash all over the cluster's slots.
    return [f"lmcache:test:{prefix}:{i}:{os.urandom(4).hex()}".encode() for i in range(n)]


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as s:
        yield s


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    # Once per module: a cluster takes ~2 s to come up (Redis holds a new master back 2 s).
    with RedisCluster() as c:
        yield c


@pytest.fixture
def count_writes(monkeypatch) -> Callable[[], Counter]:
    """Packed writes per server port since the last call: a pipelined batch is one write per server."""
    counts: Counter = Counter()
    original = redis.connection.AbstractConnection.send_packed_command

    def counting(self, command, check_health=True):
        counts[self.port] += 1
        return original(self, command, check_health)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting)

    def take() -> Counter:
        snapshot = counts.copy()
        counts.clear()
        return snapshot

    return take


def assert_fails_fast(call: Callable[[], object], url_text: str, limit_s: float) -> RemoteUnavailable:
    start = time.monotonic()
    with pytest.raises(RemoteUnavailable) as info:
        call()
    elapsed = time.monotonic() - start
    assert elapsed < limit_s, f"took {elapsed:.2f}s to fail (limit {limit_s}s)"
    assert url_text in str(info.value)
    return info.value


# ---- standalone ------------------------------------------------------------------------------


def test_round_trip_multi_mib_values_byte_exact(server):
    store = store_for(server.url())
    assert isinstance(store, RedisStore)
    keys = keys_of("big", 4)
    values: list[bytes | memoryview] = [os.urandom(3 * MiB), os.urandom(8 * MiB + 7), b"", os.urandom(1)]
    backing = bytearray(os.urandom(5 * MiB))
    values[3] = memoryview(backing)[MiB:]  # a view into a larger buffer, as the tier hands over
    store.put(list(zip(keys, values, strict=True)))
    # A view of wider items (a tensor's numpy view) is sent by bytes, not by its item count.
    words = memoryview(backing).cast("I")
    store.put([(keys[0] + b":words", words)])
    assert store.get([keys[0] + b":words"]) == [bytes(backing)]
    missing = keys_of("missing", 2)
    asked = [missing[0], keys[0], keys[1], missing[1], keys[2], keys[3]]
    assert store.exists(asked) == [False, True, True, False, True, True]
    got = store.get(asked)
    assert got[0] is None and got[3] is None
    assert got[1] == values[0] and got[2] == values[1] and got[4] == b""
    assert got[5] == bytes(backing[MiB:])
    assert store.exists([]) == [] and store.get([]) == []
    store.put([])
    assert 0 < store.ping() < 1
    store.close()


def test_batches_are_one_write_each(server, count_writes):
    store = store_for(server.url())
    keys = keys_of("rt", 40)
    store.put([(k, b"v" * 100) for k in keys[:1]])  # connects (the handshake is writes too)
    count_writes()
    store.put([(k, os.urandom(64 * 1024)) for k in keys])
    assert count_writes() == {server.port: 1}
    assert all(store.exists(keys))
    assert count_writes() == {server.port: 1}
    assert all(v is not None for v in store.get(keys))
    assert count_writes() == {server.port: 1}
    store.close()


def test_password_auth_and_wrong_password_never_shown(tmp_path):
    with RedisServer(tmp_path, password="s3cret-pw") as s:
        good = store_for(s.url())
        good.put([(b"k", b"v")])
        assert good.get([b"k"]) == [b"v"]
        good.close()

        bad = store_for(s.url(password="not-the-pw"), TIMEOUT_S)
        err = assert_fails_fast(lambda: bad.get([b"k"]), f"redis://:***@127.0.0.1:{s.port}", 2 * TIMEOUT_S)
        assert "not-the-pw" not in str(err) and "s3cret-pw" not in str(err)
        assert "not-the-pw" not in repr(err.__cause__)
        with pytest.raises(RemoteUnavailable):
            bad.put([(b"k", b"x")])

        anonymous = store_for(s.url(password=""), TIMEOUT_S)
        with pytest.raises(RemoteUnavailable, match=f"127.0.0.1:{s.port}"):
            anonymous.exists([b"k"])
        assert s.client().get(b"k") == b"v"


def test_db_selection_isolates_keys(server):
    one, two = store_for(server.url(db=1)), store_for(server.url(db=2))
    key = keys_of("db", 1)[0]
    one.put([(key, b"in db 1")])
    assert one.get([key]) == [b"in db 1"]
    assert two.exists([key]) == [False] and two.get([key]) == [None]
    assert server.client(db=1).get(key) == b"in db 1"
    assert server.client(db=0).exists(key) == 0
    one.close()
    two.close()


def test_tls_verifies_against_the_system_trust_store(tmp_path, monkeypatch):
    with RedisServer(tmp_path, tls=True) as s:
        url = s.url()
        assert url.startswith("rediss://")
        # A private CA is trusted the way the module documents: OpenSSL's own SSL_CERT_FILE.
        monkeypatch.setenv("SSL_CERT_FILE", str(s.ca_file))
        store = store_for(url, TIMEOUT_S)
        value = os.urandom(2 * MiB)
        store.put([(b"tls", value)])
        assert store.get([b"tls"]) == [value]
        store.close()
        # Without it the system store does not know that CA: refused, not silently accepted.
        monkeypatch.delenv("SSL_CERT_FILE")
        untrusted = store_for(url, TIMEOUT_S)
        with pytest.raises(RemoteUnavailable, match="rediss://127.0.0.1"):
            untrusted.get([b"tls"])


def test_standalone_killed_fails_fast_and_the_same_store_recovers(tmp_path):
    with RedisServer(tmp_path) as s:
        store = store_for(s.url(), TIMEOUT_S)
        store.put([(b"before", b"1")])
        s.kill()
        where = f"redis://127.0.0.1:{s.port}"
        assert_fails_fast(lambda: store.exists([b"before"]), where, 2 * TIMEOUT_S)
        assert_fails_fast(lambda: store.get([b"before"]), where, 2 * TIMEOUT_S)
        assert_fails_fast(lambda: store.put([(b"during", b"2")]), where, 2 * TIMEOUT_S)
        assert_fails_fast(store.ping, where, 2 * TIMEOUT_S)
        s.restart()  # empty: no persistence
        assert store.get([b"before"]) == [None]
        store.put([(b"after", b"3")])
        assert store.get([b"after"]) == [b"3"]
        assert store.ping() < TIMEOUT_S
        store.close()


def test_standalone_hung_fails_within_the_timeout_and_recovers(tmp_path):
    with RedisServer(tmp_path) as s:
        store = store_for(s.url(), TIMEOUT_S)
        store.put([(b"k", b"v")])
        s.pause()
        try:
            assert_fails_fast(lambda: store.get([b"k"]), "TimeoutError", 2 * TIMEOUT_S)
        finally:
            s.resume()
        assert store.get([b"k"]) == [b"v"]
        store.close()


def test_down_at_construction_is_no_error_until_used():
    from lmcache_p2p.testing.ports import free_ports

    port = free_ports(1)[0]
    for url in (f"redis://127.0.0.1:{port}", f"redis-cluster://127.0.0.1:{port},127.0.0.1:{port + 1}"):
        store = store_for(url, TIMEOUT_S)
        assert_fails_fast(functools.partial(store.exists, [b"k"]), f"127.0.0.1:{port}", 2 * TIMEOUT_S)
        store.close()


# ---- sentinel --------------------------------------------------------------------------------


def test_sentinel_resolves_the_master(redis_sentinel):  # noqa: F811 - the imported fixture
    store = store_for(redis_sentinel.url)
    assert isinstance(store, RedisStore)
    value = os.urandom(MiB)
    store.put([(b"via-sentinel", value)])
    assert store.get([b"via-sentinel"]) == [value]
    assert redis_sentinel.master.client().get(b"via-sentinel") == value
    assert store.ping() > 0

    redis_sentinel.master.kill()
    assert_fails_fast(lambda: store.get([b"via-sentinel"]), "redis-sentinel://127.0.0.1", 2 * TIMEOUT_S)
    redis_sentinel.master.restart()
    store.put([(b"after", b"restart")])
    assert store.get([b"after", b"via-sentinel"]) == [b"restart", None]
    store.close()

    unknown = store_for(f"redis-sentinel://127.0.0.1:{redis_sentinel.port}/no-such-master", TIMEOUT_S)
    with pytest.raises(RemoteUnavailable, match="no-such-master"):
        unknown.get([b"via-sentinel"])


# ---- cluster ---------------------------------------------------------------------------------


def slot_owner_ports(cluster: RedisCluster) -> dict[int, int]:
    """slot -> port of the master serving it, from CLUSTER SLOTS."""
    owners: dict[int, int] = {}
    with cluster.node_client(0) as c:
        # [[first slot, last slot, [host, port, id], replicas...], ...]
        for start, end, primary, *_ in c.execute_command("CLUSTER SLOTS"):
            for slot in range(int(start), int(end) + 1):
                owners[slot] = int(primary[1])
    return owners


def test_cluster_keys_spread_over_all_masters(cluster):
    for i in range(3):
        cluster.node_client(i).flushall()
    store = store_for(cluster.url)
    assert isinstance(store, RedisClusterStore)
    keys = keys_of("spread", 200)
    store.put([(k, b"x") for k in keys])
    owners = slot_owner_ports(cluster)
    with cluster.node_client(0) as c:
        expected = Counter(owners[int(c.execute_command("CLUSTER KEYSLOT", k))] for k in keys)
    held = {port: cluster.nodes[i].client().dbsize() for i, port in enumerate(cluster.ports)}
    assert held == dict(expected)
    assert sum(held.values()) == 200
    assert min(held.values()) > 30, held  # ~1/3 each; 30 is far below any plausible spread
    store.close()


def test_cluster_batches_across_shards_in_order(cluster, count_writes):
    store = store_for(cluster.url)
    keys = keys_of("batch", 60)
    values = [os.urandom(MiB if i % 10 == 0 else 1000 + i) for i in range(60)]
    store.put(list(zip(keys[:1], values[:1], strict=True)))  # discovery and connects
    store.exists(keys)
    count_writes()

    store.put(list(zip(keys, values, strict=True)))
    assert count_writes() == {port: 1 for port in cluster.ports}  # one round per shard
    missing = keys_of("absent", 30)
    asked = [k for pair in zip(keys[:30], missing, strict=True) for k in pair] + keys[30:]
    assert store.exists(asked) == [True, False] * 30 + [True] * 30
    assert count_writes() == {port: 1 for port in cluster.ports}
    got = store.get(asked)
    assert got == [v for pair in zip(values[:30], [None] * 30, strict=True) for v in pair] + values[30:]
    assert count_writes() == {port: 1 for port in cluster.ports}

    store.put([(keys[5], b"new"), (keys[50], b"newer")])
    assert store.get([keys[50], keys[5], keys[6]]) == [b"newer", b"new", values[6]]
    assert 0 < store.ping() < 1
    store.close()


def test_cluster_node_killed_fails_fast_and_the_same_store_recovers(cluster):
    store = store_for(cluster.url, TIMEOUT_S)
    keys = keys_of("kill", 30)
    store.put([(k, b"v") for k in keys])
    victim = cluster.ports[1]
    try:
        cluster.kill(1)
        err = assert_fails_fast(lambda: store.get(keys), "redis-cluster://127.0.0.1", 2 * TIMEOUT_S)
        assert f"{victim}" in str(err)
        cluster.kill()
        assert_fails_fast(lambda: store.exists(keys), "redis-cluster://", 2 * TIMEOUT_S)
        assert_fails_fast(store.ping, "redis-cluster://", 2 * TIMEOUT_S)
    finally:
        cluster.restart()  # all nodes back on their ports, cluster_state ok; empty
    assert store.exists(keys) == [False] * 30
    store.put([(k, k) for k in keys])
    assert store.get(keys) == keys
    store.close()


def test_cluster_hung_node_fails_within_the_timeout(cluster):
    store = store_for(cluster.url, TIMEOUT_S)
    keys = keys_of("hung", 30)
    store.put([(k, b"v") for k in keys])
    cluster.pause(2)
    try:
        assert_fails_fast(lambda: store.get(keys), "TimeoutError", 2 * TIMEOUT_S)
    finally:
        cluster.resume(2)
    cluster.wait_ok()  # the others may have marked it failing meanwhile
    assert store.get(keys) == [b"v"] * 30
    store.close()
