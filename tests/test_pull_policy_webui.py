"""The WebUI's "Pulls skipped" card in a real browser (Debian's headless Chromium) against a real
``lmcache_controller``, fed by a protocol-level fake worker's heartbeat totals."""

from __future__ import annotations

import time

import pytest
from browser import Chromium
from protocol_client import WEBUI_CONTROLLER, FakeWorker, wait_for

from lmcache_p2p.protocol import Traffic

pytestmark = pytest.mark.browser


@pytest.fixture
def chromium():
    browser = Chromium()
    yield browser
    browser.close()


@pytest.fixture
def controller(controllers):
    return controllers(*WEBUI_CONTROLLER)


def test_the_overview_shows_pulls_skipped_as_slower_than_recomputing(chromium, controller):
    worker = FakeWorker(controller, "lmcache_instance_2")
    try:
        worker.register()
        page, log = chromium.open(controller.url + "/")
        card = page.locator("[data-card=pulls-skipped]")
        assert card.locator(".value").inner_text() == "0"  # rendered from the embedded state
        t0 = time.time()
        for i in range(1, 4):  # 2 skipped pulls of 256 tokens a second
            worker.heartbeat(
                Traffic(started_at=t0, lookups=3 * i, pulls=i, pulls_skipped=2 * i, skipped_tokens=512 * i)
            )
            time.sleep(1.0)
        wait_for(lambda: card.locator(".value").inner_text() == "6", timeout=15, what="the skipped pulls card")
        sub = card.locator(".sub").inner_text()
        assert sub.startswith("slower than recomputing · 1,536 tokens recomputed · "), sub
        assert not log.console_errors and not log.page_errors, (log.console_errors, log.page_errors)
        page.close()
    finally:
        worker.close()
