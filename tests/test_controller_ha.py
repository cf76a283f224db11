"""Two real ``lmcache_controller`` processes serving one mesh (``controller_pull_url`` and
``controller_reply_url`` listing both): every controller indexes every key, a peer hit survives
one controller's ``kill -9``, and ``lmcache_router`` given both keeps routing when one dies."""

from __future__ import annotations

import time

import httpx
import pytest
from instances import instance_config, tokens
from openai_standin import ServedApp, StandinEngine
from protocol_client import FAST_CONTROLLER, ControllerProcess, FakeWorker, wait_for

from lmcache_p2p.config import ConfigError, LMCacheConfig
from lmcache_p2p.router.app import create_app
from lmcache_p2p.router.config import RouterConfig

CHUNK = 32
CPU = "LocalCPUBackend"


@pytest.fixture
def two_controllers(controllers) -> tuple[ControllerProcess, ControllerProcess]:
    return controllers(*FAST_CONTROLLER), controllers(*FAST_CONTROLLER)


def both(first: ControllerProcess, second: ControllerProcess) -> dict:
    """An instance's controller keys naming both controllers, first one first."""
    return {
        "controller_pull_url": f"127.0.0.1:{first.pull},tcp://127.0.0.1:{second.pull}",
        "controller_reply_url": f"127.0.0.1:{first.reply},127.0.0.1:{second.reply}",
    }


def test_every_controller_indexes_every_key_and_a_peer_hit_survives_a_kill(two_controllers, spawn):
    first, second = two_controllers
    a = spawn(instance_config("lmcache_instance_1", first, chunk_size=CHUNK, **both(first, second)))
    b = spawn(instance_config("lmcache_instance_2", first, chunk_size=CHUNK, **both(first, second)))
    prompt = tokens(4 * CHUNK, seed=31)
    assert a.prefill(prompt) == 4 * CHUNK
    for controller in (first, second):  # each indexes A's keys from A's own reports
        wait_for(lambda c=controller: c.holders(prompt).get("lmcache_instance_1") == [CPU, 4 * CHUNK], 10, "A's keys")
        wait_for(lambda c=controller: len(c.http.get("/controller/workers").json()["workers"]) == 2, 10, "A and B")
    links = b.status()["controllers"]
    assert [link["registered"] for link in links] == [True, True], links
    assert [link["reply_url"] for link in links] == [f"tcp://127.0.0.1:{c.reply}" for c in (first, second)]

    first.kill()  # SIGKILL: no goodbye, its ports simply stop answering
    t0 = time.monotonic()
    assert b.lookup(prompt) == 4 * CHUNK  # through the second controller
    took = time.monotonic() - t0
    assert took < 2.0, took  # one lookup timeout (1 s) at most, then the next controller
    assert b.retrieve(prompt)["exact"]
    assert "peer lookups answered by the controller at" in b.log()  # the switch, said once
    # A keeps reporting to the survivor: a prompt stored after the kill is indexed there.
    later = tokens(2 * CHUNK, seed=32)
    assert a.prefill(later) == 2 * CHUNK
    wait_for(lambda: second.holders(later).get("lmcache_instance_1") == [CPU, 2 * CHUNK], 10, "A's new keys")


def test_mismatched_controller_lists_are_refused_naming_the_key():
    config = {
        "enable_controller": True,
        "lmcache_worker_ports": [0],
        "controller_pull_url": "127.0.0.1:8300,127.0.0.1:8301",
        "controller_reply_url": "127.0.0.1:8400",
    }
    with pytest.raises(ConfigError, match=r"controller_reply_url=.*lists 1 controller\(s\) but controller_pull_url"):
        LMCacheConfig.from_dict(config)
    config["controller_reply_url"] = "127.0.0.1:8400,,127.0.0.1:8401"
    with pytest.raises(ConfigError, match=r"controller_reply_url=.*item 2 of 3 is empty"):
        LMCacheConfig.from_dict(config)
    config["controller_reply_url"] = "127.0.0.1:8400,localhost"
    with pytest.raises(ConfigError, match=r"item 2 \('localhost'\): expected host:port"):
        LMCacheConfig.from_dict(config)


def test_the_router_given_both_controllers_keeps_routing_when_one_dies(controllers):
    # Slow reaping: the fake ranks below register once and never heartbeat.
    first, second = (controllers("--worker-timeout", "60", "--log-level", "warning") for _ in range(2))
    engine = StandinEngine("inst-a").start()
    workers = [FakeWorker(c, "inst-a", serve_url=engine.url) for c in (first, second)]
    served = None
    try:
        for worker in workers:
            assert worker.register().ok
        config = RouterConfig(controller_url=f"{first.url},{second.url}", connect_timeout_s=0.5)
        served = ServedApp(create_app(config), lifespan="on").start()
        http = httpx.Client(base_url=served.url, timeout=30)
        body = {"model": "tiny-llama", "prompt": [1, 2, 3]}
        assert http.post("/v1/completions", json=body).headers["x-lmcache-instance"] == "inst-a"
        first.kill()
        for _ in range(3):
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 200 and response.headers["x-lmcache-instance"] == "inst-a"
        stats = http.get("/router/stats").json()
        assert stats["route_errors"] == 0, stats  # every request was routed by a controller's /route
        assert (stats["controller_url"], stats["controller_switches"]) == (second.url, 1), stats
        assert http.get("/health").json()["status"] == "ok"
        http.close()
    finally:
        if served is not None:
            served.stop()
        for worker in workers:
            worker.close()
        engine.stop()
