"""Log output for lmcache_p2p inside a host process (vLLM) that configured only its own loggers.

The lines users follow (``Storing KV cache for ...``, ``LMCache hit tokens: ...``, ``Retrieved ...``)
must reach the engine's stderr even though vLLM sets up handlers for the ``vllm`` namespace only.
``LMCACHE_LOG_LEVEL`` (default INFO) sets the level; a name that is no level is refused with the
configuration (config.py), as any bad ``LMCACHE_*`` value is, and logs at INFO meanwhile.

:class:`RateLimitedLog` keeps lines that a remote sender can trigger (a bad frame, a refused
registration) to one per key per interval, counting the rest.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Hashable, Mapping

_FORMAT = "[%(asctime)s] LMCache %(levelname)s: %(message)s (%(filename)s:%(lineno)d:%(name)s)"

LOG_LEVEL_ENV = "LMCACHE_LOG_LEVEL"
LEVELS = {
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARNING": logging.WARNING,
    "WARN": logging.WARNING,
    "ERROR": logging.ERROR,
    "CRITICAL": logging.CRITICAL,
}
LEVEL_NAMES = "DEBUG, INFO, WARNING, ERROR or CRITICAL"


def env_level(env: Mapping[str, str] | None = None) -> int | None:
    """``LMCACHE_LOG_LEVEL``'s level (any case; INFO when unset or empty), None for a name that
    is no level."""
    raw = (os.environ if env is None else env).get(LOG_LEVEL_ENV, "").strip().upper()
    return LEVELS.get(raw or "INFO")


def ensure_handler() -> None:
    """Give the ``lmcache_p2p`` logger a stderr handler unless it (or the root) already has one.
    Never raises: the plugin calls it before choosing the connector, and a bad level must not
    make that choice (the connector refuses the level with the rest of its configuration)."""
    logger = logging.getLogger("lmcache_p2p")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT))
    logger.addHandler(handler)
    logger.setLevel(env_level() or logging.INFO)
    logger.propagate = False


class RateLimitedLog:
    """At most one line per key every ``every_s`` seconds.

    A peer that sends 300k bad frames must not write 300k warnings (37 MB of log): the first line
    for a key is written, the ones after it within ``every_s`` are only counted, and the next line
    that passes says how many were held back ("... and 41 more in the last 10 s"). Keys should be
    few (a socket's name, a field's name), never a value a sender chooses: past ``max_keys``
    distinct keys, new ones share one overflow key, so the lines stay bounded whatever is sent.
    """

    OVERFLOW_KEY = ("lmcache_p2p.logs", "other keys")

    def __init__(
        self,
        logger: logging.Logger,
        every_s: float = 10.0,
        max_keys: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.logger = logger
        self.every_s = every_s
        self.max_keys = max_keys
        self._clock = clock
        self._lock = threading.Lock()
        # key -> [when its last line was written, lines held back since]
        self._keys: dict[Hashable, list[float]] = {}
        self.held_back = 0  # lines not written, over all keys (tests, stats)

    def log(self, level: int, key: Hashable, msg: str, *args: object, stacklevel: int = 2) -> bool:
        """Log ``msg % args`` unless ``key`` had a line within ``every_s``; True when written.
        ``stacklevel`` as for :meth:`logging.Logger.log`, counted from the caller of this method."""
        if not self.logger.isEnabledFor(level):
            return False
        now = self._clock()
        with self._lock:
            if key not in self._keys and len(self._keys) >= self.max_keys:
                key = self.OVERFLOW_KEY
            state = self._keys.get(key)
            if state is not None and now - state[0] < self.every_s:
                state[1] += 1
                self.held_back += 1
                return False
            held, since = (int(state[1]), now - state[0]) if state is not None else (0, 0.0)
            self._keys[key] = [now, 0]
        if held:
            msg = f"{msg} (... and %d more in the last %.0f s)"
            args = (*args, held, since)
        self.logger.log(level, msg, *args, stacklevel=stacklevel)
        return True

    def warning(self, key: Hashable, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, key, msg, *args, stacklevel=3)

    def info(self, key: Hashable, msg: str, *args: object) -> bool:
        return self.log(logging.INFO, key, msg, *args, stacklevel=3)
