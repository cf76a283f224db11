"""The vLLM connector's parts that need no vLLM engine: KV layouts, the lookup channel (real ZMQ),
and the two halves driven by hand."""

from __future__ import annotations

import logging
import re
import time
import uuid

import numpy as np
import pytest
import torch
import zmq

from lmcache_p2p import gpu_ops
from lmcache_p2p.cache_engine import PrefixLookup
from lmcache_p2p.integration.vllm.kv_layout import UnsupportedKVLayout, block_planes, fingerprint
from lmcache_p2p.integration.vllm.load_jobs import by_outcome
from lmcache_p2p.integration.vllm.lookup_channel import (
    Hit,
    LookupClient,
    LookupReply,
    LookupServer,
    PullEndedSender,
    pack_sources,
    pull_ended_path,
    socket_path,
    unpack_sources,
)
from lmcache_p2p.keys import chunk_hash_array
from lmcache_p2p.protocol import unpack_hashes
from lmcache_p2p.testing.sync_engine import store

HASHES = chunk_hash_array(np.arange(300, dtype=np.int32), 256)  # a 300-token prompt: one full chunk


def test_block_first_caches_are_one_plane_per_layer_and_kv_first_caches_two():
    cpu_layout = {f"layer.{i}": torch.zeros(10, 2, 128, 128) for i in range(3)}  # [blocks, heads, block, 2*dim]
    assert len(block_planes(cpu_layout, 10)) == 3
    kv_first = {f"layer.{i}": torch.zeros(2, 10, 16, 2, 64) for i in range(3)}
    planes = block_planes(kv_first, 10)
    assert len(planes) == 6 and planes[0].shape == (10, 16, 2, 64)
    layout = fingerprint(planes, "m", 16, 1, 0)
    assert layout.num_layers == 6 and layout.block_shape == (16, 2, 64) and layout.dtype == "float32"
    # a page holds every plane's blocks: its size is what the fingerprint says a chunk weighs
    assert layout.bytes_per_token * 16 == 6 * 16 * 2 * 64 * 4


def test_layers_carved_apart_from_one_padded_allocation_store_and_load_like_separate_tensors():
    """vLLM 0.34's extensible KV cache gives each layer a region of one reservation, padded to a
    granule, not one contiguous tensor of all layers: each layer is read where it is."""
    num_blocks, block = 10, (2, 16, 2, 4)  # [num_blocks, K/V, block, heads, dim]
    layer_numel = num_blocks * 2 * 16 * 2 * 4
    padded = layer_numel + 96  # a granule's padding after every layer
    backing = torch.full((3 * padded,), -7.0)
    layers = {f"layer.{i}": backing[i * padded : i * padded + layer_numel].view(num_blocks, *block) for i in range(3)}
    for i, tensor in enumerate(layers.values()):
        tensor.copy_(torch.randn(num_blocks, *block) + 10 * i)
    planes = block_planes(layers, num_blocks)
    assert [p.data_ptr() for p in planes] == [t.data_ptr() for t in layers.values()]
    assert fingerprint(planes, "m", 16, 1, 0) == fingerprint(
        block_planes({k: v.clone() for k, v in layers.items()}, num_blocks), "m", 16, 1, 0
    )

    page = torch.empty(3 * 2 * planes[0][0].numel() * 4, dtype=torch.uint8)
    gpu_ops.gather_chunk(planes, [3, 7], page)
    stored = {name: (tensor[3].clone(), tensor[7].clone()) for name, tensor in layers.items()}
    gpu_ops.scatter_chunk(page, planes, [0, 1])  # loaded back into other blocks of the same layers
    for name, tensor in layers.items():
        assert torch.equal(tensor[0], stored[name][0]) and torch.equal(tensor[1], stored[name][1])
    for i in range(3):  # the padding between the layers was not written
        assert (backing[i * padded + layer_numel : (i + 1) * padded] == -7.0).all()


def test_an_unknown_kv_layout_is_refused_with_the_layer_and_shape():
    with pytest.raises(UnsupportedKVLayout, match=r"layer 'model.layers.0.attn'.*\(7, 3, 5\)"):
        block_planes({"model.layers.0.attn": torch.zeros(7, 3, 5)}, 10)


def test_a_partial_scatter_leaves_the_blocks_the_engine_computed_alone():
    planes = [torch.arange(8 * 4, dtype=torch.float32).view(8, 4) for _ in range(2)]
    page = torch.empty(2 * 4 * 4 * 4, dtype=torch.uint8)
    gpu_ops.gather_chunk(planes, [0, 1, 2, 3], page)
    target = [torch.full((8, 4), -1.0) for _ in range(2)]
    gpu_ops.scatter_chunk(page, target, [4, 5, 6, 7], first_block=2)
    for plane, source in zip(target, planes, strict=True):
        assert (plane[4:6] == -1).all()  # skipped: already computed by the engine
        assert torch.equal(plane[6:8], source[2:4])


@pytest.fixture
def engine_id():
    return uuid.uuid4().hex


def test_the_scheduler_gets_the_smallest_answer_of_all_ranks_in_one_ask(engine_id):
    calls = {0: 0, 1: 0}

    def rank(r, hit, pull_from=-1):
        def handle(request):
            calls[r] += 1
            return LookupReply(seq=request.seq, req_id=request.req_id, hit_tokens=hit, pull_from=pull_from)

        return LookupServer(socket_path(engine_id, 0, r), handle)

    servers = [rank(0, 512), rank(1, 512, pull_from=256)]  # rank 1 pulls its second chunk
    client = LookupClient([socket_path(engine_id, 0, r) for r in range(2)], 256)
    try:
        hashes = chunk_hash_array(np.arange(600, dtype=np.int32), 256)
        assert client.lookup("req-1", hashes, 600, True, 5.0) == Hit(512, pull_from=256)
        assert calls == {0: 1, 1: 1}
    finally:
        client.close()
        for server in servers:
            server.close()


def test_a_rank_that_does_not_answer_is_a_miss_and_its_late_answer_is_ignored(engine_id):
    def slow(request):
        time.sleep(0.5 if request.req_id == "slow" else 0)
        return LookupReply(seq=request.seq, req_id=request.req_id, hit_tokens=256)

    server = LookupServer(socket_path(engine_id, 0, 0), slow)
    client = LookupClient([socket_path(engine_id, 0, 0)], 256)
    try:
        assert client.lookup("slow", HASHES, 300, False, 0.2) == Hit(0)
        # the late answer to "slow" must not be taken for this one's
        assert client.lookup("next", HASHES, 300, False, 2.0) == Hit(256)
    finally:
        client.close()
        server.close()


