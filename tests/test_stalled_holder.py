"""A holder that stalls (SIGSTOP) must not stall the engine that asks it: the scheduler answers
from what the ranks know (their local hit and the controller's offer), the pull runs beside the
engine's steps as the request's load, and when it gives up the request recomputes. Real vLLM CPU
engines, in both lookup modes (the seeds' enable_async_loading and the default)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lmcache_p2p.testing.stalled_holder import run
from lmcache_p2p.vocab import PULL_REQUEST_TIMEOUT_S

# Serial: it compares the stream's largest gap while the holder is stopped with its largest gap
# around a cold prompt, single samples that the other xdist worker's engines perturb (make test
# failed once at 204.7 ms against an allowance of 202.8 ms; the bug it guards against is ~2000 ms).
pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.serial]


def test_a_stalled_holder_leaves_the_asking_engines_streams_at_their_pace(tiny_model, tmp_path):
    *runs, aborted = run(tiny_model, tmp_path / "fleet", ["sync", "async"], abort=True)
    for figures, engine in zip(runs, ("engine2", "engine3"), strict=True):
        assert figures["same_output"], figures
        # While the request waits on the stopped holder, the running stream's largest gap is no
        # worse than around a cold prompt (one prefill, what any new prompt costs the stream),
        # with room for a shared host: the stream froze for the whole pull (~2 s) before.
        allowance = 2 * figures["largest_gap_cold_prompt_ms"] + 10 * figures["median_gap_ms"]
        assert figures["largest_gap_stalled_holder_ms"] <= allowance, figures
        log = (Path(figures["logs"]) / f"{engine}.log").read_text()
        # One pull, given up on once its timeout passed; then the request's blocks recompute
        # (no second pull from the same stalled holder).
        pulled = re.findall(r"request (\S+): pulling \d+ chunk\(s\) a peer offered", log)
        assert pulled and len(pulled) == len(set(pulled)), log[-3000:]
        assert "will be recomputed" in log
        assert figures["stalled_request_s"] < 2 * PULL_REQUEST_TIMEOUT_S + 3 * figures["cold_prompt_s"], figures

    # A client that leaves while its request pulls from the stopped holder: vLLM aborts it, the
    # pull is given up at the next step (not at its timeout), its blocks are freed, and the
    # engine goes on serving (a cold prompt next, the holder still stopped).
    assert aborted["abandoned"], aborted
    log = (Path(aborted["logs"]) / "engine2.log").read_text()
    assert "aborted while pulling" in log, log[-3000:]
    assert aborted["next_request_s"] < PULL_REQUEST_TIMEOUT_S, aborted
