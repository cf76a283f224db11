"""GPU staging slots for peer pulls between two processes on one host.

Measured on the H200 (BENCHMARKS.md, ``benchmarks/gpu/nixl_probe.py``): between two processes
NIXL/UCX moves GPU memory to GPU memory at 1.3-1.6 TB/s (``cuda_ipc``), host memory to host
memory at ~5 GB/s, and anything with host memory on one end and GPU memory on the other at
0.6 GB/s under every ``UCX_TLS``. So a same-host pull goes through VRAM on both ends:

    holder pool pages (pinned) --H2D ~55 GB/s--> holder send slots
        --NIXL WRITE over cuda_ipc--> requester receive slots --D2H ~55 GB/s--> requester pool pages

Each process has one VRAM buffer of page-sized slots, half for receiving (its own pulls) and
half for sending (serving peers). Two processes pulling from each other at the same time can
then never wait on slots held by their own requests.

Copies run on two threads of their own (one per direction), each on its own CUDA stream, and
return when the bytes are in place: the caller hands the slots to NIXL, or the pages to the
checksum, right after.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from lmcache_p2p.transfer.base import TransferError

logger = logging.getLogger(__name__)

# Pages; 16 to receive and 16 to send: two of the three 8-chunk requests a pull keeps in flight
# (p2p_batch_chunks x p2p_pipeline_depth). Room for all three removed the third's wait for slots
# but made pulls in vLLM on the H200 only 5% faster (BENCHMARKS.md), so the default stays at 32.
DEFAULT_SLOTS = 32


def staging_device(setting: str, engine_device: torch.device | None) -> torch.device | None:
    """Where the staging buffer lives for ``nixl_buffer_device`` (``auto``/``cuda``/``cpu``), or
    None for no staging (pulls go pool to pool)."""
    if setting == "cpu":
        return None
    if engine_device is not None and engine_device.type == "cuda":
        return engine_device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if setting == "cuda":
        raise TransferError("nixl_buffer_device is cuda but CUDA is not available here; set it to auto or cpu")
    return None


class _SlotList:
    """Free slot indices; taking waits (on the worker's loop) until some are free."""

    def __init__(self, slots: range):
        self.capacity = len(slots)
        self._free = list(reversed(slots))
        self._freed = asyncio.Event()

    @property
    def free(self) -> int:
        return len(self._free)

    async def take(self, wanted: int, timeout: float, whole: bool = False) -> list[int]:
        """``wanted`` slots when that many are free within the timeout; else as many as are free
        then (at least one, or TransferError), or with ``whole`` none at all (an empty list)."""
        wanted = max(1, min(wanted, self.capacity))
        deadline = time.monotonic() + timeout
        while len(self._free) < wanted:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._freed.clear()
            try:
                await asyncio.wait_for(self._freed.wait(), left)
            except asyncio.TimeoutError:
                break
        if whole and len(self._free) < wanted:
            return []
        if not self._free:
            raise TransferError(f"no GPU staging slot free within {timeout:.1f}s (all {self.capacity} in use)")
        n = min(wanted, len(self._free))
        taken, self._free = self._free[-n:], self._free[:-n]
        return taken

    def give(self, slots: Sequence[int]) -> None:
        self._free.extend(slots)
        self._freed.set()


class GpuStaging:
    def __init__(self, device: torch.device, page_bytes: int, size_bytes: int | None = None):
        num_slots = (size_bytes // page_bytes) if size_bytes is not None else DEFAULT_SLOTS
        if num_slots < 2:
            raise TransferError(
                f"nixl_buffer_size {size_bytes} holds {num_slots} chunk page(s) of {page_bytes} "
                f"bytes; it needs at least 2 (one to send, one to receive)"
            )
        self.device = device
        self.page_bytes = page_bytes
        self.num_slots = num_slots
        try:
            self.buffer = torch.empty(num_slots * page_bytes, dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError:
            raise TransferError(
                f"no room on {device} for {num_slots} staging pages "
                f"({num_slots * page_bytes / 2**30:.2f} GiB); lower nixl_buffer_size"
            ) from None
        half = num_slots // 2
        self.receiving = _SlotList(range(0, half))
        self.sending = _SlotList(range(half, num_slots))
        self._streams = {d: torch.cuda.Stream(device) for d in ("h2d", "d2h")}
        self._threads = {d: ThreadPoolExecutor(1, thread_name_prefix=f"lmcache-staging-{d}") for d in ("h2d", "d2h")}
        logger.info(
            "GPU staging on %s: %d slots x %.2f MiB = %.2f GiB (%d receive, %d send)",
            device,
            num_slots,
            page_bytes / 2**20,
            num_slots * page_bytes / 2**30,
            self.receiving.capacity,
            self.sending.capacity,
        )

    @property
    def base(self) -> int:
        return self.buffer.data_ptr()

    @property
    def device_index(self) -> int:
        return self.device.index if self.device.index is not None else torch.cuda.current_device()

    def slot(self, index: int) -> torch.Tensor:
        start = index * self.page_bytes
        return self.buffer[start : start + self.page_bytes]

    # -- copies ----------------------------------------------------------------------------------

    async def to_slots(self, pages: Sequence[torch.Tensor], slots: Sequence[int]) -> None:
        """Host pages into send slots (holder side)."""
        await self._run("h2d", [(self.slot(s), p) for p, s in zip(pages, slots, strict=True)])

    async def from_slots(self, slots: Sequence[int], pages: Sequence[torch.Tensor]) -> None:
        """Receive slots into host pages (requester side)."""
        await self._run("d2h", [(p, self.slot(s)) for s, p in zip(slots, pages, strict=True)])

    async def _run(self, direction: str, pairs: list) -> None:
        await asyncio.get_running_loop().run_in_executor(self._threads[direction], self._copy, direction, pairs)

    def _copy(self, direction: str, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        stream = self._streams[direction]
        with torch.cuda.device(self.device):
            with torch.cuda.stream(stream):
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
            stream.synchronize()

    def close(self) -> None:
        for thread in self._threads.values():
            thread.shutdown(wait=True)