def test_the_lookup_server_survives_garbage_and_a_failing_handler(engine_id):
    def handle(request):
        if request.req_id == "boom":
            raise RuntimeError("tier exploded")
        return LookupReply(seq=request.seq, req_id=request.req_id, hit_tokens=256)

    path = socket_path(engine_id, 0, 0)
    server = LookupServer(path, handle)
    client = LookupClient([path], 256)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.connect(f"ipc://{path}")
    try:
        raw.send(b"\x00not msgpack")
        raw.send_multipart([b"a", b"b"])
        assert client.lookup("boom", HASHES, 300, False, 2.0) == Hit(0)  # a miss, logged
        assert client.lookup("fine", HASHES, 300, False, 2.0) == Hit(256)
    finally:
        raw.close(0)
        client.close()
        server.close()


def _scheduler(engine_id: str, tp_size: int = 1, **extra):
    from types import SimpleNamespace

    from lmcache_p2p.config import LMCacheConfig
    from lmcache_p2p.integration.vllm.scheduler_side import SchedulerSide

    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=16),
        kv_transfer_config=SimpleNamespace(engine_id=engine_id, is_kv_consumer=True, is_kv_producer=True),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp_size, pipeline_parallel_size=1, data_parallel_rank=0),
        model_config=SimpleNamespace(model="unit", hf_config=SimpleNamespace(num_hidden_layers=2)),  # full attention
    )
    # The rank (a stand-in handler below) does the pulling; the scheduler side only asks.
    config = LMCacheConfig.from_dict(
        {
            "chunk_size": 256,
            "enable_async_loading": True,
            "extra_config": {"lookup_backoff_time": 0.001},
            **extra,
        }
    )
    return SchedulerSide(vllm_config, config)


def _empty_step():
    return _step()  # a round that scheduled nothing


def test_a_lookup_is_asked_once_and_never_waits_for_bytes(engine_id, caplog):
    """Requests arriving together are each asked once, with their hashes, and answered at once:
    a hit past the local tiers is an offer (here the remote store's) that the load pulls beside
    the steps; the scheduler never answers vLLM 'not yet' and never polls."""
    from types import SimpleNamespace

    received: list[tuple[str, bool]] = []

    def handle(request):
        received.append((request.req_id, request.hashes is not None))
        # The rank holds the first chunk; the store offers the second (pull_from: where it starts).
        return LookupReply(
            seq=request.seq,
            req_id=request.req_id,
            hit_tokens=512,
            pull_from=256,
            fetched=True,
            chunk_sources=pack_sources(["host", "external_unspecified"]),
        )

    caplog.set_level(logging.INFO, logger="lmcache_p2p")
    server = LookupServer(socket_path(engine_id, 0, 0), handle)
    scheduler = _scheduler(engine_id, remote_url="redis://127.0.0.1:1")
    try:
        ask = lambda rid: scheduler.get_num_new_matched_tokens(  # noqa: E731
            SimpleNamespace(request_id=rid, prompt_token_ids=list(range(600))), 0
        )
        assert [ask(r) for r in "abc"] == [(512, True)] * 3  # granted beside the steps
        assert [ask(r) for r in "abc"] == [(512, True)] * 3  # asked again: from the request's state
        assert received == [("a", True), ("b", True), ("c", True)]
        assert "beside the steps after pulling tokens [256, 512) from the remote store" in caplog.text
        assert "enable_async_loading and lookup_backoff_time have no effect" in caplog.text
    finally:
        scheduler.close()
        server.close()


def test_with_pull_before_grant_vllm_asks_again_until_every_rank_said_its_pull_ended(engine_id, monkeypatch, caplog):
    """pull_before_grant: the first lookup starts the ranks' pulls and vLLM is told to ask again
    (None: the request takes no blocks); the asks in between reach no rank; once every rank said
    its pull ended, one more lookup (settle) gives what they hold, loaded in the step. A request
    past the cap takes the grant beside the steps; one that finishes while pulling is released."""
    from types import SimpleNamespace

    from lmcache_p2p.integration.vllm import scheduler_side

    asks: list[tuple[int, str, bool, bool]] = []

    def handler(rank):
        def handle(request):
            asks.append((rank, request.req_id, request.pull_now, request.settle))
            if request.settle:  # the pull brought the second chunk: held here now
                sources = pack_sources(["host", "p2p"])
                return LookupReply(
                    seq=request.seq, req_id=request.req_id, hit_tokens=512, fetched=True, chunk_sources=sources
                )
            return LookupReply(
                seq=request.seq,
                req_id=request.req_id,
                hit_tokens=512,
                pull_from=256,
                fetched=True,
                chunk_sources=pack_sources(["host", "p2p"]),
                pulling=request.pull_now,
            )

        return handle

    servers = [LookupServer(socket_path(engine_id, 0, r), handler(r)) for r in range(2)]
    scheduler = _scheduler(engine_id, tp_size=2, remote_url="redis://127.0.0.1:1", pull_before_grant=True)
    engine = SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_rank=0), kv_transfer_config=SimpleNamespace(engine_id=engine_id)
    )
    ended = [PullEndedSender(pull_ended_path(engine), tp_rank=r) for r in range(2)]
    ask = lambda rid: scheduler.get_num_new_matched_tokens(  # noqa: E731
        SimpleNamespace(request_id=rid, prompt_token_ids=list(range(600))), 0
    )
    caplog.set_level(logging.INFO, logger="lmcache_p2p")
    try:
        assert ask("a") == (None, False)
        assert sorted(asks) == [(0, "a", True, False), (1, "a", True, False)]
        ended[0].send("a")
        ended[0].send("elsewhere")  # a word for no pulling request: ignored
        time.sleep(0.2)
        assert [ask("a") for _ in range(3)] == [(None, False)] * 3  # rank 1's pull is still on
        assert len(asks) == 2  # and no rank was asked meanwhile
        ended[0].send("a")  # said twice: still one rank
        ended[1].send("a")
        assert wait_until(lambda: ask("a") != (None, False), 5)
        assert ask("a") == (512, False)  # loaded in the step (a CPU engine)
        assert sorted(asks[2:]) == [(0, "a", False, True), (1, "a", False, True)]
        assert "pulling tokens [256, 512) from a peer before its grant" in caplog.text
        assert "pulled before its grant in" in caplog.text

        # Past the cap: no pull before the grant, the grant beside the steps as without the key.
        monkeypatch.setattr(scheduler_side, "MAX_PULLS_BEFORE_GRANT", 1)
        assert ask("b") == (None, False)
        assert ask("c") == (512, True)
        assert [a[2] for a in asks if a[1] == "c"] == [False, False]
        # Finished while pulling: released to the ranks with the next step (they give the pull up).
        assert scheduler.request_finished(SimpleNamespace(request_id="b"), []) == (False, None)
        assert "b" in scheduler.build_connector_meta(_empty_step()).released
        assert ask("d") == (None, False)  # its slot is free again
    finally:
        for sender in ended:
            sender.close()
        scheduler.close()
        for server in servers:
            server.close()


