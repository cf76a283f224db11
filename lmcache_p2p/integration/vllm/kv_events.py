"""Our tiers in vLLM's KV cache events (``--kv-events-config``), so routers that read the engine's
event stream (vllm-router's ``kv_aware``, llm-d's indexer) count the chunks we hold in CPU memory
and on disk, not only the GPU prefix cache, without talking to our controller.

The path through vLLM's connector interface:

1. each rank's worker side reads its tiers' admits and evicts from a queue of its own
   (``StorageManager.record_events``) and hands them over after every step as
   :class:`ChunkStorageEvents` (``get_kv_connector_kv_cache_events``); vLLM merges the ranks'
   objects into one;
2. the scheduler side (``update_connector_output``) turns them into ``BlockStored`` /
   ``BlockRemoved`` events with the tier's medium; vLLM's scheduler publishes them with its own
   (``take_events``).

A chunk is ours by its chained hash; routers know blocks by vLLM's block hashes and the tokens
they hold. :class:`BlockEventMapper` remembers, for every full chunk of every prompt the scheduler
saw, its blocks' hashes (as vLLM publishes them for the GPU cache: ``maybe_convert_block_hash``),
the hash of the block before it and its tokens, so a chunk's event names the same blocks the
engine's own GPU events do (one event per chunk, ``chunk_size / block_size`` blocks). With TP, a
chunk is stored for the instance once *every* rank admitted its share, and gone once *any* rank
evicted it: a router must not send a prompt for KV the engine can only half load.
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents

from lmcache_p2p.integration.vllm import compat
from lmcache_p2p.vocab import CPU, DISK

if TYPE_CHECKING:  # a type only: the scheduler half imports this module, and loads no storage (torch)
    from lmcache_p2p.storage.chunk_store import StorageEventQueue

logger = logging.getLogger(__name__)

# vLLM's names for where a block lives (vllm.distributed.kv_events.MEDIUM_*), by our location.
MEDIUM_BY_LOCATION = {CPU: "CPU", DISK: "STORAGE"}
# Chunks whose blocks the scheduler remembers: past this the least recently seen are forgotten
# (a stored one published as removed: we could not name its blocks when it leaves), and a later
# event for one of them is dropped (counted). A chunk of 256 tokens costs about 2 KB (its token
# ids as int32, 2 to 16 block hashes): 65,536 of them, 16.8M tokens of prompts, about 130 MB.
MAX_REMEMBERED_CHUNKS = 65_536

ChunkEvent = tuple[str, str, int]  # (kind "admit" | "evict", location, chunk hash)


class ChunkStorageEvents(KVConnectorKVEvents):
    """One step's admits and evicts from the ranks' tiers, in order: the carrier vLLM moves from
    the workers to the scheduler and merges over ranks (``add_events`` + ``increment_workers``).
    Counting ranks per chunk is the scheduler side's job (:class:`BlockEventMapper`): a rank's
    admit may come a step before another's."""

    def __init__(self, events: list[ChunkEvent] | None = None, rank: int = 0):
        self.events: list[tuple[int, str, str, int]] = [(rank, *e) for e in events or []]
        self.workers = 1

    def add_events(self, events: list[Any]) -> None:
        self.events.extend(events)

    def aggregate(self) -> ChunkStorageEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self.workers += count

    def get_all_events(self) -> list[Any]:
        return self.events

    def get_number_of_workers(self) -> int:
        return self.workers

    def clear_events(self) -> None:
        self.events = []
        self.workers = 1


class StorageEventBuffer:
    """The worker side's reader of its tiers' events: the store queues them as they happen (the
    engine's thread, the disk writer's), this takes them after each step, on vLLM's thread."""

    def __init__(self, rank: int, queue: StorageEventQueue):
        self.rank = rank
        self.queue = queue

    def take(self) -> ChunkStorageEvents | None:
        events: list[ChunkEvent] = [
            (e.kind, e.location, e.key.chunk_hash) for e in self.queue.take_events() if e.location in MEDIUM_BY_LOCATION
        ]
        return ChunkStorageEvents(events, self.rank) if events else None


@dataclass(slots=True)
class _ChunkBlocks:
    block_hashes: list[Any]  # vLLM's external block hashes of the chunk's blocks
    parent: Any  # the block before the chunk's first (None for the prompt's first chunk)
    token_ids: array  # int32: a tenth of a list's memory; a list again only in a published event
    published: set[str]  # locations a BlockStored went out for (a BlockRemoved is owed on evict)


