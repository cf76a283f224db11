"""Log output for lmcache_p2p inside a host process (vLLM) that configured only its own loggers.

The lines users follow (``Storing KV cache for ...``, ``LMCache hit tokens: ...``, ``Retrieved ...``)
must reach the engine's stderr even though vLLM sets up handlers for the ``vllm`` namespace only.
``LMCACHE_LOG_LEVEL`` (default INFO) sets the level.
"""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "[%(asctime)s] LMCache %(levelname)s: %(message)s (%(filename)s:%(lineno)d:%(name)s)"


def ensure_handler() -> None:
    """Give the ``lmcache_p2p`` logger a stderr handler unless it (or the root) already has one."""
    logger = logging.getLogger("lmcache_p2p")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("LMCACHE_LOG_LEVEL", "INFO").upper())
    logger.propagate = False
