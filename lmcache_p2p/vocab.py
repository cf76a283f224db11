"""Names shared across the package, with no imports of ours: any module may use them without
pulling in the one that happens to act on them (the controller reads location and channel names
here, not from the engine's config or storage).

Locations: the tiers a chunk is held in, by the names the controller's API and LMCache use.
Channels: how peers move KV. The storage event: what a location's owner reports when it admits
or evicts a chunk. Timeouts shared by the scheduler half and the engine.

Hit sources: where the KV of a loaded chunk came from. The values are vLLM's ``CacheHitSource``
values (``vllm:prompt_tokens_cached_by_source{source=...}``), ordered nearest the GPU first:

* ``device``: our GPU tier (a copy beside vLLM's blocks, in the same GPU);
* ``host``: our CPU pool;
* ``p2p``: pulled from a peer for this request;
* ``disk``: our disk tier;
* ``external_unspecified``: the remote store (lmcache_server, Redis).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # a type only: keys.py needs numpy and xxhash
    from lmcache_p2p.keys import ChunkKey

SOURCE_DEVICE = "device"
SOURCE_HOST = "host"
SOURCE_P2P = "p2p"
SOURCE_DISK = "disk"
SOURCE_REMOTE = "external_unspecified"
HIT_SOURCES = (SOURCE_DEVICE, SOURCE_HOST, SOURCE_P2P, SOURCE_DISK, SOURCE_REMOTE)

# Locations (LMCache's backend names; the controller API's "location" values).
CPU = "LocalCPUBackend"
DISK = "LocalDiskBackend"
GPU = "LocalGPUBackend"

# Transfer channels for peer pulls (the transfer_channel key).
TRANSFER_CHANNELS = ("nixl", "tcp")

# A peer pull request's wait for its answer, before its bytes' allowance (config p2p_pull_timeout_s's
# default); past it the request's chunks are a miss.
PULL_REQUEST_TIMEOUT_S = 2.0
# How long an engine's lookup waits for a peer prefix pull before serving what it has, and the
# deadline of a load that pulls a peer's offer (past it the request recomputes).
PEER_FETCH_TIMEOUT_S = 30.0
# How long an engine's lookup waits for the controller to name a prefix's holders (past it the
# rest is a miss): the scheduler waits on this, never on a peer's bytes.
OFFER_TIMEOUT_S = 1.0
# ... and a lookup that waits for the bytes anyway (a synchronous lookup, a blended prompt's
# segment fetch): as long as any request to the controller, so that a busy controller host
# delays that lookup instead of turning a peer's hit into a recompute.
WAITING_OFFER_TIMEOUT_S = 3.0
# The longest a lookup waits for the remote store's exists round (which chunks it holds) before
# answering without it (cache_engine.ExistsRounds sets the deadline from the usual round, below
# this): the scheduler waits on this, never on the store's bytes, which the load fetches beside
# the steps. A stopped store costs the scheduler one deadline per outage (later lookups skip the
# store until the round ends, then its backoff decides).
REMOTE_OFFER_TIMEOUT_S = 0.5


@dataclass(frozen=True, slots=True)
class StorageEvent:
    """A location admitted or evicted a chunk: queued by the chunk store, drained by its owner
    (the worker sends them to the controller, the KV-event publisher to vLLM's subscribers)."""

    kind: Literal["admit", "evict"]
    location: str  # CPU | DISK | GPU
    key: ChunkKey
