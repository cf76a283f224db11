"""A checksum of chunk pages computed where they are: on the GPU for pulls that land in VRAM.

A same-host pull writes chunks into the requester's GPU tier, and the step that loads them must
know they are the holder's bytes before vLLM keeps its output. The payload checksum (XXH3,
``keys.payload_checksum``) needs the bytes in host memory: a copy across PCIe and a hash that cost
~45 ms a 10,000-token document on the H200, which the step waited for (BENCHMARKS.md, issue 21).
This one runs on the device (about a millisecond a document, estimated from the bytes it reads),
at both ends: the holder over its GPU tier copy before it writes, the requester over the landed
pages.

The page is read as 32-bit words ``x_i`` and summed as ``sum_i (x_i * w_i mod 2^32)`` in 64 bits
(exact: 2^23 words in a 32 MiB page, each term under 2^31 in magnitude), with odd weights ``w_i``
from a fixed integer mix of ``i``: a changed word changes its term (an odd weight is invertible
mod 2^32), and a word moved to another place meets another weight. It guards a transfer between
two of our processes against a wrong page, a torn or missing write and stale bytes; it is not a
cryptographic hash (peers are authenticated, issue 18). What it proves is "the holder's GPU
copy, byte for byte": the host-side XXH3 check of the chunk still runs behind the request, when
it is written back to the CPU tier.

``VERSION`` names the function on the wire (``ChunkPull.device_check``): a holder computes it only
for the version it was asked for, so two builds never compare different functions.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from lmcache_p2p import gpu_ops

VERSION = 1
SLICE_WORDS = 1 << 22  # 16 MiB of a page at a time: the products and their int64 sums stay small

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


def weights_for(words: int, device: torch.device) -> torch.Tensor:
    """The weights for pages of ``words`` 32-bit words on ``device``, made once (also to warm up
    a GPU tier before its first pull)."""
    key = (device, words)
    with _lock:
        weights = _weights.get(key)
        if weights is None:
            weights = _weights[key] = _mixed_odd_weights(words, device)
    return weights


def device_checksums(pages: Sequence[torch.Tensor]) -> list[int]:
    """One checksum per page (uint8 tensors of equal length, on any one device), as uint64 ints,
    equal for equal bytes wherever computed. On CUDA it runs on a stream of its own (not behind
    the engine's forward pass) and waits for it."""
    if not pages:
        return []
    nbytes = pages[0].numel()
    if nbytes % 4:
        raise ValueError(f"page of {nbytes} bytes: a device checksum reads 4-byte words")
    device = pages[0].device
    if device.type != "cuda":
        return _checksums(pages, weights_for(nbytes // 4, device))
    stream = gpu_ops.side_stream("checksum", device)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        sums = _checksums(pages, weights_for(nbytes // 4, device))
        stream.synchronize()
    return sums


def _checksums(pages: Sequence[torch.Tensor], weights: torch.Tensor) -> list[int]:
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
    return [int(s) & 0xFFFF_FFFF_FFFF_FFFF for s in torch.stack(sums).tolist()]
