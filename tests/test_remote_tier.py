"""The remote tier (issue 20) in the storage manager, against real stores: ``lmcache_server``
started as its console script, Debian's ``redis-server`` and a three-master Redis Cluster.

Two storage managers stand for two engine ranks: one stores, the other fetches. The oracle is
the bytes: what the second fetches equals what the first stored, and anything else (another
layout, a corrupted value, a dead store) is a miss, never an error or wrong bytes.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import msgspec
import pytest
import torch
from protocol_client import wait_for
from remote_stores import LmServer, restarted, store_url

from lmcache_p2p.config import ConfigError, LMCacheConfig
from lmcache_p2p.keys import KEY_FORMAT, LayoutFingerprint, payload_checksum
from lmcache_p2p.remote import tier as tier_module
from lmcache_p2p.remote.connect import open_store
from lmcache_p2p.remote.tier import remote_key
from lmcache_p2p.remote.url import parse_remote_url
from lmcache_p2p.storage import StorageManager
from lmcache_p2p.testing.processes import freeze

CHUNK = 16
# A small layout: 16 tokens x 2 layers x (2, 16, 4, 64) fp16 blocks = 64 KiB pages.
LAYOUT = LayoutFingerprint("tiny", "float16", 16, (2, 16, 4, 64), (8192, 256, 64, 1), 2)
PAGE = LAYOUT.bytes_per_token * CHUNK


def manager(url: str, layout: LayoutFingerprint = LAYOUT, pages: int = 64, **extra) -> StorageManager:
    config = LMCacheConfig.from_dict(
        {
            "chunk_size": CHUNK,
            "max_local_cpu_size": pages * PAGE / 2**30,
            "remote_url": url,
            "remote_timeout_s": 1.0,
            **extra,
        }
    )
    return StorageManager(config, layout, pin_memory=False)


def payload(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=g)


def hashes(n: int, base: int) -> list[int]:
    return [base + i for i in range(n)]


def store_chunks(mgr: StorageManager, chunk_hashes: list[int]) -> None:
    for h in chunk_hashes:
        assert mgr.put(h, payload(h))
    assert mgr.flush(30), "write-behind did not finish"


def held_bytes(mgr: StorageManager, chunk_hash: int) -> torch.Tensor:
    chunk = mgr.pin(chunk_hash)
    assert chunk is not None
    with chunk:
        return chunk.data.clone()


# -- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url, scheme, hosts",
    [
        ("localhost:65432", "lm", [("localhost", 65432)]),  # the seed's remote_server_addr
        ("lm://10.0.0.5:7000", "lm", [("10.0.0.5", 7000)]),
        ("redis://user:p%40ss@cache:6380/3", "redis", [("cache", 6380)]),
        ("rediss://cache", "rediss", [("cache", 6379)]),
        ("redis-sentinel://s1:26379,s2:26380/mymaster", "redis-sentinel", [("s1", 26379), ("s2", 26380)]),
        ("redis-cluster://a:7000,b:7001,c:7002", "redis-cluster", [("a", 7000), ("b", 7001), ("c", 7002)]),
    ],
)
def test_every_remote_url_form_loads(url, scheme, hosts):
    config = LMCacheConfig.from_dict({"remote_url": url})
    assert config.remote is not None
    assert (config.remote.scheme, list(config.remote.hosts)) == (scheme, hosts)


def test_the_seeds_remote_server_addr_is_remote_url_and_passwords_stay_out_of_logs():
    config = LMCacheConfig.from_dict({"remote_server_addr": "localhost:65432"})
    assert config.remote_url == "localhost:65432" and config.remote.scheme == "lm"
    secret = LMCacheConfig.from_dict({"remote_url": "redis://u:hunter2@h:1/0"})
    assert secret.remote.password == "hunter2"
    assert "hunter2" not in secret.remote.describe() and "hunter2" not in repr(secret)
    assert "hunter2" not in str(secret.to_dict())


@pytest.mark.parametrize(
    "url, says",
    [
        ("http://cache:80", "unknown scheme 'http'"),
        ("redis://cache:port", "port 'port'"),
        ("redis://a:1,b:2", "use redis-cluster://"),
        ("redis-sentinel://s1:26379", "master's name"),
        ("redis-cluster://a:1/2", "only db 0"),
        ("redis://cache:6379/zero", "database 'zero'"),
        ("lm://cache:99999", "outside 1-65535"),
    ],
)
def test_a_bad_remote_url_names_the_key_and_the_wrong_part(url, says):
    with pytest.raises(ConfigError) as err:
        LMCacheConfig.from_dict({"remote_url": url})
    assert str(err.value).startswith("remote_url") and says in str(err.value)


@pytest.mark.parametrize(
    "url, shown",
    [
        ("redis//cache:6379", "'redis//cache:6379'"),
        ("lm//cache:65432", "'lm//cache:65432'"),
        ("rediss:/cache:6380", "'rediss:/cache:6380'"),
        ("redis:cache:6379", "'redis:cache:6379'"),
        ("redis//u:hunter2@cache:6379/0", "'redis//***@cache:6379/0'"),  # never the password
    ],
)
def test_a_mistyped_scheme_is_refused_not_read_as_an_lm_address(url, shown):
    """Without "://" a value is the seed's bare host:port (lm://); one that is a scheme with its
    "://" mistyped must not become an lm:// address that never answers."""
    with pytest.raises(ConfigError) as err:
        LMCacheConfig.from_dict({"remote_url": url})
    message = str(err.value)
    assert message.startswith("remote_url") and shown in message, message
    assert "redis://host:port" in message and "host:port" in message
    assert "hunter2" not in message
    for fine in ("localhost:65432", "redis:6379", "[::1]:65432"):  # a host named redis is a host
        assert LMCacheConfig.from_dict({"remote_url": fine}).remote.scheme == "lm"


