"""POST /route's parts in-process: the score's three properties (a holder first, then a cheap pull,
then the least loaded), the router over a real Registry and ChunkIndex (TP rule, tiers, peers,
eligibility, the tie-break), the checks on the new protocol fields, the settings, and the shared
decoding of prompt bodies."""

from __future__ import annotations

import argparse
import dataclasses
import time

import msgspec
import numpy as np
import pytest
from protocol_client import CPU, DISK, register_message

from lmcache_p2p.controller.admission import LoadRefused, RegisterRefused, validate_load, validate_register
from lmcache_p2p.controller.api import (
    LookupRequest,
    RouteRequest,
    _LookupFastPath,
    _RouteFastPath,
    decode_prompt_body,
)
from lmcache_p2p.controller.errors import InvalidRequest
from lmcache_p2p.controller.registry import Registry
from lmcache_p2p.controller.routing import Facts, Router, RouteWeights, expected_ttft_ms
from lmcache_p2p.controller.settings import (
    ROUTE_WEIGHTS,
    ControllerSettings,
    SettingsError,
    build_parser,
    load_settings,
)
from lmcache_p2p.keys import chunk_hash_array
from lmcache_p2p.protocol import EngineLoad

W = RouteWeights.from_settings(ControllerSettings())
KV_8B = 128 * 1024  # Llama-3.1-8B: bytes of KV a token
PROMPT = 10_000


def facts(**changes) -> Facts:
    base = Facts(prompt_tokens=PROMPT, local_tokens=0, local_by_location={}, peer_tokens=0, bytes_per_token=KV_8B)
    return dataclasses.replace(base, **changes)


# -- the score's properties ----------------------------------------------------------------------------


def test_the_instance_holding_the_prefix_scores_lowest_and_cpu_beats_disk():
    nothing = expected_ttft_ms(facts(), W)
    on_cpu = expected_ttft_ms(facts(local_tokens=8000, local_by_location={CPU: 8000}), W)
    on_disk = expected_ttft_ms(facts(local_tokens=8000, local_by_location={DISK: 8000}), W)
    on_gpu = expected_ttft_ms(facts(local_tokens=8000, local_by_location={"LocalGPUBackend": 8000}), W)
    assert on_gpu.expected_ttft_ms < on_cpu.expected_ttft_ms < on_disk.expected_ttft_ms < nothing.expected_ttft_ms
    assert on_gpu.local_load_ms == 0 and on_cpu.local_load_ms > 0
    # The parts add up, and only 2,000 tokens are left to compute.
    assert on_cpu.recompute_tokens == 2000 and on_cpu.local_tokens == 8000
    parts = on_cpu.recompute_ms + on_cpu.pull_ms + on_cpu.local_load_ms + on_cpu.load_ms
    assert on_cpu.expected_ttft_ms == pytest.approx(parts)
    assert nothing.recompute_ms == pytest.approx(PROMPT / W.prefill_tokens_per_s * 1e3)
    # A busy holder still beats an idle instance recomputing everything (a hit saves 800 ms here)...
    busy_holder = expected_ttft_ms(facts(local_tokens=8000, local_by_location={CPU: 8000}, running=8, waiting=2), W)
    assert busy_holder.expected_ttft_ms < nothing.expected_ttft_ms
    # ...but not one whose queue is long: then the idle one is faster.
    swamped = expected_ttft_ms(facts(local_tokens=8000, local_by_location={CPU: 8000}, waiting=20), W)
    assert swamped.expected_ttft_ms > nothing.expected_ttft_ms


