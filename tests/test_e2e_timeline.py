"""benchmarks/gpu/e2e.py reads engine 2's load timeline lines (load_jobs.LoadTimeline, DEBUG)
into the medians of each gap: the line the rank writes and the parser agree."""

from __future__ import annotations

import logging

from benchmark_scripts import load_benchmark

from lmcache_p2p.integration.vllm.load_jobs import LoadTimeline


def test_the_benchmark_reads_each_gap_of_the_timeline_lines_the_rank_writes(caplog):
    e2e = load_benchmark("gpu/e2e.py")
    pulled = LoadTimeline(100.0, offered=100.001, granted=100.004, pull_started=100.004, pull_ended=100.060)
    pulled.queued, pulled.copy_started, pulled.copy_ended = 100.020, 100.021, 100.064  # copied as it landed
    pulled.pieces, pulled.step_wait_ms = 5, 0.8
    local = LoadTimeline(200.0, granted=200.003)  # from host memory, no pull
    local.queued, local.copy_started, local.copy_ended = 200.003, 200.004, 200.030
    local.pieces = 1
    with caplog.at_level(logging.DEBUG):
        for req_id, timeline in (("e2warmup-0-ab12", pulled), ("e2warmup-1-cd34", local), ("e1warmup-0-ef56", local)):
            timeline.log_reported(req_id)
    timelines = e2e.load_timelines(caplog.text, "e2warmup-")
    assert sorted(timelines) == [0, 1]
    assert timelines[0]["pieces"] == 5 and timelines[0]["step_wait_ms"] == 0.8
    assert timelines[1]["points"]["pull start"] is None
    reported = timelines[0]["points"]["reported"]

    summary = e2e.timeline_summary(timelines, ttfts_ms=[reported + 40.0, timelines[1]["points"]["reported"] + 20.0])
    assert summary["requests"] == 2
    assert summary["seen_to_offer_median"] == 1.0  # only the pulled one had an offer
    assert summary["pull_median"] == 56.0
    assert summary["pull_end_to_load_queued_median"] == -40.0  # its copying began while it pulled
    assert summary["pull_end_to_load_end_median"] == 4.0
    assert summary["load_queued_to_load_start_median"] == 1.0
    assert summary["load_median"] == (43.0 + 26.0) / 2
    assert summary["reported_to_first_token_median"] == 30.0
    assert summary["pieces_median"] == 3.0