def test_pull_before_grant_waits_only_for_pulls_that_add_to_the_grant(engine_id):
    """A rank pulling past what another rank holds, or an offer vLLM's own prefix cache covers,
    holds nothing back: vLLM gets its answer at once. A settled pull loads in the step even with
    async_kv_loads True (beside the steps its end would reach vLLM a step or two late)."""
    from types import SimpleNamespace

    holds = {0: (512, 256), 1: (256, -1)}  # rank -> (hit tokens, where its offer starts)

    def handler(rank):
        def handle(request):
            hit, pull_from = holds[rank]
            if request.settle:
                hit, pull_from = 512, -1
            return LookupReply(
                seq=request.seq,
                req_id=request.req_id,
                hit_tokens=hit,
                pull_from=pull_from,
                pulling=request.pull_now and pull_from >= 0,
            )

        return handle

    servers = [LookupServer(socket_path(engine_id, 0, r), handler(r)) for r in range(2)]
    scheduler = _scheduler(
        engine_id, tp_size=2, remote_url="redis://127.0.0.1:1", pull_before_grant=True, async_kv_loads=True
    )
    engine = SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_rank=0), kv_transfer_config=SimpleNamespace(engine_id=engine_id)
    )
    ended = PullEndedSender(pull_ended_path(engine), tp_rank=0)
    ask = lambda rid, computed=0: scheduler.get_num_new_matched_tokens(  # noqa: E731
        SimpleNamespace(request_id=rid, prompt_token_ids=list(range(600))), computed
    )
    try:
        # Rank 1 holds the first chunk only: rank 0's pull of the second adds nothing.
        assert ask("a") == (256, True)  # (async_kv_loads True: a local hit beside the steps)
        holds[1] = (512, 256)  # now rank 1 is offered the second chunk too: both pulls count
        # vLLM's own prefix cache holds both chunks: the pull adds nothing.
        assert ask("b", computed=512) == (0, False)
        assert ask("c") == (None, False)
        ended.send("c")
        time.sleep(0.2)
        assert ask("c") == (None, False)  # rank 1's pull is still on
        other = PullEndedSender(pull_ended_path(engine), tp_rank=1)
        other.send("c")
        assert wait_until(lambda: ask("c") != (None, False), 5)
        assert ask("c") == (512, False)  # in the step
        other.close()
    finally:
        ended.close()
        scheduler.close()
        for server in servers:
            server.close()


def wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def _step(new_reqs=(), num_scheduled=None):
    from types import SimpleNamespace

    num_scheduled = num_scheduled or {}
    return SimpleNamespace(
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=sum(num_scheduled.values()),
        scheduled_new_reqs=list(new_reqs),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()
        ),
        preempted_req_ids=set(),
    )


def test_a_load_beside_the_steps_keeps_its_blocks_until_done_and_a_failed_one_is_retried_once(engine_id, caplog):
    """async_kv_loads: the hit is granted asynchronously, its load goes out in the next metadata
    with the blocks vLLM allocated for it, an abort while it copies keeps the blocks until the
    ranks report it done, and vLLM's re-ask after a failed load looks it up afresh once, then
    recomputes."""
    from types import SimpleNamespace

    asks: list[bool] = []  # whether each lookup the rank got carried the hashes (a fresh ask)

    def handle(request):
        asks.append(request.hashes is not None)
        return LookupReply(seq=request.seq, req_id=request.req_id, hit_tokens=512)

    server = LookupServer(socket_path(engine_id, 0, 0), handle)
    scheduler = _scheduler(engine_id, async_kv_loads=True)
    request = SimpleNamespace(request_id="a", prompt_token_ids=list(range(600)))
    blocks = SimpleNamespace(get_block_ids=lambda: (list(range(100, 132)),))

    def granted(req) -> list:
        """Asked, granted asynchronously and allocated: the next metadata's loads."""
        assert scheduler.get_num_new_matched_tokens(req, 0) == (512, True)
        scheduler.update_state_after_alloc(req, blocks, 512)
        return scheduler.build_connector_meta(_empty_step()).loads

    try:
        (load,) = granted(request)
        assert (load.beside_steps, load.start, load.end) == (True, 0, 512)
        assert load.block_ids == list(range(100, 132))
        assert scheduler.build_connector_meta(_empty_step()).loads == []  # sent once

        # vLLM's re-ask after the load failed from its first block: a fresh lookup, once; asked
        # again before it is granted (no blocks free that step), it is the same retry.
        scheduler.update_connector_output(SimpleNamespace(finished_recving={"a"}))
        with caplog.at_level(logging.WARNING):
            assert scheduler.get_num_new_matched_tokens(request, 0) == (512, True)
            assert scheduler.get_num_new_matched_tokens(request, 0) == (512, True)
            assert asks == [True, True]
            assert caplog.text.count("looking it up again") == 1
            scheduler.update_state_after_alloc(request, blocks, 512)
            scheduler.build_connector_meta(_empty_step())
            scheduler.update_connector_output(SimpleNamespace(finished_recving={"a"}))
            assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
            assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)  # and stays so
        assert "its load beside the steps failed: looking it up again" in caplog.text
        assert caplog.text.count("its load beside the steps failed 2 times: recomputing") == 1

        # An abort while a load copies into its blocks: vLLM keeps them until it is reported done.
        b = SimpleNamespace(request_id="b", prompt_token_ids=list(range(600)))
        granted(b)
        assert scheduler.request_finished(b, []) == (True, None)
        # A request that stored, was preempted and is reloaded beside the steps: its earlier
        # stores read the blocks freed at the preemption, so they are forgotten (the ranks forget
        # them too) and its blocks wait for nothing once the reload is done: one report each.
        d = SimpleNamespace(request_id="d", prompt_token_ids=list(range(800)))
        granted(d)
        scheduler.update_connector_output(SimpleNamespace(finished_recving={"d"}))
        scheduler.update_state_after_alloc(d, blocks, 0)
        computed = SimpleNamespace(
            req_id="d", prompt_token_ids=d.prompt_token_ids, block_ids=(list(range(100, 150)),), num_computed_tokens=512
        )
        (store,) = scheduler.build_connector_meta(_step([computed], {"d": 288})).stores  # the third chunk
        assert len(store.chunk_hashes) == 3
        preempted = _empty_step()
        preempted.preempted_req_ids = {"d"}
        scheduler.build_connector_meta(preempted)
        (reload,) = granted(d)
        assert reload.beside_steps and reload.block_ids == list(range(100, 132))
        scheduler.update_connector_output(SimpleNamespace(finished_recving={"d"}))
        assert scheduler.request_finished(d, []) == (False, None)

        # Reported done before the abort: nothing to wait for.
        c = SimpleNamespace(request_id="c", prompt_token_ids=list(range(600)))
        granted(c)
        scheduler.update_connector_output(SimpleNamespace(finished_recving={"c"}))
        assert scheduler.request_finished(c, []) == (False, None)
    finally:
        scheduler.close()
        server.close()