def test_remote_serde_naive_loads_lmcache_serializers_warn_and_typos_fail(caplog):
    LMCacheConfig.from_dict({"remote_url": "lm://h:1", "remote_serde": "naive"})
    with caplog.at_level(logging.WARNING):
        LMCacheConfig.from_dict({"remote_url": "lm://h:1", "remote_serde": "cachegen"})
    assert "'cachegen' is not implemented and pages are stored naive" in caplog.text
    with pytest.raises(ConfigError, match=r"remote_serde='nave'.*expected \"naive\""):
        LMCacheConfig.from_dict({"remote_url": "lm://h:1", "remote_serde": "nave"})


# -- one store, two ranks ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["lm_server", "shared_redis", "shared_redis_cluster"])
def test_a_chunk_stored_by_one_rank_is_fetched_byte_exact_by_another(backend, request):
    url = store_url(request.getfixturevalue(backend))
    base = 1_000 * (1 + ["lm_server", "shared_redis", "shared_redis_cluster"].index(backend))
    writer, reader = manager(url), manager(url)
    try:
        store_chunks(writer, hashes(6, base))
        assert writer.remote.counters.chunks_written == 6
        # the reader holds nothing locally, then fetches the prefix the store holds
        assert reader.lookup_prefix(hashes(8, base)).num_chunks == 0
        assert reader.remote.fetch_prefix_into(reader, hashes(8, base)) == 6
        assert reader.lookup_prefix(hashes(8, base)).num_chunks == 6
        for h in hashes(6, base):
            assert torch.equal(held_bytes(reader, h), payload(h))
        stats = reader.stats()["remote"]
        assert stats["chunks_read"] == 6 and stats["bad_values"] == 0 and stats["lookup_chunks_hit"] == 6
        # fetched chunks are not written back; a second writer of the same chunks skips them
        assert reader.remote.counters.chunks_written == 0
        again = manager(url)
        try:
            store_chunks(again, hashes(6, base))
            assert again.remote.counters.writes_already_there == 6
            assert again.remote.counters.chunks_written == 0
        finally:
            again.close()
    finally:
        writer.close()
        reader.close()


def test_another_layout_or_rank_never_reads_the_bytes(lm_server):
    other_rank = msgspec.structs.replace(LAYOUT, tp_size=2, tp_rank=1)
    other_model = msgspec.structs.replace(LAYOUT, model="another")
    writer = manager(lm_server.url)
    readers = [manager(lm_server.url, layout) for layout in (other_rank, other_model)]
    try:
        store_chunks(writer, hashes(3, 5_000))
        for reader in readers:
            assert reader.remote.fetch_prefix_into(reader, hashes(3, 5_000)) == 0
            assert reader.remote.counters.chunks_read == 0
    finally:
        writer.close()
        for reader in readers:
            reader.close()


def test_a_corrupted_value_is_a_logged_miss(shared_redis, caplog):
    writer, reader = manager(shared_redis.url()), manager(shared_redis.url())
    try:
        store_chunks(writer, hashes(3, 7_000))
        store = open_store(parse_remote_url(shared_redis.url()))
        name = remote_key(writer.key(7_001))
        value = bytearray(store.get([name])[0])
        value[-1] ^= 0xFF  # one bit of the payload flipped
        store.put([(name, bytes(value))])
        store.close()
        with caplog.at_level(logging.WARNING):
            got = reader.remote.fetch_prefix_into(reader, hashes(3, 7_000))
        assert got == 1, "the chunks before the corrupted one are still a hit"
        assert reader.remote.counters.bad_values == 1
        assert "unusable (checksum" in caplog.text and "treating it as a miss" in caplog.text
        assert torch.equal(held_bytes(reader, 7_000), payload(7_000))
        assert reader.lookup_prefix(hashes(3, 7_000)).num_chunks == 1
    finally:
        writer.close()
        reader.close()


