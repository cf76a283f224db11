"""``lmcache_router`` against real parts: the real ``lmcache_controller`` process, ranks that
register the URL their engine serves on (``serve_url``) and report load over real ZMQ, and real
HTTP stand-in engines (openai_standin.py) that tokenize and answer like vLLM's server. What a
user relies on: a prompt goes where its prefix is cached, the comparison policies do what they
say, streams pass through unchanged, and no request fails while one engine (or the controller)
is down."""

from __future__ import annotations

import logging
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import pytest
from openai_standin import ServedApp, StandinEngine, chat_text, standin_tokens
from protocol_client import ControllerProcess, FakeWorker, registered_workers, wait_for
from raw_http import peak_rss, read_response

from lmcache_p2p.http_body import DEFAULT_MAX_BODY_BYTES
from lmcache_p2p.keys import KeyIdentity, salt_tag
from lmcache_p2p.protocol import EngineLoad
from lmcache_p2p.router import cli
from lmcache_p2p.router.app import CHAT, COMPLETIONS, create_app, first_multimodal, prefix_body, route_identity
from lmcache_p2p.router.config import RouterConfig
from lmcache_p2p.router.policies import Candidate, LeastLoaded, RoundRobin, demote, make_policy
from lmcache_p2p.testing.ports import free_ports
from lmcache_p2p.testing.processes import ServedProcess

NAMES = ["inst-a", "inst-b", "inst-c"]
MODEL = "tiny-llama"  # the stand-ins' served model and the FakeWorkers' layout model
TOKEN = "router-test-token-0123456789"


def words(prefix: str, n: int) -> str:
    return " ".join(f"{prefix}{i}" for i in range(n))


DOC = words("doc", 64)  # 64 stand-in tokens: 4 chunks of 16


@dataclass
class Router:
    served: ServedApp
    http: httpx.Client

    def complete(self, prompt, **extra) -> httpx.Response:
        return self.http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, **extra})

    def chat(self, messages: list[dict], **extra) -> httpx.Response:
        return self.http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, **extra})

    def stats(self) -> dict:
        return self.http.get("/router/stats").json()


