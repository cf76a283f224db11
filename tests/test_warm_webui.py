"""The WebUI shows the channel each worker runs (issue 17): a worker configured for NIXL that fell
back to tcp is flagged in its instance's worker table, with its error (which names the fix) as the
cell's tooltip. Debian's headless Chromium against a real ``lmcache_controller``."""

from __future__ import annotations

import pytest
from browser import Chromium
from protocol_client import CPU, WEBUI_CONTROLLER, FakeWorker

from lmcache_p2p.protocol import PROTOCOL_VERSION, Register

pytestmark = pytest.mark.browser

ONE_REFRESH_MS = 8000  # a 2 s poll, plus the page's fetch and render on a shared host (as test_webui)
FIX = "NIXL cannot be imported here (No module named 'nixl'); fix: pip install 'lmcache-p2p[nixl]' <b>x</b>"


@pytest.fixture
def controller(controllers):
    return controllers(*WEBUI_CONTROLLER)


def register(worker: FakeWorker, effective: str, error: str | None) -> None:
    reply = worker._ask(
        worker.req,
        Register(
            version=PROTOCOL_VERSION,
            instance_id=worker.instance_id,
            rank=0,
            host="127.0.0.1",
            worker_port=worker.worker_port,
            layout=worker.layout,
            chunk_size=16,
            locations=[CPU],
            p2p_init_port=9100,
            p2p_lookup_port=9200,
            transfer_channel="nixl",
            effective_channel=effective,
            channel_error=error,
        ),
    )
    assert reply.ok


def test_the_worker_table_shows_the_channel_each_worker_runs(controller):
    fallen, fine = FakeWorker(controller, "no-nixl"), FakeWorker(controller, "with-nixl")
    browser = Chromium()
    try:
        register(fallen, "tcp", FIX)
        register(fine, "nixl", None)
        page, log = browser.open(controller.url + "/")
        for instance_id, shown in (("no-nixl", "tcp (nixl unavailable)"), ("with-nixl", "nixl")):
            row = page.locator(f"tr.instance[data-instance={instance_id}]")
            row.wait_for(timeout=ONE_REFRESH_MS)
            row.click()
            cell = page.locator("tr.detail tr[data-worker='0'] td").nth(5)
            assert cell.inner_text() == shown
            flagged = cell.locator(".channel-fallback")
            if instance_id == "no-nixl":
                assert flagged.get_attribute("title") == FIX  # as text: no markup made it into the page
                assert page.locator("tr.detail b").count() == 0
            else:
                assert flagged.count() == 0
            row.click()  # closed again
        assert not log.console_errors and not log.page_errors, (log.console_errors, log.page_errors)
        page.close()
    finally:
        browser.close()
        fallen.close()
        fine.close()
