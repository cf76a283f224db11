"""The device checksum of landed GPU tier pages (lmcache_p2p.device_checksum): what it must tell
apart, and that both ends compute the same number for the same bytes."""

from __future__ import annotations

import pytest
import torch

from lmcache_p2p.device_checksum import device_checksums

PAGE = 1 << 16

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on the H200 device)")


def pages(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=g) for _ in range(n)]


def test_equal_bytes_give_equal_checksums_and_every_kind_of_damage_shows():
    original = pages(3)
    sums = device_checksums(original)
    assert sums == device_checksums([p.clone() for p in original]) and len(set(sums)) == 3
    assert all(0 <= s < 2**64 for s in sums)
    damaged = [p.clone() for p in original]
    damaged[0][12345] ^= 1  # one bit
    words = damaged[1].view(torch.int32)
    words[[7, 9]] = words[[9, 7]].clone()  # two words swapped
    damaged[2][PAGE // 2 :] = 0  # a torn write: the second half never arrived
    assert [a != b for a, b in zip(device_checksums(damaged), sums, strict=True)] == [True, True, True]
    assert device_checksums(original[::-1]) == sums[::-1]  # pages in another order: each its own


def test_a_page_that_is_not_whole_words_is_refused():
    with pytest.raises(ValueError, match="4-byte words"):
        device_checksums([torch.zeros(PAGE + 2, dtype=torch.uint8)])
    assert device_checksums([]) == []


@pytest.mark.gpu
@gpu
def test_the_gpu_computes_what_the_cpu_computes():
    host = pages(4, seed=1)
    assert device_checksums([p.cuda() for p in host]) == device_checksums(host)
