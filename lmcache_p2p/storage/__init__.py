"""Local chunk storage: the page pools, the GPU, CPU and disk tiers, and the StorageManager."""

from lmcache_p2p.storage.cpu_tier import CpuTier, PinnedChunk
from lmcache_p2p.storage.disk_tier import DiskTier
from lmcache_p2p.storage.gpu_tier import GpuTier
from lmcache_p2p.storage.manager import PrefixHit, StorageManager
from lmcache_p2p.storage.memory import PagePool

__all__ = [
    "CpuTier",
    "DiskTier",
    "GpuTier",
    "PagePool",
    "PinnedChunk",
    "PrefixHit",
    "StorageManager",
]
