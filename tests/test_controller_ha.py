"""Two real ``lmcache_controller`` processes serving one mesh (``controller_pull_url`` and
``controller_reply_url`` listing both): every controller indexes every key, a peer hit survives
one controller's ``kill -9``, and ``lmcache_router`` given both keeps routing when one dies."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from instances import instance_config, tokens
from msgspec.structs import replace
from openai_standin import ServedApp, StandinEngine
from protocol_client import FAST_CONTROLLER, ControllerProcess, FakeWorker, wait_for

from lmcache_p2p.config import ConfigError, LMCacheConfig
from lmcache_p2p.miss_reasons import TIMEOUT
from lmcache_p2p.protocol import P2PLookupReply, PeerHolder
from lmcache_p2p.router.app import RouterService, create_app
from lmcache_p2p.router.config import RouterConfig
from lmcache_p2p.testing.link_fleet import standin_layout
from lmcache_p2p.worker.links import ControllerLinks

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
    assert took < 2.0, took  # one FAILOVER_WAIT_S (1 s) at most, then the next controller
    assert b.retrieve(prompt)["exact"]
    assert "peer lookups answered by the controller at" in b.log()  # the switch, said once
    # The dead controller cost that lookup one unanswered request at most (its timeout; none when
    # a heartbeat noticed first), and costs later ones nothing: its link misses at once (lookups
    # failing, or not registered once a heartbeat went unanswered) until it is heard again.
    asked = b.status()["controllers"][0]["p2p_lookups"]
    assert asked <= 1, asked
    # A keeps reporting to the survivor: a prompt stored after the kill is indexed there, and B's
    # lookup of it does not ask the dead controller again.
    later = tokens(2 * CHUNK, seed=32)
    assert a.prefill(later) == 2 * CHUNK
    wait_for(lambda: second.holders(later).get("lmcache_instance_1") == [CPU, 2 * CHUNK], 10, "A's new keys")
    assert b.lookup(later) == 2 * CHUNK
    assert b.status()["controllers"][0]["p2p_lookups"] == asked


def test_a_move_issued_on_a_killed_controller_runs_once_and_the_survivor_says_whose_it_was(two_controllers, spawn):
    first, second = two_controllers
    a = spawn(instance_config("lmcache_instance_1", first, chunk_size=CHUNK, **both(first, second)))
    spawn(instance_config("lmcache_instance_2", first, chunk_size=CHUNK, **both(first, second)))
    prompt = tokens(4 * CHUNK, seed=41)
    assert a.prefill(prompt) == 4 * CHUNK
    for controller in (first, second):
        wait_for(lambda c=controller: c.holders(prompt).get("lmcache_instance_1") == [CPU, 4 * CHUNK], 10, "A's keys")
        wait_for(lambda c=controller: len(c.http.get("/controller/workers").json()["workers"]) == 2, 10, "A and B")
    body = {"old_position": ["lmcache_instance_1", CPU], "new_position": ["lmcache_instance_2", CPU], "tokens": prompt}
    event_id = first.api("/move", body)["event_id"]
    first.kill()  # with the move in flight, or just done: its record goes with it either way

    # The rank runs the command it accepted, once, and reports it to every controller.
    wait_for(lambda: second.holders(prompt) == {"lmcache_instance_2": [CPU, 4 * CHUNK]}, 10, "the move, at B")

    def answer() -> dict | None:
        r = second.post("/check_finish", {"event_id": event_id})
        assert r.status_code == 404, r.text  # not the survivor's event: never "pending" forever
        return r.json() if "ranks reported" in r.json()["error"] else None

    error = wait_for(answer, 10, "the survivor's answer with the rank's report")["error"]
    assert "was not issued by this controller" in error, error
    assert "'lmcache_instance_1' rank 0: done, 128 tokens" in error, error
    assert a.log().count(f"move {event_id}: 4 of 4 chunk(s) now at lmcache_instance_2") == 1
    unknown = second.post("/check_finish", {"event_id": "move-0123456789abcdef"})
    assert unknown.status_code == 404 and "not issued by this controller since it started" in unknown.json()["error"]


def test_a_restarted_controllers_misses_are_checked_with_the_next_until_ranks_are_back(controllers, spawn):
    # Default flags: 5 s heartbeats, so a restarted controller settles for 8 s after a rank is back.
    first, second = controllers(), controllers()
    # A holder rank that never heartbeats: it will not register again with the restarted controller,
    # as a live rank would not yet have in the seconds after a restart.
    holders = [FakeWorker(c, "holder") for c in (first, second)]
    b = spawn(instance_config("engine_b", first, chunk_size=16, p2p_pull_policy="always", **both(first, second)))
    prompt = tokens(4 * 16, seed=51)
    try:
        for holder in holders:
            holder.layout = standin_layout("llama-3.1-8b")  # the stand-in engine's: it can pull from it
            assert holder.register().ok
            holder.admit_tokens(prompt)
        for controller in (first, second):
            wait_for(lambda c=controller: c.holders(prompt).get("holder") == [CPU, 64], 10, "the holder's keys")
            wait_for(lambda c=controller: _listed(c, "engine_b"), 10, "B registered")
        assert b.request("offer", tokens=prompt)["offered"] == 4  # the first controller names the holder

        first.kill()
        restarted = ControllerProcess(ports=first.ports).start()  # the same ports, an empty index
        try:
            # B hears "unknown" at its next heartbeat and registers again; the holder does not.
            wait_for(lambda: _listed(restarted, "engine_b"), 15, "B registered again", interval=0.2)
            holders[1].heartbeat()  # still live at the second controller, however long that took
            answer = b.request("offer", tokens=prompt)
            assert answer["offered"] == 4, answer  # the restarted one's "not held", checked with the second
            link = b.status()["controllers"][0]
            assert link["p2p_lookups_rechecked"] == 1, link
            assert "restarted; its index may lack ranks not registered again" in b.log()
        finally:
            restarted.stop()
    finally:
        for holder in holders:
            holder.close()


def _listed(controller: ControllerProcess, instance_id: str) -> bool:
    workers = controller.http.get("/controller/workers").json()["workers"]
    return any(w["instance_id"] == instance_id for w in workers)


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


# -- the facade's choices, with stand-in links ----------------------------------------------------


class StandinLink:
    """What ControllerLinks uses of a ControllerLink: a session (registered, a warm set), a lookup
    answer, messages kept by the event stream."""

    def __init__(self, name: str, reply: P2PLookupReply, registered: bool = True):
        self.reply = SimpleNamespace(address=f"tcp://{name}:8400")
        self.me = SimpleNamespace(describe=lambda: "inst rank 0")
        self.session = SimpleNamespace(
            registered=registered,
            epoch=f"epoch-{name}",
            settling=False,
            unanswered_since=None,
            effective_channel=None,
            channel_error=None,
            on_peers=None,
            max_warm_peers=0,
        )
        self.lookup = self
        self.events = self
        self.answer = reply
        self.stats = {"p2p_lookups": 0, "p2p_lookups_rechecked": 0}
        self.sent: list = []

    async def p2p_lookup(self, hashes, timeout):
        self.stats["p2p_lookups"] += 1
        return self.answer

    def send(self, message) -> bool:
        self.sent.append(message)
        return True


def test_lookups_go_in_order_past_timeout_misses_messages_to_all_warm_set_from_the_first():
    holder = PeerHolder(
        instance_id="a",
        rank=0,
        location="LocalCPUBackend",
        matched_chunks=3,
        host="h",
        p2p_init_port=1,
        p2p_lookup_port=2,
        transfer_channel="tcp",
    )
    unanswered = P2PLookupReply(holders=[], miss_reason=TIMEOUT, miss_detail="holder lookup unanswered in 1.0 s")
    first = StandinLink("c1", unanswered)
    second = StandinLink("c2", P2PLookupReply(holders=[holder]))
    links = ControllerLinks([first, second])  # type: ignore[list-item]
    hashes = np.arange(3, dtype=np.uint64)
    assert asyncio.run(links.p2p_lookup(hashes, 1.0)).holders == [holder]
    assert (first.stats["p2p_lookups"], second.stats["p2p_lookups"]) == (1, 1)
    assert links.stats == {"p2p_lookups": 2, "p2p_lookups_rechecked": 0}
    second.answer = P2PLookupReply(holders=[], miss_reason="not_held")  # an answer, not a timeout
    assert asyncio.run(links.p2p_lookup(hashes, 1.0)).miss_reason == "not_held"
    second.answer = unanswered
    miss = asyncio.run(links.p2p_lookup(hashes, 1.0))
    assert miss.miss_reason == TIMEOUT and "tcp://c1:8400" in miss.miss_detail and "tcp://c2:8400" in miss.miss_detail

    # A restarted controller, settling: an answer short of the prompt is checked with the next one,
    # whose longer offer wins; a full answer is not checked, nor is a settled controller's.
    def offering(chunks: int) -> P2PLookupReply:
        return P2PLookupReply(
            holders=[replace(holder, matched_chunks=chunks)] if chunks else [], miss_reason="not_held"
        )

    first.session.settling, first.answer, second.answer = True, offering(0), offering(3)
    assert asyncio.run(links.p2p_lookup(hashes, 1.0)).holders[0].matched_chunks == 3
    first.answer, second.answer = offering(2), offering(1)
    assert asyncio.run(links.p2p_lookup(hashes, 1.0)).holders[0].matched_chunks == 2
    first.answer = offering(3)
    assert asyncio.run(links.p2p_lookup(hashes, 1.0)).holders[0].matched_chunks == 3
    second.answer = unanswered  # nobody else answers: the settling controller's answer stands
    first.answer = offering(0)
    assert asyncio.run(links.p2p_lookup(hashes, 1.0)).miss_reason == "not_held"
    assert first.stats["p2p_lookups_rechecked"] == 3 and second.stats["p2p_lookups"] == 6
    first.session.settling = False
    assert asyncio.run(links.p2p_lookup(hashes, 1.0)).miss_reason == "not_held"
    assert second.stats["p2p_lookups"] == 6
    first.answer = unanswered

    links.send("done")
    assert first.sent == second.sent == ["done"]

    taken: list = []
    links.on_peers = lambda peers, registered: taken.append(peers)
    first.session.on_peers(["from c1"], True)
    second.session.on_peers(["from c2"], False)  # dropped: c1 is registered and comes first
    assert taken == [["from c1"]]
    first.session.registered = False
    second.session.on_peers(["from c2"], False)  # c1 gone: c2's set is taken
    assert taken == [["from c1"], ["from c2"]] and links.epoch == "epoch-c2"
    assert [s["warm_set_from_here"] for s in links.status()] == [False, True]


def test_the_router_switches_on_a_5xx_or_no_connection_and_not_on_a_4xx():
    answers = {"a": 503, "b": 200}

    def controller(request: httpx.Request) -> httpx.Response:
        status = answers[request.url.host]
        if status == 0:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(status, json={"ranked": []} if status == 200 else {"detail": "no"})

    service = RouterService(RouterConfig(controller_url="http://a:9000,http://b:9000"))
    service._client = httpx.AsyncClient(transport=httpx.MockTransport(controller))
    assert asyncio.run(service.ask_route([])) == ({"ranked": []}, None)
    assert (service.controllers.current, service.controllers.switches) == ("http://b:9000", 1)
    answers.update(a=200, b=401)  # b refuses: a 4xx another controller would give too
    answer, error = asyncio.run(service.ask_route([]))
    assert answer is None and error is not None and "http://b:9000: HTTP 401" in error
    assert service.controllers.current == "http://b:9000"
    answers.update(b=0)  # b down: back to a
    assert asyncio.run(service.ask_route([]))[0] == {"ranked": []}
    assert (service.controllers.current, service.controllers.switches) == ("http://a:9000", 2)