class BlockEventMapper:
    """Chunk events to vLLM block events. Used on the scheduler's thread only."""

    def __init__(self, chunk_size: int, block_size: int, tp_size: int, max_chunks: int = MAX_REMEMBERED_CHUNKS):
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        self._convert = maybe_convert_block_hash
        self.chunk_size, self.block_size, self.tp_size = chunk_size, block_size, tp_size
        self.blocks_per_chunk = chunk_size // block_size
        self.max_chunks = max_chunks
        self._chunks: OrderedDict[int, _ChunkBlocks] = OrderedDict()
        self._admitted: dict[tuple[str, int], set[int]] = {}  # (location, chunk) -> ranks holding it
        self._events: list[KVCacheEvent] = []
        self._stored_fields = set(getattr(BlockStored, "__struct_fields__", ()))
        self._removed_fields = set(getattr(BlockRemoved, "__struct_fields__", ()))
        self.stats = {"stored": 0, "removed": 0, "unknown_chunk": 0, "no_block_hashes": 0}

    def remember(self, chunk_hashes: Sequence[int], request: Any) -> None:
        """The blocks of a prompt's full chunks, from the request vLLM hashed into blocks (it does
        with prefix caching on, the default)."""
        block_hashes = getattr(request, "block_hashes", None) or ()
        if len(block_hashes) < len(chunk_hashes) * self.blocks_per_chunk:
            self.stats["no_block_hashes"] += 1
            if self.stats["no_block_hashes"] == 1:
                logger.warning(
                    "KV events: request %s has %d block hashes for %d chunks (prefix caching off?): its chunks "
                    "are not published",
                    getattr(request, "request_id", "?"),
                    len(block_hashes),
                    len(chunk_hashes),
                )
            return
        tokens = compat.prompt_tokens(request.prompt_token_ids)  # a list, or vLLM 0.34's TokenBuffer
        per = self.blocks_per_chunk
        for i, chunk_hash in enumerate(chunk_hashes):
            key = int(chunk_hash)
            known = self._chunks.get(key)
            if known is not None:
                self._chunks.move_to_end(key)
                continue
            first = i * per
            self._chunks[key] = _ChunkBlocks(
                block_hashes=[self._convert(h) for h in block_hashes[first : first + per]],
                parent=self._convert(block_hashes[first - 1]) if first else None,
                token_ids=array("i", tokens[i * self.chunk_size : (i + 1) * self.chunk_size].tobytes()),
                published=set(),
            )
        while len(self._chunks) > self.max_chunks:
            _, forgotten = self._chunks.popitem(last=False)
            for location in list(forgotten.published):
                self._remove(location, forgotten)

    def take_rank_events(self, carrier: ChunkStorageEvents) -> None:
        for rank, kind, location, chunk_hash in carrier.get_all_events():
            if kind == "admit":
                holders = self._admitted.setdefault((location, chunk_hash), set())
                holders.add(rank)
                if len(holders) == self.tp_size:  # held by the instance: an evict now needs `published` only
                    del self._admitted[(location, chunk_hash)]
                    self._publish_stored(location, chunk_hash)
            else:
                self._admitted.pop((location, chunk_hash), None)
                self._publish_removed(location, chunk_hash)
        if len(self._admitted) > self.max_chunks:  # some ranks' admits whose chunk no rank completed
            for key in list(self._admitted)[: len(self._admitted) // 2]:
                del self._admitted[key]

    def _publish_stored(self, location: str, chunk_hash: int) -> None:
        chunk = self._chunks.get(chunk_hash)
        if chunk is None:
            self.stats["unknown_chunk"] += 1
            return
        fields = {
            "block_hashes": chunk.block_hashes,
            "parent_block_hash": chunk.parent,
            "token_ids": chunk.token_ids.tolist(),
            "block_size": self.block_size,
            "lora_id": None,
            "medium": MEDIUM_BY_LOCATION[location],
            "lora_name": None,
            "group_idx": 0,
        }
        # Only the fields this vLLM's BlockStored has (0.25 lacks some of 0.27's).
        self._events.append(BlockStored(**{k: v for k, v in fields.items() if k in self._stored_fields}))
        chunk.published.add(location)
        self.stats["stored"] += 1

    def _publish_removed(self, location: str, chunk_hash: int) -> None:
        chunk = self._chunks.get(chunk_hash)
        if chunk is not None and location in chunk.published:
            self._remove(location, chunk)

    def _remove(self, location: str, chunk: _ChunkBlocks) -> None:
        chunk.published.discard(location)
        fields: dict[str, Any] = {
            "block_hashes": chunk.block_hashes,
            "medium": MEDIUM_BY_LOCATION[location],
            "group_idx": 0,
        }
        self._events.append(BlockRemoved(**{k: v for k, v in fields.items() if k in self._removed_fields}))
        self.stats["removed"] += 1

    def take_events(self) -> Iterable[KVCacheEvent]:
        events, self._events = self._events, []
        return events


def kv_events_enabled(vllm_config: Any) -> bool:
    """Whether this engine publishes KV cache events (``--kv-events-config`` with
    ``enable_kv_cache_events``): only then are ours worth collecting."""
    events_config = getattr(vllm_config, "kv_events_config", None)
    return bool(events_config is not None and getattr(events_config, "enable_kv_cache_events", False))
