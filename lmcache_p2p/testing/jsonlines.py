"""The JSON-lines process protocol of the stand-in and the offline vLLM driver.

One request object per line on stdin, one answer per line on stdout; ``{"op": "quit"}`` or the end
of input stops. A request that fails is answered ``{"ok": false, "error": ...}`` and the process
goes on: the driving test or benchmark reads the error. Logs go to stderr.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from typing import TextIO

logger = logging.getLogger(__name__)


def claim_stdout() -> TextIO:
    """Keep fd 1 for answers: returns a writer on it, and sends everything else that writes to
    stdout (NIXL's logger, C libraries printing to fd 1, ``print``) to stderr instead."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return answers


def answer(stdout: TextIO, message: dict) -> None:
    stdout.write(json.dumps(message, default=str) + "\n")
    stdout.flush()


def serve(handle: Callable[[dict], dict], stdin: TextIO, stdout: TextIO) -> None:
    """Answer each request with ``handle(request)`` plus ``"ok": true`` until ``quit``."""
    for line in stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            if request.get("op") == "quit":
                break
            reply = handle(request)
            reply["ok"] = True
        except Exception as exc:
            logger.exception("request failed")
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        answer(stdout, reply)
