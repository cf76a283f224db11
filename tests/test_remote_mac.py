"""Values in the remote store are authenticated end to end, and ``lmcache_server`` admits only
clients that hold the mesh secret ("trust the data, not the network").

Against real processes: ``lmcache_server`` started as its console script (with and without
``--mesh-secret-file``) and Debian's ``redis-server``. The stranger is a process without the
secret that can reach the store: it writes a well-formed value (the right layout digest, chunk
hash and XXH3 of its own payload) under a chunk's key. An engine-side reader with the secret
must refuse it as a counted miss; a reader without a secret loads it (the documented cost of
running without one). On ``lmcache_server`` with a secret the stranger does not get that far:
every command, CLEAR included, is refused at the connection.
"""

from __future__ import annotations

import logging
import os
import struct
import subprocess

import pytest
import torch
from remote_stores import SCRIPT as SERVER
from remote_stores import LmServer, raw_frame
from test_remote_tier import PAGE, hashes, held_bytes, payload, store_chunks
from test_remote_tier import manager as plain_manager

from lmcache_p2p.keys import ChunkKey, payload_checksum
from lmcache_p2p.remote import wire
from lmcache_p2p.remote.connect import open_store
from lmcache_p2p.remote.lm_store import LmServerStore
from lmcache_p2p.remote.store import RemoteUnavailable
from lmcache_p2p.remote.tier import remote_key
from lmcache_p2p.remote.url import parse_remote_url
from lmcache_p2p.storage import StorageManager
from lmcache_p2p.testing.ports import free_ports

SECRET = "remote-mac-test-secret-0123456789"
OTHER_SECRET = "another-mesh-secret-9876543210"


def manager(url: str, secret: str | None = SECRET, **extra) -> StorageManager:
    """An engine rank's storage manager whose config carries ``secret`` as its mesh secret."""
    if secret is not None:
        extra["mesh_secret"] = secret
    return plain_manager(url, **extra)


def forged_value(key: ChunkKey, data: bytes) -> bytes:
    """What a stranger without the secret can write: a v1 header with the right layout digest,
    chunk hash, length and XXH3 of ``data``, then ``data``; no MAC (it cannot make one)."""
    header = struct.pack("<4sHHQQQQ", b"LMKV", 1, 0, key.fingerprint, key.chunk_hash, len(data), payload_checksum(data))
    return header + data


def forged_payload(chunk_hash: int) -> bytes:
    return bytes(reversed(payload(chunk_hash).numpy().tobytes()))


@pytest.fixture(scope="module")
def secured_lm_server(tmp_path_factory):
    with LmServer(mesh_secret=SECRET, log_dir=tmp_path_factory.mktemp("lm-secured")) as server:
        yield server


# -- values carry a MAC ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["secured_lm_server", "shared_redis"])
def test_values_written_with_the_secret_carry_a_mac_and_read_back_byte_exact(backend, request):
    server = request.getfixturevalue(backend)
    url = server.url if backend == "secured_lm_server" else server.url()
    base = 40_000 + 1_000 * ["secured_lm_server", "shared_redis"].index(backend)
    writer, reader = manager(url), manager(url)
    try:
        store_chunks(writer, hashes(4, base))
        assert writer.remote.counters.chunks_written == 4
        assert reader.remote.fetch_prefix_into(reader, hashes(4, base)) == 4
        for h in hashes(4, base):
            assert torch.equal(held_bytes(reader, h), payload(h))
        stats = reader.stats()["remote"]
        assert stats["mac_failures"] == 0 and stats["bad_values"] == 0 and stats["values_authenticated"]
        # the stored value is longer than header + page: it carries its tag
        store = open_store(parse_remote_url(url).with_mesh_secret(SECRET))
        value = store.get([remote_key(writer.key(base))])[0]
        store.close()
        assert value is not None and len(value) > 40 + PAGE
    finally:
        writer.close()
        reader.close()


