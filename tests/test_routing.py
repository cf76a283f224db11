"""POST /route on the real ``lmcache_controller`` process, fed over real ZMQ: ranks register (with
the URL they serve on) and heartbeat (with their engine's load) the way workers do, admit chunks
on the pull socket, and /route must follow: the prefix's holder first, a peer-pull candidate ahead
of a recompute when its link is fast and not when it is slow, nobody deregistered, the load spread
when nothing is cached, and bodies validated like /lookup's."""

from __future__ import annotations

import pytest
from protocol_client import CHUNK, CPU, DISK, ControllerProcess, FakeWorker, registered_workers, wait_for

from lmcache_p2p.protocol import EngineLoad

DOC = list(range(7000, 7000 + 64 * CHUNK))  # 1,024 tokens: 64 chunks
# The weights the numbers below are worked out with: 1,000 tokens/s of prefill (so recomputing the
# document takes ~1 s), a 1 ms fixed cost per pull.
FLAGS = ("--route-prefill-tokens-per-s", "1000", "--route-pull-fixed-ms", "1")


class RoutedWorker(FakeWorker):
    """A FakeWorker that says where its engine serves (Register.serve_url) and reports its load
    (Heartbeat.load), as the worker side will."""

    def __init__(self, controller: ControllerProcess, instance_id: str, **kw):
        kw.setdefault("serve_url", f"http://127.0.0.1:{8000 + sum(map(ord, instance_id)) % 1000}")
        super().__init__(controller, instance_id, **kw)

    def beat(self, **load):
        reply = self.heartbeat(load=EngineLoad(**{"running": 0, "waiting": 0, "kv_usage": 0.0, **load}))
        assert reply.status == "ok"
        return reply


@pytest.fixture
def controller(controllers):
    # Warnings only: every /route writes an INFO line, and the polls below would fill the
    # undrained stdout pipe of the test's controller (test_every_decision_is_logged reads them).
    return controllers(*FLAGS, "--worker-timeout", "30", "--log-level", "warning")


@pytest.fixture
def workers(controller):
    with registered_workers(controller, RoutedWorker) as make:
        yield make


def route(controller, tokens=DOC, **extra) -> dict:
    return controller.api("/route", {"tokens": tokens, **extra})


def ranking(answer: dict) -> list[str]:
    return [r["instance_id"] for r in answer["ranked"]]


def entry(answer: dict, instance_id: str) -> dict:
    return next(r for r in answer["ranked"] if r["instance_id"] == instance_id)


def wait_local(controller, instance_id: str, tokens: int, **extra) -> dict:
    return wait_for(
        lambda: (a := route(controller, **extra)) and entry(a, instance_id)["local_tokens"] == tokens and a,
        15,
        f"/route to see {tokens} tokens at {instance_id}",
    )


def test_the_instance_holding_the_prefix_is_chosen_and_its_url_given(controller, workers):
    a, b, c = workers("inst-a"), workers("inst-b", locations=(CPU, DISK)), workers("inst-c")
    b.admit_tokens(DOC[: 16 * CHUNK])
    b.admit_tokens(DOC[: 40 * CHUNK], location=DISK)
    answer = wait_local(controller, "inst-b", 40 * CHUNK)
    assert answer["chosen"] == "inst-b" and answer["serve_url"] == b.serve_url
    best = answer["ranked"][0]
    assert best["local_tokens_by_location"] == {CPU: 16 * CHUNK, DISK: 24 * CHUNK}
    assert best["recompute_tokens"] == len(DOC) - 40 * CHUNK and best["pull_tokens"] == 0
    # The others could pull b's prefix (same layout, p2p ports): ranked by that pull, equal.
    assert entry(answer, "inst-a")["peer_tokens"] == 40 * CHUNK and entry(answer, "inst-a")["pull_from"] == ["inst-b"]
    assert best["expected_ttft_ms"] < entry(answer, "inst-a")["expected_ttft_ms"]
    # Asked about c and b only, b wins; a is not ranked.
    answer = route(controller, candidates=["inst-c", "inst-b"])
    assert ranking(answer) == ["inst-b", "inst-c"] and answer["skipped"] == []
    assert entry(answer, "inst-c")["serve_url"] == c.serve_url
    # a comes to hold the whole document (but the last token, which is always computed): a now.
    a.admit_tokens(DOC)
    answer = wait_local(controller, "inst-a", len(DOC) - 1)
    assert ranking(answer)[0] == "inst-a" and answer["serve_url"] == a.serve_url
    assert entry(answer, "inst-a")["recompute_tokens"] == 1


