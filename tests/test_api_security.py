"""Issue 18, part B: the controller's HTTP API against a hostile neighbour. A real
``lmcache_controller`` process over real HTTP (httpx, curl, raw sockets for the oversized bodies),
protocol-level fake workers, and Debian's headless Chromium for the WebUI's token dialog.

* routes that change state need the bearer token when one is configured (401 otherwise), reads
  only with --protect-reads; with no token everything stays open, as the seeds' scripts expect;
* a POST that is not ``application/json`` is a 415 (a web page can send text/plain or a form
  encoding cross-origin without asking the browser first);
* bodies over api.MAX_BODY_BYTES are a 413, refused before they are read;
* bodies that do not decode are 4xx, never 500; a 404 names only what was asked.
"""

from __future__ import annotations

import json
import select
import shutil
import socket
import subprocess
import time

import pytest
from protocol_client import CPU, ControllerProcess, FakeWorker, wait_for
from raw_http import peak_rss, read_response

from lmcache_p2p.controller.api import MAX_BODY_BYTES
from lmcache_p2p.protocol import ClearCommand, MoveCommand, PinCommand

TOKEN = "issue18-test-token-3f9c0a7d1b"  # recognisable, so a test can look for it in the log
TOKENS = list(range(1000, 1000 + 4 * 16))  # 4 FakeWorker chunks
WRITES = {
    "/clear": {"instance_id": "inst-a", "location": CPU},
    "/pin": {"instance_id": "inst-a", "location": CPU, "tokens": TOKENS},
    "/move": {"old_position": ["inst-a", CPU], "new_position": ["inst-b", CPU], "tokens": TOKENS},
    "/copy": {"old_position": ["inst-a", CPU], "new_position": ["inst-b", CPU], "tokens": TOKENS},
}
# Every read the API has, each with a body that answers 200 once the worker inst-a is registered.
READS_POST = {
    "/lookup": {"tokens": TOKENS},
    "/check_finish": None,  # filled with an event id a lookup handed out
    "/query_worker_info": {"instance_id": "all"},
    "/query_instance": {"ip": "127.0.0.1"},
    "/health": {"instance_id": "inst-a"},
    "/status": {"instance_id": "inst-a"},
}
READS_GET = ["/controller/dashboard", "/controller/workers", "/controller/key-stats", "/controller/events", "/metrics"]
# How much the controller's peak resident memory (VmHWM) may grow while it refuses a 100 MB body:
# the body limit, once more for joining the chunks read so far, and uvicorn's read buffers. Before
# the limit the controller read the whole body (0.8 GB peak).
RSS_GROWTH_BOUND = 3 * MAX_BODY_BYTES + 8 * 1024 * 1024
HUNDRED_MB = 100 * 1000 * 1000


class SecuredController(ControllerProcess):
    """``lmcache_controller`` with --api-token-file (the token in a 0600 file) and --protect-reads."""

    def __init__(self, tmp_path, token: str | None, protect_reads: bool = False, *extra: str):
        flags = list(extra)
        if token is not None:
            path = tmp_path / "api-token"
            path.write_text(token + "\n")
            path.chmod(0o600)
            flags += ["--api-token-file", str(path)]
        if protect_reads:
            flags.append("--protect-reads")
        # A token in the test's own environment would be a second source (and an error).
        super().__init__(*flags, env={"LMCACHE_API_TOKEN": ""}, reads_protected=protect_reads)


def start_controller(tmp_path, token: str | None = None, protect_reads: bool = False, *extra: str) -> ControllerProcess:
    return SecuredController(tmp_path, token, protect_reads, *extra).start()