def test_a_store_killed_mid_read_is_a_miss_and_the_tier_reconnects(monkeypatch, caplog):
    big = 48
    monkeypatch.setattr(tier_module, "FETCH_BATCH_BYTES", 4 * (PAGE + tier_module.HEADER_BYTES))  # 4 per round
    server = LmServer().start()
    writer = manager(server.url, pages=big + 8)
    reader = manager(server.url, pages=big + 8)
    try:
        store_chunks(writer, hashes(big, 9_000))
        keys = [reader.key(h) for h in hashes(big, 9_000)]
        # Killed between two get rounds: what the first round brought is good, then it stops.
        rounds = reader.remote.fetch(keys)
        first = next(rounds)
        server.kill()
        with caplog.at_level(logging.WARNING):
            rest = list(rounds)
        assert [k for k, _, _ in [first, *rest]] == keys[:4]
        assert all(bytes(p) == payload(k.chunk_hash).numpy().tobytes() for k, p, _ in [first, *rest])
        assert not reader.remote.is_up()
        assert "unavailable (get:" in caplog.text and "lookups are misses" in caplog.text
        # while down: a miss without a round trip
        free_before = reader.cpu.pool.free_pages
        errors = reader.remote.counters.errors
        assert reader.remote.fetch_prefix_into(reader, hashes(big, 9_000)) == 0
        assert reader.remote.counters.errors == errors
        # back on the same port (empty): after the back-off the same tier works again
        server = restarted(server)
        monkeypatch.undo()
        writer_again = manager(server.url)
        store_chunks(writer_again, hashes(2, 9_500))
        writer_again.close()
        with caplog.at_level(logging.INFO):
            wait_for(
                lambda: reader.remote.fetch_prefix_into(reader, hashes(2, 9_500)) == 2, timeout=10, what="reconnect"
            )
        assert reader.remote.is_up() and "is back after" in caplog.text
        assert reader.cpu.pool.free_pages == free_before - 2, "a page leaked on the failed reads"
    finally:
        writer.close()
        reader.close()
        server.kill()


def test_a_store_that_stops_answering_during_a_lookup_is_a_miss_without_leaking_pages(caplog):
    server = LmServer().start()
    writer, reader = manager(server.url), manager(server.url)
    try:
        store_chunks(writer, hashes(8, 10_000))
        free_before = reader.cpu.pool.free_pages
        freeze(server.proc.pid)  # the exists round hangs ...
        killer = threading.Timer(0.3, server.kill)  # ... until the server dies
        killer.start()
        with caplog.at_level(logging.WARNING):
            got = reader.remote.fetch_prefix_into(reader, hashes(8, 10_000))
        killer.join(10)
        assert got == 0 and not reader.remote.is_up()
        assert "unavailable (exists:" in caplog.text
        assert reader.cpu.pool.free_pages == free_before
        assert reader.lookup_prefix(hashes(8, 10_000)).num_chunks == 0
    finally:
        writer.close()
        reader.close()
        server.kill()