def test_under_auto_only_a_load_crossing_pcie_from_what_the_ranks_held_goes_beside_the_steps(engine_id, caplog):
    """async_kv_loads "auto" (the default): a hit whose part to load some rank held in host
    memory goes beside the steps; one all in GPU memory, already in vLLM's prefix cache up to
    where the host part ends, or fetched for this lookup (a pull: the next one shares PCIe)
    loads in the step. With two ranks the furthest host part counts, and either rank's fetch."""
    from types import SimpleNamespace

    # per request: (rank 0's host_until, rank 1's), and whether rank 1 fetched part of the hit
    replies = {
        "gpu": ((0, 0), False),
        "host": ((0, 256), False),
        "cached": ((256, 256), False),
        "pulled": ((0, 512), True),
    }

    def rank(r):
        def handle(request):
            until, fetched = replies[request.req_id]
            return LookupReply(
                seq=request.seq, req_id=request.req_id, hit_tokens=512, host_until=until[r], fetched=fetched and r == 1
            )

        return LookupServer(socket_path(engine_id, 0, r), handle)

    servers = [rank(0), rank(1)]
    scheduler = _scheduler(engine_id, tp_size=2)
    try:
        with caplog.at_level(logging.INFO):
            asked = {}
            for name, computed in (("gpu", 0), ("host", 0), ("cached", 256), ("pulled", 0)):
                request = SimpleNamespace(request_id=name, prompt_token_ids=list(range(600)))
                while (answer := scheduler.get_num_new_matched_tokens(request, computed))[0] is None:
                    pass
                asked[name] = answer
        assert asked == {"gpu": (512, False), "host": (512, True), "cached": (256, False), "pulled": (512, False)}
        assert re.search(
            r"need to load: 512 \(lookup [\d.]+ ms\), beside the steps \(host memory up to token 256\)", caplog.text
        )
        assert re.search(
            r"need to load: 512 \(lookup [\d.]+ ms\), in the step \(host memory up to token 512, fetched for this"
            r" lookup: the next pull shares PCIe\)",
            caplog.text,
        )
    finally:
        scheduler.close()
        for server in servers:
            server.close()


def test_chunks_recomputed_after_a_failed_load_are_stored_again(engine_id, caplog):
    """A load that failed from block 16 (token 256): vLLM recomputes from there, and the ranks
    stored none of the failing step's chunks for the request, so the step after the recompute
    hands out the store again (not cut off as held by the old hit)."""
    from types import SimpleNamespace

    def handle(request):
        return LookupReply(seq=request.seq, req_id=request.req_id, hit_tokens=512)

    server = LookupServer(socket_path(engine_id, 0, 0), handle)
    scheduler = _scheduler(engine_id)
    request = SimpleNamespace(request_id="r", prompt_token_ids=list(range(800)))
    blocks = list(range(200, 250))
    try:
        assert scheduler.get_num_new_matched_tokens(request, 0) == (512, False)
        scheduler.update_state_after_alloc(request, None, 512)
        new = SimpleNamespace(
            req_id="r", prompt_token_ids=request.prompt_token_ids, block_ids=(blocks,), num_computed_tokens=512
        )
        meta = scheduler.build_connector_meta(_step([new], {"r": 288}))
        assert len(meta.loads) == 1 and len(meta.stores[0].chunk_hashes) == 3
        with caplog.at_level(logging.INFO, logger="lmcache_p2p"):
            scheduler.update_connector_output(SimpleNamespace(invalid_block_ids={blocks[16], blocks[20]}))
        assert (
            "Reqid: r, its load failed from token 256: the chunks from there are stored once recomputed" in caplog.text
        )
        recompute = _step(num_scheduled={"r": 544})
        recompute.scheduled_cached_reqs = SimpleNamespace(
            req_ids=["r"], new_block_ids=[None], num_computed_tokens=[256], resumed_req_ids=set()
        )
        (store,) = scheduler.build_connector_meta(recompute).stores
        assert len(store.chunk_hashes) == 3 and store.block_ids == blocks[:48]
    finally:
        scheduler.close()
        server.close()


def test_a_prompt_is_hashed_once_and_its_hashes_go_out_with_its_one_lookup(engine_id, monkeypatch, caplog):
    from types import SimpleNamespace

    from lmcache_p2p.integration.vllm import scheduler_side

    hashings = []
    monkeypatch.setattr(
        scheduler_side,
        "chunk_hash_array",
        lambda tokens, size, **keys: hashings.append(len(tokens)) or chunk_hash_array(tokens, size, **keys),
    )
    received = []
    held: dict[str, np.ndarray] = {}  # the rank's lookups

    def handle(request):
        received.append(request)
        held[request.req_id] = unpack_hashes(request.hashes)
        return LookupReply(seq=request.seq, req_id=request.req_id, hit_tokens=512)

    server = LookupServer(socket_path(engine_id, 0, 0), handle)
    scheduler = _scheduler(engine_id)
    prompt = list(range(800))  # three full chunks and a tail
    try:
        ask = lambda: scheduler.get_num_new_matched_tokens(  # noqa: E731
            SimpleNamespace(request_id="r", prompt_token_ids=prompt), 0
        )
        assert ask() == (512, False)
        assert ask() == (512, False)  # asked again before its allocation: no new lookup
        (first,) = received
        assert unpack_hashes(first.hashes).tolist() == chunk_hash_array(prompt, 256).tolist()
        assert first.num_tokens == 800

        # Loads and stores name the chunks by the same hashes, and nothing hashed the prompt again.
        scheduler.update_state_after_alloc(SimpleNamespace(request_id="r"), None, 512)
        new = SimpleNamespace(
            req_id="r", prompt_token_ids=prompt, block_ids=(list(range(50)),), num_computed_tokens=512
        )
        with caplog.at_level(logging.INFO, logger="lmcache_p2p"):
            meta = scheduler.build_connector_meta(_step([new], {"r": 288}))
        (load,), (store,) = meta.loads, meta.stores
        # The hit's timeline, for where a time to first token goes: seen, known, load scheduled.
        timeline = re.search(
            r"Reqid: r, loading 512 tokens in this step, ([\d.]+) ms after .* \(hit known at ([\d.]+) ms\)", caplog.text
        )
        assert timeline and float(timeline[1]) >= float(timeline[2]) > 0, caplog.text
        assert load.chunk_hashes.tolist() == held["r"].tolist() and load.num_tokens == 800
        assert (load.start, load.end) == (0, 512)
        assert store.chunk_hashes.tolist() == held["r"].tolist() and store.block_ids == list(range(48))
        assert hashings == [800]
    finally:
        scheduler.close()
        server.close()


