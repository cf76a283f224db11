"""A checksum of chunk pages computed where they are: on the GPU for pulls that land in VRAM.

A same-host pull writes chunks into the requester's GPU tier, and the step that loads them must
know they are the holder's bytes before vLLM keeps its output. The payload checksum (XXH3,
``keys.payload_checksum``) needs the bytes in host memory: a copy across PCIe and a hash that cost
~45 ms a 10,000-token document on the H200, which the step waited for (BENCHMARKS.md, issue 21).
This one runs on the device, at both ends: the holder over its GPU tier copy (taken behind the
store, or before it writes one that landed there from a peer), the requester over the landed pages.

The page is read as 32-bit words ``x_i`` and summed as ``sum_i (x_i * w_i mod 2^32)`` in 64 bits
(exact: 2^23 words in a 32 MiB page, each term under 2^31 in magnitude), with odd weights ``w_i``
from a fixed integer mix of ``i``: a changed word changes its term (an odd weight is invertible
mod 2^32), and a word moved to another place meets another weight. It guards a transfer between
two of our processes against a wrong page, a torn or missing write and stale bytes; it is not a
cryptographic hash (peers are authenticated, issue 18). What it proves is "the holder's GPU
copy, byte for byte": the host-side XXH3 check of the chunk still runs behind the request, when
it is written back to the CPU tier.

On CUDA a batch of pages is one launch of csrc/page_checksum.cu (``kv_kernels``), which makes
the weights in registers and reads each page once. The torch code below is the definition, the
path on CPUs and the fallback where the kernels are not built: a few launches per 16 MiB slice
and a weight table to read, which on the H200 beside two engines cost 25-50 ms a 1.3 GB document
(BENCHMARKS.md, issue 21), where the kernel should take about what HBM needs to read it.

``VERSION`` names the function on the wire (``ChunkPull.device_check``): a holder computes it only
for the version it was asked for, so two builds never compare different functions.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence

import torch

from lmcache_p2p import gpu_ops, kv_kernels

VERSION = 1
SLICE_WORDS = 1 << 22  # 16 MiB of a page at a time: the products and their int64 sums stay small
# The kernel's CTAs per page: a batch of 8 pages is 256 CTAs, about two per SM on an H200; each
# reads its share of the page at full rate, and the launch leaves no SM busy for long beside
# the engine's forward pass.
CTAS_PER_PAGE = 32
_U64 = (1 << 64) - 1

_weights: dict[tuple[torch.device, int], torch.Tensor] = {}
_lock = threading.Lock()


def _mixed_odd_weights(words: int, device: torch.device) -> torch.Tensor:
    """Version 1's weights: a multiplicative hash of the word index, odd, as int32 (two's
    complement). Integer arithmetic only, so every build and device draws the same ones. Made
    on the host and copied (a pageable copy returns when done), so any stream may read them."""
    h = torch.arange(words, dtype=torch.int64) * 2654435761  # < 2^55: exact
    h = h ^ (h >> 15)
    h = (h * 2246822519) & 0xFFFF_FFFF  # wraps in int64; the low 32 bits are exact
    h = h | 1
    return torch.where(h >= 2**31, h - 2**32, h).to(torch.int32).to(device)


def prepare(page_bytes: int, device: torch.device) -> None:
    """Make ready what a first check of ``page_bytes`` pages on ``device`` needs (the kernels, or
    the weights where they are not built), so that the first pull does not wait for it."""
    if device.type == "cuda" and kv_kernels.load() is not None:
        return
    weights_for(page_bytes // 4, device)


def weights_for(words: int, device: torch.device) -> torch.Tensor:
    """The weights for pages of ``words`` 32-bit words on ``device``, made once."""
    key = (device, words)
    with _lock:
        weights = _weights.get(key)
        if weights is None:
            weights = _weights[key] = _mixed_odd_weights(words, device)
    return weights


def device_checksums(pages: Sequence[torch.Tensor], timing: dict[str, float] | None = None) -> list[int]:
    """One checksum per page (uint8 tensors of equal length, on any one device), as uint64 ints,
    equal for equal bytes wherever computed. On CUDA it runs on a stream of its own (not behind
    the engine's forward pass), reads its result back on that stream, and waits for it; with
    ``timing`` it sets ``gpu_ms``, the time the checksum stream spent on the launch (sharing the
    GPU with whatever else runs, and the stream with other threads' checksums queued meanwhile),
    and ``wait_ms``, the host's time blocked on the stream (the GPU's part and any wait to get
    onto it)."""
    if not pages:
        return []
    nbytes = pages[0].numel()
    if nbytes % 4:
        raise ValueError(f"page of {nbytes} bytes: a device checksum reads 4-byte words")
    device = pages[0].device
    for i, page in enumerate(pages):
        if page.dtype != torch.uint8 or page.numel() != nbytes or page.device != device or not page.is_contiguous():
            raise ValueError(
                f"page {i}: {page.dtype} of {page.numel()} bytes on {page.device} (contiguous:"
                f" {page.is_contiguous()}); expected contiguous uint8 of {nbytes} bytes on {device}"
            )
    if nbytes == 0:
        return [0] * len(pages)
    if device.type != "cuda":
        return _as_uint64(_checksums(pages, weights_for(nbytes // 4, device)))
    # The kernel reads whole words: a view that starts inside a word would be a misaligned load,
    # an error that ends the process's CUDA context (the engine's), not just this call.
    unaligned = next((i for i, page in enumerate(pages) if page.data_ptr() % 4), None)
    if unaligned is not None:
        raise ValueError(f"page {unaligned} starts at an address that is not a multiple of 4 bytes")
    kernels = kv_kernels.load()
    stream = gpu_ops.side_stream("checksum", device)
    # Timed only when asked: two CUDA events around the launch.
    around = (
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if timing is not None else None
    )
    with torch.cuda.device(device), torch.cuda.stream(stream):
        if kernels is not None:
            sums = _checksums_by_kernel(kernels, pages, nbytes, device, around)
        else:
            with _between(around):
                sums = _checksums(pages, weights_for(nbytes // 4, device))
        # Read back on this stream too: a copy on the thread's default stream would be ordered
        # after whatever the engine queued there.
        host = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
        host.copy_(sums, non_blocking=True)
        t0 = time.perf_counter()
        stream.synchronize()
    if timing is not None and around is not None:
        timing["wait_ms"] = (time.perf_counter() - t0) * 1e3
        timing["gpu_ms"] = around[0].elapsed_time(around[1])
    return _as_uint64(host)


@contextlib.contextmanager
def _between(around: tuple | None) -> Iterator[None]:
    """Record ``around``'s two CUDA events on the current stream before and after the block."""
    if around is not None:
        around[0].record()
    yield
    if around is not None:
        around[1].record()


def _as_uint64(sums: torch.Tensor) -> list[int]:
    return [int(s) & _U64 for s in sums.tolist()]


def _checksums_by_kernel(
    kernels, pages: Sequence[torch.Tensor], nbytes: int, device: torch.device, around: tuple | None = None
) -> torch.Tensor:
    """One launch on the current stream; ``around``'s two CUDA events, if given, are recorded on
    either side of it (after its inputs are in place)."""
    addresses = [page.data_ptr() for page in pages]
    # 16-byte loads where every page allows them (tier pages do: whole pages of a 16-aligned pool).
    vec_bytes = 16 if nbytes % 16 == 0 and all(a % 16 == 0 for a in addresses) else 4
    page_ptrs = torch.tensor(addresses, dtype=torch.int64).to(device)
    out = torch.empty(len(pages), dtype=torch.int64, device=device)
    with _between(around):
        kernels.page_checksums(page_ptrs, nbytes, vec_bytes, CTAS_PER_PAGE, out)
    return out  # int64 sums, still being computed on the current stream


def _checksums(pages: Sequence[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    words = weights.numel()
    sums = []
    for page in pages:
        page_words = page.view(torch.int32)
        total = torch.zeros((), dtype=torch.int64, device=page.device)
        for start in range(0, words, SLICE_WORDS):
            end = min(start + SLICE_WORDS, words)
            # int32 products wrap mod 2^32 (two's complement, on CPU and CUDA alike); sums exact.
            total += (page_words[start:end] * weights[start:end]).sum(dtype=torch.int64)
        sums.append(total)
    return torch.stack(sums)  # int64, wrapped sums