def test_a_cheap_pull_beats_recomputing_and_a_slow_link_is_not_counted_as_one():
    holder = expected_ttft_ms(facts(local_tokens=8000, local_by_location={CPU: 8000}), W)
    can_pull = expected_ttft_ms(facts(peer_tokens=8000), W)
    nothing = expected_ttft_ms(facts(), W)
    assert holder.expected_ttft_ms < can_pull.expected_ttft_ms < nothing.expected_ttft_ms
    assert can_pull.pull_tokens == 8000 and can_pull.pull_bytes == 8000 * KV_8B
    assert can_pull.pull_ms == pytest.approx(W.pull_fixed_ms + 8000 * KV_8B / W.pull_bytes_per_s * 1e3)
    # A measured link of 100 MB/s: pulling 1 GB takes 10 s, recomputing 8,000 tokens 0.8 s.
    slow = expected_ttft_ms(facts(peer_tokens=8000, pull_bytes_per_s=100e6), W)
    assert slow.pull_tokens == 0 and slow.pull_ms == 0 and slow.recompute_tokens == PROMPT
    assert slow.expected_ttft_ms == pytest.approx(nothing.expected_ttft_ms)
    # A measured faster engine makes the same pull less worth it, never more.
    fast_engine = expected_ttft_ms(facts(peer_tokens=8000, prefill_tokens_per_s=100_000), W)
    assert fast_engine.pull_tokens == 0 and fast_engine.prefill_tokens_per_s == 100_000


def test_with_nothing_cached_the_least_loaded_scores_lowest():
    idle = expected_ttft_ms(facts(), W)
    running = expected_ttft_ms(facts(running=3), W)
    waiting = expected_ttft_ms(facts(running=3, waiting=1), W)
    kv_full = expected_ttft_ms(facts(kv_usage=1.0), W)
    kv_half = expected_ttft_ms(facts(kv_usage=0.5), W)
    assert idle.expected_ttft_ms < running.expected_ttft_ms < waiting.expected_ttft_ms
    assert kv_half.load_ms == 0 and kv_full.load_ms == pytest.approx(W.kv_full_ms)


def test_the_last_token_is_always_computed():
    everything = expected_ttft_ms(facts(local_tokens=PROMPT, local_by_location={CPU: PROMPT}), W)
    assert everything.local_tokens == PROMPT - 1 and everything.recompute_tokens == 1
    empty = expected_ttft_ms(facts(prompt_tokens=0), W)
    assert empty.recompute_tokens == 0 and empty.expected_ttft_ms == 0


# -- the router over a registry ----------------------------------------------------------------------

CHUNK = 16
DOC = list(range(3000, 3000 + 10 * CHUNK))
HASHES = chunk_hash_array(DOC, CHUNK)


def register(registry: Registry, instance_id: str, rank: int = 0, tp: int = 1, model: str = "tiny-llama", **kw):
    fields = {"locations": [CPU, DISK], "p2p_init_port": 9100 + rank, "p2p_lookup_port": 9200 + rank, **kw}
    return registry.register(register_message(instance_id, rank, tp, model, **fields))


def hold(registry: Registry, instance_id: str, chunks: int | slice, location: str = CPU, rank: int = 0) -> None:
    part = HASHES[chunks] if isinstance(chunks, slice) else HASHES[:chunks]
    registry.index.add(registry.holder_id(instance_id, rank, location), part)


def router(registry: Registry, **settings) -> Router:
    return Router(registry, ControllerSettings(**settings))


def by_id(answer: dict) -> dict[str, dict]:
    return {r["instance_id"]: r for r in answer["ranked"]}


def test_the_holder_ranks_first_with_its_tokens_per_tier_and_a_peer_can_pull_the_rest():
    registry = Registry()
    for name in ("holder", "puller", "other-model"):
        register(
            registry, name, model="other" if name == "other-model" else "tiny-llama", serve_url=f"http://{name}:8000"
        )
    hold(registry, "holder", 4)  # chunks 0-3 in CPU...
    hold(registry, "holder", slice(2, 8), DISK)  # ...2-7 on disk: 8 chunks held across tiers
    hold(registry, "puller", 1)
    hold(registry, "other-model", 8)  # another layout: nobody can pull from it
    answer = router(registry).route(DOC)
    # Both hold 8 chunks; the holder reads half of them from disk, so the other model's CPU copy
    # loads faster; the puller holds one chunk and pulls the rest.
    assert [r["instance_id"] for r in answer["ranked"]] == ["other-model", "holder", "puller"]
    ranked = by_id(answer)
    holder, puller = ranked["holder"], ranked["puller"]
    assert holder["local_tokens"] == 8 * CHUNK
    # The fastest copy serves each chunk: 0-3 from CPU, 4-7 from disk.
    assert holder["local_tokens_by_location"] == {CPU: 4 * CHUNK, DISK: 4 * CHUNK}
    assert (puller["local_tokens"], puller["peer_tokens"], puller["pull_from"]) == (CHUNK, 7 * CHUNK, ["holder"])
    assert ranked["other-model"]["peer_tokens"] == 0 and ranked["other-model"]["local_tokens"] == 8 * CHUNK
    assert holder["recompute_tokens"] == 2 * CHUNK and holder["serve_url"] == "http://holder:8000"
    # With the model asked for, only its instances are ranked; the holder first.
    answer = router(registry).route(DOC, model="tiny-llama")
    assert [r["instance_id"] for r in answer["ranked"]] == ["holder", "puller"]
    assert (answer["chosen"], answer["serve_url"]) == ("holder", "http://holder:8000")