def _cpu_worker_side(engine_id: str):
    """A rank's worker half on CPU, without vLLM: chunks of 32 tokens (two 16-token blocks), a KV
    cache of 8 blocks in 2 layers, a small CPU pool."""
    from types import SimpleNamespace

    from lmcache_p2p.config import LMCacheConfig
    from lmcache_p2p.integration.vllm.worker_side import WorkerSide

    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=16),
        model_config=SimpleNamespace(model="tiny"),
        kv_transfer_config=SimpleNamespace(engine_id=engine_id),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_rank=0),
    )
    side = WorkerSide(vllm_config, LMCacheConfig.from_dict({"chunk_size": 32, "max_local_cpu_size": 0.01}))
    side.register_kv_caches({f"layer.{i}": torch.randn(8, 2, 16, 2, 4) for i in range(2)})
    return side


def test_a_kv_cache_sized_to_the_free_gpu_memory_gets_one_warning_naming_our_device_buffers(caplog):
    """vLLM 0.34 commits its KV cache after warm-up to the memory then free (extensible KV cache,
    gpu_memory_utilization unset) and builds the worker side after it: the rank says which of
    its device buffers come out of what is left, and how to make room. Not when vLLM was told
    how much to take, nor on releases that size the cache up front."""
    from types import SimpleNamespace

    from lmcache_p2p.config import LMCacheConfig
    from lmcache_p2p.integration.vllm.worker_side import WorkerSide

    def warnings(extensible: bool, utilization: float | None, **keys) -> list[str]:
        vllm_config = SimpleNamespace(
            cache_config=SimpleNamespace(
                block_size=16, enable_extensible_kv_cache=extensible, gpu_memory_utilization=utilization
            ),
            parallel_config=SimpleNamespace(tensor_parallel_size=1),
        )
        side = WorkerSide(vllm_config, LMCacheConfig.from_dict({"chunk_size": 256, **keys}))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lmcache_p2p"):
            side._warn_device_buffers_after_kv_cache(2 * 2**20)  # 2 MiB chunk pages
        return [r.getMessage() for r in caplog.records]

    tier = {"local_cpu": True, "local_gpu": True, "max_local_gpu_size": 4}
    (warning,) = warnings(True, None, **tier)
    assert "GPU tier 4 GB (max_local_gpu_size), load staging 256 MiB (load_staging_mb)" in warning
    assert "--gpu-memory-utilization" in warning and "--no-enable-extensible-kv-cache" in warning
    assert warnings(True, 0.8, **tier) == []  # vLLM leaves the rest of the GPU free
    assert warnings(False, None, **tier) == []  # vLLM <= 0.33, or the cache sized up front
    assert warnings(True, None, async_kv_loads=False) == []  # nothing of ours on the device


def test_a_rank_answers_its_local_hit_and_an_offer_past_it_at_once(engine_id, monkeypatch):
    from lmcache_p2p.integration.vllm.lookup_channel import LookupRequest
    from lmcache_p2p.protocol import pack_hashes
    from lmcache_p2p.remote.offers import RemoteOffer

    side = _cpu_worker_side(engine_id)
    prompt = list(range(100))  # three full chunks and a tail
    hashes = chunk_hash_array(prompt, 32)
    try:
        assert store(side.engine, hashes[:2], side.planes, list(range(8))) == 64

        def ask(**fields):
            return side.lookups.answer(LookupRequest(seq=1, req_id="r", fetch_missing=False, **fields))

        assert ask().error  # a prefix lookup without its hashes: a miss, said so
        assert ask(hashes=pack_hashes(hashes), num_tokens=100).hit_tokens == 64
        again = ask()  # asked again (the same request): answered from the lookup the rank kept
        assert again.hit_tokens == 64 and not again.error
        counters = side.engine.counters
        assert (counters.lookups, counters.lookup_tokens, counters.hit_tokens) == (1, 100, 64)
        assert not again.fetched

        assert unpack_sources(again.chunk_sources) == ("host", "host")  # both in the CPU pool

        # A hit a peer's offer extends: the offered chunk is promised at once (the load pulls it,
        # beside the steps), from the token where the local hit ends, and counted as the peer's;
        # the lookup itself is counted once the pull ends. A CPU rank counts no host part.
        class OneChunk:
            chunks = 1

            def first(self, chunks):
                return self

        monkeypatch.setattr(side.engine, "lookup_async", lambda _: PrefixLookup(["host", "host"], offer=OneChunk()))
        request = LookupRequest(seq=2, req_id="p", fetch_missing=True, hashes=pack_hashes(hashes))
        offered = side.lookups.answer(request)
        assert (offered.hit_tokens, offered.fetched, offered.host_until, offered.pull_from) == (96, True, 0, 64)
        assert unpack_sources(offered.chunk_sources) == ("host", "host", "p2p")
        assert counters.lookups == 1

        # The remote store's offer is promised the same way, counted as the store's.
        monkeypatch.setattr(
            side.engine, "lookup_async", lambda _: PrefixLookup(["host", "host"], offer=RemoteOffer((int(hashes[2]),)))
        )
        request = LookupRequest(seq=3, req_id="s", fetch_missing=True, hashes=pack_hashes(hashes))
        fetched = side.lookups.answer(request)
        assert (fetched.hit_tokens, fetched.fetched, fetched.pull_from) == (96, True, 64)
        assert unpack_sources(fetched.chunk_sources) == ("host", "host", "external_unspecified")
    finally:
        side.close()


