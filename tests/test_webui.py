"""The WebUI in a real browser: Debian's headless Chromium against a real ``lmcache_controller``,
with protocol-level fake workers for registry views and real instance processes (cache engine,
worker, P2P over TCP) for traffic and commands."""

from __future__ import annotations

import time
from urllib.parse import urlparse

import pytest
from browser import Chromium, screenshot
from instances import instance_config, tokens
from protocol_client import WEBUI_CONTROLLER, ControllerProcess, FakeWorker, wait_for

from lmcache_p2p.protocol import CommandReply, Traffic

pytestmark = pytest.mark.browser

POLL_S = 2.0
# A poll period, plus the page's own fetch and render time: headless Chromium shares two cores with
# the other xdist worker's engines, so that part gets 6 s (a wait returns as soon as the page shows it).
ONE_REFRESH_MS = int((POLL_S + 6.0) * 1000)
CPU = "LocalCPUBackend"
CHUNK = 32
# Markup that runs a script if it ever reaches the page as HTML. No whitespace: the controller
# refuses instance ids with any (admission.py), and "/" separates the attributes just as well.
XSS = "<img/src/onerror=alert(1)>"


@pytest.fixture(scope="module")
def chromium():
    browser = Chromium()
    yield browser
    browser.close()


@pytest.fixture
def controller(controllers):
    # workers heartbeat every second, so traffic reaches the page quickly
    return controllers(*WEBUI_CONTROLLER)


def assert_clean(log, controller) -> None:
    """No console errors, no script errors, and no request left the controller."""
    assert not log.console_errors, log.console_errors
    assert not log.page_errors, log.page_errors
    assert not log.dialogs, log.dialogs
    origin = urlparse(controller.url).netloc
    foreign = [u for u in log.requests if not u.startswith("data:") and urlparse(u).netloc != origin]
    assert not foreign, f"requests outside the controller: {foreign}"


def wait_refreshed(page) -> None:
    """Until the page has rendered one more poll ("updated HH:MM:SS" changes: polls are 2 s apart)."""
    before = page.locator("#refreshed").inner_text()
    page.wait_for_function(
        "old => document.getElementById('refreshed').textContent !== old", arg=before, timeout=ONE_REFRESH_MS
    )


def test_page_loads_offline_small_and_without_errors(chromium, controller):
    page, log = chromium.open(controller.url + "/")
    assert page.title() == "lmcache-p2p controller"
    # Rendered from the embedded state before any poll: cards, the empty registry, the chart.
    assert page.locator("[data-card=instances] .value").inner_text() == "0"
    assert "No worker has registered yet" in page.locator("#instances tbody").inner_text()
    page.wait_for_selector("#refreshed:not(:empty)", timeout=ONE_REFRESH_MS)  # one poll went through
    assert page.locator("#banner").is_hidden()
    assert_clean(log, controller)
    assert set(urlparse(u).path for u in log.requests) >= {
        "/",
        "/static/app.js",
        "/static/app.css",
        "/controller/dashboard",
    }
    assert log.response_bytes < 200_000, f"{log.response_bytes} bytes transferred"
    page.close()


def test_the_api_docs_render_without_reaching_any_other_host(chromium, controller):
    """/docs (Swagger UI) is served from the package: on an air-gapped cluster it renders every
    route; a page loading its scripts from a CDN would be blank there."""
    page, log = chromium.open(controller.url + "/docs")
    page.wait_for_selector(".swagger-ui .info .title", timeout=15_000)
    assert "lmcache-p2p controller" in page.locator(".swagger-ui .info .title").inner_text()
    page.wait_for_selector("text=/move", timeout=15_000)  # the routes, read from /openapi.json
    assert_clean(log, controller)
    assert any(urlparse(u).path == "/openapi.json" for u in log.requests)
    page.close()