def test_a_lookup_offers_what_the_store_holds_the_load_fetches_it_and_a_stopped_store_is_asked_once():
    """The remote store answers a lookup as a peer does: what it holds, as an offer (one exists
    round, no bytes), which the load fetches, each chunk reported as it lands. Stopped (SIGSTOP),
    the store costs one lookup its deadline; the next lookups skip it at once until that round
    ends; answering again, it is offered again."""
    import time

    from lmcache_p2p.cache_engine import CacheEngine
    from lmcache_p2p.miss_reasons import TIMEOUT
    from lmcache_p2p.remote.offers import ExistsRounds, RemoteOffer

    server = LmServer().start()
    writer, reader = manager(server.url), manager(server.url)
    engine = CacheEngine(reader_config(server.url), LAYOUT, reader)
    try:
        held = hashes(4, 20_000)
        store_chunks(writer, held)
        first = engine.lookup_async(held + [20_999])  # the store holds the first four
        assert first.sources == [] and isinstance(first.offer, RemoteOffer) and first.offer.chunks == 4
        assert first.miss is not None and first.miss.reason == "never_stored"  # the fifth: nowhere
        assert reader.stats()["remote"]["chunks_read"] == 0  # an offer moves no bytes
        landed: list[int] = []
        pulled = engine.pull_offer_async(first.offer, landed.append).result(10)
        assert pulled.chunks == 4 and pulled.miss is None and landed == [1, 2, 3, 4]
        for h in held:
            assert torch.equal(held_bytes(reader, h), payload(h))

        later = hashes(2, 21_000)
        store_chunks(writer, later)
        freeze(server.proc.pid)
        try:
            t0 = time.monotonic()
            stalled = engine.lookup_async(later)
            waited = time.monotonic() - t0
            assert stalled.offer is None and stalled.miss is not None and stalled.miss.reason == TIMEOUT
            assert ExistsRounds.DEADLINE_MIN_S <= waited < 0.5 + 0.25, waited
            t0 = time.monotonic()
            again = engine.lookup_async(later)  # that round still runs: not asked again
            assert again.offer is None and again.miss is not None and again.miss.reason == TIMEOUT
            assert time.monotonic() - t0 < ExistsRounds.DEADLINE_MIN_S
        finally:
            server.proc.send_signal(signal.SIGCONT)
        # Its round answered (or timed out, then the tier's backoff passed): offered again.
        wait_for(lambda: engine.lookup_async(later).offer is not None, timeout=15, what="the store offered again")
    finally:
        engine.close()
        writer.close()
        server.kill()


def test_the_first_exists_round_may_take_the_longest_deadline_and_the_store_is_connected_at_start(caplog):
    """A first round may open the connections (a cluster client discovers the slots first): it
    gets the longest deadline, and the engine connects at start so that its first lookup does not
    pay for that. Later rounds get a deadline that follows the store's usual round."""
    import logging

    from lmcache_p2p.cache_engine import CacheEngine
    from lmcache_p2p.remote.offers import ExistsRounds
    from lmcache_p2p.vocab import REMOTE_OFFER_TIMEOUT_S

    rounds = ExistsRounds()
    assert rounds.deadline() == REMOTE_OFFER_TIMEOUT_S
    rounds.took(0.001)
    assert rounds.deadline() == ExistsRounds.DEADLINE_MIN_S
    for _ in range(ExistsRounds.WINDOW):
        rounds.took(0.004)
    assert rounds.deadline() == pytest.approx(ExistsRounds.DEADLINE_PER_USUAL * 0.004)

    server = LmServer().start()
    reader = manager(server.url)
    try:
        with caplog.at_level(logging.INFO, logger="lmcache_p2p.remote.tier"):
            engine = CacheEngine(reader_config(server.url), LAYOUT, reader)
            wait_for(lambda: "connected (ping" in caplog.text, timeout=10, what="the engine to connect to the store")
        engine.close()
    finally:
        reader.close()
        server.kill()


def reader_config(url: str) -> LMCacheConfig:
    return LMCacheConfig.from_dict(
        {"chunk_size": CHUNK, "max_local_cpu_size": 64 * PAGE / 2**30, "remote_url": url, "remote_timeout_s": 1.0}
    )


def test_writes_never_block_the_store_path_a_full_queue_drops_and_counts(lm_server):
    mgr = manager(lm_server.url, remote_write_queue_chunks=2)
    try:
        freeze(lm_server.proc.pid)  # the writer's round trip hangs until its timeout
        try:
            for h in hashes(20, 11_000):
                assert mgr.put(h, payload(h))  # every chunk is admitted locally, none waits
            # one batch in the writer's hands, two queued, the rest dropped and counted
            assert mgr.stats()["remote"]["writes_dropped_queue_full"] >= 20 - 2 - 16
        finally:
            lm_server.proc.send_signal(signal.SIGCONT)
        assert mgr.lookup_prefix(hashes(20, 11_000)).num_chunks == 20
        assert mgr.flush(30)
    finally:
        mgr.close()


def keys_per_master(cluster) -> list[int]:
    return [cluster.node_client(i).dbsize() for i in range(3)]


def test_cluster_keys_spread_over_every_master(shared_redis_cluster):
    mgr = manager(shared_redis_cluster.url)
    try:
        before = keys_per_master(shared_redis_cluster)
        store_chunks(mgr, hashes(30, 13_000))
        after = keys_per_master(shared_redis_cluster)
        grown = [a - b for a, b in zip(after, before, strict=True)]
        assert sum(grown) == 30 and all(g > 0 for g in grown), grown
    finally:
        mgr.close()


