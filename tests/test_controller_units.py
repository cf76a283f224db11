"""Controller parts in-process: the chunk index against a reference model, and the /lookup fast
path against the strict decoder."""

import json

import msgspec
import numpy as np
import pytest

from lmcache_p2p.controller.api import LookupRequest, parse_token_array
from lmcache_p2p.controller.index import ChunkIndex


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