def test_a_tp_instance_holds_a_chunk_only_when_every_rank_does():
    registry = Registry()
    register(registry, "tp", rank=0, tp=2)
    register(registry, "tp", rank=1, tp=2)
    register(registry, "single")
    hold(registry, "tp", 10, rank=0)
    hold(registry, "tp", 3, rank=1)
    hold(registry, "single", 5)
    ranked = by_id(router(registry).route(DOC))
    assert ranked["tp"]["local_tokens"] == 3 * CHUNK and ranked["tp"]["tp_size"] == 2
    assert ranked["single"]["local_tokens"] == 5 * CHUNK
    assert list(by_id(router(registry).route(DOC))) == ["single", "tp"]
    # Rank 1 has no peer of its layout (tp_rank 1) holding more: nothing to pull for the instance.
    assert ranked["tp"]["peer_tokens"] == 0 and ranked["single"]["peer_tokens"] == 0


def test_candidates_and_eligibility_are_reported_as_skipped():
    registry = Registry()
    register(registry, "a")
    register(registry, "b", model="other")
    register(registry, "half", rank=0, tp=2)
    register(registry, "silent")
    registry.workers[("silent", 0)].last_seen = time.monotonic() - 60
    answer = router(registry).route(DOC, model="tiny-llama", candidates=["ghost", "a", "b", "half", "silent", "a"])
    assert [r["instance_id"] for r in answer["ranked"]] == ["a"]
    reasons = {s["instance_id"]: s["reason"] for s in answer["skipped"]}
    assert reasons["ghost"] == "not registered"
    assert reasons["b"] == "serves model 'other', not 'tiny-llama'"
    assert reasons["half"] == "rank(s) [1] of tp_size 2 not registered"
    assert reasons["silent"].startswith("rank 0 silent for") and len(answer["skipped"]) == 4
    # No candidates: every instance of the model; the others are not listed.
    answer = router(registry).route(DOC, model="other")
    assert [r["instance_id"] for r in answer["ranked"]] == ["b"] and answer["skipped"] == []
    assert router(registry).route(DOC, candidates=["ghost"])["chosen"] is None


def test_equal_scores_take_turns_and_loads_decide_otherwise():
    registry = Registry()
    for name in ("a", "b", "c"):
        register(registry, name)
    r = router(registry)
    chosen = [r.route(DOC)["chosen"] for _ in range(6)]
    assert sorted(chosen[:3]) == ["a", "b", "c"] and chosen[3:] == chosen[:3]
    registry.note_load(("a", 0), EngineLoad(running=4, waiting=0, kv_usage=0.2))
    registry.note_load(("b", 0), EngineLoad(running=0, waiting=0, kv_usage=0.1))
    registry.note_load(("c", 0), EngineLoad(running=2, waiting=0, kv_usage=0.3))
    for _ in range(3):  # no turns now: the scores differ
        answer = r.route(DOC)
        assert [x["instance_id"] for x in answer["ranked"]] == ["b", "c", "a"]
    load = answer["ranked"][0]["load"]
    assert (load["reported"], load["running"], load["waiting"], load["kv_usage"]) == (True, 0, 0, 0.1)