def test_a_peer_pull_ranks_ahead_of_recomputing_while_its_link_is_fast(controller, workers):
    holder = workers("holder")
    puller = workers("puller")
    workers("no-p2p", p2p=False)  # holds nothing and cannot pull: recomputes everything
    workers("other-model", model="other-model")  # another layout: cannot pull holder's pages
    holder.admit_tokens(DOC)
    wait_local(controller, "holder", len(DOC) - 1)
    answer = route(controller, candidates=["puller", "no-p2p", "other-model"])
    assert ranking(answer)[0] == "puller"
    first = answer["ranked"][0]
    assert (first["peer_tokens"], first["pull_tokens"], first["pull_from"]) == (len(DOC) - 1, len(DOC) - 1, ["holder"])
    assert first["pull_ms"] > 0 and first["pull_bytes"] == first["pull_tokens"] * holder.layout.bytes_per_token
    for name in ("no-p2p", "other-model"):
        assert entry(answer, name)["peer_tokens"] == 0 and entry(answer, name)["recompute_tokens"] == len(DOC)
    assert first["expected_ttft_ms"] < entry(answer, "no-p2p")["expected_ttft_ms"]
    # puller measures its link at 1 KB/s: 256 KB would take minutes, recomputing ~1 s. It
    # still could pull (peer_tokens) but is estimated not to, and scores like a recompute.
    puller.beat(pull_bytes_per_s=1000.0)
    answer = wait_for(
        lambda: (
            (a := route(controller, candidates=["puller", "no-p2p"])) and entry(a, "puller")["pull_tokens"] == 0 and a
        ),
        15,
        "the slow link to count",
    )
    slow = entry(answer, "puller")
    assert slow["peer_tokens"] == len(DOC) - 1 and slow["recompute_tokens"] == len(DOC)
    assert slow["pull_bytes_per_s"] == 1000.0
    assert slow["expected_ttft_ms"] == pytest.approx(entry(answer, "no-p2p")["expected_ttft_ms"])


def test_a_deregistered_instance_is_never_returned(controller, workers):
    a, b = workers("inst-a"), workers("inst-b")
    a.admit_tokens(DOC)
    assert wait_local(controller, "inst-a", len(DOC) - 1)["chosen"] == "inst-a"
    a.deregister()
    answer = wait_for(lambda: (x := route(controller)) and "inst-a" not in ranking(x) and x, 15, "inst-a to leave")
    assert ranking(answer) == ["inst-b"] and (answer["chosen"], answer["serve_url"]) == ("inst-b", b.serve_url)
    assert entry(answer, "inst-b")["peer_tokens"] == 0  # its keys left with it: nothing to pull
    answer = route(controller, candidates=["inst-a"])
    assert answer["ranked"] == [] and answer["chosen"] is None and answer["serve_url"] is None
    assert answer["skipped"] == [{"instance_id": "inst-a", "reason": "not registered"}]


def test_with_nothing_cached_the_load_spreads(controller, workers):
    names = ["idle-a", "idle-b", "idle-c"]
    ws = {name: workers(name) for name in names}
    # No loads reported, nothing cached: consecutive asks take turns over the three.
    chosen = [route(controller)["chosen"] for _ in range(3)]
    assert sorted(chosen) == names
    # Loads reported over heartbeats: the least loaded first, every time.
    ws["idle-a"].beat(running=6, kv_usage=0.5)
    ws["idle-b"].beat(running=1, waiting=0, kv_usage=0.1)
    ws["idle-c"].beat(running=1, waiting=2, kv_usage=0.1)
    for _ in range(3):
        answer = route(controller)
        assert ranking(answer) == ["idle-b", "idle-a", "idle-c"]
    load = answer["ranked"][0]["load"]
    assert (load["reported"], load["running"], load["waiting"], load["kv_usage"]) == (True, 1, 0, 0.1)
    # A KV cache nearly full weighs like a queue.
    ws["idle-b"].beat(running=1, kv_usage=0.99)
    assert ranking(route(controller))[0] == "idle-a"