def test_a_rank_pulls_before_the_grant_says_when_it_ended_and_settles_on_what_landed(engine_id, monkeypatch):
    """pull_before_grant on a rank: the offer's pull starts with the answer and idle steps wait on
    it; its end is told; the settle pins what landed with the local hit (the lookup counted once,
    the offered chunks as the peer's). A pull that failed settles on the local hit; a request
    dropped mid-pull gives the pull up and its pins back."""
    import concurrent.futures

    from lmcache_p2p.integration.vllm.lookup_channel import LookupRequest
    from lmcache_p2p.miss_reasons import PulledChunks
    from lmcache_p2p.protocol import pack_hashes

    side = _cpu_worker_side(engine_id)
    prompt = list(range(100))  # three full chunks and a tail
    hashes = chunk_hash_array(prompt, 32)
    ended: list[str] = []
    side.lookups.on_pull_ended = ended.append
    pulls: list[concurrent.futures.Future] = []

    class OneChunk:
        chunks = 1

        def first(self, chunks):
            return self

    def pull(_offer):
        pulls.append(concurrent.futures.Future())
        return pulls[-1]

    monkeypatch.setattr(side.engine, "lookup_async", lambda _: PrefixLookup(["host", "host"], offer=OneChunk()))
    monkeypatch.setattr(side.engine, "pull_offer_async", pull)
    cpu = side.engine.storage.cpu

    def ask(req_id, **fields):
        return side.lookups.answer(LookupRequest(seq=1, req_id=req_id, fetch_missing=True, **fields))

    try:
        assert store(side.engine, hashes[:2], side.planes, list(range(8))) == 64
        first = ask("p", hashes=pack_hashes(hashes), num_tokens=100, pull_now=True)
        assert (first.hit_tokens, first.pull_from, first.pulling) == (96, 64, True)
        assert side.lookups.running_pulls() == pulls and ended == []
        lookups_before = side.engine.counters.lookups
        # The chunk lands (stored here as a pull would), and the pull ends: the scheduler is told.
        store(side.engine, hashes[:3], side.planes, list(range(8)))
        pulls[0].set_result(PulledChunks(1))
        assert ended == ["p"] and side.lookups.running_pulls() == []
        settled = ask("p", settle=True)
        assert (settled.hit_tokens, settled.pull_from, settled.pulling, settled.fetched) == (96, -1, False, True)
        assert unpack_sources(settled.chunk_sources) == ("host", "host", "p2p")
        assert side.engine.counters.lookups == lookups_before + 1
        assert cpu.pins_held == 3  # the settled hit, for its load
        side.lookups.drop("p")
        assert cpu.pins_held == 0

        # A pull that failed: the settle holds the local hit only, and says why no more.
        ask("q", hashes=pack_hashes(hashes[:2].tolist() + [12345]), num_tokens=100, pull_now=True)
        pulls[1].set_exception(RuntimeError("the holder went away"))
        failed = ask("q", settle=True)
        assert (failed.hit_tokens, failed.pulling) == (64, False)
        side.lookups.drop("q")

        # Dropped while pulling (the request finished): the pull is given up, the pins go back.
        ask("d", hashes=pack_hashes(hashes[:2].tolist() + [54321]), num_tokens=100, pull_now=True)
        assert cpu.pins_held == 2
        side.lookups.drop("d")
        assert pulls[2].cancelled() and cpu.pins_held == 0
    finally:
        side.close()


def test_the_scheduler_tells_the_ranks_how_many_tokens_a_step_computes_and_how_many_are_prefill(engine_id):
    from types import SimpleNamespace

    scheduler = _scheduler(engine_id)
    try:
        n = SimpleNamespace(
            req_id="n", prompt_token_ids=list(range(800)), block_ids=(list(range(50)),), num_computed_tokens=512
        )
        meta = scheduler.build_connector_meta(_step([n], {"n": 288}))  # 512 loaded, the rest computed
        assert (meta.step_tokens, meta.prefill_tokens) == (288, 288)
        # Next step: "n" decodes a token while a new prompt prefills 300 of its tokens.
        m = SimpleNamespace(
            req_id="m", prompt_token_ids=list(range(300)), block_ids=(list(range(19)),), num_computed_tokens=0
        )
        step = _step([m], {"n": 1, "m": 300})
        step.scheduled_cached_reqs = SimpleNamespace(
            req_ids=["n"], new_block_ids=[None], num_computed_tokens=[800], resumed_req_ids=set()
        )
        meta = scheduler.build_connector_meta(step)
        assert (meta.step_tokens, meta.prefill_tokens) == (301, 300)
    finally:
        scheduler.close()


def test_a_rank_times_its_prefill_steps_for_the_pull_policy_and_not_its_decode_steps(engine_id):
    from types import SimpleNamespace

    from lmcache_p2p.config import LMCacheConfig
    from lmcache_p2p.integration.vllm.metadata import P2PConnectorMetadata
    from lmcache_p2p.integration.vllm.worker_side import WorkerSide

    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=16),
        model_config=SimpleNamespace(model="tiny"),
        kv_transfer_config=SimpleNamespace(engine_id=engine_id),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_rank=0),
    )
    side = WorkerSide(
        vllm_config, LMCacheConfig.from_dict({"chunk_size": 32, "max_local_cpu_size": 0.01, "prefill_tokens_per_s": 50})
    )
    side.register_kv_caches({f"layer.{i}": torch.randn(8, 2, 16, 2, 4) for i in range(2)})
    try:
        rate = side.engine.counters.prefill
        assert rate.tokens_per_s == 50  # the configured start-up value, until a step is measured
        decode = P2PConnectorMetadata(step_tokens=4, prefill_tokens=0)
        side.start_load_kv(decode)
        side.wait_for_save(decode)
        small = P2PConnectorMetadata(step_tokens=20, prefill_tokens=20)  # under a chunk
        side.start_load_kv(small)
        side.wait_for_save(small)
        assert rate.steps == 0

        prefill = P2PConnectorMetadata(step_tokens=66, prefill_tokens=64)  # the "forward pass": 50 ms
        side.start_load_kv(prefill)
        time.sleep(0.05)
        side.wait_for_save(prefill)
        assert rate.steps == 1 and 66 / 0.5 < rate.tokens_per_s <= 66 / 0.05
        assert side.engine.status()["prefill"]["steps_measured"] == 1
    finally:
        side.close()


def test_layer_wise_loads_ask_vllm_for_piecewise_graphs_and_step_aside_for_speculative_decoding(monkeypatch, caplog):
    """A full CUDA graph's replay skips wait_for_layer_load (attention would read blocks still
    being copied); a speculative decoder's draft layers would count as never waited for."""
    from types import SimpleNamespace

    from lmcache_p2p.integration.vllm.connector import LMCacheConnectorV1
    from lmcache_p2p.integration.vllm.worker_side import WorkerSide

    monkeypatch.setenv("LMCACHE_USE_LAYERWISE", "True")
    assert LMCacheConnectorV1.requires_piecewise_for_cudagraph({}) is True
    monkeypatch.setenv("LMCACHE_USE_LAYERWISE", "False")
    assert LMCacheConnectorV1.requires_piecewise_for_cudagraph({}) is False
    assert WorkerSide._layerwise_possible(SimpleNamespace(speculative_config=None))
    assert not WorkerSide._layerwise_possible(SimpleNamespace(speculative_config=SimpleNamespace(method="eagle")))
    assert "use_layerwise is ignored with speculative decoding" in caplog.text


def test_the_thread_switch_interval_is_shortened_on_a_gpu_engine_unless_set_and_kept_on_cpu(caplog):
    import sys

    from lmcache_p2p.integration.vllm.connector import set_switch_interval

    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)  # Python's default, whatever ran before in this process
    try:
        with caplog.at_level(logging.INFO, logger="lmcache_p2p.integration.vllm.connector"):
            set_switch_interval(None, "cpu")  # a CPU engine: Python's own interval, nothing logged
            assert sys.getswitchinterval() == 0.005 and not caplog.records
            set_switch_interval(None, "cuda")
            assert sys.getswitchinterval() == pytest.approx(0.0005)
            assert "5.00 ms -> 0.50 ms (switch_interval_ms unset, a GPU engine)" in caplog.text
            set_switch_interval(5.0, "cuda")  # the key set: it wins on a GPU too
            assert sys.getswitchinterval() == pytest.approx(0.005)
            assert "0.50 ms -> 5.00 ms (switch_interval_ms)" in caplog.text
    finally:
        sys.setswitchinterval(before)