def test_a_forged_value_in_redis_is_a_counted_miss_for_a_reader_with_the_secret(shared_redis, caplog):
    base = 50_000
    writer, reader = manager(shared_redis.url()), manager(shared_redis.url())
    try:
        store_chunks(writer, hashes(3, base))
        # The stranger: redis-py, no secret, overwrites chunk 1 with a well-formed value.
        target = writer.key(base + 1)
        with shared_redis.client() as stranger:
            stranger.set(remote_key(target), forged_value(target, forged_payload(base + 1)))
        with caplog.at_level(logging.WARNING, logger="lmcache_p2p.remote.tier"):
            got = reader.remote.fetch_prefix_into(reader, hashes(3, base))
        assert got == 1, "the chunk before the forged one is still a hit, the forged one a miss"
        assert reader.remote.counters.mac_failures == 1 and reader.remote.counters.bad_values == 0
        assert reader.stats()["remote"]["mac_failures"] == 1
        assert torch.equal(held_bytes(reader, base), payload(base))
        assert reader.lookup_prefix(hashes(3, base)).num_chunks == 1
        warning = [r.getMessage() for r in caplog.records if "MAC" in r.getMessage()]
        assert len(warning) == 1, caplog.text
        assert f"{target.chunk_hash:016x}" in warning[0] and shared_redis.url() in warning[0]
        assert "no MAC" in warning[0]
    finally:
        writer.close()
        reader.close()


def test_a_value_with_a_wrong_mac_or_another_secret_is_refused_and_logged_once_a_minute(shared_redis, caplog):
    base = 51_000
    writer, reader = manager(shared_redis.url(), OTHER_SECRET), manager(shared_redis.url())
    try:
        store_chunks(writer, hashes(2, base))  # MAC'd, with a key the reader does not share
        with caplog.at_level(logging.WARNING, logger="lmcache_p2p.remote.tier"):
            assert reader.remote.fetch_prefix_into(reader, hashes(2, base)) == 0
            assert reader.remote.fetch_prefix_into(reader, hashes(2, base)) == 0
        assert reader.remote.counters.mac_failures == 2
        lines = [r.getMessage() for r in caplog.records if "MAC" in r.getMessage()]
        assert len(lines) == 1, lines  # the second failure within the minute is only counted
        assert "does not match" in lines[0]
    finally:
        writer.close()
        reader.close()


def test_without_a_secret_the_forged_value_is_loaded_and_a_macd_value_is_read(shared_redis):
    """Documented: a reader without a secret checks only the header and XXH3, so a stranger's
    well-formed value is KV it loads; it ignores the tags of values written with a secret."""
    base = 52_000
    writer, reader = manager(shared_redis.url()), manager(shared_redis.url(), secret=None)
    try:
        store_chunks(writer, hashes(2, base))  # with MACs
        target = writer.key(base + 1)
        with shared_redis.client() as stranger:
            stranger.set(remote_key(target), forged_value(target, forged_payload(base + 1)))
        assert reader.remote.fetch_prefix_into(reader, hashes(2, base)) == 2
        assert torch.equal(held_bytes(reader, base), payload(base))  # MAC'd, tag ignored
        assert held_bytes(reader, base + 1).numpy().tobytes() == forged_payload(base + 1)  # poisoned
        assert reader.remote.counters.mac_failures == 0 and not reader.stats()["remote"]["values_authenticated"]
    finally:
        writer.close()
        reader.close()


# -- lmcache_server admits only the mesh ------------------------------------------------------------


