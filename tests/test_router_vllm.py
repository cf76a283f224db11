"""``lmcache_router`` in front of real engines: the controller, two vLLM CPU OpenAI servers with P2P
on (each registering its ``serve_url`` and reporting its queue from its own /metrics) and the
router as a user starts them (lmcache_p2p/testing/served_fleet.py). What a user relies on: a
conversation's next turn goes to the engine holding its history, a streamed answer arrives
through the router as the engine gives it, and when that engine dies the request is served by
the other one."""

from __future__ import annotations

import os
import signal

import httpx
import pytest
from conftest import ENGINE_ENV
from protocol_client import wait_for

from lmcache_p2p.router.tokenizer import LocalTokenizer
from lmcache_p2p.testing.processes import stream_completion
from lmcache_p2p.testing.served_fleet import ServedFleet
from lmcache_p2p.testing.tiny_model import sample_text

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.engine, pytest.mark.serial]


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    fleet = ServedFleet(tmp_path_factory.mktemp("fleet"), tiny_model, engine_env=ENGINE_ENV)
    try:
        yield fleet.start()
    finally:
        fleet.stop()


def complete(url: str, model: str, prompt: str, **extra) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def streamed_text(url: str, model: str, prompt: str) -> tuple[str, str]:
    """(the text, the engine the router chose: "" when asked directly) of a streamed completion."""
    answer = stream_completion(url, model, prompt, max_tokens=8)
    return answer["text"], answer["headers"].get("x-lmcache-instance", "")


def route(fleet: ServedFleet, tokens: list[int]) -> dict:
    answer = httpx.post(f"{fleet.controller_url}/route", json={"tokens": tokens}, timeout=10).json()
    return {r["instance_id"]: r for r in answer["ranked"]}


def tokens_of(fleet: ServedFleet, text: str) -> list[int]:
    body = {"model": fleet.model, "prompt": text}
    return httpx.post(f"{fleet.engine_urls[0]}/tokenize", json=body, timeout=30).json()["tokens"]


def test_next_turn_follows_its_history_streams_intact_and_survives_its_engine_dying(fleet, tiny_model):
    _, router = fleet.start_router("kv-aware")
    # Both engines report their queue (rank 0 reads it from its own /metrics at serve_url).
    wait_for(
        lambda: len(r := route(fleet, [1, 2, 3])) == 2 and all(e["load"]["reported"] for e in r.values()),
        30,
        "both engines' load at /route",
        interval=0.2,
    )

    history = sample_text(1200, seed=11) + "\nUser: what is this about?\nAssistant:"
    first = complete(router, tiny_model, history)
    assert first.status_code == 200, first.text
    holder = first.headers["x-lmcache-instance"]
    other = next(i for i in fleet.instance_ids if i != holder)
    turn1 = history + first.json()["choices"][0]["text"]
    held = wait_for(
        lambda: (r := route(fleet, tokens_of(fleet, turn1))) and r[holder]["local_tokens"] >= 1024 and r,
        20,
        f"the controller to index turn 1 at {holder}",
        interval=0.2,
    )
    assert held[holder]["expected_ttft_ms"] < held[other]["expected_ttft_ms"], held
    # --tokenizer gives the ids the engine prefills, so routing by them finds the same chunks.
    assert LocalTokenizer(tiny_model).completion(turn1) == tokens_of(fleet, turn1)

    # Turn 2 appends to the history: the router sends it where turn 1's KV is.
    turn2 = turn1 + "\nUser: and then?\nAssistant:"
    text, chosen = streamed_text(router, tiny_model, turn2)
    assert chosen == holder
    direct, _ = streamed_text(fleet.engine_urls[fleet.instance_ids.index(holder)], tiny_model, turn2)
    assert text == direct and text  # the stream through the router is the engine's own
    router_log = fleet.processes["router-kv-aware"].log()
    assert f"-> {holder} expected_ttft_ms=" in router_log, router_log[-2000:]

    # The holder dies (its whole process group, as a crash would). The controller still lists it
    # until its heartbeats are missed, so the router tries it first, finds the port closed and
    # serves the next turn on the other engine (which recomputes the history: no holder is left).
    engine = fleet.processes[holder]
    os.killpg(engine.process.pid, signal.SIGKILL)
    engine.process.wait(30)
    turn3 = turn2 + text + "\nUser: thanks.\nAssistant:"
    survived = complete(router, tiny_model, turn3)
    assert survived.status_code == 200, survived.text
    assert survived.headers["x-lmcache-instance"] == other
    stats = httpx.get(f"{router}/router/stats", timeout=10).json()
    assert stats["failures"] == 0 and stats["per_instance"][other] >= 1, stats
    # Tokenizing found it first (the router asks an engine before it routes) and demoted it.
    router_log = fleet.processes["router-kv-aware"].log()
    assert f"after {holder}: " in router_log or f"fell back past {holder}" in router_log, router_log[-2000:]