def test_registered_worker_appears_within_one_refresh_and_expands(chromium, controller):
    page, log = chromium.open(controller.url + "/")
    worker = FakeWorker(controller, "lmcache_instance_7", locations=(CPU, "LocalDiskBackend"))
    try:
        worker.register()
        worker.admit_tokens(tokens(4 * 16))  # FakeWorker chunks are 16 tokens: 4 keys
        row = page.locator("tr.instance[data-instance=lmcache_instance_7]")
        row.wait_for(timeout=ONE_REFRESH_MS)
        wait_for(lambda: "CPU 4" in row.inner_text(), what="key count on the row")
        # Live while it heartbeats. This worker beats only when told: on a loaded host the row was
        # read after its registration had aged past "live" ("late", 2.0 s ago), so it beats here.
        wait_for(lambda: (worker.heartbeat(), "live" in row.inner_text())[1], what="the row to say live")
        text = row.inner_text()
        assert "127.0.0.1" in text and "tiny-llama · float16 · TP 1" in text
        assert page.locator("[data-card=instances] .value").inner_text() == "1"
        # The pickers offer it, and its own locations.
        assert page.locator("#clear-form select[name=instance] option").all_inner_texts() == ["lmcache_instance_7"]
        assert page.locator("#clear-form select[name=location] option").all_inner_texts() == [CPU, "LocalDiskBackend"]

        row.click()
        detail = page.locator("tr.detail")
        assert detail.locator("tr[data-worker='0']").count() == 1
        assert "CPU 4 · Disk 0" in detail.inner_text()
        # The open instance stays open across refreshes.
        wait_refreshed(page)
        assert page.locator("tr.detail").count() == 1

        worker.deregister()
        gone = page.locator("tr.departed[data-departed=lmcache_instance_7]")
        gone.wait_for(timeout=ONE_REFRESH_MS)
        assert "deregistered" in gone.inner_text() and "dead" in gone.inner_text()
    finally:
        worker.close()
    assert_clean(log, controller)
    page.close()


def test_an_instance_that_cannot_share_with_another_of_its_model_says_why_on_its_row(chromium, controller):
    import msgspec

    page, log = chromium.open(controller.url + "/")
    a, b = FakeWorker(controller, "engine_a"), FakeWorker(controller, "engine_b")
    try:
        assert a.register().ok
        b.layout = msgspec.structs.replace(b.layout, tp_size=2)  # started with another TP size
        assert b.register().ok
        row = page.locator("tr.instance[data-instance=engine_b]")
        row.wait_for(timeout=ONE_REFRESH_MS)
        wait_for(lambda: "cannot share KV" in row.inner_text(), what="the mismatch on B's row")
        assert "cannot share KV with engine_a: tp_size 2 vs 1" in row.inner_text()
        assert (
            "cannot share KV with engine_b: tp_size 1 vs 2" in page.locator("tr[data-instance=engine_a]").inner_text()
        )
    finally:
        a.close()
        b.close()
    assert_clean(log, controller)
    page.close()


def test_worker_text_is_escaped(chromium, controller):
    """An instance id (and a command error) full of markup renders as text and runs nothing."""
    worker = FakeWorker(controller, XSS)
    worker.command_reply = lambda c: CommandReply(
        event_id=c.event_id, ok=False, error="<script>alert(2)</script> refused"
    )
    try:
        worker.register()
        assert controller.post("/clear", {"instance_id": XSS, "location": CPU}).status_code == 409
        page, log = chromium.open(controller.url + "/")
        row = page.locator("tr.instance").first
        assert row.locator("td.id").inner_text().endswith(XSS)
        page.locator("#events tbody tr").first.wait_for()
        assert "<script>alert(2)</script> refused" in page.locator("#events td.error").first.inner_text()
        assert page.locator("#clear-form select[name=instance] option").first.inner_text() == XSS
        wait_refreshed(page)  # and again after a live refresh
        assert page.locator("img").count() == 0
        assert page.locator("main script").count() == 0
        assert_clean(log, controller)  # no alert() fired
        page.close()
    finally:
        worker.close()