def bearer(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


class Fleet:
    """A controller and two registered fake workers, inst-a holding TOKENS' chunks, and inst-b."""

    def __init__(self, controller: ControllerProcess, token: str | None = None):
        self.controller = controller
        self.a, self.b = FakeWorker(controller, "inst-a"), FakeWorker(controller, "inst-b")
        for w in (self.a, self.b):
            assert w.register().ok
        self.a.admit_tokens(TOKENS)
        headers = bearer(token) if token else {}
        wait_for(
            lambda: controller.http.post("/lookup", json={"tokens": TOKENS}, headers=headers).json()["layout_info"],
            what="inst-a's keys",
        )

    def commands(self) -> int:
        return len(self.a.commands) + len(self.b.commands)

    def close(self) -> str:
        self.a.close()
        self.b.close()
        return self.controller.stop()


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """Token set, reads open (the default)."""
    fleet = Fleet(start_controller(tmp_path_factory.mktemp("secured"), TOKEN))
    yield fleet
    fleet.close()


@pytest.fixture(scope="module")
def open_fleet(tmp_path_factory):
    """No token: the seeds' setup."""
    fleet = Fleet(start_controller(tmp_path_factory.mktemp("open")))
    yield fleet
    fleet.close()


# -- the bearer token -------------------------------------------------------------------------------


@pytest.mark.parametrize("route", sorted(WRITES))
def test_state_changing_routes_answer_401_without_the_token_and_work_with_it(secured, route):
    http, before = secured.controller.http, secured.commands()
    for headers, sent in (
        ({}, False),
        ({"Authorization": "Basic dXNlcjpwYXNz"}, False),  # not a bearer token: as good as none
        (bearer("not-the-token"), True),
        (bearer(TOKEN[:-1]), True),  # all but the last character: still wrong
    ):
        r = http.post(route, json=WRITES[route], headers=headers)
        assert r.status_code == 401, (route, headers, r.text)
        challenge = r.headers["WWW-Authenticate"]
        assert challenge.startswith("Bearer ") and ('error="invalid_token"' in challenge) == sent, challenge
        error = r.json()["error"]
        assert r.json()["field"] == "Authorization" and route in error and "API token" in error, error
        if not sent:
            assert "Authorization: Bearer <token>" in error and "--api-token-file" in error, error
        assert TOKEN not in r.text
    assert secured.commands() == before, "a refused request reached a worker"

    r = http.post(route, json=WRITES[route], headers=bearer())
    assert r.status_code == 200, (route, r.text)
    command = secured.a.commands[-1]
    expected = {"/clear": ClearCommand, "/pin": PinCommand, "/move": MoveCommand, "/copy": MoveCommand}[route]
    assert isinstance(command, expected) and (route != "/copy" or command.copy), command
    # The scheme is case-insensitive (RFC 7235) and a charset parameter is fine.
    headers = {"Authorization": f"bearer {TOKEN}", "Content-Type": "application/json; charset=utf-8"}
    r = http.post(route, content=json.dumps(WRITES[route]), headers=headers)
    assert r.status_code == 200, r.text


def _check_reads(controller: ControllerProcess, headers: dict[str, str]) -> dict[str, int]:
    http = controller.http
    event_id = http.post("/lookup", json={"tokens": TOKENS}, headers=headers).json().get("event_id", "lookup-x")
    codes = {}
    for route, body in READS_POST.items():
        codes[route] = http.post(route, json=body or {"event_id": event_id}, headers=headers).status_code
    for route in READS_GET:
        codes[route] = http.get(route, headers=headers).status_code
    return codes


def test_reads_stay_open_when_only_a_token_is_set(secured):
    codes = _check_reads(secured.controller, {})
    assert codes == dict.fromkeys(codes, 200), codes
    # ...while the same controller refuses a command without it.
    assert secured.controller.http.post("/clear", json=WRITES["/clear"]).status_code == 401
    page = secured.controller.http.get("/")
    assert page.status_code == 200 and "inst-a" in page.text  # the first state is embedded, as before


def test_protect_reads_puts_every_read_behind_the_token(tmp_path):
    fleet = Fleet(start_controller(tmp_path, TOKEN, True), token=TOKEN)
    try:
        without = _check_reads(fleet.controller, {})
        assert without == dict.fromkeys(without, 401), without
        r = fleet.controller.http.get("/metrics")
        assert r.headers["WWW-Authenticate"].startswith("Bearer ") and "protect_reads" in r.json()["error"]
        with_token = _check_reads(fleet.controller, bearer())
        assert with_token == dict.fromkeys(with_token, 200), with_token
        # The page is served (a browser's navigation carries no token) but holds no data: its
        # script asks for the token and fetches the dashboard with it.
        page = fleet.controller.http.get("/")
        assert page.status_code == 200 and "inst-a" not in page.text
        assert '<script id="initial-state" type="application/json">null</script>' in page.text
        # The static files and the API's own description stay readable.
        assert fleet.controller.http.get("/static/app.js").status_code == 200
        assert fleet.controller.http.get("/openapi.json").status_code == 200
    finally:
        fleet.close()


def test_openapi_declares_the_bearer_scheme_on_the_routes_that_need_it(secured):
    spec = secured.controller.http.get("/openapi.json").json()
    assert spec["components"]["securitySchemes"]["api_token"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "The controller's API token (--api-token-file or LMCACHE_API_TOKEN)",
    }
    for route in WRITES:
        assert spec["paths"][route]["post"]["security"] == [{"api_token": []}], route
    for route in READS_POST:
        assert "security" not in spec["paths"][route]["post"], route


def test_the_token_never_reaches_the_log(tmp_path):
    fleet = Fleet(start_controller(tmp_path, TOKEN, False, "--log-level", "debug"))
    http = fleet.controller.http
    assert http.post("/clear", json=WRITES["/clear"], headers=bearer()).status_code == 200
    assert http.post("/clear", json=WRITES["/clear"], headers=bearer(TOKEN + "x")).status_code == 401
    assert http.post("/clear", json={"instance_id": TOKEN}, headers=bearer()).status_code == 404  # echoed, as asked
    log = fleet.close()
    assert "HTTP API on" in log  # the log was captured
    assert TOKEN not in log, log


# -- no token: the seeds' requests ------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_with_no_token_the_seeds_curl_requests_work(open_fleet):
    url = open_fleet.controller.url

    def curl(path: str, body: str, content_type: str | None = "application/json") -> dict:
        header = ["-H", f"Content-Type: {content_type}"] if content_type else []
        out = subprocess.run(
            ["curl", "-sS", "-X", "POST", f"{url}{path}", *header, "-d", body],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        return json.loads(out)

    moved = curl(
        "/move",
        '{"old_position": ["inst-a", "LocalCPUBackend"], "new_position": ["inst-b", "LocalCPUBackend"], '
        f'"tokens": {TOKENS}}}',
    )
    assert moved["event_id"].startswith("move-") and moved["num_tokens"] == len(TOKENS), moved
    assert isinstance(open_fleet.a.commands[-1], MoveCommand)
    status = curl("/check_finish", f'{{"event_id": "{moved["event_id"]}"}}')
    assert status["status"] in ("pending", "done"), status
    assert curl("/clear", '{"instance_id": "inst-a", "location": "LocalCPUBackend"}')["event_id"].startswith("clear")
    # Without -H, curl -d sends a form encoding: refused, with what to add.
    refused = curl("/clear", '{"instance_id": "inst-a", "location": "LocalCPUBackend"}', content_type=None)
    assert "'application/x-www-form-urlencoded' is not accepted" in refused["error"], refused
    assert "Content-Type: application/json" in refused["error"]


# -- content types ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",  # what a cross-origin fetch()/XHR with a string body sends, with no preflight
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",  # an HTML form, or curl -d without -H
        "multipart/form-data; boundary=x",
        None,  # a Blob body with no type: no header at all, and no preflight either
    ],
)
def test_a_post_that_is_not_json_is_refused_with_415_and_changes_nothing(open_fleet, content_type):
    http, before = open_fleet.controller.http, open_fleet.commands()
    events = len(http.get("/controller/events").json()["events"])
    headers = {"Content-Type": content_type} if content_type else {}
    body = b'{"instance_id": "inst-a", "location": "LocalCPUBackend"}'
    r = http.post("/clear", content=body, headers=headers)
    assert r.status_code == 415, r.text
    error = r.json()["error"]
    assert r.json()["field"] == "Content-Type" and "application/json" in error
    assert (repr(content_type) in error) if content_type else ("no Content-Type" in error), error
    assert open_fleet.commands() == before, "the clear reached a worker"
    assert len(http.get("/controller/events").json()["events"]) == events
    # Every POST, reads too.
    assert http.post("/lookup", content=b'{"tokens": [1]}', headers=headers).status_code == 415


