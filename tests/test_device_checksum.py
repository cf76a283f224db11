"""The device checksum of landed GPU tier pages (lmcache_p2p.device_checksum): what it must tell
apart and that both ends compute the same number for the same bytes. The requester's check of
landed pages against the holder's numbers, behind the pull, is tested with the tier
(test_gpu_tier.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from lmcache_p2p import device_checksum
from lmcache_p2p.device_checksum import device_checksums
from lmcache_p2p.storage.memory import PagePool

PAGE = 1 << 16

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on the H200 device)")


def pages(n: int, seed: int = 0, size: int = PAGE) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g) for _ in range(n)]


def test_equal_bytes_give_equal_checksums_and_every_kind_of_damage_shows():
    original = pages(3)
    sums = device_checksums(original)
    assert sums == device_checksums([p.clone() for p in original]) and len(set(sums)) == 3
    damaged = [p.clone() for p in original]
    damaged[0][12345] ^= 1  # one bit
    words = damaged[1].view(torch.int32)
    words[[7, 9]] = words[[9, 7]].clone()  # two words swapped
    damaged[2][PAGE // 2 :] = 0  # a torn write: the second half never arrived
    assert [a != b for a, b in zip(device_checksums(damaged), sums, strict=True)] == [True, True, True]
    assert device_checksums(original[::-1]) == sums[::-1]  # pages in another order: each its own


def test_version_1_is_the_same_number_in_every_build():
    """Both ends of a pull must compute one function: a change to it is a new VERSION."""
    known = torch.arange(PAGE, dtype=torch.int64).remainder(251).to(torch.uint8)
    assert device_checksum.VERSION == 1
    assert device_checksums([known, torch.zeros(PAGE, dtype=torch.uint8)]) == [204875164507, 0]
    # Pages longer than a slice are summed slice by slice: the same as in one piece.
    long = pages(1, seed=3, size=4 * device_checksum.SLICE_WORDS + 64)[0]
    weights = device_checksum.weights_for(long.numel() // 4, long.device)
    whole = int((long.view(torch.int32) * weights).sum(dtype=torch.int64)) & (2**64 - 1)
    assert device_checksums([long]) == [whole]


def test_a_page_that_is_not_whole_words_or_unlike_the_first_is_refused():
    with pytest.raises(ValueError, match="4-byte words"):
        device_checksums([torch.zeros(PAGE + 2, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="page 1: torch.uint8 of 65540 bytes"):
        device_checksums([torch.zeros(PAGE, dtype=torch.uint8), torch.zeros(PAGE + 4, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="page 0: torch.int32"):
        device_checksums([torch.zeros(PAGE // 4, dtype=torch.int32)])
    assert device_checksums([]) == []


@pytest.mark.gpu
@gpu
def test_the_gpu_computes_what_the_cpu_computes_on_real_tier_pages():
    from lmcache_p2p import kv_kernels

    assert kv_kernels.load() is not None, "the kernels must build on the GPU machine"
    page_bytes = 32 << 20
    host = pages(3, seed=1, size=page_bytes)
    for index in range(torch.cuda.device_count()):
        pool = PagePool(page_bytes, 4 * page_bytes, device=f"cuda:{index}")
        for page, data in zip([1, 2, 3], host, strict=True):
            pool.page(page).copy_(data)
        on_gpu = [pool.page(p) for p in (1, 2, 3)]
        assert device_checksums(on_gpu) == device_checksums(host)  # the kernel, 16-byte loads
        # The torch definition, run on the GPU, agrees with its kernel.
        weights = device_checksum.weights_for(page_bytes // 4, on_gpu[0].device)
        assert device_checksum._as_uint64(device_checksum._checksums(on_gpu, weights)) == device_checksums(host)
    # Pages at addresses that are not 16-byte aligned, of a size that is not: word loads.
    odd = pages(9, seed=6, size=PAGE + 4)
    flat = torch.cat([torch.zeros(4, dtype=torch.uint8)] + odd).cuda()
    shifted = [flat[4 + i * (PAGE + 4) : 4 + (i + 1) * (PAGE + 4)] for i in range(9)]
    assert device_checksums(shifted) == device_checksums(odd)
    # A page starting inside a word is refused before the launch (a misaligned load would end
    # the process's CUDA context).
    with pytest.raises(ValueError, match="page 0 starts at an address that is not a multiple of 4"):
        device_checksums([flat[1 : 1 + PAGE]])


def test_a_holder_vouches_only_for_checked_gpu_tier_copies_of_the_version_asked_for():
    from lmcache_p2p.protocol import ChunkPull
    from lmcache_p2p.vocab import CPU, GPU
    from lmcache_p2p.worker.p2p_server import PeerServer

    data = pages(2, seed=4)
    server = SimpleNamespace(me=SimpleNamespace(describe=lambda: "holder"))

    def sums(version, *pins):
        request = ChunkPull(session="s", fingerprint=0, hashes=b"", device_check=version)
        return asyncio.run(PeerServer._device_checksums(server, request, list(pins)))

    def pin(i, location=GPU, check=None, kept=None):
        return SimpleNamespace(data=data[i], location=location, check=check, device_checksum=kept)

    assert sums(device_checksum.VERSION, pin(0), pin(1)) == device_checksums(data)
    assert sums(0, pin(0), pin(1)) == []  # not asked
    assert sums(device_checksum.VERSION + 1, pin(0)) == []  # a version this build does not have
    assert sums(device_checksum.VERSION, pin(0), pin(1, location=CPU)) == []  # one sent from host memory
    assert sums(device_checksum.VERSION, pin(0), pin(1, check=object())) == []  # landed here, not checked yet
    odd = SimpleNamespace(data=torch.zeros(PAGE + 2, dtype=torch.uint8), location=GPU, check=None, device_checksum=None)
    assert sums(device_checksum.VERSION, odd) == []  # could not run: none, and the pull goes on
    # One taken behind its store is sent as kept (not recomputed); the others are computed.
    assert sums(device_checksum.VERSION, pin(0, kept=12345), pin(1)) == [12345, device_checksums(data[1:])[0]]
