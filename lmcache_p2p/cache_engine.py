"""CacheEngine: one engine rank's KV cache service, the object the vLLM connector drives.

It owns the rank's :class:`StorageManager` (CPU and disk tiers) and, with ``enable_controller``,
its :class:`Worker` (controller link, commands, peers). The engine's KV lives in paged per-layer
tensors; the engine hands them in with the block ids of a request's tokens:

* ``store``: gather each full chunk not held yet into a CPU page and admit it;
* ``lookup``: how many leading tokens can be loaded (local tiers; with ``enable_p2p`` the rest of
  the prefix is first pulled from the peer holding the most of it);
* ``retrieve``: scatter the held leading chunks into the request's blocks.

Nothing here raises into the engine for a cache problem: a failure is a shorter hit.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Optional, Sequence

import torch

from lmcache_p2p import gpu_ops
from lmcache_p2p.config import ConfigError, LMCacheConfig
from lmcache_p2p.keys import LayoutFingerprint, TokenIds, chunk_hash_array
from lmcache_p2p.storage.manager import StorageManager

logger = logging.getLogger(__name__)

PEER_FETCH_TIMEOUT_S = 30.0


class CacheEngine:
    def __init__(self, config: LMCacheConfig, layout: LayoutFingerprint, rank: int = 0,
                 pin_memory: Optional[bool] = None):
        config.validate()
        config.validate_for_tp(layout.tp_size)
        if config.chunk_size % layout.block_size:
            raise ConfigError("chunk_size", f"must be a multiple of the engine's KV block size {layout.block_size}",
                              value=config.chunk_size, source=config.sources.get("chunk_size"))
        self.config = config
        self.layout = layout
        self.rank = rank
        self.chunk_size = config.chunk_size
        self.blocks_per_chunk = config.chunk_size // layout.block_size
        self.storage = StorageManager(config, layout, pin_memory=pin_memory)
        self.worker = None
        if config.enable_controller:
            from lmcache_p2p.worker import Worker  # the network side only when asked for
            self.worker = Worker(config, self.storage, layout, rank)

    # -- store -----------------------------------------------------------------------------------

    def store(self, tokens: TokenIds, layers: Sequence[torch.Tensor], block_ids: Sequence[int]) -> int:
        """Save the full chunks of ``tokens`` whose KV sits in ``block_ids`` (one block id per
        ``block_size`` tokens, in order); returns the tokens newly stored."""
        spans = self.storage.spans(tokens)
        stored = 0
        for span in spans:
            if self.storage.location_of(span.chunk_hash) is not None:
                continue
            blocks = self._blocks(block_ids, span.start)
            if blocks is None:
                break
            reserved = self.storage.reserve_page()
            if reserved is None:
                break  # every page pinned: nothing more can be stored now
            page, data = reserved
            gpu_ops.gather_chunk(layers, blocks, data)
            if self.storage.commit_page(span.chunk_hash, page):
                stored += self.chunk_size
        logger.info("Storing KV cache for %d out of %d tokens", stored, len(tokens))
        return stored

    def _blocks(self, block_ids: Sequence[int], start: int) -> Optional[list[int]]:
        first = start // self.layout.block_size
        blocks = list(block_ids[first:first + self.blocks_per_chunk])
        return blocks if len(blocks) == self.blocks_per_chunk else None

    # -- lookup ----------------------------------------------------------------------------------

    def _local_hit(self, tokens: TokenIds) -> tuple[list[int], int]:
        """The prompt's chunk hashes, and how many leading chunks the local tiers hold."""
        hashes = chunk_hash_array(tokens, self.chunk_size).tolist()
        return hashes, self.storage.lookup_prefix(hashes).num_chunks

    def lookup(self, tokens: TokenIds, use_peers: bool = True) -> int:
        """Leading tokens of ``tokens`` that :meth:`retrieve` can load now (pulling from a peer
        first when P2P is on and the local prefix ends early)."""
        hashes, hit = self._local_hit(tokens)
        if use_peers and hit < len(hashes) and self.worker is not None:
            if self.worker.fetch_prefix(hashes[hit:], PEER_FETCH_TIMEOUT_S):
                hit = self.storage.lookup_prefix(hashes).num_chunks
        return hit * self.chunk_size

    def lookup_async(self, tokens: TokenIds) -> tuple[int, Optional[concurrent.futures.Future]]:
        """The local hit now, and a future for the peer pull of the rest (None when there is
        nothing to pull); for schedulers that must not wait (``enable_async_loading``)."""
        hashes, hit = self._local_hit(tokens)
        future = None
        if hit < len(hashes) and self.worker is not None:
            future = self.worker.fetch_prefix_async(hashes[hit:])
        return hit * self.chunk_size, future

    # -- retrieve --------------------------------------------------------------------------------

    def retrieve(self, tokens: TokenIds, layers: Sequence[torch.Tensor], block_ids: Sequence[int],
                 max_tokens: Optional[int] = None) -> int:
        """Load the held leading chunks of ``tokens`` into ``block_ids``; returns tokens loaded."""
        t0 = time.perf_counter()
        spans = self.storage.spans(tokens)
        if max_tokens is not None:
            spans = [s for s in spans if s.end <= max_tokens]
        loaded = 0
        for span in spans:
            blocks = self._blocks(block_ids, span.start)
            chunk = self.storage.pin(span.chunk_hash) if blocks is not None else None
            if chunk is None:
                break
            with chunk:
                gpu_ops.scatter_chunk(chunk.data, layers, blocks)
            loaded += 1
        elapsed = time.perf_counter() - t0
        nbytes = loaded * self.storage.page_bytes
        logger.info("Retrieved %d out of total %d tokens. size: %.4f gb, cost %.4f ms, throughput: %.4f GB/s",
                    loaded * self.chunk_size, len(tokens), nbytes / 1e9, elapsed * 1e3,
                    nbytes / 1e9 / max(elapsed, 1e-9))
        return loaded * self.chunk_size

    # -- lifecycle -------------------------------------------------------------------------------

    def status(self) -> dict:
        return self.worker.status() if self.worker is not None else {"storage": self.storage.stats()}

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None
        self.storage.close()