def test_a_reported_prefill_rate_and_pull_rate_replace_the_defaults():
    registry = Registry()
    register(registry, "holder")
    register(registry, "puller")
    hold(registry, "holder", 10)
    r = router(registry, route_prefill_tokens_per_s=1000.0, route_pull_fixed_ms=1.0)
    puller = by_id(r.route(DOC))["puller"]
    assert puller["prefill_tokens_per_s"] == 1000.0 and puller["pull_tokens"] == 159
    registry.note_load(("puller", 0), EngineLoad(running=0, waiting=0, kv_usage=0, pull_bytes_per_s=1000.0))
    puller = by_id(r.route(DOC))["puller"]  # 41 KB at 1 KB/s: recomputing 159 tokens (0.16 s) wins
    assert (puller["pull_tokens"], puller["peer_tokens"], puller["recompute_tokens"]) == (0, 159, 160)
    registry.note_load(("puller", 0), EngineLoad(running=0, waiting=0, kv_usage=0, prefill_tokens_per_s=4000.0))
    assert by_id(r.route(DOC))["puller"]["prefill_tokens_per_s"] == 4000.0


def test_a_rate_measured_over_few_steps_gives_way_to_the_candidates_median():
    # Seen on two equal CPU engines: one's first step measured 1,394 tokens/s, the other's 7,794;
    # scored at its first step's rate, the holder of a prompt lost it to a peer that had to pull.
    registry = Registry()
    for name in ("cold", "warm-1", "warm-2"):
        register(registry, name)
    hold(registry, "cold", 10)
    r = router(registry, route_pull_fixed_ms=1.0, route_prefill_min_steps=5)

    def beat(name: str, rate: float, steps: int) -> None:
        load = EngineLoad(running=0, waiting=0, kv_usage=0, prefill_tokens_per_s=rate, prefill_steps=steps)
        registry.note_load((name, 0), load)

    beat("cold", 100.0, 1)
    beat("warm-1", 8000.0, 40)
    beat("warm-2", 6000.0, 12)
    answer = r.route(DOC)
    cold = by_id(answer)["cold"]
    assert (cold["prefill_tokens_per_s"], cold["prefill_source"], cold["prefill_steps"]) == (
        7000.0,
        "candidates' median",
        1,
    )
    assert answer["chosen"] == "cold"  # it holds the prompt: 1 token to compute at 7,000 tokens/s
    assert by_id(answer)["warm-1"]["prefill_source"] == "measured"
    beat("cold", 100.0, 5)  # measured over enough steps: its own rate stands, and it is that slow
    cold = by_id(answer := r.route(DOC))["cold"]
    assert (cold["prefill_tokens_per_s"], cold["prefill_source"]) == (100.0, "measured")
    assert answer["chosen"] == "warm-1"  # one token at 100 tokens/s (10 ms) loses to a 1 ms pull
    beat("warm-1", 8000.0, 4)
    beat("warm-2", 6000.0, 4)
    beat("cold", 100.0, 4)  # nobody measured over enough: each its own
    assert {i: e["prefill_tokens_per_s"] for i, e in by_id(r.route(DOC)).items()} == {
        "cold": 100.0,
        "warm-1": 8000.0,
        "warm-2": 6000.0,
    }


# -- protocol fields checked -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    ["", "ftp://host:21", "http://", "http://host:99999", "http://a b:8000", "host:8000", "http://x\n", "h" * 3000],
)
def test_a_bad_serve_url_is_refused_by_name(url):
    with pytest.raises(RegisterRefused) as refused:
        validate_register(register_message(serve_url=url))
    assert refused.value.field == "serve_url" and "Register field serve_url=" in refused.value.message


def test_good_serve_urls_and_none_pass():
    for url in (None, "http://127.0.0.1:8000", "https://engine-3.cluster.local/v1", "http://[::1]:8000"):
        validate_register(register_message(serve_url=url))


@pytest.mark.parametrize(
    ("field", "changes"),
    [
        ("load.running", {"running": -1}),
        ("load.waiting", {"waiting": 10**7}),
        ("load.running", {"running": True}),
        ("load.kv_usage", {"kv_usage": 1.5}),
        ("load.kv_usage", {"kv_usage": float("nan")}),
        ("load.prefill_tokens_per_s", {"prefill_tokens_per_s": -5.0}),
        ("load.prefill_steps", {"prefill_steps": -1}),
        ("load.pull_bytes_per_s", {"pull_bytes_per_s": float("inf")}),
        ("load.pull_fixed_ms", {"pull_fixed_ms": 1e9}),
    ],
)
def test_an_out_of_bounds_load_is_refused_by_name_and_dropped_by_the_registry(field, changes):
    bad = msgspec.structs.replace(EngineLoad(running=1, waiting=0, kv_usage=0.5), **changes)
    with pytest.raises(LoadRefused) as refused:
        validate_load(bad)
    assert refused.value.field == field and f"Heartbeat field {field}=" in refused.value.message
    registry = Registry()
    register(registry, "inst")
    registry.note_load(("inst", 0), EngineLoad(running=1, waiting=0, kv_usage=0.5))
    registry.note_load(("inst", 0), bad)
    assert registry.workers[("inst", 0)].load is None
    registry.note_load(("ghost", 0), EngineLoad(running=1, waiting=0, kv_usage=0.5))  # unknown: ignored


