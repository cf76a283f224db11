"""The CPU page pool: one buffer carved into fixed-size pages, one chunk payload per page.

One allocation up front (instead of one tensor per chunk) gives a hard memory cap, no
fragmentation, and a single region to register with NIXL so peers can read pages by offset.
The buffer is pinned when CUDA is present (fast, async host<->GPU copies) and plain otherwise;
plain memory is only touched as pages are written, so a large cap costs nothing until used.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

logger = logging.getLogger(__name__)


def _say_what_is_pinned(nbytes: int) -> None:
    """Pinned memory is taken from the host at once and never swapped: a pool sized for another
    host (the seeds' files ask for 100 GB) is said before it is taken, loudly past half the host."""
    try:
        host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        host_bytes = 0
    share = nbytes / host_bytes if host_bytes else 0.0
    log = logger.warning if share > 0.5 else logger.info
    log(
        "CPU pool: pinning %.1f GiB of host memory now (%.0f%% of this host's %.1f GiB); "
        "max_local_cpu_size (LMCACHE_MAX_LOCAL_CPU_SIZE) sets it",
        nbytes / 2**30,
        100 * share,
        host_bytes / 2**30,
    )


class PagePool:
    """``num_pages`` pages of ``page_bytes`` each in one uint8 buffer; thread-safe alloc/free."""

    def __init__(
        self, page_bytes: int, capacity_bytes: int, pin_memory: bool | None = None, device: torch.device | None = None
    ):
        if page_bytes <= 0:
            raise ValueError(f"page_bytes must be positive, got {page_bytes}")
        self.page_bytes = page_bytes
        self.num_pages = capacity_bytes // page_bytes
        # ``device``: the pages live there instead (the GPU tier's VRAM; always resident).
        self.device = torch.device("cpu") if device is None else torch.device(device)
        on_host = self.device.type == "cpu"
        if pin_memory is None:
            pin_memory = on_host and torch.cuda.is_available()
        self.pinned = pin_memory and on_host
        if self.pinned:
            _say_what_is_pinned(self.num_pages * page_bytes)
        if on_host:
            self.buffer = torch.empty(self.num_pages * page_bytes, dtype=torch.uint8, pin_memory=self.pinned)
        else:
            self.buffer = torch.empty(self.num_pages * page_bytes, dtype=torch.uint8, device=self.device)
        # Pop from the end: low page indices are handed out first, which keeps the touched part
        # of a plain (unpinned) buffer small when the pool is mostly empty.
        self._free = list(range(self.num_pages - 1, -1, -1))
        # Pages whose memory the OS has mapped (written once). A pinned buffer is resident from
        # the start; a pageable one is faulted in on first write (see make_resident).
        self._resident = bytearray([1 if self.pinned or not on_host else 0]) * self.num_pages
        self._lock = threading.Lock()
        logger.info(
            "%s page pool: %d pages x %.2f MiB = %.2f GiB (%s)",
            "CPU" if on_host else "GPU",
            self.num_pages,
            page_bytes / 2**20,
            self.num_pages * page_bytes / 2**30,
            ("pinned" if self.pinned else "pageable") if on_host else self.device,
        )

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self) -> int | None:
        """A free page index, or None when every page is in use."""
        with self._lock:
            return self._free.pop() if self._free else None

    def free(self, page: int) -> None:
        with self._lock:
            self._free.append(page)

    def page(self, page: int) -> torch.Tensor:
        """The page as a uint8 tensor view (no copy)."""
        start = page * self.page_bytes
        return self.buffer[start : start + self.page_bytes]

    def make_resident(self, pages) -> int:
        """Write-touch pages that were never written, before another process writes into them
        (NIXL/UCX through CMA): the fault cost is then ours, not the holder's, whose writes for
        every requester share one thread. Returns pages touched."""
        touched = 0
        for page in pages:
            if not self._resident[page]:
                self.page(page)[::4096] = 0
                self._resident[page] = 1
                touched += 1
        return touched