def test_overview_shows_fleet_traffic_from_heartbeats(chromium, controller):
    worker = FakeWorker(controller, "lmcache_instance_1")
    try:
        worker.register()
        page, log = chromium.open(controller.url + "/")
        t0 = time.time()
        # Every second for a few seconds: 10 lookups of 1,000 tokens, 800 of them hits, and 2 peer
        # pulls of 50 MB each.
        for i in range(1, 6):
            worker.heartbeat(
                Traffic(
                    started_at=t0,
                    lookups=10 * i,
                    lookup_tokens=1000 * i,
                    hit_tokens=800 * i,
                    peer_hit_tokens=300 * i,
                    pulls=2 * i,
                    pulled_bytes=100_000_000 * i,
                )
            )
            time.sleep(1.0)
        wait_for(
            lambda: page.locator("[data-card=hit-ratio] .value").inner_text() == "80.0%",
            timeout=15,
            what="hit ratio card",
        )
        p2p = page.locator("[data-card=p2p] .value").inner_text()
        assert p2p.endswith("MB/s") and 50 <= float(p2p.split()[0]) <= 150, p2p
        lookups = float(page.locator("[data-card=lookups] .value").inner_text())
        assert 5 <= lookups <= 15, lookups
        assert page.locator("#chart polyline.hit").count() == 1
        assert page.locator("#chart polyline.p2p").count() == 1
        assert_clean(log, controller)
        page.close()
    finally:
        worker.close()


def test_unreachable_banner_and_recovery(chromium, controller):
    page, log = chromium.open(controller.url + "/")
    page.wait_for_selector("#refreshed:not(:empty)", timeout=ONE_REFRESH_MS)
    epoch = page.locator("#epoch").inner_text()
    controller.kill()
    banner = page.locator("#banner")
    banner.wait_for(state="visible", timeout=ONE_REFRESH_MS + 4000)
    assert "Controller unreachable" in banner.inner_text()
    assert "stale" in page.locator("main").get_attribute("class")
    # The same controller comes back on the same ports: the page recovers by itself.
    restarted = ControllerProcess("--worker-timeout", "6", ports=controller.ports).start()
    try:
        banner.wait_for(state="hidden", timeout=ONE_REFRESH_MS)
        wait_for(lambda: page.locator("#epoch").inner_text() != epoch, what="the new epoch on the page")
    finally:
        restarted.stop()
    # Failed polls log "Failed to load resource" in the console; only those are expected.
    assert all("Failed to load resource" in e or "ERR_CONNECTION_REFUSED" in e for e in log.console_errors), (
        log.console_errors
    )
    assert not log.page_errors
    page.close()


# -- commands from the page, against real instances ------------------------------------------------


@pytest.fixture
def pair(controller, spawn):
    return [spawn(instance_config(f"lmcache_instance_{i}", controller, "tcp", chunk_size=CHUNK)) for i in (1, 2)]