def test_workers_view_shows_serve_url_and_load_and_a_bad_load_is_dropped(controller, workers):
    a = workers("inst-a")
    a.beat(running=3, waiting=1, kv_usage=0.25, prefill_tokens_per_s=12_000.0)

    def workers_view() -> dict:
        return controller.http.get("/controller/workers").json()["workers"][0]

    # (the view is rebuilt at most once a second: --view-cache-s)
    worker = wait_for(lambda: (w := workers_view())["load"] and w, 15, "the load in the workers view")
    assert worker["serve_url"] == a.serve_url
    assert {k: worker["load"][k] for k in ("running", "waiting", "kv_usage", "prefill_tokens_per_s")} == {
        "running": 3,
        "waiting": 1,
        "kv_usage": 0.25,
        "prefill_tokens_per_s": 12_000.0,
    }
    assert entry(route(controller), "inst-a")["prefill_tokens_per_s"] == 12_000.0
    a.beat(running=3, waiting=1, kv_usage=1.5)  # out of bounds: dropped, the heartbeat still answered ok
    wait_for(lambda: workers_view()["load"] is None, 15, "the refused load gone from the workers view")
    out = controller.stop()
    assert "Heartbeat field load.kv_usage=1.5 refused" in out


def test_every_decision_is_logged_with_its_numbers():
    c = ControllerProcess(*FLAGS).start()
    a, b = RoutedWorker(c, "inst-a"), RoutedWorker(c, "inst-b")
    try:
        assert a.register().ok and b.register().ok
        a.admit_tokens(DOC[: 48 * CHUNK])
        a.beat(running=2, kv_usage=0.35)
        wait_for(lambda: c.holders(DOC).get("inst-a"), 15, "inst-a's chunks")
        answer = route(c, candidates=["inst-a", "nobody"])
        assert answer["chosen"] == "inst-a"
    finally:
        a.close()
        b.close()
        out = c.stop()
    lines = [line for line in out.splitlines() if " route " in line]
    assert len(lines) == 1, lines
    assert (
        "route 1024 tokens -> inst-a: expected TTFT 276.0 ms = local 768 tokens {'LocalCPUBackend': 768} (0.0 ms) "
        "+ pull 0 tokens from - (0.0 ms) + recompute 256 tokens at 1000 tokens/s (default) (256.0 ms) "
        "+ load running 2 waiting 0 kv 0.35 (20.0 ms); 1 ranked, 1 skipped"
    ) in lines[0]


def test_a_bad_serve_url_is_refused_by_name(controller):
    w = RoutedWorker(controller, "bad-url")
    try:
        w.serve_url = "ftp://somewhere"
        reply = w.register()
        assert not reply.ok and "serve_url='ftp://somewhere'" in reply.error
        assert controller.http.get("/controller/workers").json()["workers"] == []
    finally:
        w.close()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "tokens"),
        ({"model": "m"}, "tokens"),
        ({"tokens": "1 2 3"}, "tokens"),
        ({"tokens": [1, -1]}, "tokens"),
        ({"tokens": [1, 2**31]}, "tokens"),
        ({"tokens": [1, "2"]}, "tokens"),
        ({"tokens": [1], "model": 7}, "model"),
        ({"tokens": [1], "candidates": []}, "candidates"),
        ({"tokens": [1], "candidates": "inst-a"}, "candidates"),
        ({"tokens": [1], "candidates": [1, 2]}, "candidates"),
        ({"tokens": [1], "candidates": [""]}, "candidates"),
        ({"tokens": [1], "candidates": ["x" * 129]}, "candidates"),
    ],
)
def test_route_validates_its_body_like_lookup(controller, body, field):
    response = controller.post("/route", body)
    assert response.status_code == 422, response.text
    assert response.json()["field"] == field
    if "candidates" not in body:  # /lookup has no candidates: the rest must answer alike
        lookup = controller.post("/lookup", body)
        assert (lookup.status_code, lookup.json()["field"]) == (422, field)


def test_route_refuses_what_lookup_refuses_before_the_body(controller):
    no_json = controller.http.post("/route", content=b'{"tokens": [1]}', headers={"Content-Type": "text/plain"})
    assert no_json.status_code == 415
    assert controller.http.post("/route", content=b"{", headers={"Content-Type": "application/json"}).status_code == 422
    spec = controller.http.get("/openapi.json").json()["paths"]["/route"]["post"]
    schema = spec["requestBody"]["content"]["application/json"]["schema"]
    identity = {"cache_salt", "lora", "lora_id", "mm_features"}  # a request's identity (docs/controller.md)
    assert set(schema["properties"]) == {"tokens", "model", "candidates", *identity} and schema["required"] == [
        "tokens"
    ]
