"""A checksum of chunk pages computed where they are: on the GPU for pulls that land in VRAM.

A same-host pull writes chunks into the requester's GPU tier, and the step that loads them must
know they are the holder's bytes before vLLM keeps its output. The payload checksum (XXH3,
``keys.payload_checksum``) needs the bytes in host memory: a copy across PCIe and a hash that cost
~45 ms a 10,000-token document on the H200, which the step waited for (BENCHMARKS.md, issue 21).
This one runs on the device in about a millisecond a document, at both ends: the holder over its
GPU tier copy before it writes, the requester over the landed pages.

The page is read as 32-bit words ``x_i`` and summed as ``sum_i (x_i * w_i mod 2^32)`` in 64 bits
(exact: 2^23 words in a 32 MiB page, each term under 2^31 in magnitude), with fixed odd weights ``w_i``:
a changed word changes its term (an odd weight is invertible mod 2^32), and a word moved to
another place meets another weight. It guards a transfer between two of our processes against
a wrong page, a torn or missing write and stale bytes; it is not a cryptographic hash (peers
are authenticated, issue 18). The host-side XXH3 check still runs behind the request, when the
chunk is written back to the CPU tier.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

WEIGHT_SEED = 0x6C6D_6361_6368_6532  # both ends must draw the same weights: never change it

_weights: dict[tuple[torch.device, int], torch.Tensor] = {}
_weights_lock = threading.Lock()


def _weights_for(words: int, device: torch.device) -> torch.Tensor:
    key = (device, words)
    with _weights_lock:
        weights = _weights.get(key)
        if weights is None:
            drawn = np.random.default_rng(WEIGHT_SEED).integers(0, 2**32, size=words, dtype=np.uint64) | 1
            weights = torch.from_numpy(drawn.astype(np.uint32).view(np.int32)).to(device)
            _weights[key] = weights
    return weights


def device_checksums(pages: Sequence[torch.Tensor]) -> list[int]:
    """One checksum per page (uint8 tensors of equal length, on any one device), as uint64 ints,
    equal for equal bytes wherever computed. Waits for the device."""
    if not pages:
        return []
    nbytes = pages[0].numel()
    if nbytes % 4:
        raise ValueError(f"page of {nbytes} bytes: a device checksum reads 4-byte words")
    weights = _weights_for(nbytes // 4, pages[0].device)
    # int32 products wrap mod 2^32 (two's complement, on CPU and CUDA alike); the sum is exact.
    sums = torch.stack([(page.view(torch.int32) * weights).sum(dtype=torch.int64) for page in pages])
    return [int(s) & 0xFFFF_FFFF_FFFF_FFFF for s in sums.tolist()]
