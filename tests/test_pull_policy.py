"""The pull policy's model without processes: the prefill rate, the link estimate's fit, the
decision and its log line, the skip totals on their way to the dashboard, and the settings."""

from __future__ import annotations

import itertools
import random

import pytest

from lmcache_p2p.config import ConfigError, LMCacheConfig
from lmcache_p2p.controller.traffic import FleetTraffic
from lmcache_p2p.peer_service import EngineCounters
from lmcache_p2p.protocol import Traffic
from lmcache_p2p.pull_policy import (
    DEFAULT_PREFILL_TOKENS_PER_S,
    REMEASURE_AFTER_S,
    LinkEstimate,
    PrefillRate,
    PullPolicy,
    decide,
)

MB = 1_000_000
PAGE = 4 * 2**20  # a 32-token chunk of Llama-3.1-8B
CHUNK = 32


# -- prefill rate ------------------------------------------------------------------------------------


def test_the_prefill_rate_starts_from_config_or_the_device_class_and_then_follows_measurements():
    assert PrefillRate.for_engine(5000.0, "cuda").tokens_per_s == 5000.0
    assert PrefillRate.for_engine(None, "cuda").tokens_per_s == DEFAULT_PREFILL_TOKENS_PER_S["cuda"]
    assert PrefillRate.for_engine(None, "tpu").source == "start-up default for cpu"  # unknown: the low one
    rate = PrefillRate.for_engine(None, "cpu", min_tokens=256)
    assert "start-up default for cpu" in rate.describe()
    # Decode steps and small prefills say nothing about prefill speed.
    assert not rate.observe(300, 0.01, prefill_tokens=10)
    assert not rate.observe(100, 0.01)
    assert rate.steps == 0
    assert rate.observe(2000, 0.5, prefill_tokens=1990)
    assert rate.tokens_per_s == pytest.approx(4000.0)
    assert rate.describe() == "4,000 tok/s, measured over 1 step(s)"
    # An EWMA of tokens and of seconds: the rate is their ratio, so long steps weigh by length.
    rate.observe(1000, 0.5)
    expected = (2000 + 0.2 * (1000 - 2000)) / (0.5 + 0.2 * (0.5 - 0.5))
    assert rate.tokens_per_s == pytest.approx(expected)


def test_engine_counters_report_totals_without_the_prefill_rate():
    counters = EngineCounters(lookups=2, hit_tokens=64)
    totals = counters.totals()
    assert totals["lookups"] == 2 and totals["hit_tokens"] == 64 and "prefill" not in totals


# -- link estimate -----------------------------------------------------------------------------------


def test_pulls_of_different_sizes_give_the_fixed_cost_and_the_bandwidth():
    link = LinkEstimate()
    fixed, bandwidth = 0.004, 2e9  # 4 ms, 2 GB/s
    for size in (8, 64, 16, 32, 8, 64):
        link.observe(size * PAGE, fixed + size * PAGE / bandwidth, now=1.0)
    assert link.fixed_s == pytest.approx(fixed, rel=1e-6)
    assert link.bytes_per_s == pytest.approx(bandwidth, rel=1e-6)
    assert link.seconds_for(100 * MB) == pytest.approx(fixed + 100 * MB / bandwidth)


def test_pulls_of_one_size_give_their_effective_rate_and_no_fixed_cost():
    link = LinkEstimate()
    for seconds in (0.020, 0.022, 0.018):
        link.observe(8 * PAGE, seconds, now=1.0)
    assert link.fixed_s == 0.0
    assert 8 * PAGE / 0.022 < link.bytes_per_s < 8 * PAGE / 0.018
    # A fit that says bigger pulls were faster (noise) falls back the same way.
    noisy = LinkEstimate()
    noisy.observe(4 * PAGE, 0.050, now=1.0)
    noisy.observe(64 * PAGE, 0.040, now=2.0)
    assert noisy.fixed_s == 0.0 and noisy.bytes_per_s > 0


def test_the_estimate_follows_a_link_that_slowed_down_within_a_few_pulls():
    link = LinkEstimate()
    for size in (8, 16, 8, 16):
        link.observe(size * PAGE, 0.002 + size * PAGE / 10e9, now=1.0)
    for size in (8, 16, 8, 16, 8, 16, 8, 16):
        link.observe(size * PAGE, 0.002 + size * PAGE / 0.5e9, now=2.0)
    assert link.bytes_per_s < 0.6e9


# -- the decision ------------------------------------------------------------------------------------


def measured(fixed_s: float, bytes_per_s: float) -> LinkEstimate:
    link = LinkEstimate()
    for size in (4, 16):
        link.observe(size * PAGE, fixed_s + size * PAGE / bytes_per_s, now=0.0)
    return link


def test_a_link_never_measured_is_pulled_over_to_measure_it():
    d = decide(8, CHUNK, PAGE, None, PrefillRate(1e9, "configured prefill_tokens_per_s"))
    assert (d.chunks, d.reason, d.pull_ms) == (8, "unmeasured", None)
    assert "link not measured yet" in d.describe("peer", None)


