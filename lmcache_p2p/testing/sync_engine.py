"""A :class:`~lmcache_p2p.cache_engine.CacheEngine` driven synchronously, for the test stand-in
and tests: store and wait, look up with the fetch waited for, retrieve and wait. The connector
drives the engine's one face (store_async, lookup_async, pull_offer_async, plan_load, run_load,
loaded); these are that face, waited for."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Sequence

import torch

from lmcache_p2p.cache_engine import CacheEngine
from lmcache_p2p.keys import ChunkHashes, hash_list
from lmcache_p2p.miss_reasons import HOLDER_GONE, TIMEOUT, Miss, PulledChunks
from lmcache_p2p.remote.offers import RemoteOffer
from lmcache_p2p.vocab import PEER_FETCH_TIMEOUT_S, WAITING_OFFER_TIMEOUT_S

logger = logging.getLogger(__name__)


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
    the remote store, and waited for: :func:`fetch`). ``num_tokens`` is the prompt's
    length for the counters (default: its full chunks' tokens)."""
    hashes = hash_list(chunk_hashes)
    if fetch_missing:
        hit, miss = fetch(engine, hashes)
    else:
        hit = engine.storage.lookup_prefix(hashes).num_chunks
        miss = engine.local_miss(hashes[hit]) if hit < len(hashes) else None
    prompt = len(hashes) * engine.chunk_size if num_tokens is None else num_tokens
    engine.count_lookup(prompt, hit * engine.chunk_size, miss)
    return hit * engine.chunk_size


def fetch(engine: CacheEngine, chunk_hashes: ChunkHashes) -> tuple[int, Miss | None]:
    """``engine.lookup_async``'s answer, waited for: a peer's offer pulled (then the remote store
    asked for the rest), or the remote fetch; the leading chunks now held, and why the next one is
    not. Counts no lookup. Peers come first, as in the connector: the controller's index is exact
    and a peer's pages cross one link with no server between; the remote store serves what no live
    peer holds (the holder restarted or left)."""
    hashes = hash_list(chunk_hashes)
    storage = engine.storage
    # Waited for anyway: the store gets as long as any of its round trips.
    first = engine.lookup_async(hashes, WAITING_OFFER_TIMEOUT_S, engine.config.remote_timeout_s)
    miss = first.miss
    if first.offer is not None:
        pull = engine.pull_offer_async(first.offer)
        try:
            pulled: PulledChunks = pull.result(PEER_FETCH_TIMEOUT_S)
            if pulled.chunks < first.offer.chunks:
                miss = pulled.miss
        except concurrent.futures.TimeoutError:
            pull.cancel()
            miss = Miss(TIMEOUT, f"the pull took over {PEER_FETCH_TIMEOUT_S:.0f} s")
        except Exception as e:
            logger.exception("a pull of %d offered chunk(s) failed; treating them as a miss", first.offer.chunks)
            miss = Miss(HOLDER_GONE, f"the pull failed: {e}")
        remote, hit = storage.remote, storage.lookup_prefix(hashes).num_chunks
        if remote is not None and hit < len(hashes) and not isinstance(first.offer, RemoteOffer):
            remote.fetch_prefix_into(storage, hashes[hit:])
    hit = storage.lookup_prefix(hashes).num_chunks
    return hit, (miss if hit < len(hashes) else None)


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
