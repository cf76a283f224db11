"""Headless Chromium (Debian's package, not a downloaded build) driven by playwright-python, with
what a dashboard test needs to check: console errors, uncaught exceptions, every request URL,
bytes transferred, and any alert() an injected script managed to fire."""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from playwright.sync_api import Browser, Page, sync_playwright

CHROMIUM = os.environ.get("CHROMIUM_BIN", "/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
# Screenshots and other test output; gitignored. (Test-only variables stay out of LMCACHE_*:
# every LMCACHE_* variable is read as engine configuration.)
ARTIFACTS = Path(os.environ.get("TEST_ARTIFACTS_DIR", Path(__file__).resolve().parent.parent / ".artifacts"))


def chromium_path() -> str:
    if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
        raise RuntimeError(
            f"Chromium not found at {CHROMIUM}: `make test` installs Debian's chromium "
            "(apt-get install -y chromium), or set CHROMIUM_BIN to a chromium binary"
        )
    return CHROMIUM


@dataclass
class PageLog:
    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)
    response_bytes: int = 0


class Chromium:
    def __init__(self) -> None:
        self._playwright = sync_playwright().start()
        self.browser: Browser = self._playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_FLAGS)

    def open(self, url: str, width: int = 1400, height: int = 1000) -> tuple[Page, PageLog]:
        log = PageLog()
        page = self.browser.new_page(viewport={"width": width, "height": height})
        page.on("console", lambda m: log.console_errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: log.page_errors.append(str(e)))
        page.on("request", lambda r: log.requests.append(r.url))

        def on_response(response) -> None:
            with contextlib.suppress(Exception):  # a body already gone (navigated away): its size is not needed
                log.response_bytes += len(response.body())

        page.on("response", on_response)

        def on_dialog(dialog) -> None:
            log.dialogs.append(f"{dialog.type}: {dialog.message}")
            dialog.dismiss()

        page.on("dialog", on_dialog)
        page.goto(url)
        return page, log

    def close(self) -> None:
        self.browser.close()
        self._playwright.stop()


def screenshot(page: Page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=True)
    return path
