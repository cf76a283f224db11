"""Blending at tensor parallelism 2 (issue 23): a real vLLM CPU engine at
``--tensor-parallel-size 2`` with ``enable_blending``. Each rank stores its own heads of every
segment and blends on them, in step with the other rank (vLLM's all-reduces run inside the
blend, and the check layer's deviation is summed over ranks so both recompute the same tokens).
At ratio 1.0 the blend is a prefill by other means: the engine answers a repeated prompt, now
blended from its segments, as it answered it cold."""

from __future__ import annotations

import re

import pytest
from protocol_client import wait_for

from lmcache_p2p.testing.processes import stream_completion
from lmcache_p2p.testing.served_fleet import ServedFleet
from lmcache_p2p.testing.tiny_model import sample_text

# One TP fleet at a time (test_vllm_tp says why).
pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.xdist_group("tensor_parallel")]


def test_a_tp2_engine_blends_rank_by_rank_and_a_full_blend_equals_its_cold_answer(tmp_path, tiny_model):
    fleet = ServedFleet(
        tmp_path,
        tiny_model,
        engines=1,
        tp=2,
        ports_per_rank=True,
        engine_extra={"enable_blending": True, "blend_recompute_ratios": [1.0], "transfer_channel": "tcp"},
        engine_args=("--no-enable-prefix-caching", "--max-num-seqs", "4"),
    )
    try:
        fleet.start(timeout=400)
        url = fleet.engine_urls[0]
        system, first, second = (sample_text(120, seed) for seed in (31, 32, 33))
        one = " # # ".join([system, first, second, sample_text(30, 34)])
        other = " # # ".join([system, second, first, sample_text(30, 35)])
        cold = stream_completion(url, fleet.model, other, 16)["text"]
        stream_completion(url, fleet.model, one, 16)  # blended from the segments `other` stored
        again = stream_completion(url, fleet.model, other, 16)["text"]
        engine = fleet.processes["engine1"]

        def blends(log: str, rank: int) -> int:
            return len(re.findall(rf"rank {rank}: blended \d+ tokens: \d+ cached in 3 segment\(s\) reused", log))

        # Each rank's worker process writes its own lines, and the answer waits for rank 0's step
        # only: rank 1's line of the last blend can reach the log a moment after the answer.
        wait_for(lambda: all(blends(engine.log(), r) >= 2 for r in (0, 1)), 30, "both ranks' blend lines")
        log = engine.log()
        for rank in (0, 1):  # each rank stores its heads of the segments, and blends both repeats
            assert len(re.findall(rf"rank {rank}: stored 3 segment\(s\)", log)) == 1, rank
            assert blends(log, rank) == 2, rank
        assert again == cold
    finally:
        fleet.stop()