def test_a_pull_slower_than_recomputing_is_skipped_with_its_numbers():
    link = measured(0.005, 1e9)  # 8 chunks = 33.6 MB: ~38.6 ms
    fast_engine = PrefillRate(10_000.0, "configured prefill_tokens_per_s")  # 256 tokens: 25.6 ms
    d = decide(8, CHUNK, PAGE, link, fast_engine)
    assert not d.pull and d.reason == "slower"
    assert d.pull_ms == pytest.approx(5 + 8 * PAGE / 1e6, rel=1e-6)
    assert d.recompute_ms == pytest.approx(25.6)
    line = d.describe("lmcache_instance_1 rank 0 (127.0.0.1:8201)", "tcp")
    assert line.startswith("peer pull decision: skip 8 chunks (256 tokens) at lmcache_instance_1 rank 0 ")
    assert "over tcp: est pull 38.6 ms (fixed 5.0 ms + 0.0336 gb at 1.0000 GB/s) > 0.8 x est recompute 25.6 ms" in line
    assert "10,000 tok/s, configured prefill_tokens_per_s" in line and "policy auto" in line

    slow_engine = PrefillRate(2_000.0, "start-up default for cpu")  # 256 tokens: 128 ms
    d = decide(8, CHUNK, PAGE, link, slow_engine)
    assert d.pull and d.chunks == 8 and d.reason == "faster"
    assert "<= 0.8 x est recompute 128.0 ms" in d.describe("p", "tcp")
    # The margin: a pull must win clearly (38.6 ms against 0.8 x 45 ms loses).
    assert not decide(8, CHUNK, PAGE, link, PrefillRate(256 / 0.045, "x")).pull
    assert decide(8, CHUNK, PAGE, link, PrefillRate(256 / 0.045, "x"), margin=1.0).pull


def test_always_pulls_whatever_a_peer_holds_and_still_says_what_auto_would_have_done():
    d = decide(8, CHUNK, PAGE, measured(0.005, 1e9), PrefillRate(1e9, "x"), policy="always")
    assert d.chunks == 8 and d.reason == "always"
    line = d.describe("p", "tcp")
    assert "> 0.8 x est recompute" in line and "policy always" in line


def test_an_old_slow_estimate_is_measured_again_with_one_batch():
    link = measured(0.005, 1e9)
    d = decide(20, CHUNK, PAGE, link, PrefillRate(1e9, "x"), stale=True, probe_chunks=8)
    assert (d.chunks, d.reason) == (8, "remeasure")
    clock = [0.0]
    policy = PullPolicy(PrefillRate(1e9, "x"), CHUNK, PAGE, probe_chunks=8, clock=lambda: clock[0])
    policy.observe_pull("p", "tcp", 8 * PAGE, 0.040)
    assert policy.decide("p", "tcp", 20).chunks == 0
    clock[0] = REMEASURE_AFTER_S + 1
    assert policy.decide("p", "tcp", 20).chunks == 8


def test_if_the_longest_prefix_loses_every_shorter_prefix_over_that_link_loses_too():
    """Why one test per holder decides it: pull and recompute times are both affine in chunks."""
    rng = random.Random(17)
    for _ in range(500):
        link = measured(rng.uniform(0, 0.05), rng.uniform(0.05e9, 50e9))
        rate = PrefillRate(rng.uniform(100, 100_000), "x")
        longest = rng.randint(1, 64)
        if not decide(longest, CHUNK, PAGE, link, rate).pull:
            assert not any(decide(n, CHUNK, PAGE, link, rate).pull for n in range(1, longest))


def test_a_peer_not_connected_yet_is_judged_by_its_latest_estimate_over_any_channel():
    clock = itertools.count()
    policy = PullPolicy(PrefillRate(1e9, "x"), CHUNK, PAGE, clock=lambda: float(next(clock)))
    assert policy.link("p", None) is None
    policy.observe_pull("p", "nixl", 8 * PAGE, 0.01)
    policy.observe_pull("p", "tcp", 8 * PAGE, 0.05)
    assert policy.link("p", None) is policy.links[("p", "tcp")]
    assert policy.link("p", "nixl via GPU staging") is None
    snapshot = policy.snapshot()
    assert set(snapshot["links"]) == {"p over nixl", "p over tcp"}
    assert snapshot["policy"] == "auto" and snapshot["prefill"]["tokens_per_s"] == 1e9


# -- settings and totals -----------------------------------------------------------------------------


def test_a_bad_policy_or_margin_is_named():
    with pytest.raises(ConfigError, match=r"p2p_pull_policy='sometimes'.*auto, always"):
        LMCacheConfig.from_dict({"p2p_pull_policy": "sometimes"}).validate()
    with pytest.raises(ConfigError, match=r"p2p_pull_margin=0\.0"):
        LMCacheConfig.from_dict({"p2p_pull_margin": 0.0}).validate()
    with pytest.raises(ConfigError, match=r"prefill_tokens_per_s=-1\.0"):
        LMCacheConfig.from_dict({"prefill_tokens_per_s": -1.0}).validate()
    with pytest.raises(ValueError, match="p2p_pull_policy='never'"):
        PullPolicy(PrefillRate(1.0, "x"), CHUNK, PAGE, policy="never")


def test_skipped_pulls_reach_the_dashboards_totals_and_rate():
    fleet = FleetTraffic(started_at=100.0, sample_every_s=2.0, rate_window_s=4.0)
    fleet.sample({}, now=100.0)
    fleet.report(("b", 0), Traffic(started_at=101.0, pulls_skipped=3, skipped_tokens=768))
    fleet.sample({}, now=102.0)
    fleet.report(("b", 0), Traffic(started_at=101.0, pulls_skipped=5, skipped_tokens=1280))
    fleet.sample({}, now=104.0)
    assert fleet.totals["pulls_skipped"] == 5 and fleet.totals["skipped_tokens"] == 1280
    assert fleet.current()["pulls_skipped_per_s"] == pytest.approx(5 / 4)