def test_lm_server_with_a_secret_refuses_a_stranger_before_any_command(secured_lm_server):
    base = 53_000
    writer, reader = manager(secured_lm_server.url), manager(secured_lm_server.url)
    try:
        store_chunks(writer, hashes(2, base))
        name = remote_key(writer.key(base))
        forged = forged_value(writer.key(base), forged_payload(base))
        member = secured_lm_server.client()
        refused_before = member.health()["auth_refused"]
        for secret in ("", OTHER_SECRET):
            stranger = secured_lm_server.client(mesh_secret=secret)
            for what, call in [
                ("PUT", lambda s=stranger: s.put([(name, forged)])),
                ("GET", lambda s=stranger: s.get([name])),
                ("EXISTS", lambda s=stranger: s.exists([name])),
                ("HEALTH", lambda s=stranger: s.health()),
                ("CLEAR", lambda s=stranger: s.clear()),
            ]:
                with pytest.raises(RemoteUnavailable) as refused:
                    call()
                assert "mesh secret" in str(refused.value), (secret, what, refused.value)
            stranger.close()
        assert member.health()["auth_refused"] == refused_before + 10
        assert member.health()["chunks"] >= 2, "the refused CLEAR dropped nothing"
        # the stored value is the writer's, and the reader still gets it
        assert reader.remote.fetch_prefix_into(reader, hashes(2, base)) == 2
        assert torch.equal(held_bytes(reader, base), payload(base))
        assert reader.remote.counters.mac_failures == 0
        member.close()
        log = secured_lm_server.log()
        assert "refused" in log and "mesh secret" in log and "Traceback" not in log
    finally:
        writer.close()
        reader.close()


def test_a_strangers_raw_clear_is_refused_and_the_data_stays(secured_lm_server):
    member = secured_lm_server.client()
    member.put([(b"stays", b"value")])
    data, closed = raw_frame(wire.pack_header(wire.Op.CLEAR), secured_lm_server.port)
    assert closed
    reply = wire.unpack_header(data[: wire.HEADER.size])
    assert reply.kind == wire.Status.ERROR
    assert "mesh secret" in wire.decode_message(data[wire.HEADER.size : wire.HEADER.size + reply.meta_len])
    assert member.get([b"stays"]) == [b"value"]
    member.close()


def test_a_client_with_a_secret_refuses_a_server_without_one(lm_server):
    store = LmServerStore(parse_remote_url(lm_server.url), 2.0, mesh_secret=SECRET)
    with pytest.raises(RemoteUnavailable, match="runs without a mesh secret"):
        store.exists([b"k"])


# -- the command line ------------------------------------------------------------------------------


def test_a_non_loopback_bind_without_a_secret_needs_insecure(tmp_path, monkeypatch):
    port = free_ports(1)[0]
    done = subprocess.run([SERVER, "0.0.0.0", str(port)], capture_output=True, text=True, timeout=20)
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip()
    assert "\n" not in line and "--insecure" in line and "0.0.0.0" in line and "--mesh-secret-file" in line, line
    (tmp_path / "secret").write_text(SECRET)
    for extra, env in (
        (["--insecure"], None),
        (["--mesh-secret-file", str(tmp_path / "secret")], None),
        ([], SECRET),
    ):
        if env is None:
            monkeypatch.delenv("LMCACHE_MESH_SECRET", raising=False)
        else:
            monkeypatch.setenv("LMCACHE_MESH_SECRET", env)
        server = LmServer(argv=[SERVER, "0.0.0.0", str(port), *extra], port=port, log_dir=tmp_path).start()
        try:
            assert "listening on 0.0.0.0" in server.log()
            if extra == ["--insecure"]:
                assert "unauthenticated" in server.log()
        finally:
            server.kill()


def test_a_bad_or_doubled_secret_exits_2_naming_the_source(tmp_path):
    port = str(free_ports(1)[0])
    short = tmp_path / "short"
    short.write_text("too-short")
    cases = [
        (["--mesh-secret-file", str(tmp_path / "missing")], {}, ["--mesh-secret-file", "not found"]),
        (["--mesh-secret-file", str(short)], {}, ["--mesh-secret-file", "at least 16"]),
        ([], {"LMCACHE_MESH_SECRET": "short"}, ["LMCACHE_MESH_SECRET", "at least 16"]),
        (["--mesh-secret-file", str(short)], {"LMCACHE_MESH_SECRET": SECRET}, ["given 2 times"]),
    ]
    for args, env, expected in cases:
        done = subprocess.run(
            [SERVER, "127.0.0.1", port, *args],
            capture_output=True,
            text=True,
            timeout=20,
            env={**os.environ, **env},
        )
        assert done.returncode == 2, (args, done.stderr)
        line = done.stderr.strip()
        assert "\n" not in line and all(e in line for e in expected), (args, line)
        assert SECRET not in line
