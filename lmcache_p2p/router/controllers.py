"""The controllers ``lmcache_router`` may ask (``--controller-url a,b``), in order of preference.

Controllers share nothing: each indexes the whole mesh from the workers' own reports, so any of
them answers ``/route`` for every engine. The router asks the one it used last; on a connection
error or a 5xx it asks the next ones within the same request, and stays with the first that
answers (a WARNING names the switch once, not every request). A 4xx or an answer that does not
decode is not a reason to switch: another controller, configured alike, would say the same.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("lmcache_p2p.router")


class ControllerChoice:
    """Which controller is asked first, and the switch to another when it fails."""

    def __init__(self, urls: tuple[str, ...]):
        if not urls:
            raise ValueError("at least one controller URL is needed")
        self.urls = urls
        self._current = 0
        self.switches = 0

    @property
    def current(self) -> str:
        return self.urls[self._current]

    def order(self) -> list[str]:
        """Every URL, the current one first, then the ones after it (wrapping round)."""
        n = len(self.urls)
        return [self.urls[(self._current + i) % n] for i in range(n)]

    def answered(self, url: str, failures: list[str]) -> None:
        """``url`` answered after the ``failures`` (one line each) of the ones asked before it."""
        index = self.urls.index(url)
        if index == self._current:
            return
        logger.warning(
            "controller %s failed (%s); asking %s from now on (%d controller(s) configured)",
            self.current,
            "; ".join(failures),
            url,
            len(self.urls),
        )
        self._current = index
        self.switches += 1

    def describe(self) -> str:
        """For messages: the current URL, or all of them when there are several."""
        return self.current if len(self.urls) == 1 else ", ".join(self.urls)
