"""Controller parts in-process: the chunk index against a reference model, the /lookup fast path
against the strict decoder, and the dashboard's traffic rates."""

import json

import msgspec
import numpy as np
import pytest

from lmcache_p2p.controller.api import LookupRequest, parse_token_array
from lmcache_p2p.controller.index import ChunkIndex
from lmcache_p2p.controller.traffic import FleetTraffic
from lmcache_p2p.protocol import Traffic


def test_index_matches_a_reference_model_under_random_updates():
    rng = np.random.default_rng(0)
    index = ChunkIndex(capacity=16)  # small: forces many rebuilds
    ref: dict[int, set[int]] = {}
    for step in range(400):
        holder = int(rng.integers(1, 6))
        keys = rng.integers(0, 3000, size=int(rng.integers(1, 150))).astype(np.uint64)  # includes key 0
        if rng.random() < 0.65:
            index.add(holder, keys)
            for k in keys.tolist():
                ref.setdefault(k, set()).add(holder)
        else:
            index.remove(holder, keys)
            for k in keys.tolist():
                ref.get(k, set()).discard(holder)
        if step % 60 == 0:
            gone = int(rng.integers(1, 6))
            index.drop_holder(gone)
            for held in ref.values():
                held.discard(gone)
    everything = np.arange(3000, dtype=np.uint64)
    for key, set_id in zip(everything.tolist(), index.lookup(everything).tolist()):
        assert index.sets.members(set_id) == frozenset(ref.get(key, set())), key
    assert index.live_keys == sum(1 for held in ref.values() if held)
    for holder in range(1, 6):
        expected = sorted(k for k, held in ref.items() if holder in held)
        assert index.holder_count(holder) == len(expected)
        assert sorted(index.holder_keys(holder).tolist()) == expected


def test_prefix_holders_stop_at_each_holders_first_gap():
    index = ChunkIndex()
    keys = np.arange(1, 11, dtype=np.uint64)
    index.add(1, keys)
    index.add(2, keys[:4])
    index.add(2, keys[5:])  # a gap at chunk 4
    index.add(3, keys[1:])  # never holds chunk 0: not a prefix holder
    assert index.prefix_holders(keys) == {1: 10, 2: 4}
    assert index.prefix_holders(np.array([99], dtype=np.uint64)) == {}


def test_replace_holder_is_exact():
    index = ChunkIndex()
    index.add(7, np.arange(1, 100, dtype=np.uint64))
    index.replace_holder(7, np.arange(50, 60, dtype=np.uint64))
    assert sorted(index.holder_keys(7).tolist()) == list(range(50, 60)) and index.live_keys == 10


@pytest.mark.parametrize("tokens", [[], [0], [1, 2, 3], list(range(0, 2**31, 2**24)), [2**31 - 1]])
def test_lookup_fast_path_agrees_with_the_strict_decoder(tokens):
    for text in (json.dumps(tokens), json.dumps(tokens, separators=(",", ":")), json.dumps(tokens, indent=1)):
        fast = parse_token_array(text.encode())
        strict = msgspec.json.decode(f'{{"tokens": {text}}}'.encode(), type=LookupRequest).tokens
        assert fast is not None and fast.tolist() == strict


@pytest.mark.parametrize("text", ["[1,-2]", "[1.5]", '[1,"2"]', "[1e3]", "[2147483648]", "[1,,2]", "[1,2,]", "[true]",
                                  "{}", "[[1]]", "[1 2]"])
def test_lookup_fast_path_declines_whatever_the_strict_decoder_should_judge(text):
    assert parse_token_array(text.encode()) is None


# -- fleet traffic (the dashboard's rates) -----------------------------------------------------------

def test_traffic_rates_from_heartbeat_totals():
    fleet = FleetTraffic(started_at=100.0, sample_every_s=2.0, rate_window_s=4.0)
    assert fleet.current()["hit_ratio"] is None  # nothing asked yet: no ratio, not 0%
    fleet.sample({}, now=100.0)
    fleet.report(("a", 0), Traffic(started_at=101.0, lookups=4, lookup_tokens=1000, hit_tokens=800,
                                   peer_hit_tokens=200, pulls=2, pulled_bytes=8_000_000))
    fleet.sample({}, now=102.0)
    fleet.sample({}, now=104.0)  # no heartbeat in between: the window still spans the traffic
    now = fleet.current()
    assert now["lookups_per_s"] == 1.0 and now["hit_ratio"] == 0.8
    assert now["p2p_bytes_per_s"] == 2_000_000 and now["p2p_transfers_per_s"] == 0.5
    fleet.sample({}, now=108.0)  # the window has moved past it
    assert fleet.current()["lookups_per_s"] == 0 and fleet.current()["hit_ratio"] is None
    assert len(fleet.series()) == 3


def test_traffic_baseline_for_older_workers_and_restarts():
    fleet = FleetTraffic(started_at=100.0)
    # Running since before the controller: its first totals are history, not traffic now.
    fleet.report(("old", 0), Traffic(started_at=50.0, lookups=1_000_000, pulled_bytes=10**12))
    assert fleet.totals["lookups"] == 0
    fleet.report(("old", 0), Traffic(started_at=50.0, lookups=1_000_010, pulled_bytes=10**12 + 5))
    assert fleet.totals["lookups"] == 10 and fleet.totals["pulled_bytes"] == 5
    # The same worker restarted: its totals began again, all of them are new.
    fleet.report(("old", 0), Traffic(started_at=150.0, lookups=3))
    assert fleet.totals["lookups"] == 13 and fleet.totals["pulled_bytes"] == 5
    # A worker that started after the controller: everything it reports counts.
    fleet.report(("new", 0), Traffic(started_at=120.0, lookups=7))
    assert fleet.totals["lookups"] == 20
