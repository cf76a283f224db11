"""A :class:`~lmcache_p2p.cache_engine.CacheEngine` driven synchronously, for the test stand-in
and tests: store and wait, look up with the fetch waited for, retrieve and wait. The connector
drives the engine's one face (store_async, lookup_async, pull_offer_async, plan_load, run_load,
loaded); these are that face, waited for."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmcache_p2p.cache_engine import CacheEngine
from lmcache_p2p.keys import ChunkHashes, hash_list


def store(
    engine: CacheEngine,
    chunk_hashes: ChunkHashes,
    layers: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    num_tokens: int | None = None,
) -> int:
    """Save the chunks ``chunk_hashes`` names whose KV sits in ``block_ids`` (one block id per
    ``block_size`` tokens from token 0, in order) and wait for the copy; returns the tokens newly
    stored. ``num_tokens`` is the prompt's length for the log (default: the chunks' tokens)."""
    before = engine.counters.stored_tokens
    engine.store_async(chunk_hashes, layers, block_ids, num_tokens=num_tokens)
    engine.poll_stores(wait=True)
    return engine.counters.stored_tokens - before


def lookup(
    engine: CacheEngine, chunk_hashes: ChunkHashes, num_tokens: int | None = None, fetch_missing: bool = True
) -> int:
    """Leading tokens of the prompt ``chunk_hashes`` names that :func:`retrieve` can load now
    (with ``fetch_missing``, what the local tiers lack is first pulled from a peer or fetched from
    the remote store, and waited for: ``CacheEngine.fetch``). ``num_tokens`` is the prompt's
    length for the counters (default: its full chunks' tokens)."""
    hashes = hash_list(chunk_hashes)
    if fetch_missing:
        hit, miss = engine.fetch(hashes)
    else:
        hit = engine.storage.lookup_prefix(hashes).num_chunks
        miss = engine.local_miss(hashes[hit]) if hit < len(hashes) else None
    prompt = len(hashes) * engine.chunk_size if num_tokens is None else num_tokens
    engine.count_lookup(prompt, hit * engine.chunk_size, miss)
    return hit * engine.chunk_size


def retrieve(
    engine: CacheEngine,
    chunk_hashes: ChunkHashes,
    layers: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    max_tokens: int | None = None,
    num_tokens: int | None = None,
) -> int:
    """Load the held leading chunks of ``chunk_hashes`` into ``block_ids`` (every layer, done when
    this returns); returns the tokens loaded. ``num_tokens`` is the prompt's length for the log
    (default: its chunks' tokens)."""
    total = len(chunk_hashes) * engine.chunk_size if num_tokens is None else num_tokens
    with engine.pin_prefix(chunk_hashes, max_tokens) as prefix:
        end = prefix.num_tokens if max_tokens is None else min(prefix.num_tokens, max_tokens)
        plan = engine.plan_load(prefix, block_ids, 0, end, total_tokens=total)
        engine.run_load(plan, layers)
        return plan.loaded_to
