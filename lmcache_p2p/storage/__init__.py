"""Local chunk storage: the page pools, the GPU, CPU and disk tiers, and the StorageManager."""

from lmcache_p2p.storage.cpu_tier import CpuTier, PinnedChunk
from lmcache_p2p.storage.disk_tier import DiskTier
from lmcache_p2p.storage.gpu_tier import GpuTier
from lmcache_p2p.storage.manager import CPU, DISK, GPU, PrefixHit, StorageEvent, StorageManager
from lmcache_p2p.storage.memory import PagePool

__all__ = [
    "CPU",
    "DISK",
    "GPU",
    "CpuTier",
    "DiskTier",
    "GpuTier",
    "PagePool",
    "PinnedChunk",
    "PrefixHit",
    "StorageEvent",
    "StorageManager",
]