def _engine_config(transfer):
    """A VllmConfig's parts the scheduler side and vLLM's MultiConnector read, around vLLM's real
    KVTransferConfig."""
    from types import SimpleNamespace

    return SimpleNamespace(
        cache_config=SimpleNamespace(block_size=16),
        kv_transfer_config=transfer,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_rank=0),
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=True),
        device_config=SimpleNamespace(device_type="cpu"),
        model_config=SimpleNamespace(model="unit", hf_config=SimpleNamespace(num_hidden_layers=2)),  # full attention
    )


def test_the_load_failure_policy_is_set_to_recompute_and_the_log_says_what_was_done(caplog):
    """vLLM's default 'fail' would end a request whose hit of ours fails to load. A KVTransferConfig
    does not record whether 'fail' was given or defaulted, so the rewrite is logged as such."""
    from vllm.config import KVTransferConfig

    from lmcache_p2p.config import LMCacheConfig
    from lmcache_p2p.integration.vllm.scheduler_side import SchedulerSide

    for given in ({}, {"kv_load_failure_policy": "recompute"}):
        transfer = KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both", **given)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="lmcache_p2p"):
            SchedulerSide(_engine_config(transfer), LMCacheConfig.from_dict({"chunk_size": 256})).close()
        assert transfer.kv_load_failure_policy == "recompute"
        policy = [r for r in caplog.records if "kv_load_failure_policy" in r.getMessage()]
        if given:
            assert not policy  # nothing was changed: nothing to say
            continue
        (line,) = policy
        assert line.levelno == logging.INFO
        assert "kv_load_failure_policy is 'recompute' (was 'fail'" in line.getMessage()
        assert "vLLM's default" in line.getMessage()


def test_under_multiconnector_the_top_level_policy_is_named_in_one_warning(monkeypatch, caplog):
    """vLLM's MultiConnector hands each child a fresh KVTransferConfig, and its scheduler reads the
    top-level one: setting the child's would change nothing while the log said it did."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    for var in [v for v in __import__("os").environ if v.startswith("LMCACHE_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "256")
    ours = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    ours["kv_connector_module_path"] = "lmcache_p2p.integration.vllm"  # not the plugin's registry
    for top_level in ({}, {"kv_load_failure_policy": "recompute"}):
        transfer = KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"connectors": [ours]},
            **top_level,
        )
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="lmcache_p2p"):
            multi = MultiConnector(_engine_config(transfer), KVConnectorRole.SCHEDULER, None)
        multi.shutdown()
        policy = [r for r in caplog.records if "kv_load_failure_policy" in r.getMessage()]
        if top_level:
            assert not policy, [r.getMessage() for r in policy]
            continue
        assert transfer.kv_load_failure_policy == "fail"  # the scheduler's: not ours to set
        (line,) = policy
        assert line.levelno == logging.WARNING
        assert "MultiConnector" in line.getMessage()
        assert '"kv_load_failure_policy": "recompute"' in line.getMessage()
        assert "top-level" in line.getMessage()


def test_the_seed_multiconnector_config_asks_vllm_to_recompute_failed_loads_at_the_top_level():
    from vllm.config import KVTransferConfig

    from lmcache_p2p.testing.pd_proxy import seed_kv_transfer_config

    config = seed_kv_transfer_config(kv_buffer_device="cpu")
    assert KVTransferConfig(**config).kv_load_failure_policy == "recompute"  # what vLLM's scheduler reads
    for child in config["kv_connector_extra_config"]["connectors"]:
        assert KVTransferConfig(**child, engine_id="e")  # each child still a valid KVTransferConfig


def test_when_one_tp_rank_can_load_nothing_the_others_drop_their_lookup_pins_at_the_next_step(engine_id):
    """The scheduler takes the smallest answer over the ranks; at 0 the engine loads nothing, so
    what the other ranks pinned for the lookup must go now, not when the request finishes."""
    from types import SimpleNamespace

    from lmcache_p2p.config import LMCacheConfig
    from lmcache_p2p.integration.vllm.worker_side import WorkerSide

    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=16),
        model_config=SimpleNamespace(model="tiny"),
        kv_transfer_config=SimpleNamespace(engine_id=engine_id),
        parallel_config=SimpleNamespace(tensor_parallel_size=2, data_parallel_rank=0),
    )
    rank0 = WorkerSide(vllm_config, LMCacheConfig.from_dict({"chunk_size": 256, "max_local_cpu_size": 0.01}))
    rank0.register_kv_caches({f"layer.{i}": torch.randn(40, 2, 16, 2, 4) for i in range(2)})
    rank1 = LookupServer(  # holds none of the prompt (evicted, restarted)
        socket_path(engine_id, 0, 1), lambda r: LookupReply(seq=r.seq, req_id=r.req_id, hit_tokens=0)
    )
    scheduler = _scheduler(engine_id, tp_size=2)
    request = SimpleNamespace(request_id="r", prompt_token_ids=list(range(600)))
    storage = rank0._engine.storage
    try:
        assert store(rank0._engine, chunk_hash_array(request.prompt_token_ids, 256)[:2], rank0.planes, list(range(32)))
        assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
        assert storage.cpu.pins_held == 2  # rank 0 pinned its 512 tokens for a load that will not come
        scheduler.update_state_after_alloc(request, None, 0)
        meta = scheduler.build_connector_meta(_step([], {"r": 600}))
        assert meta.released == ["r"]
        rank0.start_load_kv(meta)
        assert storage.cpu.pins_held == 0
    finally:
        scheduler.close()
        rank1.close()
        rank0.close()


def test_engines_whose_ids_share_a_prefix_get_lookup_sockets_of_their_own(engine_id):
    """Ids such as vLLM's or Ray Serve's replicas' may share a long prefix: the path must differ
    with any character of the id, and stay within the 107 bytes of a Unix socket path."""
    first, second = f"prefill-replica-{engine_id}-0", f"prefill-replica-{engine_id}-1"
    paths = {socket_path(e, dp, tp) for e in (first, second) for dp in (0, 1) for tp in (0, 1)}
    assert len(paths) == 8
    assert all(len(p.encode()) <= 107 for p in paths)
    assert socket_path(first, 0, 0) == socket_path(first, 0, 0)  # both halves derive the same one


def test_a_lookup_server_refuses_a_live_socket_and_takes_over_only_a_stale_one(engine_id):
    import socket as sockets

    path = socket_path(engine_id, 0, 0)
    live = LookupServer(path, lambda r: LookupReply(seq=r.seq, req_id=r.req_id, hit_tokens=256))
    client = LookupClient([path], 256)
    try:
        with pytest.raises(OSError) as refused:
            LookupServer(path, lambda r: LookupReply(seq=r.seq, req_id=r.req_id, hit_tokens=0))
        assert path in str(refused.value) and "another live process" in str(refused.value)
        assert client.lookup("r", HASHES, 300, False, 2.0) == Hit(256)  # the first still answers
    finally:
        client.close()
        live.close()
    # A socket file whose process is gone (killed before it could remove it): taken over.
    dead = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
    dead.bind(path)
    dead.close()
    assert __import__("os").path.exists(path)
    server = LookupServer(path, lambda r: LookupReply(seq=r.seq, req_id=r.req_id, hit_tokens=256))
    client = LookupClient([path], 256)
    try:
        assert client.lookup("r", HASHES, 300, False, 2.0) == Hit(256)
    finally:
        client.close()
        server.close()


def test_an_unknown_log_level_keeps_our_connector_and_is_refused_like_any_bad_lmcache_value(monkeypatch):
    """LMCACHE_LOG_LEVEL=verbose once made the plugin fail and leave LMCacheConnectorV1 to vLLM's
    built-in one (the original LMCache); now ours is chosen and its configuration names the value."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from lmcache_p2p.config import ConfigError, LMCacheConfig
    from lmcache_p2p.integration.vllm import plugin

    # This process's registry, plugin decision and loggers are put back after the test. The
    # plugin sets a handler up only where nothing logs yet (as in vLLM's processes), not under pytest's.
    monkeypatch.setattr(KVConnectorFactory, "_registry", dict(KVConnectorFactory._registry))
    monkeypatch.setattr(plugin, "_decision", None)
    ours = logging.getLogger("lmcache_p2p")
    for target, name, value in [(logging.getLogger(), "handlers", []), (ours, "handlers", [])]:
        monkeypatch.setattr(target, name, value)
    monkeypatch.setattr(ours, "propagate", ours.propagate)
    monkeypatch.setattr(ours, "level", ours.level)
    monkeypatch.delenv("LMC_P2P_CONNECTOR", raising=False)
    monkeypatch.setenv("LMCACHE_LOG_LEVEL", "verbose")

    plugin.register()
    assert plugin._decision == "p2p"
    chosen = KVConnectorFactory.get_connector_class(
        KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both")
    )
    assert chosen.__module__ == "lmcache_p2p.integration.vllm.connector"
    assert ours.level == logging.INFO  # meanwhile

    with pytest.raises(ConfigError) as refused:  # what the connector reports at engine start
        LMCacheConfig.load()
    assert refused.value.key == "log_level" and refused.value.source == "env LMCACHE_LOG_LEVEL"
    assert "'verbose'" in str(refused.value) and "DEBUG, INFO, WARNING, ERROR or CRITICAL" in str(refused.value)
    monkeypatch.setenv("LMCACHE_LOG_LEVEL", "debug")  # any case, as before
    LMCacheConfig.load()