def test_payload_checksum_matches_what_the_reader_verifies(lm_server):
    # what the value frame carries is the same XXH3 the CPU tier, disk and peers use
    writer = manager(lm_server.url)
    try:
        store_chunks(writer, [15_000])
        store = open_store(parse_remote_url(lm_server.url))
        value = store.get([remote_key(writer.key(15_000))])[0]
        store.close()
        assert int.from_bytes(value[32:40], "little") == payload_checksum(payload(15_000).numpy())
    finally:
        writer.close()


if os.environ.get("LMCACHE_P2P_TEST_DEBUG"):
    logging.getLogger("lmcache_p2p").setLevel(logging.DEBUG)


def test_a_write_the_store_refuses_is_counted_and_reads_stay_on(caplog):
    # a server smaller than one page refuses every write, but it is up: lookups keep working
    with LmServer(max_size_gb=PAGE / 2 / 2**30) as small:
        mgr = manager(small.url)
        try:
            with caplog.at_level(logging.WARNING):
                store_chunks(mgr, hashes(2, 17_000))
            assert mgr.remote.counters.writes_refused == 2 and mgr.remote.is_up()
            # The write-behind thread takes what is queued: one batch of 2, or 2 of 1 under load.
            assert "refused a write of" in caplog.text and "unavailable" not in caplog.text
            assert mgr.remote.prefix_length([mgr.key(17_000)]) == 0 and mgr.remote.is_up()
        finally:
            mgr.close()


@pytest.mark.parametrize("password", ["pa/ss", "12345/678", "a@b/c"])
def test_a_password_with_a_slash_or_an_at_parses_and_never_shows(password):
    url = parse_remote_url(f"redis://user:{password}@cache:6380/2")
    assert (url.password, url.host, url.port, url.db) == (password, "cache", 6380, 2)
    with pytest.raises(ConfigError) as err:
        LMCacheConfig.from_dict({"remote_url": f"redis://user:{password}@cache:port"})
    assert password not in str(err.value) and "port 'port'" in str(err.value)


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1"])
def test_remote_timeout_must_be_a_finite_positive_number_of_seconds(value):
    with pytest.raises(ConfigError, match="remote_timeout_s"):
        LMCacheConfig.from_dict({"remote_url": "lm://h:1", "remote_timeout_s": value})


# -- key formats ----------------------------------------------------------------------------------


def test_key_format_2_values_are_flagged_old_readers_refuse_them_and_old_values_are_read_and_counted(
    lm_server, monkeypatch
):
    """No flush on upgrade: an upgraded engine reads what an old one stored (plain keys did not
    change) and counts it; an engine from before key format 2 refuses what an upgraded one wrote."""
    layout_v2 = msgspec.structs.replace(LAYOUT, key_format=KEY_FORMAT)
    old_writer, new_writer = manager(lm_server.url), manager(lm_server.url, layout_v2)
    new_reader = manager(lm_server.url, layout_v2)
    try:
        assert old_writer.key(1) == new_writer.key(1)  # one namespace for both formats
        store_chunks(old_writer, hashes(3, 9_000))
        store_chunks(new_writer, hashes(3, 9_100))
        assert new_reader.remote.fetch_prefix_into(new_reader, hashes(3, 9_000)) == 3
        assert new_reader.remote.fetch_prefix_into(new_reader, hashes(3, 9_100)) == 3
        for h in (*hashes(3, 9_000), *hashes(3, 9_100)):
            assert torch.equal(held_bytes(new_reader, h), payload(h))
        stats = new_reader.stats()["remote"]
        assert stats["chunks_read"] == 6 and stats["legacy_values_read"] == 3 and stats["bad_values"] == 0

        store = open_store(parse_remote_url(lm_server.url))
        value = store.get([remote_key(new_writer.key(9_100))])[0]
        store.close()
        flags = int.from_bytes(bytes(value[6:8]), "little")
        assert flags & tier_module.FLAG_KEY_FORMAT_2
        # A reader from before key format 2 knew only FLAG_MAC: it refuses the value, a counted miss.
        monkeypatch.setattr(tier_module, "KNOWN_FLAGS", tier_module.FLAG_MAC)
        with pytest.raises(tier_module.BadValue, match="unknown flags"):
            tier_module.unframe_value(new_writer.key(9_100), value, PAGE)
        old_reader = manager(lm_server.url)
        try:
            assert old_reader.remote.fetch_prefix_into(old_reader, hashes(3, 9_100)) == 0
            assert old_reader.remote.counters.bad_values == 1
            assert old_reader.remote.fetch_prefix_into(old_reader, hashes(3, 9_000)) == 3
        finally:
            old_reader.close()
    finally:
        old_writer.close()
        new_writer.close()
        new_reader.close()
