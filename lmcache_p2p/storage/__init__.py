"""Local chunk storage: the page pools, the GPU, CPU and disk tiers, the chunk store protocol and
its StorageManager, and the landing of peer pulls in VRAM."""

from lmcache_p2p.storage.chunk_store import ChunkStore, PrefixHit, StorageEventQueue
from lmcache_p2p.storage.cpu_tier import CpuTier, PinnedChunk
from lmcache_p2p.storage.disk_tier import DiskTier
from lmcache_p2p.storage.gpu_tier import GpuTier
from lmcache_p2p.storage.landing import VramLanding
from lmcache_p2p.storage.manager import StorageManager
from lmcache_p2p.storage.memory import PagePool

__all__ = [
    "ChunkStore",
    "CpuTier",
    "DiskTier",
    "GpuTier",
    "PagePool",
    "PinnedChunk",
    "PrefixHit",
    "StorageEventQueue",
    "StorageManager",
    "VramLanding",
]
