"""CacheEngine: one engine rank's KV cache service, the object the vLLM connector drives.

It works on the rank's :class:`StorageManager` (CPU and disk tiers) and, with ``enable_controller``,
a :class:`PeerService` (the rank's worker: controller link, commands, peers), both handed in by
``lmcache_p2p.worker.build_engine``: the core never imports the network side. The engine's KV
lives in paged per-layer tensors; the engine hands them in with the block ids of a request's
tokens. Prompts arrive as their chained chunk hashes, computed once per request by the caller
(``keys.chunk_hash_array``); chunk *i* covers tokens ``[i * chunk_size, (i + 1) * chunk_size)``:

* ``store_async``: gather each full chunk not held yet into a CPU page (and, with ``local_gpu``,
  a GPU tier page in the same launch) on a copy stream beside the next forward pass, admitted by
  a later ``poll_stores``;
* ``lookup_async``: what a prompt's lookup can promise without waiting for bytes: the local hit,
  then an offer of what comes after it (a live peer's, through the controller's index; else the
  remote store's, from one bounded ``exists`` round) that the load pulls beside the steps
  (``pull_offer_async``);
* ``plan_load`` / ``run_load`` / ``loaded``: what loading pinned chunks into a request's blocks
  copies (from the GPU tier's copy where there is one: device to device), the copy, and its
  account (the connector's loads beside the steps copy plans through ``layerwise``);
* ``observe_prefill``: the engine's measured forward passes, the prefill rate the worker's pull
  policy weighs a peer pull against (``lmcache_p2p.pull_policy``).

Nothing here raises into the engine for a cache problem: a failure is a shorter hit. The same
face, waited for (store, look up with the fetch, retrieve), is ``lmcache_p2p.testing.sync_engine``'s,
for the test stand-in and tests.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import deque
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from lmcache_p2p import gpu_ops
from lmcache_p2p.config import LMCacheConfig
from lmcache_p2p.durations import RecentDurations
from lmcache_p2p.keys import ChunkHashes, LayoutFingerprint, hash_list
from lmcache_p2p.miss_reasons import (
    NEVER_STORED,
    NOT_HELD,
    EvictionMemory,
    Miss,
    MissTally,
)
from lmcache_p2p.peer_service import EngineCounters, Landed, Offer, PeerService
from lmcache_p2p.pull_policy import PrefillRate
from lmcache_p2p.remote.offers import RemoteOffer, RemoteOffers
from lmcache_p2p.storage.manager import StorageManager
from lmcache_p2p.vocab import (
    CPU,
    DISK,
    GPU,
    OFFER_TIMEOUT_S,
    SOURCE_DEVICE,
    SOURCE_DISK,
    SOURCE_HOST,
)

logger = logging.getLogger(__name__)

_SOURCE_OF_LOCATION = {GPU: SOURCE_DEVICE, CPU: SOURCE_HOST, DISK: SOURCE_DISK}


class CacheEngine:
    """One rank's engine over ``storage`` and, when the controller is on, ``peers``; ``counters``
    are shared with ``peers``, which report them. Build it with ``lmcache_p2p.worker.build_engine``,
    which validates the configuration against the layout before anything is allocated."""

    def __init__(
        self,
        config: LMCacheConfig,
        layout: LayoutFingerprint,
        storage: StorageManager,
        rank: int = 0,
        peers: PeerService | None = None,
        counters: EngineCounters | None = None,
    ):
        self.config = config
        self.layout = layout
        self.rank = rank
        self.chunk_size = config.chunk_size
        self.blocks_per_chunk = config.chunk_size // layout.block_size
        self.storage = storage
        self.peers = peers
        if counters is None:
            counters = EngineCounters(
                prefill=PrefillRate.for_engine(config.prefill_tokens_per_s, "cpu", self.chunk_size)
            )
        self.counters = counters  # shared with the peers' reports and their pull policy
        self._pending: deque[_PendingStore] = deque()  # store_async copies in flight, oldest first
        # The remote store's exists rounds and fetches: several threads, so one slow round does not
        # queue every other request's fetch.
        # The remote store's offers and their fetches (on threads of their own).
        self.remote_offers = RemoteOffers(storage.remote, storage) if storage.remote is not None else None
        # Every missed chunk's reason (miss_reasons), and this rank's evictions to tell an
        # evicted chunk from one never stored: read from the store's event queue at each lookup.
        self.load_durations = RecentDurations()  # each load's copy time (a latency histogram)
        self.misses = MissTally(f"rank {rank}")
        self._evictions = EvictionMemory(storage.record_events())

    # -- store -----------------------------------------------------------------------------------

    def store_async(
        self,
        chunk_hashes: ChunkHashes,
        layers: Sequence[torch.Tensor],
        block_ids: Sequence[int],
        owner: str = "",
        num_tokens: int | None = None,
    ) -> int:
        """:meth:`store` without waiting for the copy (the engine's store path on a GPU): the
        chunks are gathered on a copy stream beside the next forward pass and indexed by a later
        :meth:`poll_stores` once the copy is done. The caller keeps ``block_ids`` unchanged until
        then (:meth:`stores_pending` for ``owner`` says when). Returns the chunks launched."""
        batch = self._reserve(chunk_hashes, block_ids)
        if not batch:
            return 0
        t0 = time.perf_counter()
        try:
            copy = gpu_ops.gather_chunks_async(layers, *_gather_targets(batch), max_ctas=self.config.store_ctas)
        except BaseException:
            self._abandon(batch)
            raise
        num_tokens = self._prompt_tokens(chunk_hashes, num_tokens)
        if copy is None:  # copied already (no CUDA here)
            self._commit(batch, num_tokens)
        else:
            self._pending.append(_PendingStore(copy, batch, owner, num_tokens, t0))
        return len(batch)

    def poll_stores(self, wait: bool = False) -> int:
        """Index the stores whose copies are done (all of them, with ``wait``), in launch order;
        returns the tokens stored."""
        stored = 0
        while self._pending and (wait or self._pending[0].copy.done()):
            pending = self._pending.popleft()
            if wait:
                pending.copy.wait()
            stored += self._commit(pending.batch, pending.num_tokens, pending.launched)
        return stored

    def stores_pending(self, owner: str) -> bool:
        return any(p.owner == owner for p in self._pending)

    def order_stores_before(self, stream: torch.cuda.Stream, blocks: AbstractSet[int] | None = None) -> None:
        """Make work queued on ``stream`` from now on wait (on the device) for every store copy
        in flight: blocks about to be reused must be read first. With ``blocks`` (the blocks that
        work writes), only for the copies reading any of them: a copy reads its own chunks'
        blocks and writes only its reserved pages, so the others cannot see that work."""
        for pending in self._pending:
            if blocks is None or any(not blocks.isdisjoint(chunk.blocks) for chunk in pending.batch):
                pending.copy.order_before(stream)

    def _reserve(self, chunk_hashes: ChunkHashes, block_ids: Sequence[int]) -> list[_ReservedChunk]:
        """A page for every chunk not held yet (or on its way), so a store is one gather."""
        on_the_way = {c.chunk_hash for pending in self._pending for c in pending.batch}
        batch = []
        for index, chunk_hash in enumerate(hash_list(chunk_hashes)):
            if self.storage.location_of(chunk_hash) is not None or chunk_hash in on_the_way:
                continue
            blocks = self._blocks(block_ids, index * self.chunk_size)
            if blocks is None:
                break
            reserved = self.storage.reserve_page()
            if reserved is None:
                break  # every page pinned: nothing more can be stored now
            # The GPU tier's copy, when it has a page to spare (none: the chunk is in the CPU tier only).
            gpu_page, gpu_data = self.storage.reserve_gpu_page() or (None, None)
            batch.append(_ReservedChunk(chunk_hash, blocks, *reserved, gpu_page, gpu_data))
        return batch

    def _prompt_tokens(self, chunk_hashes: ChunkHashes, num_tokens: int | None) -> int:
        """The prompt length a log line reports: as given, else the chunks' tokens."""
        return len(chunk_hashes) * self.chunk_size if num_tokens is None else num_tokens

    def _abandon(self, batch: list[_ReservedChunk]) -> None:
        for chunk in batch:
            self.storage.abandon_page(chunk.page)
            if chunk.gpu_page is not None:
                self.storage.abandon_gpu_page(chunk.gpu_page)

    def _commit(self, batch: list[_ReservedChunk], num_tokens: int, launched: float | None = None) -> int:
        """Index a gathered batch; ``launched`` is when an asynchronous copy of it started."""
        stored = sum(self.chunk_size for c in batch if self.storage.commit_page(c.chunk_hash, c.page))
        # After the CPU tier: the GPU tier copies what it holds.
        in_gpu_tier = [
            c.chunk_hash
            for c in batch
            if c.gpu_page is not None and self.storage.commit_gpu_page(c.chunk_hash, c.gpu_page)
        ]
        self.storage.keep_device_checksums(in_gpu_tier)
        self.counters.stored_tokens += stored
        self._evictions.note()
        took = (
            ""
            if launched is None
            else f" (copied in {(time.perf_counter() - launched) * 1e3:.1f} ms beside the forward pass)"
        )
        logger.log(
            logging.INFO if stored else logging.DEBUG,
            "Storing KV cache for %d out of %d tokens%s",
            stored,
            num_tokens,
            took,
        )
        return stored

    def _blocks(self, block_ids: Sequence[int], start: int) -> list[int] | None:
        first = start // self.layout.block_size
        blocks = list(block_ids[first : first + self.blocks_per_chunk])
        return blocks if len(blocks) == self.blocks_per_chunk else None

    # -- lookup ----------------------------------------------------------------------------------

    def count_lookup(
        self, num_tokens: int, hit_tokens: int, miss: Miss | None = None, count_misses: bool = True
    ) -> None:
        """One prompt looked up and what was found (local tiers or peers), once per request:
        the totals the controller's dashboard turns into a hit ratio; the prompt's full chunks
        past the hit are counted as missed for ``miss`` (default: never_stored)."""
        self.counters.lookups += 1
        self.counters.lookup_tokens += num_tokens
        self.counters.hit_tokens += hit_tokens
        if not count_misses:
            return
        prompt_chunks, hit_chunks = num_tokens // self.chunk_size, hit_tokens // self.chunk_size
        self.misses.count(prompt_chunks - hit_chunks, miss or Miss(NEVER_STORED), prompt_chunks, hit_chunks)

    def local_miss(self, chunk_hash: int) -> Miss:
        """Why this rank lacks ``chunk_hash`` when no live peer holds it: evicted here (from
        which tier, when), or never stored."""
        return self._evictions.miss_for(chunk_hash)

    def _miss_after(self, hashes: list[int], at: int, miss: Miss) -> Miss:
        """``miss`` for chunk ``at`` of ``hashes``, with ``not_held`` told apart here (the
        controller's detail kept for a chunk never stored: who can never share with us)."""
        if miss.reason != NOT_HELD:
            return miss
        here = self.local_miss(hashes[at])
        return Miss(NEVER_STORED, miss.detail) if here.reason == NEVER_STORED and miss.detail else here

    def lookup_async(
        self, chunk_hashes: ChunkHashes, offer_timeout: float = OFFER_TIMEOUT_S, exists_timeout: float | None = None
    ) -> PrefixLookup:
        """What a prompt's lookup can promise without waiting for bytes: the local hit, as the
        source of each leading chunk held here (``vocab``'s hit sources); after it, an offer the
        load pulls beside the engine's steps: the chunks a live peer offers (the controller's
        holders and the pull policy's decision; the controller given ``offer_timeout``), else the
        chunks the remote store holds (one ``exists`` round, given ``exists_timeout``, by default
        :meth:`remote.offers.ExistsRounds.deadline`). The caller counts the lookup (:meth:`count_lookup`) once
        its hit is final."""
        hashes = hash_list(chunk_hashes)
        sources = self.local_sources(hashes)
        hit = len(sources)
        if hit == len(hashes):
            return PrefixLookup(sources)
        miss = Miss(NOT_HELD)
        if self.peers is not None:
            answer = self.peers.offer_prefix(hashes[hit:], offer_timeout)
            if not isinstance(answer, Miss):
                then = answer.then
                after = hit + answer.chunks
                return PrefixLookup(
                    sources, offer=answer, miss=None if then is None else self._miss_after(hashes, after, then)
                )
            miss = answer
        miss = self._miss_after(hashes, hit, miss)
        if self.remote_offers is None:
            return PrefixLookup(sources, miss=miss)
        remote = self.remote_offers.offer(hashes[hit:], exists_timeout)
        if isinstance(remote, Miss):  # not held there either: the peers' reason stands
            return PrefixLookup(sources, miss=miss if remote.reason == NOT_HELD else remote)
        then = remote.then and self._miss_after(hashes, hit + remote.chunks, remote.then)
        return PrefixLookup(sources, offer=remote, miss=then)

    def pull_offer_async(self, offer: Offer, on_landed: Landed | None = None) -> concurrent.futures.Future:
        """Start pulling what a lookup's offer promised (a peer's, or the remote store's); the
        future gives a :class:`PulledChunks`. ``on_landed`` is told how many leading chunks of
        the offer are held so far, after each batch (a peer's) or chunk (the store's) that
        brought some (``peer_service.Landed``)."""
        if isinstance(offer, RemoteOffer):
            assert self.remote_offers is not None  # it made the offer
            return self.remote_offers.fetch_async(offer, on_landed)
        assert self.peers is not None  # an offer came from them
        return self.peers.pull_offer_async(offer, on_landed)

    def local_sources(self, chunk_hashes: ChunkHashes) -> list[str]:
        """Each leading chunk held in the local tiers, as the hit source a load reads it from
        (the GPU tier, the CPU pool, the disk tier); the first chunk held nowhere ends the list."""
        sources = []
        for chunk_hash in hash_list(chunk_hashes):
            location = self.storage.load_location(chunk_hash)
            if location is None:
                break
            sources.append(_SOURCE_OF_LOCATION[location])
        return sources

    # -- retrieve --------------------------------------------------------------------------------

    def pin_prefix(self, chunk_hashes: ChunkHashes, max_tokens: int | None = None) -> PinnedPrefix:
        """Hold the leading chunks of ``chunk_hashes`` the local tiers have (those starting
        before ``max_tokens``) against eviction until released: what a lookup promised stays
        loadable."""
        chunks = []
        for index, chunk_hash in enumerate(hash_list(chunk_hashes)):
            if max_tokens is not None and index * self.chunk_size >= max_tokens:
                break
            chunk = self.storage.pin(chunk_hash, gpu=True)  # loads copy on the device
            if chunk is None:
                break
            chunks.append(chunk)
        return PinnedPrefix(chunks, self.chunk_size)

    def plan_load(
        self,
        prefix: PinnedPrefix,
        block_ids: Sequence[int],
        start: int = 0,
        end: int | None = None,
        total_tokens: int | None = None,
    ) -> LoadPlan:
        """What loading the pinned chunks covering tokens ``[start, end)`` into ``block_ids`` (the
        request's blocks from token 0) copies. Blocks before ``start`` are left alone: the engine
        computed them already."""
        end = prefix.num_tokens if end is None else min(end, prefix.num_tokens)
        block_size = self.layout.block_size
        start -= start % block_size
        plan = LoadPlan(start=start, loaded_to=start, total_tokens=total_tokens if total_tokens is not None else end)
        for index in range(start // self.chunk_size, -(-end // self.chunk_size)):
            chunk_start = index * self.chunk_size
            blocks = self._blocks(block_ids, chunk_start)
            if blocks is None:
                break
            skip = (max(start, chunk_start) - chunk_start) // block_size
            chunk = prefix.chunks[index]
            plan.pages.append(chunk.data)
            if chunk.location == GPU:
                plan.from_gpu += 1
                if chunk.check is not None:  # landed from a peer, its checksum not checked when pinned
                    plan.unchecked.append((chunk_start, chunk.key.chunk_hash, chunk.check))
            plan.chunk_blocks.append(blocks)
            plan.skips.append(skip)
            plan.nbytes += self.storage.page_bytes * (len(blocks) - skip) // len(blocks)
            plan.loaded_to = min(chunk_start + self.chunk_size, end)
        return plan

    def run_load(self, plan: LoadPlan, layers: Sequence[torch.Tensor]) -> None:
        """Copy a planned load into ``layers`` (every layer, one batch, done when this returns)."""
        t0 = time.perf_counter()
        gpu_ops.scatter_chunks(plan.pages, layers, plan.chunk_blocks, plan.skips)
        self.loaded(plan, time.perf_counter() - t0)

    def first_bad_chunk(self, plan: LoadPlan, deadline: float) -> int | None:
        """Where the first chunk of a load that landed in VRAM unchecked starts, if its check (on
        the device, or its write-back's) found its checksum wrong, could not run, or did not
        finish by ``deadline`` (time.monotonic); None when every such chunk is good (or there
        were none)."""
        for start, chunk_hash, check in plan.unchecked:
            try:
                bad = check.result(max(0.0, deadline - time.monotonic()))
            except Exception:  # not finished in time, or the write-back failed: not known good
                return start
            if chunk_hash in bad:
                return start
        return None

    def loaded(self, plan: LoadPlan, seconds: float, how: str = "") -> None:
        """Count and log a finished load (the seed's line, with where its chunks came from)."""
        self.counters.retrieved_tokens += plan.loaded_to - plan.start
        self.counters.retrieves += 1
        self.load_durations.add(seconds * 1e3)
        notes = [how] if how else []
        if plan.from_gpu:
            notes.append(f"{plan.from_gpu} of {len(plan.pages)} chunks from the GPU tier")
        logger.info(
            "Retrieved %d out of total %d tokens. size: %.4f gb, cost %.4f ms, throughput: %.4f GB/s%s",
            plan.loaded_to - plan.start,
            plan.total_tokens,
            plan.nbytes / 1e9,
            seconds * 1e3,
            plan.nbytes / 1e9 / max(seconds, 1e-9),
            f" ({'; '.join(notes)})" if notes else "",
        )

    # -- prefill rate ----------------------------------------------------------------------------

    def observe_prefill(self, tokens: int, seconds: float, prefill_tokens: int | None = None) -> bool:
        """The engine computed ``tokens`` in one forward pass of ``seconds``, ``prefill_tokens`` of
        them prompt tokens (default: all). Steps that prefill less than a chunk do not count
        (``PrefillRate.min_tokens``); returns whether this one did."""
        counted = self.counters.prefill.observe(tokens, seconds, prefill_tokens)
        if counted:
            logger.debug(
                "prefill step: %d tokens (%s prompt) in %.1f ms; rate now %s",
                tokens,
                tokens if prefill_tokens is None else prefill_tokens,
                seconds * 1e3,
                self.counters.prefill.describe(),
            )
        return counted

    def note_adapter(self, name: str, lora_id: str) -> None:
        """The engine served LoRA adapter ``name`` with ``lora_id``: its controllers learn it, so
        that they key requests naming the adapter as this engine does (no peers: nobody to tell)."""
        if self.peers is not None:
            self.peers.note_adapter(name, lora_id)

    # -- lifecycle -------------------------------------------------------------------------------

    def status(self) -> dict:
        out = self.peers.status() if self.peers is not None else {"storage": self.storage.stats()}
        out["engine"] = self.counters.totals()
        out["engine"]["missed_chunks"] = self.misses.totals()
        out["engine"]["load_ms"] = self.load_durations.snapshot()
        out["prefill"] = self.counters.prefill.snapshot()
        return out

    def flush(self, timeout: float = 30.0) -> None:
        """Wait for disk write-behind and for the peers side to send its queued admit/evict reports."""
        self.storage.flush(timeout)
        if self.peers is not None:
            self.peers.flush()

    def close(self) -> None:
        self.poll_stores(wait=True)
        if self.remote_offers is not None:
            self.remote_offers.close()
        if self.peers is not None:
            self.peers.close()
            self.peers = None
        self.storage.close()


@dataclass
class PrefixLookup:
    """A lookup's first answer (:meth:`CacheEngine.lookup_async`): the local hit's sources, and
    after it an offer (a peer's or the remote store's) that the load pulls."""

    sources: list[str]
    offer: Offer | None = None
    # Why the first chunk past the local hit and the offer cannot be served (miss_reasons);
    # None when they cover the prompt.
    miss: Miss | None = None


@dataclass
class LoadPlan:
    """One load: each chunk's page, the blocks it goes to and how many of them the engine computed
    already (``skips``), and the tokens ``[start, loaded_to)`` it covers."""

    start: int
    loaded_to: int
    total_tokens: int  # the prompt's length, for the log
    pages: list[torch.Tensor] = field(default_factory=list)
    chunk_blocks: list[list[int]] = field(default_factory=list)
    skips: list[int] = field(default_factory=list)
    nbytes: int = 0
    from_gpu: int = 0  # chunks whose page is the GPU tier's (copied device to device)
    # Of those, chunks a peer wrote there whose check still ran when pinned: (first token, hash,
    # the check's future). The engine's output from them stands only once it says good.
    unchecked: list[tuple[int, int, concurrent.futures.Future]] = field(default_factory=list)

    def written_blocks(self) -> frozenset[int]:
        """The blocks this load writes (each chunk's, past those the engine computed already)."""
        return frozenset(b for blocks, skip in zip(self.chunk_blocks, self.skips, strict=True) for b in blocks[skip:])


class _ReservedChunk(NamedTuple):
    """A chunk a store will gather: its blocks in the engine's cache and the pool page reserved for it."""

    chunk_hash: int
    blocks: list[int]
    page: int
    data: torch.Tensor
    gpu_page: int | None = None  # the GPU tier's copy (local_gpu), gathered in the same launch
    gpu_data: torch.Tensor | None = None


def _gather_targets(batch: list[_ReservedChunk]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Block ids and pages for one gather of ``batch``: every chunk into its CPU page, and those
    with a GPU tier page into that too."""
    mirrored = [c for c in batch if c.gpu_data is not None]
    blocks = [c.blocks for c in batch] + [c.blocks for c in mirrored]
    pages = [c.data for c in batch] + [c.gpu_data for c in mirrored if c.gpu_data is not None]
    return blocks, pages


@dataclass
class _PendingStore:
    copy: gpu_ops.PendingCopy
    batch: list[_ReservedChunk]
    owner: str
    num_tokens: int
    launched: float


class PinnedPrefix:
    """The leading chunks of a prompt held in the local tiers, pinned until :meth:`release`."""

    def __init__(self, chunks: list, chunk_size: int):
        self.chunks = chunks
        self.chunk_size = chunk_size
        self.num_tokens = len(chunks) * chunk_size

    def host_until(self) -> int:
        """Where the last chunk held in host memory (not on a GPU) ends, in tokens; 0: none is."""
        for index in range(len(self.chunks) - 1, -1, -1):
            if not self.chunks[index].data.is_cuda:
                return (index + 1) * self.chunk_size
        return 0

    def release(self) -> None:
        chunks, self.chunks = self.chunks, []
        for chunk in chunks:
            chunk.release()

    def __enter__(self) -> PinnedPrefix:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