def test_a_pull_that_brings_part_of_an_offer_loads_that_part_and_vllm_recomputes_exactly_the_rest(
    engine_id, monkeypatch
):
    """A peer offered chunks 1-2 beyond the rank's chunk 0; the pull (the load's first half) brought
    chunk 1 only (the holder died): chunks 0-1 load into the request's blocks, the request is
    reported failed with chunk 2's blocks, which vLLM recomputes, and nothing else."""
    import concurrent.futures

    from lmcache_p2p.integration.vllm.lookup_channel import LookupRequest
    from lmcache_p2p.integration.vllm.metadata import LoadSpec, P2PConnectorMetadata
    from lmcache_p2p.miss_reasons import HOLDER_GONE, Miss, PulledChunks
    from lmcache_p2p.protocol import pack_hashes

    side = _cpu_worker_side(engine_id)
    hashes = chunk_hash_array(list(range(100)), 32)  # three full chunks (two blocks each) and a tail
    try:
        assert store(side.engine, hashes[:1], side.planes, [0, 1]) == 32

        class TwoChunks:
            chunks = 2

            def first(self, chunks):
                return self

        def pull(offer, on_landed=None):  # brings chunk 1 (from blocks 2-3), then the holder is gone
            store(side.engine, hashes[:2], side.planes, [0, 1, 2, 3])
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(PulledChunks(1, Miss(HOLDER_GONE, "the holder left mid-pull")))
            return done

        monkeypatch.setattr(side.engine, "lookup_async", lambda _: PrefixLookup(["host"], offer=TwoChunks()))
        monkeypatch.setattr(side.engine, "pull_offer_async", pull)
        reply = side.lookups.answer(
            LookupRequest(seq=1, req_id="p", fetch_missing=True, hashes=pack_hashes(hashes), num_tokens=100)
        )
        assert (reply.hit_tokens, reply.pull_from) == (96, 32)

        meta = P2PConnectorMetadata()
        meta.loads.append(LoadSpec("p", hashes, 100, [7, 6, 5, 4, 3, 2], 0, 96, beside_steps=True))
        side.start_load_kv(meta)
        (job,) = side.finished_loads()
        assert by_outcome([job]) == (set(), {"p"}) and job.loaded_to == 64
        assert job.unloaded_blocks == [3, 2]  # chunk 2's blocks, and only those
        side.recompute_blocks(job.unloaded_blocks)  # as the connector does for vLLM < 0.32
        assert side.take_load_errors() == {3, 2}
        assert side.engine.counters.retrieved_tokens == 64
        # The chunk the pull did not bring is a miss, with the pull's reason.
        assert side.engine.misses.totals()["holder_gone"] == 1
        assert sum(side.engine.misses.totals().values()) == 1
        for plane in side.planes:  # chunks 0 and 1 are in the request's blocks
            assert torch.equal(plane[[7, 6, 5, 4]], plane[[0, 1, 2, 3]])
    finally:
        side.close()


def test_a_blend_whose_segments_were_pulled_runs_only_in_the_step_scheduled_from_its_end(caplog):
    """vLLM counts a blended load granted beside the steps as loaded once its segments landed;
    the blend itself runs in the step that schedules the request from the blend's end. A failed
    pull (vLLM computes from token 0) blends nothing, quietly; any other start is an error."""
    from lmcache_p2p.integration.vllm.blending import BlendRequest

    request = BlendRequest(np.zeros(300, dtype=np.int32), [], last_start=280, blend_at=256)
    assert request.scheduled("r", 256) and request.blend_at == 0
    assert not request.scheduled("r", 256)  # once
    request.blend_at = 256
    with caplog.at_level(logging.ERROR):
        assert not request.scheduled("r", 0) and not caplog.records
        request.blend_at = 256
        assert not request.scheduled("r", 128)
    assert "scheduled from token 128, not at its blend's end 256: not blended" in caplog.text
