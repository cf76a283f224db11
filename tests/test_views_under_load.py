"""GET /controller/workers and /controller/dashboard under polling (a real ``lmcache_controller``,
fake ranks of one process): however many clients poll, each view is built at most about once per
--view-cache-s, every answer says its age, and a newly registered worker shows at once. The WebUI's
page carries the cached dashboard, escaped for its script element.

How long heartbeats wait meanwhile is a benchmark's figure, not a test's:
``benchmarks/bench_controller_scale.py --views-pollers 4``."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import httpx
import pytest
from fake_fleet import FakeFleet
from protocol_client import ControllerProcess, FakeWorker

RANKS = 300
INTERVAL = 1.0


def poll_back_to_back(controller: ControllerProcess, poll: Callable[[httpx.Client], None], seconds: float) -> None:
    """Four clients, each on a connection of its own, calling ``poll`` back to back for ``seconds``."""
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(base_url=controller.http.base_url, timeout=30) as http:
            while not stop.is_set():
                poll(http)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(30)


@pytest.fixture
def controller():
    c = ControllerProcess("--log-level", "warning", "--view-cache-s", str(INTERVAL)).start()
    yield c
    c.stop()


def test_polled_views_are_built_once_per_interval_and_show_new_workers(controller):
    fleet = FakeFleet(controller, RANKS, tp=1)
    try:
        replies = fleet.register_all(list(range(RANKS - 1)))
        assert all(r.ok for r in replies.values())
        served = [0]
        wrong: list[str] = []  # what a polling thread saw amiss (an assert there would not fail the test)

        def poll(http: httpx.Client) -> None:
            for path in ("/controller/workers", "/controller/dashboard"):
                r = http.get(path)
                age = float(r.headers.get("X-View-Age-S", "-1"))
                if r.status_code != 200 or not 0 <= age < INTERVAL + 0.5:
                    wrong.append(f"{path}: {r.status_code}, age {age}")
                served[0] += 1

        before = controller.metric("lmcache_controller_view_builds_total", view="workers")
        poll_back_to_back(controller, poll, seconds=4.0)
        builds = controller.metric("lmcache_controller_view_builds_total", view="workers") - before
        assert not wrong, wrong[:5]
        assert served[0] > 20
        assert builds <= 4.0 / INTERVAL + 2, (builds, served[0])

        # A newly registered worker is in both views on the next read.
        assert fleet.register_all([RANKS - 1])[RANKS - 1].ok
        assert len(controller.http.get("/controller/workers").json()["workers"]) == RANKS
    finally:
        fleet.close()


MARKUP = "<img/src/onerror=alert(1)>"  # an instance id that is markup


def test_the_page_carries_the_cached_dashboard_escaped_for_its_script_element():
    # A cache that outlives the test: the page must reuse the build, whatever the machine's pace.
    controller = ControllerProcess("--log-level", "warning", "--view-cache-s", "600").start()
    worker = FakeWorker(controller, MARKUP)
    try:
        worker.register()
        dashboard = controller.http.get("/controller/dashboard")
        builds = controller.metric("lmcache_controller_view_builds_total", view="dashboard")
        page = controller.http.get("/").text
        assert controller.metric("lmcache_controller_view_builds_total", view="dashboard") == builds

        opening = '<script id="initial-state" type="application/json">'
        state = page.split(opening, 1)[1].split("</script>", 1)[0]
        assert "<" not in state and MARKUP not in page  # written as \\u003c...: no element can start
        assert json.loads(state) == dashboard.json()
        assert json.loads(state)["instances"][0]["instance_id"] == MARKUP
    finally:
        worker.close()
        controller.stop()


def test_metrics_scraped_back_to_back_share_renders_and_no_cache_gets_a_fresh_one(controller):
    """Clients scraping /metrics as fast as they can do not make the controller render it for each
    of them (it takes at most a tenth of the loop); one that sends Cache-Control: no-cache sees
    what happened just before."""
    fleet = FakeFleet(controller, RANKS, tp=1)
    try:
        assert all(r.ok for r in fleet.register_all(list(range(RANKS))).values())
        ages: list[float] = []  # one per scrape answered
        wrong: list[str] = []  # what a scraping thread saw amiss (an assert there would not fail the test)

        def scrape(http: httpx.Client) -> None:
            r = http.get("/metrics")
            if r.status_code != 200 or "X-View-Age-S" not in r.headers:
                wrong.append(f"{r.status_code}, headers {dict(r.headers)}")
            else:
                ages.append(float(r.headers["X-View-Age-S"]))

        renders = "lmcache_controller_metrics_renders_total"
        before = controller.metric(renders)
        poll_back_to_back(controller, scrape, seconds=3.0)
        rendered = controller.metric(renders) - before - 1  # less the no-cache read of the count
        assert not wrong, wrong[:3]
        assert len(ages) > 20
        assert 1 <= rendered <= len(ages) / 2, f"{rendered:.0f} renders for {len(ages)} scrapes"
        assert max(ages) <= INTERVAL + 0.5, max(ages)  # never older than --view-cache-s allows

        # Right after a render, a plain scrape gets that render; a no-cache one a render of its own.
        controller.http.get("/metrics", headers={"Cache-Control": "no-cache"})
        t0 = time.monotonic()
        fresh = controller.http.get("/metrics", headers={"Cache-Control": "no-cache"})
        assert float(fresh.headers["X-View-Age-S"]) <= time.monotonic() - t0  # rendered after it asked

        # A counter bumped just now: a plain scrape may have the render from before; no-cache does not.
        member = FakeWorker(controller, "late")
        try:
            member.register()
            seen_before = controller.metric("lmcache_controller_messages_total", type="Register")
            member.register()
            assert controller.metric("lmcache_controller_messages_total", type="Register") == seen_before + 1
        finally:
            member.close()
    finally:
        fleet.close()
