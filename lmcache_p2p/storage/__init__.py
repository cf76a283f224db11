"""Local chunk storage: the CPU page pool and tier, the disk tier, and the StorageManager."""

from lmcache_p2p.storage.cpu_tier import CpuTier, PinnedChunk
from lmcache_p2p.storage.disk_tier import DiskTier
from lmcache_p2p.storage.manager import CPU, DISK, PrefixHit, StorageEvent, StorageManager
from lmcache_p2p.storage.memory import PagePool

__all__ = [
    "CPU",
    "DISK",
    "CpuTier",
    "DiskTier",
    "PagePool",
    "PinnedChunk",
    "PrefixHit",
    "StorageEvent",
    "StorageManager",
]