def answered_by(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    instance = response.headers["x-lmcache-instance"]
    body = response.json()
    choice = body["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    assert text.startswith(f" {instance}"), (instance, text)  # the engine the header names wrote it
    return instance


@pytest.fixture
def controller(controllers):
    return controllers("--worker-timeout", "60", "--log-level", "warning")


@pytest.fixture
def engines():
    started: list[StandinEngine] = []

    def start(name: str, **kw) -> StandinEngine:
        engine = StandinEngine(name, **kw).start()
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.stop()


@dataclass
class Fleet:
    controller: ControllerProcess
    engines: dict[str, StandinEngine]
    workers: dict[str, FakeWorker]
    make_worker: Callable[..., FakeWorker]


@pytest.fixture
def fleet(controller, engines):
    """Three instances, each a registered rank whose serve_url is a running stand-in engine."""
    with registered_workers(controller) as make:
        es = {name: engines(name) for name in NAMES}
        ws = {name: make(name, serve_url=es[name].url) for name in NAMES}
        yield Fleet(controller, es, ws, make)


@pytest.fixture
def router():
    started: list[Router] = []

    def start(controller_url: str, policy: str = "kv-aware", **kw) -> Router:
        app = create_app(RouterConfig(controller_url=controller_url, policy=policy, **kw))
        served = ServedApp(app, lifespan="on").start()
        r = Router(served, httpx.Client(base_url=served.url, timeout=30))
        started.append(r)
        return r

    yield start
    for r in started:
        r.http.close()
        r.served.stop()


def admit(fleet: Fleet, instance_id: str, text: str) -> list[int]:
    """``instance_id`` comes to hold ``text``'s chunks (as its engine would store them), seen by
    the controller before this returns."""
    tokens = standin_tokens(text)
    fleet.workers[instance_id].admit_tokens(tokens)
    wait_for(lambda: fleet.controller.holders(tokens).get(instance_id), 15, f"{instance_id}'s chunks")
    return tokens


def beat(worker: FakeWorker, **load) -> None:
    assert worker.heartbeat(load=EngineLoad(**{"running": 0, "waiting": 0, "kv_usage": 0.0, **load})).status == "ok"


# -- policies, as pure code ----------------------------------------------------------------------


def candidate(instance_id: str, **kw) -> Candidate:
    return Candidate(instance_id, f"http://{instance_id}:8000", **kw)


def test_policies_order_the_candidates_they_are_given():
    ranked = [candidate("c", running=3), candidate("a", running=1, kv_usage=0.5), candidate("b", running=1)]
    assert [c.instance_id for c in make_policy("kv-aware").order(ranked)] == ["c", "a", "b"]
    rr = RoundRobin()
    assert [[c.instance_id for c in rr.order(ranked)][0] for _ in range(4)] == ["a", "b", "c", "a"]
    ll = LeastLoaded()
    assert [c.instance_id for c in ll.order(ranked)] == ["b", "a", "c"]  # 1 queued, lower KV usage first
    ties = [candidate("x"), candidate("y"), candidate("z", waiting=1)]
    assert [ll.order(ties)[0].instance_id for _ in range(4)] == ["y", "x", "y", "x"]  # turns among equals
    assert [c.instance_id for c in demote(ranked, {"c"})] == ["a", "b", "c"]
    entry = {"instance_id": "i", "serve_url": None, "load": {"running": 2, "waiting": 1, "kv_usage": 0.25}}
    parsed = Candidate.from_route(entry)
    assert (parsed.serve_url, parsed.queued, parsed.kv_usage, parsed.expected_ttft_ms) == (None, 3, 0.25, None)
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        make_policy("fastest")


# -- routing -------------------------------------------------------------------------------------


def test_kv_aware_sends_a_prompt_to_its_prefix_holder_and_spreads_the_rest(fleet, router, caplog):
    caplog.set_level(logging.INFO, logger="lmcache_p2p.router")
    admit(fleet, "inst-b", DOC)
    r = router(fleet.controller.url)
    for extra in ("", " what does it say"):
        assert answered_by(r.complete(DOC + extra)) == "inst-b"
    # Token ids as the prompt: routed without a /tokenize.
    tokenized = sum(len(e.paths("/tokenize")) for e in fleet.engines.values())
    assert answered_by(r.complete(standin_tokens(DOC))) == "inst-b"
    assert sum(len(e.paths("/tokenize")) for e in fleet.engines.values()) == tokenized
    # Unrelated prompts, nothing cached, no load: the controller takes turns over the three.
    assert sorted(answered_by(r.complete(words(f"other{i}-", 40))) for i in range(3)) == NAMES
    # A chat is routed by its templated tokens: the holder of the conversation so far gets it.
    messages = [{"role": "system", "content": words("sys", 40)}, {"role": "user", "content": "hello there"}]
    admit(fleet, "inst-c", chat_text(messages))
    kwargs = {"enable_thinking": False}
    assert answered_by(r.chat(messages, chat_template_kwargs=kwargs)) == "inst-c"
    asked = [b for e in fleet.engines.values() for b in e.paths("/tokenize") if "messages" in b][-1]
    assert asked == {
        "model": MODEL,
        "messages": messages,
        "add_generation_prompt": True,
        "chat_template_kwargs": kwargs,
    }
    stats = r.stats()
    assert (stats["requests"], stats["forwarded"], stats["fallbacks"], stats["route_errors"]) == (7, 7, 0, 0)
    assert stats["per_instance"]["inst-b"] >= 3 and stats["mean_route_ms"] > 0 and stats["mean_tokenize_ms"] > 0
    assert stats["engines"] == {name: fleet.engines[name].url for name in NAMES}
    line = next(rec.getMessage() for rec in caplog.records if "prompt_tokens=64 -> inst-b" in rec.getMessage())
    assert "policy=kv-aware" in line and "local=63 peer=0 pull=0 recompute=1 running=0 waiting=0" in line
    assert "fallbacks=0" in line and "tokenize_ms=" in line and "route_ms=" in line and "expected_ttft_ms=" in line


def test_round_robin_alternates_and_least_loaded_follows_heartbeats(fleet, router):
    admit(fleet, "inst-a", DOC)  # ignored by both: neither looks at caches
    rr = router(fleet.controller.url, policy="round-robin")
    assert [answered_by(rr.complete(DOC)) for _ in range(6)] == NAMES + NAMES
    beat(fleet.workers["inst-a"], running=4, kv_usage=0.3)
    beat(fleet.workers["inst-b"], running=1, waiting=2)
    beat(fleet.workers["inst-c"], running=1, kv_usage=0.1)
    ll = router(fleet.controller.url, policy="least-loaded")
    assert {answered_by(ll.complete(DOC)) for _ in range(3)} == {"inst-c"}
    beat(fleet.workers["inst-c"], running=8)
    beat(fleet.workers["inst-b"], running=0)
    assert {answered_by(ll.complete(DOC)) for _ in range(3)} == {"inst-b"}
    assert ll.stats()["policy"] == "least-loaded" and rr.stats()["per_instance"] == dict.fromkeys(NAMES, 2)


# -- streaming -----------------------------------------------------------------------------------


def stream(client: httpx.Client, path: str, body: dict) -> tuple[httpx.Headers, bytes, list[float]]:
    """The raw bytes of a streamed answer and when each piece arrived."""
    t0 = time.monotonic()
    times, pieces = [], []
    with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        for piece in response.iter_raw():
            pieces.append(piece)
            times.append(time.monotonic() - t0)
        return response.headers, b"".join(pieces), times


def test_streams_pass_through_byte_for_byte_as_they_come_and_stop_with_the_client(fleet, router):
    r = router(fleet.controller.url)
    cases: list[tuple[str, dict, int]] = [
        ("/v1/completions", {"model": MODEL, "prompt": DOC, "stream": True, "max_tokens": 5}, 5),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": DOC}], "stream": True}, 4),
    ]
    for path, body, generated in cases:
        body["standin_delay_s"] = 0.15  # the stand-in waits between events; the router must not
        headers, proxied, times = stream(r.http, path, body)
        assert headers["content-type"].startswith("text/event-stream")
        engine = fleet.engines[headers["x-lmcache-instance"]]
        with httpx.Client(base_url=engine.url) as direct:
            _, expected, _ = stream(direct, path, body)
        assert proxied == expected and proxied.endswith(b"data: [DONE]\n\n")
        assert proxied.count(b"data: ") == generated + 1
        # Passed on as produced: the first event long before the last.
        assert times[-1] - times[0] > 0.3, times

    # A client that goes away mid-stream closes the engine's stream too: it stops generating.
    body = {"model": MODEL, "prompt": words("long", 20), "stream": True, "max_tokens": 50, "standin_delay_s": 0.1}
    with r.http.stream("POST", "/v1/completions", json=body) as response:
        engine = fleet.engines[response.headers["x-lmcache-instance"]]
        assert next(response.iter_raw()).startswith(b"data: ")
    wait_for(lambda: engine.streams_ended[-1:] == ["cancelled"], 10, "the engine's stream to be cancelled")


# -- engines and the controller going away -------------------------------------------------------


def test_an_unreachable_engine_is_skipped_and_counted(fleet, router):
    # A registered instance whose serve_url is a closed port, holding the prompt's prefix: the
    # controller ranks it first, the router cannot connect and takes the next.
    ghost_port = free_ports(1)[0]
    ghost = fleet.make_worker("ghost", serve_url=f"http://127.0.0.1:{ghost_port}")
    r = router(fleet.controller.url)
    tokens = standin_tokens(words("ghost", 48))
    ghost.admit_tokens(tokens)
    wait_for(lambda: fleet.controller.holders(tokens).get("ghost"), 15, "ghost's chunks")
    # Token ids as the prompt (no /tokenize, which would meet the ghost first and cool it down).
    assert answered_by(r.complete(tokens)) in NAMES
    stats = r.stats()
    assert (stats["fallbacks"], stats["requests_with_fallback"], stats["failures"]) == (1, 1, 0)
    assert stats["cooling"] == ["ghost"]
    # While it cools down it goes last: the next request does not wait on it again.
    assert answered_by(r.complete(tokens)) in NAMES and r.stats()["fallbacks"] == 1

    # A real engine stops serving (its process gone) while the controller still lists it.
    doc_tokens = admit(fleet, "inst-b", DOC)
    fleet.engines["inst-b"].stop()
    assert answered_by(r.complete(doc_tokens)) in ("inst-a", "inst-c")
    stats = r.stats()
    assert stats["fallbacks"] == 2 and sorted(stats["cooling"]) == ["ghost", "inst-b"]
    assert answered_by(r.complete(DOC)) in ("inst-a", "inst-c")  # text: tokenized elsewhere, served elsewhere

    # An engine that answers 503 before generating (overloaded): the next one serves it.
    admit(fleet, "inst-c", words("busy", 32))
    fleet.engines["inst-c"].fail_status = 503
    assert answered_by(r.complete(words("busy", 32))) == "inst-a"
    assert r.stats()["fallbacks"] == 3 and r.stats()["failures"] == 0


def test_with_the_controller_down_known_engines_are_served_round_robin(fleet, router, caplog):
    caplog.set_level(logging.INFO, logger="lmcache_p2p.router")
    r = router(fleet.controller.url)
    assert r.http.get("/health").json() == {"status": "ok", "engines": 3, "policy": "kv-aware"}
    assert answered_by(r.complete(DOC)) in NAMES
    fleet.controller.kill()
    assert sorted(answered_by(r.complete(DOC)) for _ in range(3)) == NAMES
    stats = r.stats()
    assert stats["route_errors"] == 3 and stats["failures"] == 0 and stats["forwarded"] == 4
    health = r.http.get("/health")
    assert health.status_code == 503 and health.json()["engines"] == 3
    assert f"controller {fleet.controller.url} /route failed: cannot connect" in health.json()["reason"]
    warnings = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
    assert any("routing round-robin over the 3 known engine(s)" in w for w in warnings), warnings
    models = r.http.get("/v1/models")  # still from a known engine
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL


# -- bad requests and no engine at all -----------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "content", "param", "says"),
    [
        ("/v1/completions", b"{not json", None, "not valid JSON"),
        ("/v1/completions", b"[1, 2]", None, "expected an object"),
        ("/v1/completions", b'{"prompt": "hi"}', "model", "'model' is required"),
        ("/v1/completions", b'{"model": 7, "prompt": "hi"}', "model", "'model' must be"),
        ("/v1/completions", b'{"model": "m"}', "prompt", "'prompt' is required"),
        ("/v1/completions", b'{"model": "m", "prompt": 5}', "prompt", "'prompt' must be"),
        ("/v1/completions", b'{"model": "m", "prompt": [1, -2]}', "prompt", "'prompt' must be"),
        ("/v1/chat/completions", b'{"model": "m", "prompt": "hi"}', "messages", "'messages' is required"),
        ("/v1/chat/completions", b'{"model": "m", "messages": []}', "messages", "'messages' must be"),
    ],
)
def test_a_bad_body_is_refused_naming_the_field(router, path, content, param, says):
    r = router(f"http://127.0.0.1:{free_ports(1)[0]}")  # nothing is asked: no controller needed
    response = r.http.post(path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param) and says in error["message"]
    assert r.stats()["bad_requests"] == 1


def test_every_engine_down_is_a_503_naming_each(controller, router):
    ports = free_ports(2)
    with registered_workers(controller) as make:
        for i, port in enumerate(ports):
            make(f"down-{i}", serve_url=f"http://127.0.0.1:{port}")
        r = router(controller.url)
        response = r.complete("hello")
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["type"] == "service_unavailable"
        for i, port in enumerate(ports):
            assert f"down-{i} (http://127.0.0.1:{port}): cannot connect" in error["message"]
        assert sorted(t["instance_id"] for t in error["tried"]) == ["down-0", "down-1"]
        stats = r.stats()
        assert (stats["failures"], stats["fallbacks"], stats["tokenize_errors"]) == (1, 2, 1)
        assert r.http.get("/v1/models").status_code == 503


# -- the command ---------------------------------------------------------------------------------


def test_flags_are_checked_with_their_names(capsys, tmp_path):
    def error(*argv: str, env: dict | None = None) -> str:
        args = cli.build_parser().parse_args(list(argv))
        with pytest.raises(cli.FlagError) as e:
            cli.config_from_args(args, env or {})
        return str(e.value)

    assert "--controller-url 'ftp://x'" in error("--controller-url", "ftp://x")
    assert "--port 70000" in error("--controller-url", "c:9000", "--port", "70000")
    assert "--api-token-file" in error("--controller-url", "c:9000", "--api-token-file", str(tmp_path / "none"))
    assert "given twice" in error(
        "--controller-url", "c:9000", "--api-token-file", "f", env={"LMCACHE_API_TOKEN": TOKEN}
    )
    assert "--request-timeout 0.0" in error("--controller-url", "c:9000", "--request-timeout", "0")
    assert "--max-body-bytes 0" in error("--controller-url", "c:9000", "--max-body-bytes", "0")
    args = cli.build_parser().parse_args(["--controller-url", "127.0.0.1:9000/"])
    config = cli.config_from_args(args, {"LMCACHE_API_TOKEN": TOKEN})
    assert (config.controller_url, config.api_token, config.policy) == ("http://127.0.0.1:9000", TOKEN, "kv-aware")
    assert config.max_body_bytes == DEFAULT_MAX_BODY_BYTES == 4 * 2**20
    with pytest.raises(SystemExit):
        cli.main(["--controller-url", "c:9000", "--policy", "fastest"])
    assert "--policy: invalid choice: 'fastest'" in capsys.readouterr().err
    assert cli.main(["--controller-url", "ftp://x"]) == 2
    assert "lmcache_router: --controller-url" in capsys.readouterr().err
    assert cli.main(["--controller-url", "c:9000", "--tokenizer", str(tmp_path / "no-model")]) == 2
    assert f"lmcache_router: --tokenizer {tmp_path / 'no-model'}: cannot load a tokenizer" in capsys.readouterr().err


def test_the_command_routes_through_a_controller_with_a_token(tmp_path, engines, router):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    c = ControllerProcess(
        "--worker-timeout", "60", "--api-token-file", str(token_file), "--protect-reads", reads_protected=True
    ).start()
    port = free_ports(1)[0]
    proc = None
    log = tmp_path / "router.log"
    try:
        with registered_workers(c) as make:
            engine = engines("inst-a", api_key="sk-client")
            make("inst-a", serve_url=engine.url)
            # Without the token the controller refuses /route; health says so, by status.
            unauthorized = router(c.url).http.get("/health").json()
            assert "HTTP 401" in unauthorized["reason"] and "--api-token-file" in unauthorized["reason"]
            proc = ServedProcess(
                "lmcache_router",
                [sys.executable, "-m", "lmcache_p2p.router.cli", "--controller-url", c.url, "--port", str(port)]
                + ["--api-token-file", str(token_file)],
                log,
                env={"LMCACHE_API_TOKEN": ""},  # the file is the one source (an empty variable is unset)
            ).start()
            url = f"http://127.0.0.1:{port}"
            proc.wait_http(f"{url}/health", 20)
            auth = {"Authorization": "Bearer sk-client"}  # the client's key for the engine, passed on
            response = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": DOC}, headers=auth)
            assert answered_by(response) == "inst-a"
            assert engine.requests[-1][2]["authorization"] == "Bearer sk-client"
            assert httpx.get(f"{url}/v1/models", headers=auth).json()["data"][0]["owned_by"] == "inst-a"
            stats = httpx.get(f"{url}/router/stats").json()
            assert (stats["route_errors"], stats["tokenize_errors"], stats["forwarded"]) == (0, 0, 1)
    finally:
        if proc is not None:
            proc.stop()
        c.stop()
    out = log.read_text()
    assert "routing with policy kv-aware via controller" in out
    assert "/v1/completions model=tiny-llama stream=False policy=kv-aware prompt_tokens=64 -> inst-a" in out


HUNDRED_MIB = 100 * 2**20


def test_a_100_mib_body_is_refused_with_413_and_never_held(fleet, tmp_path):
    """Issue 47 item 5: the router read a 100 MiB completions body whole and forwarded it (59 -> 603
    MB). Now a declared one is refused before a byte is read, a chunked one once past the limit,
    and the router's memory stays near where it was; a normal completion still routes."""
    port = free_ports(1)[0]
    proc = ServedProcess(
        "lmcache_router",
        [sys.executable, "-m", "lmcache_p2p.router.cli", "--controller-url", fleet.controller.url]
        + ["--port", str(port), "--log-level", "warning"],
        tmp_path / "router.log",
    ).start()
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(f"{url}/health", 20)
        assert answered_by(httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": DOC}))
        hwm0, _ = peak_rss(proc.process.pid)
        # Declared: the 413 comes before the body is sent.
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % HUNDRED_MIB
            )
            status, body = read_response(sock, timeout=5)
        assert status == 413, body
        error = httpx.Response(413, content=body).json()["error"]
        assert str(DEFAULT_MAX_BODY_BYTES) in error["message"] and str(HUNDRED_MIB) in error["message"], error
        assert (error["param"], error["max_body_bytes"]) == ("Content-Length", DEFAULT_MAX_BODY_BYTES)

        # Chunked, streamed from a generator (never built here): cut off at the limit.
        def blocks():
            yield b'{"model": "tiny-llama", "prompt": "'
            block = b"x" * 2**20
            for _ in range(HUNDRED_MIB // len(block)):
                yield block
            yield b'"}'

        r = httpx.post(f"{url}/v1/completions", content=blocks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413, r.text[:300]
        assert f"over the limit of {DEFAULT_MAX_BODY_BYTES} bytes" in r.json()["error"]["message"]
        hwm1, rss1 = peak_rss(proc.process.pid)
        print(f"router peak RSS growth {(hwm1 - hwm0) / 2**20:.1f} MiB, RSS now {rss1 / 2**20:.1f} MiB")
        assert hwm1 - hwm0 < 3 * DEFAULT_MAX_BODY_BYTES + 8 * 2**20, f"peak RSS grew {(hwm1 - hwm0) / 2**20:.1f} MiB"
        # Nothing of it reached an engine, and the next request routes as before.
        assert sum(len(e.paths("/v1/completions")) for e in fleet.engines.values()) == 1
        assert answered_by(httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": DOC}))
        assert httpx.get(f"{url}/router/stats").json()["bad_requests"] == 2
    finally:
        proc.stop()


# -- tenants: cache_salt, adapters, multimodal chats ---------------------------------------------

SQL_ID = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def tenant_fleet(controller, engines):
    """Two instances whose stand-in engines serve the base model and a LoRA adapter ``sql``."""
    with registered_workers(controller) as make:
        es = {name: engines(name, adapters=("sql",)) for name in NAMES[:2]}
        ws = {name: make(name, serve_url=es[name].url) for name in NAMES[:2]}
        yield Fleet(controller, es, ws, make)


def admit_as(fleet: Fleet, instance_id: str, tokens: list[int], **identity) -> None:
    """``instance_id`` holds ``tokens``' chunks keyed as its engine keys a request of that identity."""
    ident = KeyIdentity(**identity)
    fleet.workers[instance_id].admit_tokens(tokens, identity=ident)
    body = {"tokens": tokens, **({"cache_salt": ident.cache_salt} if ident.cache_salt else {})}
    if ident.lora_name:
        body.update(lora=ident.lora_name, lora_id=ident.lora_id)
    wait_for(lambda: fleet.controller.api("/lookup", body)["layout_info"].get(instance_id), 15, "chunks")


def route_lines(caplog) -> list[str]:
    return [rec.getMessage() for rec in caplog.records if "prompt_tokens=" in rec.getMessage()]


def test_one_prompt_under_two_salts_is_never_routed_to_the_other_tenant_s_holder(tenant_fleet, router, caplog):
    caplog.set_level(logging.INFO, logger="lmcache_p2p.router")
    tokens = standin_tokens(DOC)
    admit_as(tenant_fleet, "inst-a", tokens, cache_salt="tenant-a")
    admit_as(tenant_fleet, "inst-b", tokens)
    r = router(tenant_fleet.controller.url)
    assert answered_by(r.complete(DOC, cache_salt="tenant-a")) == "inst-a"
    assert answered_by(r.complete(DOC)) == "inst-b"
    assert "cache_salt" in tenant_fleet.engines["inst-a"].paths("/v1/completions")[0]  # forwarded untouched
    for _ in range(2):
        r.complete(DOC, cache_salt="tenant-b")
    lines = route_lines(caplog)
    salted, plain, others = lines[0], lines[1], lines[2:]
    assert f"identity {salt_tag('tenant-a')}" in salted and "-> inst-a" in salted and "local=63" in salted
    assert "identity" not in plain and "-> inst-b" in plain and "local=63" in plain
    # Another tenant's request holds nothing anywhere: ranked by load, nothing local, nothing to pull.
    assert all(f"identity {salt_tag('tenant-b')}" in line and "local=0 peer=0 pull=0" in line for line in others)
    assert "tenant-a" not in caplog.text and "tenant-b" not in caplog.text
    assert r.stats()["identity_routes"] == 3


def test_a_model_naming_an_adapter_is_routed_by_that_adapter_s_keys(tenant_fleet, router, caplog):
    caplog.set_level(logging.INFO, logger="lmcache_p2p.router")
    tokens = standin_tokens(DOC)
    assert tenant_fleet.workers["inst-a"].heartbeat(adapters={"sql": SQL_ID}).status == "ok"
    admit_as(tenant_fleet, "inst-a", tokens, lora_name="sql", lora_id=SQL_ID)
    admit_as(tenant_fleet, "inst-b", tokens)
    r = router(tenant_fleet.controller.url)
    response = r.http.post("/v1/completions", json={"model": "sql", "prompt": DOC})
    assert answered_by(response) == "inst-a"
    assert answered_by(r.complete(DOC)) == "inst-b"  # the base model's served name is no adapter
    lines = route_lines(caplog)
    assert "model=sql" in lines[0] and "identity lora=sql" in lines[0] and "-> inst-a" in lines[0]
    assert "identity" not in lines[1]


def test_a_multimodal_chat_is_routed_by_its_text_before_the_first_image(tenant_fleet, router, caplog):
    caplog.set_level(logging.INFO, logger="lmcache_p2p.router")
    system = {"role": "system", "content": words("sys", 40)}
    user = {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "text", "text": "what is in it?"},
        ],
    }
    prefix = standin_tokens(chat_text([system], add_generation_prompt=False))
    admit_as(tenant_fleet, "inst-b", prefix)
    r = router(tenant_fleet.controller.url)
    assert answered_by(r.chat([system, user])) == "inst-b"
    asked = [b for e in tenant_fleet.engines.values() for b in e.paths("/tokenize") if "messages" in b][-1]
    assert asked["messages"] == [system] and asked["add_generation_prompt"] is False
    line = route_lines(caplog)[-1]
    assert f"multimodal: routed by the {len(prefix)} tokens of the 1 message(s) before its first image_url" in line
    # An image in the first message leaves nothing to route by: load alone, and the log says so.
    r.chat([user])
    assert "multimodal: its first message holds an image_url: routed by load" in route_lines(caplog)[-1]
    assert "prompt_tokens=0" in route_lines(caplog)[-1]
    # Prompt embeddings are never cached by the engines: routed by load.
    r.http.post("/v1/completions", json={"model": MODEL, "prompt": DOC, "prompt_embeds": "AAAA"})
    assert "prompt_embeds: not cached by lmcache-p2p, routed by load" in route_lines(caplog)[-1]
    stats = r.stats()
    assert (stats["multimodal_prefix_routes"], stats["unkeyed_routes"]) == (1, 2)


def test_route_identity_reads_salt_adapter_and_the_first_non_text_part():
    def adapter(model: str) -> bool:
        return model == "sql"

    text = {"role": "user", "content": "hi"}
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio", "input_audio": {}}]}
    ident = route_identity({"model": "sql", "cache_salt": "s", "messages": [text, parts]}, CHAT, adapter)
    assert (ident.cache_salt, ident.lora, ident.messages, ident.multimodal) == ("s", "sql", [text], (1, "input_audio"))
    assert ident.route_fields() == {"cache_salt": "s", "lora": "sql"} and not ident.by_load
    plain = route_identity({"model": MODEL, "cache_salt": "", "prompt": "x"}, COMPLETIONS, adapter)
    assert plain.route_fields() == {} and plain.messages is None and plain.notes(3) == []
    assert route_identity({"model": MODEL, "messages": [parts]}, CHAT, adapter).by_load
    assert first_multimodal([text, {"role": "user", "content": [{"type": "text", "text": "b"}]}]) is None
    body = {"model": MODEL, "messages": [text, parts], "continue_final_message": True, "tools": []}
    assert prefix_body(body, [text]) == {
        "model": MODEL,
        "messages": [text],
        "add_generation_prompt": False,
        "continue_final_message": False,
        "tools": [],
    }
    notes = ident.notes(7)
    assert notes[0].startswith("identity salt#") and notes[0].endswith(" lora=sql") and "s " not in notes[0]
    assert notes[1] == "multimodal: routed by the 7 tokens of the 1 message(s) before its first input_audio"