# -- body size --------------------------------------------------------------------------------------


def _warm(controller: ControllerProcess) -> None:
    # A few lookups first, so that allocations of the first requests are not counted as growth.
    for _ in range(3):
        controller.http.post("/lookup", json={"tokens": list(range(100_000))})


def test_a_100_mb_body_is_refused_before_it_is_read(open_fleet):
    controller = open_fleet.controller
    # The largest legitimate body fits: 131,072 token ids up to 2**31 - 1, the widest the API
    # accepts, as indented JSON (2 MiB).
    prompt = "{\n  " + '"tokens": [\n' + ",\n".join(["    2147483647"] * 131_072) + "\n  ]\n}"
    assert len(prompt) < MAX_BODY_BYTES
    r = controller.http.post("/lookup", content=prompt, headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text[:300]
    _warm(controller)
    hwm0, _ = peak_rss(controller.proc.pid)
    with socket.create_connection(("127.0.0.1", controller.http_port)) as sock:
        sock.sendall(
            b"POST /lookup HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % HUNDRED_MB
        )
        # The answer comes before a byte of the body is sent.
        t0 = time.monotonic()
        status, body = read_response(sock, timeout=5)
        assert status == 413, body
        assert str(HUNDRED_MB) in body.decode() and str(MAX_BODY_BYTES) in body.decode(), body
        answered_in = time.monotonic() - t0
        # A client that sends it anyway: uvicorn reads it and drops it, and the connection goes on.
        block = b" " * (1 << 20)
        for _ in range(HUNDRED_MB // len(block)):
            sock.sendall(block)
        sock.sendall(b" " * (HUNDRED_MB % len(block)))
        sock.sendall(b"GET /controller/workers HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        status, _ = read_response(sock, timeout=30)
        assert status == 200
    hwm1, rss1 = peak_rss(controller.proc.pid)
    print(f"peak RSS growth {(hwm1 - hwm0) / 2**20:.1f} MiB, RSS now {rss1 / 2**20:.1f} MiB")
    assert hwm1 - hwm0 < RSS_GROWTH_BOUND, f"peak RSS grew {(hwm1 - hwm0) / 2**20:.1f} MiB"
    assert answered_in < 2.0


def test_a_chunked_100_mb_body_is_cut_off_at_the_limit(open_fleet):
    controller = open_fleet.controller
    _warm(controller)
    hwm0, _ = peak_rss(controller.proc.pid)
    block = b"[" + b"1," * ((1 << 20) // 2 - 1)  # 1 MiB chunks of a JSON array that never ends
    sent = 0
    with socket.create_connection(("127.0.0.1", controller.http_port)) as sock:
        sock.sendall(
            b"POST /lookup HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        while sent < HUNDRED_MB:
            sock.sendall(b"%x\r\n%s\r\n" % (len(block), block))
            sent += len(block)
            if select.select([sock], [], [], 0)[0]:
                break  # the controller answered before the body ended
        else:
            sock.sendall(b"0\r\n\r\n")
        status, body = read_response(sock, timeout=30)
    assert status == 413, body
    assert f"over the limit of {MAX_BODY_BYTES} bytes" in body.decode(), body
    # What was sent before the answer arrived: the limit, plus what the kernel's socket buffers
    # held on the way (up to tens of MB on loopback), never the whole 100 MB.
    assert sent < HUNDRED_MB, f"{sent} bytes sent before the answer"
    hwm1, rss1 = peak_rss(controller.proc.pid)
    print(f"{sent / 2**20:.0f} MiB sent before the 413; peak RSS growth {(hwm1 - hwm0) / 2**20:.1f} MiB")
    assert hwm1 - hwm0 < RSS_GROWTH_BOUND, f"peak RSS grew {(hwm1 - hwm0) / 2**20:.1f} MiB"


# -- bodies that do not decode ----------------------------------------------------------------------

DEEP = 10_000


# Each case: the field our 422 names (None: the body as a whole) and what its message says in
# our words. The decoder's own detail after them ("Expected `object`, got `array`", "Input data
# was truncated") is msgspec's, and not asserted.
@pytest.mark.parametrize(
    "route,body,field,says",
    [
        ("/lookup", b'{"tokens": ' + b"[" * DEEP + b"]" * DEEP + b"}", "tokens", "invalid LookupRequest"),
        ("/clear", b'{"instance_id": ' + b"[" * DEEP + b"]" * DEEP + b"}", "instance_id", "invalid ClearRequest"),
        ("/clear", b'{"instance_id": "inst-a", "x": ' + b"[" * DEEP + b"]" * DEEP + b"}", None, "too deeply"),
        ("/lookup", b'{"tokens": [1], "x": ' + b'{"a": ' * DEEP + b"1" + b"}" * DEEP + b"}", None, "too deeply"),
        ("/move", b"[" * DEEP + b"]" * DEEP, None, "invalid MoveRequest"),
        ("/lookup", b'{"tokens": [1, 2], "model": "\xff\xfe"}', None, "not valid UTF-8"),
        ("/clear", b'{"instance_id": "inst-\xc3"}', None, "not valid UTF-8"),
        (
            "/pin",
            b'{"instance_id": "inst-a", "location": "LocalCPUBackend", "tokens": "1,2"}',
            "tokens",
            "invalid PinRequest",
        ),
        ("/pin", b'{"instance_id": "inst-a", "location": "LocalCPUBackend"}', "tokens", "invalid PinRequest"),
        (
            "/move",
            b'{"old_position": ["inst-a"], "new_position": ["inst-b", "x"]}',
            "old_position",
            "invalid MoveRequest",
        ),
        ("/lookup", b'{"tokens": [-1]}', "tokens", "invalid LookupRequest"),
        ("/lookup", b"", None, "not valid JSON"),
        ("/check_finish", b'{"event_id": 5}', "event_id", "invalid CheckFinishRequest"),
    ],
)
def test_bodies_that_do_not_decode_are_4xx_with_a_message(open_fleet, route, body, field, says):
    before = open_fleet.commands()
    r = open_fleet.controller.http.post(route, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code in (400, 422), (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert error and "internal error" not in error
    assert r.json()["field"] == field and says in error, r.json()
    assert open_fleet.commands() == before
    assert open_fleet.controller.http.get("/controller/workers").status_code == 200  # still serving


# -- 404s -------------------------------------------------------------------------------------------


def test_a_404_names_only_the_instance_asked_for(open_fleet):
    http = open_fleet.controller.http
    for route, body, field in (
        ("/clear", {"instance_id": "nope", "location": CPU}, "instance_id"),
        ("/pin", {"instance_id": "nope", "location": CPU, "tokens": TOKENS}, "instance_id"),
        ("/move", {"old_position": ["nope", CPU], "new_position": ["inst-b", CPU]}, "old_position"),
        ("/copy", {"old_position": ["inst-a", CPU], "new_position": ["nope", CPU]}, "new_position"),
        ("/health", {"instance_id": "nope"}, "instance_id"),
        ("/status", {"instance_id": "nope"}, "instance_id"),
        ("/query_worker_info", {"instance_id": "nope"}, "instance_id"),
    ):
        r = http.post(route, json=body)
        assert r.status_code == 404, (route, r.text)
        # Exactly that: before, the message went on "(registered: ['inst-a', 'inst-b'])".
        assert r.json() == {"error": "unknown instance 'nope'", "field": field}, (route, r.text)
    # An id that itself looks like the listing is named whole.
    r = http.post("/clear", json={"instance_id": "x (registered: y)"})
    assert r.json()["error"] == "unknown instance 'x (registered: y)'", r.text


# -- the WebUI --------------------------------------------------------------------------------------


@pytest.mark.browser
def test_the_webui_asks_for_the_token_on_the_first_action_only(tmp_path):
    from browser import Chromium

    fleet = Fleet(start_controller(tmp_path, TOKEN))
    chromium = Chromium()
    try:
        page, log = chromium.open(fleet.controller.url + "/")
        sent_auth: dict[str, list[str | None]] = {}
        page.on(
            "request",
            lambda req: sent_auth.setdefault(req.url.rsplit("/", 1)[-1], []).append(req.headers.get("authorization")),
        )
        dialog = page.locator("#token-dialog")
        # The dashboard's reads need no token: the page polls without asking.
        page.wait_for_selector("#refreshed:not(:empty)", timeout=4000)
        assert dialog.is_hidden()

        # First action: Clear, confirmed. The controller answers 401, the page asks for the token.
        page.click("[role=tab][data-tab=clear]")
        page.select_option("#clear-form select[name=instance]", "inst-a")
        page.click("#clear-form button[type=submit]")
        page.click("#confirm-ok")
        dialog.wait_for(state="visible", timeout=5000)
        assert "need its API token" in page.locator("#token-why").inner_text()
        assert page.locator("#token-input").get_attribute("type") == "password"
        page.fill("#token-input", TOKEN)
        page.press("#token-input", "Enter")
        page.locator("#action-result .ok").wait_for(timeout=5000)
        assert page.locator("#action-result").inner_text().startswith("clear accepted: event clear-")
        assert dialog.is_hidden()
        assert sent_auth["clear"] == [None, f"Bearer {TOKEN}"]  # refused once without, then sent with it
        assert sum(isinstance(c, ClearCommand) for c in fleet.a.commands) == 1

        # Next action: Pin. No question this time; the token goes with it.
        page.click("[role=tab][data-tab=pin]")
        page.select_option("#pin-form select[name=instance]", "inst-a")
        page.fill("#pin-form textarea[name=tokens]", str(TOKENS))
        page.click("#pin-form button[type=submit]")
        page.locator("#action-result", has_text="pin accepted").wait_for(timeout=5000)
        assert dialog.is_hidden()
        assert sent_auth["pin"] == [f"Bearer {TOKEN}"]
        assert isinstance(fleet.a.commands[-1], PinCommand)

        # Kept for this tab only (sessionStorage), not in the page.
        assert page.evaluate("sessionStorage.getItem('lmcache-p2p.api-token')") == TOKEN
        assert page.evaluate("localStorage.length") == 0
        assert page.locator("#token-input").input_value() == ""
        assert not log.console_errors or all("401" in e for e in log.console_errors), log.console_errors
        assert not log.page_errors and not log.dialogs, (log.page_errors, log.dialogs)
        page.close()
    finally:
        chromium.close()
        fleet.close()


@pytest.mark.browser
def test_the_webui_with_protected_reads_asks_first_a_cancel_waits_and_a_refused_token_is_asked_again(tmp_path):
    from browser import Chromium

    fleet = Fleet(start_controller(tmp_path, TOKEN, True), token=TOKEN)
    chromium = Chromium()
    try:
        page, log = chromium.open(fleet.controller.url + "/")
        dialog = page.locator("#token-dialog")
        dialog.wait_for(state="visible", timeout=5000)  # the first poll met a 401
        assert "shows its data only" in page.locator("#token-why").inner_text()
        # Cancelled: polls stop asking; the banner says why and offers the dialog again.
        page.click("#token-cancel")
        banner = page.locator("#banner")
        banner.wait_for(state="visible", timeout=5000)
        assert "only with its API token" in banner.inner_text()
        page.wait_for_timeout(2500)  # a poll period: no new question
        assert dialog.is_hidden()
        page.click("#banner-token")
        dialog.wait_for(state="visible", timeout=5000)
        page.fill("#token-input", "wrong-token")
        page.click("#token-ok")
        # Refused: asked again, saying so; the wrong token is not kept.
        page.wait_for_function("document.getElementById('token-why').textContent.includes('refused')", timeout=5000)
        assert dialog.is_visible()
        assert page.evaluate("sessionStorage.getItem('lmcache-p2p.api-token')") is None
        page.fill("#token-input", TOKEN)
        page.click("#token-ok")
        page.locator("tr.instance[data-instance=inst-a]").wait_for(timeout=5000)
        assert dialog.is_hidden() and banner.is_hidden()
        # Polls go on with the token: no more questions.
        before = page.locator("#refreshed").inner_text()
        page.wait_for_function(
            "old => document.getElementById('refreshed').textContent !== old", arg=before, timeout=5000
        )
        assert dialog.is_hidden()
        assert not log.page_errors and not log.dialogs, (log.page_errors, log.dialogs)
        page.close()
    finally:
        chromium.close()
        fleet.close()
