"""A remote store that stops answering (SIGSTOP) must not stall the engines that use it: a lookup
asks the store only which chunks it holds, within a deadline set from its usual rounds, and
never waits for bytes (the load fetches them beside the steps); a round past the deadline is
served without the store, and no lookup asks it again until that round ends. Real vLLM CPU
engines, one per store kind (Redis, ``lmcache_server``), peers off."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from redis_servers import RedisServer
from remote_stores import LmServer

from lmcache_p2p.testing.stalled_holder import run_stalled_stores

# Serial, as the stalled-holder test: it compares single samples of a stream's gaps.
pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.serial]


def test_a_stopped_store_leaves_the_engines_streams_at_their_pace(tiny_model, tmp_path):
    with RedisServer(tmp_path / "redis") as redis_server, LmServer(log_dir=tmp_path) as lm_server:
        redis_proc = redis_server.process.proc
        assert redis_proc is not None and lm_server.proc is not None
        stores = [
            ("redis", redis_server.url(), redis_proc.send_signal),
            ("lmcache_server", lm_server.url, lm_server.proc.send_signal),
        ]
        runs = run_stalled_stores(tiny_model, tmp_path / "fleet", stores)
    for figures in runs:
        log = (Path(figures["logs"]) / f"{figures['engine']}.log").read_text()
        # The round that went unanswered is named, with its deadline; the prompt was recomputed.
        late = re.findall(r"remote tier \S+: its exists round for \d+ chunk\(s\) took over (\d+) ms", log)
        assert late and all(50 <= int(ms) <= 500 for ms in late), (figures, log[-3000:])
        # The stalled holder's bound (no worse than around a cold prompt, one prefill, with room
        # for a shared host) plus the one deadline the scheduler waited. A lookup that waited for
        # the store's answer (its timeout, 2 s) or its bytes would freeze the stream that long.
        allowance = 2 * figures["largest_gap_cold_prompt_ms"] + 10 * figures["median_gap_ms"] + max(map(int, late))
        assert figures["largest_gap_stalled_holder_ms"] <= allowance, figures
        assert figures["stalled_request_s"] < 3 * figures["cold_prompt_s"] + 1.0, figures
