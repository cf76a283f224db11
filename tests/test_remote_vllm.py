"""Seed 001's flow with real vLLM CPU engines: instances configured only with ``remote_url`` (no
controller, no P2P) share KV through a store, and a prompt computed on engine 1 is a remote hit
on engine 2 with the same greedy output; through ``lmcache_server``, ``redis-server`` and a
three-master Redis Cluster. And the remote tier beside P2P: a live peer is pulled from first,
the store serves once the holder is gone.
"""

from __future__ import annotations

import pytest
from instances import instance_config
from protocol_client import ControllerProcess, wait_for
from remote_stores import store_url

pytestmark = pytest.mark.engine

CHUNK = 256
PROMPT_TOKENS = 700  # two full chunks and a tail vLLM computes itself
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def prompt(tiny_model) -> list[int]:
    from lmcache_p2p.testing.tiny_model import sample_prompts

    return sample_prompts(tiny_model, PROMPT_TOKENS, seeds=[21])[0]


def remote_only(url: str) -> dict:
    """The seed's cache_config.yaml, with our key name (remote_server_addr works the same)."""
    return {"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.25, "remote_url": url}


@pytest.mark.slow
# The seeds' store and the most involved client (slots, redirects); plain Redis and Sentinel take
# the same RemoteTier path, and their clients are tested against real servers in test_redis_store.
@pytest.mark.parametrize("backend", ["lm_server", "shared_redis_cluster"])
def test_two_engines_share_kv_through_the_remote_store_alone(backend, request, engine, prompt):
    url = store_url(request.getfixturevalue(backend))
    first = engine(remote_only(url), name="engine1")
    cold = first.generate(prompt, MAX_TOKENS)
    first.request("flush")  # write-behind done: the store holds engine 1's chunks
    assert first.status()["storage"]["remote"]["chunks_written"] == 2

    second = engine(remote_only(url), name="engine2")
    warm = second.generate(prompt, MAX_TOKENS)
    assert warm == cold
    status = second.status()
    assert status["engine"]["retrieved_tokens"] == 2 * CHUNK
    assert status["storage"]["remote"]["chunks_read"] == 2 and status["storage"]["remote"]["bad_values"] == 0
    log = second.log()
    assert "fetched 2 of 2 chunk(s) (512 tokens" in log
    assert f"LMCache hit tokens: {2 * CHUNK}, need to load: {2 * CHUNK}" in log


@pytest.mark.slow
def test_the_seeds_remote_server_addr_and_a_dead_store_is_a_miss_not_an_error(engine, prompt, lm_server):
    # remote_server_addr: "host:port" as seed 001 writes it; then a store that is down serves misses
    config = {"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.25}
    eng = engine({**config, "remote_server_addr": f"127.0.0.1:{lm_server.port}"}, name="seed001")
    assert len(eng.generate(prompt, MAX_TOKENS)) == MAX_TOKENS
    dead = engine({**config, "remote_url": "lm://127.0.0.1:9"}, name="dead-store")
    assert dead.generate(prompt, MAX_TOKENS) == eng.generate(prompt, MAX_TOKENS), "a dead store changed the output"
    log = dead.log()
    assert "remote tier lm://127.0.0.1:9 unavailable" in log and "lookups are misses" in log
    assert dead.status()["engine"]["retrieved_tokens"] == 0


@pytest.mark.slow
def test_a_live_peer_is_pulled_first_and_the_store_serves_once_no_peer_holds_it(engine, prompt, lm_server):
    # engines that quit stop heartbeating: the controller drops them after --worker-timeout
    controller = ControllerProcess("--worker-timeout", "3", "--health-check-interval", "0.5").start()
    try:

        def config(instance_id: str) -> dict:
            return instance_config(
                instance_id, controller, chunk_size=CHUNK, remote_url=lm_server.url, p2p_pull_policy="always"
            )

        holder = engine(config("holder"), name="holder")
        cold = holder.generate(prompt, MAX_TOKENS)
        holder.request("flush")
        wait_for(lambda: controller.holders(prompt), timeout=10, what="the controller to index the holder's chunks")

        puller = engine(config("puller"), name="puller")
        assert puller.generate(prompt, MAX_TOKENS) == cold
        pulled = puller.status()
        assert pulled["p2p_client"]["chunks_pulled"] == 2, "the live peer was not asked first"
        assert pulled["storage"]["remote"]["chunks_read"] == 0

        # Both leave; their chunks outlive them in the store.
        holder.stop(timeout=60)
        puller.stop(timeout=60)
        wait_for(lambda: not controller.holders(prompt), timeout=20, what="the controller to drop the leavers")
        latecomer = engine(config("latecomer"), name="latecomer")
        assert latecomer.generate(prompt, MAX_TOKENS) == cold
        late = latecomer.status()
        assert late["storage"]["remote"]["chunks_read"] == 2 and late["p2p_client"]["chunks_pulled"] == 0
    finally:
        controller.stop()