def test_old_senders_without_the_new_fields_still_decode():
    from lmcache_p2p.protocol import Heartbeat, encode, worker_message_decoder

    old_heartbeat = {"type": "heartbeat", "instance_id": "i", "rank": 0, "controller_epoch": "e"}
    decoded = worker_message_decoder.decode(msgspec.msgpack.encode(old_heartbeat))
    assert isinstance(decoded, Heartbeat) and decoded.load is None
    assert worker_message_decoder.decode(encode(register_message())).serve_url is None


# -- settings ------------------------------------------------------------------------------------------


def test_route_weights_come_from_flags_and_yaml_and_bad_ones_are_named(tmp_path):
    args = build_parser().parse_args(["--route-prefill-tokens-per-s", "2500", "--route-kv-knee", "0.5"])
    settings = load_settings(args, env={})
    assert settings.route_prefill_tokens_per_s == 2500 and settings.route_kv_knee == 0.5
    assert RouteWeights.from_settings(settings).pull_bytes_per_s == ROUTE_WEIGHTS["route_pull_gbps"][0] * 1e9
    config = tmp_path / "controller.yaml"
    config.write_text("route_disk_load_gbps: 0.5\nroute_waiting_ms: 0\n")
    settings = load_settings(build_parser().parse_args(["--config", str(config)]), env={})
    assert (settings.route_disk_load_gbps, settings.route_waiting_ms) == (0.5, 0.0)
    for flags, named in (
        (["--route-pull-gbps", "0"], "--route-pull-gbps 0.0: expected N > 0"),
        (["--route-running-ms", "-1"], "--route-running-ms -1.0: expected N >= 0"),
        (["--route-kv-knee", "1"], "--route-kv-knee 1.0: expected 0 <= N < 1"),
        (["--route-prefill-tokens-per-s", "nan"], "--route-prefill-tokens-per-s nan: expected a number"),
    ):
        with pytest.raises(SettingsError, match=named):
            load_settings(build_parser().parse_args(flags), env={})
    assert isinstance(build_parser().parse_args([]), argparse.Namespace)


# -- decoding a prompt body ------------------------------------------------------------------------------


def test_fast_and_strict_bodies_agree_on_every_field_but_the_tokens():
    for strict, fast in ((LookupRequest, _LookupFastPath), (RouteRequest, _RouteFastPath)):
        assert strict.__struct_fields__ == fast.__struct_fields__
        assert strict.__struct_defaults__ == fast.__struct_defaults__


def test_route_bodies_decode_like_lookup_bodies():
    tokens, body = decode_prompt_body(b'{"tokens": [1, 2, 3], "candidates": ["a"]}', RouteRequest, _RouteFastPath)
    assert isinstance(tokens, np.ndarray) and tokens.tolist() == [1, 2, 3] and body.candidates == ["a"]
    for raw, field in (
        (b"{}", "tokens"),
        (b'{"tokens": "1,2"}', "tokens"),
        (b'{"tokens": [1, -2]}', "tokens"),
        (b'{"tokens": [1], "model": 3}', "model"),
        (b'{"tokens": [1], "candidates": []}', "candidates"),
        (b'{"tokens": [1], "candidates": "a"}', "candidates"),
        (b'{"tokens": [1], "candidates": [""]}', "candidates"),
        (b'{"tokens": [1], "candidates": [7]}', "candidates"),
    ):
        with pytest.raises(InvalidRequest) as bad:
            decode_prompt_body(raw, RouteRequest, _RouteFastPath)
        assert bad.value.field == field, (raw, bad.value.message)