def test_lookup_move_clear_from_the_page(chromium, controller, pair):
    a, b = pair
    shared, moved = tokens(6 * CHUNK, seed=11), tokens(4 * CHUNK, seed=12)
    assert a.prefill(shared) == 6 * CHUNK and a.prefill(moved) == 4 * CHUNK
    wait_for(lambda: controller.holders(moved).get("lmcache_instance_1") == [CPU, 4 * CHUNK], what="A's keys")
    assert b.lookup(shared) == 6 * CHUNK  # a real peer pull: traffic for the overview
    page, log = chromium.open(controller.url + "/")
    page.locator("tr.instance[data-instance=lmcache_instance_2]").wait_for(timeout=ONE_REFRESH_MS)

    # Lookup tool: pasted tokens.
    page.fill("#lookup-tokens", str(moved))
    page.click("#lookup-form button[type=submit]")
    page.wait_for_selector("#lookup-result .summary")
    assert page.locator("#lookup-result .summary").inner_text() == f"lmcache_instance_1 holds 128 of 128 tokens ({CPU})"
    # Explain: why B would (not) reuse it, run by run.
    page.select_option("#explain-instance", "lmcache_instance_2")
    page.click("#explain-button")
    page.wait_for_selector("#lookup-result table.explain")
    assert page.locator("#lookup-result .summary").inner_text() == "lmcache_instance_2 can reuse 128 of 128 tokens"
    row = page.locator("#lookup-result tr[data-status=peer]")
    assert row.count() == 1 and "lmcache_instance_1" in row.inner_text()
    # ...and a bad paste names the bad token.
    page.fill("#lookup-tokens", "1, 2, three")
    page.click("#lookup-form button[type=submit]")
    assert page.locator("#lookup-result .error").inner_text() == 'token 2 is "three", not a non-negative integer'

    # Move A -> B through the form, confirmed in the dialog.
    page.select_option("#move-form select[name=src]", "lmcache_instance_1")
    page.select_option("#move-form select[name=dst]", "lmcache_instance_2")
    page.fill("#move-form textarea[name=tokens]", str(moved))
    page.click("#move-form button[type=submit]")
    assert page.locator("#confirm").is_visible()
    assert "Move the chunks of these 128 tokens lmcache_instance_1 holds" in page.locator("#confirm-text").inner_text()
    page.click("#confirm-ok")
    page.wait_for_selector("#action-result .ok")
    event_id = page.locator("#action-result code").inner_text()
    assert event_id.startswith("move-")
    done = page.locator(f"#events tr[data-event='{event_id}'] .badge.done")
    done.wait_for(timeout=30_000)
    row = page.locator(f"#events tr[data-event='{event_id}']").inner_text()
    assert "128" in row and "lmcache_instance_1/LocalCPUBackend -> lmcache_instance_2/LocalCPUBackend" in row
    # Once done, the index never lists the source (its removals precede its done); the
    # destination's additions arrive on its own socket, sent before it answered the source.
    assert "lmcache_instance_1" not in controller.holders(moved)
    wait_for(lambda: controller.holders(moved) == {"lmcache_instance_2": [CPU, 4 * CHUNK]}, what="index after move")

    # Clear asks first; Cancel sends nothing.
    page.click("[role=tab][data-tab=clear]")
    page.select_option("#clear-form select[name=instance]", "lmcache_instance_2")
    events_before = len(controller.http.get("/controller/events").json()["events"])
    page.click("#clear-form button[type=submit]")
    assert "Clear every chunk lmcache_instance_2 holds" in page.locator("#confirm-text").inner_text()
    page.click("#confirm button[value=cancel]")
    page.locator("#action-result", has_text="Cancelled; nothing was sent.").wait_for()
    assert len(controller.http.get("/controller/events").json()["events"]) == events_before

    # The overview carries the peer pull B made (B heartbeats every second): its lookup of the
    # shared prompt, all of it pulled from A.
    def b_traffic():
        totals = controller.http.get("/controller/dashboard").json()["overview"]["traffic_totals"]
        return totals if totals["peer_hit_tokens"] else None

    totals = wait_for(b_traffic, timeout=10, what="B's traffic in a heartbeat")
    assert totals["peer_hit_tokens"] == 6 * CHUNK and totals["lookups"] >= 1
    assert totals["pulled_bytes"] >= 6 * a.page_bytes
    wait_for(
        lambda: page.locator("[data-card=p2p] .sub").inner_text().split("·")[-1].strip() != "0 B total",
        timeout=10,
        what="P2P totals on the overview",
    )
    page.locator("tr.instance[data-instance=lmcache_instance_1]").click()
    shot = screenshot(page, "webui.png")
    assert shot.stat().st_size > 10_000
    assert_clean(log, controller)
    page.close()
