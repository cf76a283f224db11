"""KV gather/scatter between a paged cache and chunk pages (lmcache_p2p.gpu_ops).

Tests marked ``gpu`` run the CUDA kernels of csrc/ against a torch reference on the H200 device
(skipped without CUDA); the rest check the checks and the torch path, which every machine runs.
Comparisons are on raw bytes, so fp8 (and any NaN bit pattern) compares exactly."""

from __future__ import annotations

import random

import pytest
import torch

from lmcache_p2p import gpu_ops, kv_kernels

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA (runs on the H200 device)")

FP8 = [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d is not None]
DTYPES = [torch.float16, torch.bfloat16, *FP8]


def make_cache(layers: int, blocks: int, block_shape=(2, 16, 2, 64), dtype=torch.bfloat16, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        raw = torch.randint(
            0, 256, (blocks, *block_shape, torch.finfo(dtype).bits // 8), dtype=torch.uint8, generator=gen
        )
        out.append(raw.view(dtype).reshape(blocks, *block_shape).to(device))
    return out


def page_bytes(cache, blocks_per_chunk: int) -> int:
    return len(cache) * blocks_per_chunk * cache[0][0].numel() * cache[0].element_size()


def reference_page(cache, ids) -> torch.Tensor:
    """What a chunk page must hold: every layer's blocks, in order, as bytes."""
    return torch.cat(
        [layer[torch.tensor(ids, device=layer.device)].cpu().reshape(-1).view(torch.uint8) for layer in cache]
    )


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8).reshape(-1)


# -- checks that run everywhere ------------------------------------------------------------------------


def test_bad_inputs_are_named_before_anything_moves():
    cache = make_cache(2, 8)
    page = torch.zeros(page_bytes(cache, 2), dtype=torch.uint8)
    with pytest.raises(IndexError, match=r"chunk 1: block ids \[8\] out of range \[0, 8\)"):
        gpu_ops.gather_chunks(cache, [[0, 1], [2, 8]], [page, page.clone()])
    with pytest.raises(ValueError, match="page 0 is 10 torch.uint8 elements"):
        gpu_ops.gather_chunks(cache, [[0, 1]], [torch.zeros(10, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="chunk 1 has 1 block ids; every chunk of a batch needs 2"):
        gpu_ops.scatter_chunks([page, page], cache, [[0, 1], [2]])
    with pytest.raises(ValueError, match=r"chunk 0: first_block 3 outside \[0, 2\]"):
        gpu_ops.scatter_chunks([page], cache, [[0, 1]], [3])
    with pytest.raises(ValueError, match="layers\\[1\\] is torch.float16"):
        gpu_ops.gather_chunks([cache[0], cache[1].view(torch.float16)], [[0, 1]], [page])
    with pytest.raises(TypeError, match="layers\\[0\\] is torch.int32; a KV cache is one of"):
        gpu_ops.gather_chunks([torch.zeros(8, 4, dtype=torch.int32)], [[0]], [page])
    with pytest.raises(ValueError, match="2 block id lists for 1 pages"):
        gpu_ops.gather_chunks(cache, [[0, 1], [2, 3]], [page])
    assert not page.any()  # nothing was written by any refused call


def test_a_build_lock_left_by_a_killed_build_is_cleared_and_a_fresh_one_is_waited_for(tmp_path):
    """A killed build leaves torch's lock file behind, which made every later engine start wait
    on it forever (seen on the H200: a test run killed mid-build). Older than any build: removed."""
    import os
    import time

    lock = tmp_path / "lock"
    lock.touch()
    assert not kv_kernels.clear_stale_build_lock(tmp_path)  # a build may be running now
    assert lock.exists()
    old = time.time() - kv_kernels.STALE_BUILD_LOCK_S - 1
    os.utime(lock, (old, old))
    assert kv_kernels.clear_stale_build_lock(tmp_path)
    assert not lock.exists()
    assert not kv_kernels.clear_stale_build_lock(tmp_path)  # nothing to clear


def test_torch_path_matches_the_reference_and_skips_leading_blocks():
    cache = make_cache(3, 16, dtype=torch.float16, seed=1)
    ids = [[3, 9, 1, 14], [0, 7, 2, 5]]
    pages = [torch.empty(page_bytes(cache, 4), dtype=torch.uint8) for _ in ids]
    gpu_ops.gather_chunks(cache, ids, pages)
    for chunk_ids, page in zip(ids, pages, strict=True):
        assert torch.equal(page, reference_page(cache, chunk_ids))
    target = make_cache(3, 16, dtype=torch.float16, seed=2)
    before = [layer.clone() for layer in target]
    gpu_ops.scatter_chunks(pages, target, [[10, 11, 12, 13], [4, 6, 8, 15]], first_blocks=[0, 2])
    for layer, old, src in zip(target, before, cache, strict=True):
        assert torch.equal(as_bytes(layer[[10, 11, 12, 13]]), as_bytes(src[[3, 9, 1, 14]]))
        assert torch.equal(as_bytes(layer[[8, 15]]), as_bytes(src[[2, 5]]))
        assert torch.equal(as_bytes(layer[[4, 6]]), as_bytes(old[[4, 6]]))  # skipped: the engine's own blocks
    assert gpu_ops.backend(cache) == "torch"


def test_layer_wise_metadata_is_the_whole_batch_row_at_each_layers_page_offset():
    """What scatter_layers_async uploads (checked here, where the kernel cannot run): per group of
    layers, the row a whole-batch launch uses, its page addresses moved to the group's slice."""
    cache = make_cache(4, 16)
    ids = [[3, 5], [7, 1], [0, 2]]
    pages = [torch.zeros(page_bytes(cache, 2), dtype=torch.uint8) for _ in ids]
    batch = gpu_ops._Batch(cache, ids, pages, [0, 1, 0])
    groups = [range(0, 1), range(1, 3), range(3, 4)]
    rows = gpu_ops._layer_meta_rows(batch, groups)
    whole = [b for chunk in ids for b in chunk] + [p.data_ptr() for p in pages] + [0, 1, 0]
    assert rows.shape == (3, len(ids) * (2 + 2))  # the kernel checks num_chunks * (blocks_per_chunk + 2)
    assert rows[0].tolist() == whole
    plane = page_bytes(cache, 2) // len(cache)
    for row, group in zip(rows, groups, strict=True):
        lo = group.start * plane
        assert row[6:9].tolist() == [p[lo:].data_ptr() for p in pages]  # the slice the CPU path copies
        assert row[:6].tolist() == whole[:6] and row[9:].tolist() == [0, 1, 0]


# -- the CUDA kernels ---------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
def test_kernels_build_and_are_chosen():
    assert kv_kernels.load() is not None
    assert gpu_ops.backend(make_cache(1, 2, device="cuda")) == "cuda-kernel"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pages_on", ["cuda", "pinned"])
def test_gather_matches_reference(dtype, pages_on):
    rng = random.Random(3)
    cache = make_cache(4, 64, block_shape=(2, 16, 8, 128), dtype=dtype, device="cuda", seed=3)
    ids = [rng.sample(range(64), 4) for _ in range(5)]
    pages = [
        torch.full((page_bytes(cache, 4),), 0xAB, dtype=torch.uint8, device="cuda" if pages_on == "cuda" else "cpu")
        for _ in ids
    ]
    if pages_on == "pinned":
        pages = [p.pin_memory() for p in pages]
    gpu_ops.gather_chunks(cache, ids, pages)
    for chunk_ids, page in zip(ids, pages, strict=True):
        assert torch.equal(as_bytes(page), reference_page(cache, chunk_ids))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scatter_partial_batches_match_reference(dtype):
    rng = random.Random(4)
    src = make_cache(3, 32, block_shape=(2, 16, 4, 64), dtype=dtype, device="cuda", seed=4)
    ids = [rng.sample(range(32), 8) for _ in range(3)]
    pages = [torch.empty(page_bytes(src, 8), dtype=torch.uint8).pin_memory() for _ in ids]
    gpu_ops.gather_chunks(src, ids, pages)
    dst = make_cache(3, 64, block_shape=(2, 16, 4, 64), dtype=dtype, device="cuda", seed=5)
    expected = [layer.clone() for layer in dst]
    flat = rng.sample(range(64), 24)
    targets = [flat[0:8], flat[8:16], flat[16:24]]  # distinct across chunks, so the result is defined
    skips = [0, 3, 8]  # whole chunk, a partial one, and one the engine computed entirely
    for layer_src, layer_exp in zip(src, expected, strict=True):
        for chunk_ids, t_ids, skip in zip(ids, targets, skips, strict=True):
            layer_exp[t_ids[skip:]] = layer_src[chunk_ids[skip:]]
    gpu_ops.scatter_chunks(pages, dst, targets, skips)
    for got, want in zip(dst, expected, strict=True):
        assert torch.equal(as_bytes(got), as_bytes(want))


@pytest.mark.gpu
@gpu
def test_round_trip_gpu_to_host_to_other_blocks_is_bit_exact():
    """Llama-3.1-8B's block shape: engine A's blocks -> pinned pages -> engine B's blocks."""
    rng = random.Random(6)
    a = make_cache(8, 128, block_shape=(2, 16, 8, 128), device="cuda", seed=6)
    b = make_cache(8, 128, block_shape=(2, 16, 8, 128), device="cuda", seed=7)
    ids_a = [rng.sample(range(128), 16) for _ in range(4)]
    flat = rng.sample(range(128), 64)  # distinct targets across chunks
    ids_b = [flat[i : i + 16] for i in range(0, 64, 16)]
    pages = [torch.empty(page_bytes(a, 16), dtype=torch.uint8).pin_memory() for _ in ids_a]
    gpu_ops.gather_chunks(a, ids_a, pages)
    gpu_ops.scatter_chunks(pages, b, ids_b)
    for la, lb in zip(a, b, strict=True):
        for ca, cb in zip(ids_a, ids_b, strict=True):
            assert torch.equal(as_bytes(la[ca]), as_bytes(lb[cb]))


@pytest.mark.gpu
@gpu
def test_narrow_and_unaligned_copies():
    """Blocks whose size is not a multiple of 16 bytes, and pages at an 8-byte offset, still copy
    exactly (with narrower vectors)."""
    cache = make_cache(2, 16, block_shape=(2, 16, 1, 3), dtype=torch.float16, device="cuda", seed=8)  # 192 B blocks
    odd = make_cache(2, 16, block_shape=(1, 1, 1, 3), dtype=torch.float16, device="cuda", seed=9)  # 6 B blocks
    for layers in (cache, odd):
        n = page_bytes(layers, 3)
        buffer = torch.zeros(n + 8, dtype=torch.uint8, device="cuda")
        page = buffer[8:]
        gpu_ops.gather_chunks(layers, [[5, 0, 11]], [page])
        assert torch.equal(as_bytes(page), reference_page(layers, [5, 0, 11]))
        assert not buffer[:8].any()


@pytest.mark.gpu
@gpu
def test_pageable_host_pages_fall_back_and_stay_correct():
    cache = make_cache(2, 16, device="cuda", seed=10)
    page = torch.empty(page_bytes(cache, 2), dtype=torch.uint8)  # not pinned: the kernel cannot reach it
    gpu_ops.gather_chunks(cache, [[4, 2]], [page])
    assert torch.equal(page, reference_page(cache, [4, 2]))
    target = make_cache(2, 16, device="cuda", seed=11)
    gpu_ops.scatter_chunks([page], target, [[0, 1]])
    for src, dst in zip(cache, target, strict=True):
        assert torch.equal(as_bytes(dst[[0, 1]]), as_bytes(src[[4, 2]]))


@pytest.mark.gpu
@gpu
def test_bad_block_ids_on_gpu_are_refused_before_launch():
    cache = make_cache(2, 16, device="cuda")
    page = torch.zeros(page_bytes(cache, 2), dtype=torch.uint8, device="cuda")
    with pytest.raises(IndexError, match=r"block ids \[-1\] out of range"):
        gpu_ops.gather_chunks(cache, [[0, -1]], [page])
    with pytest.raises(IndexError, match=r"block ids \[16\] out of range"):
        gpu_ops.scatter_chunks([page], cache, [[16, 0]])
    assert not page.any()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("ctas", [1, 3, 16, 0])
def test_a_capped_async_gather_walks_every_unit(ctas):
    """The store path runs on a few CTAs that each walk many (chunk, layer, block) units."""
    rng = random.Random(4)
    cache = make_cache(5, 64, block_shape=(2, 16, 8, 128), device="cuda", seed=4)
    ids = [rng.sample(range(64), 4) for _ in range(7)]  # 7 x 5 x 4 = 140 units, not a multiple of any cap
    pages = [torch.full((page_bytes(cache, 4),), 0xAB, dtype=torch.uint8).pin_memory() for _ in ids]
    gpu_ops.gather_chunks_async(cache, ids, pages, max_ctas=ctas).wait()
    for chunk_ids, page in zip(ids, pages, strict=True):
        assert torch.equal(page, reference_page(cache, chunk_ids))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("slots", [1, 2, 8])
def test_a_load_staged_through_a_ring_smaller_than_it_lands_every_page_exactly(slots):
    """Loads beside the steps come from host memory through a ring of GPU pages (the copy
    engine's H2D, then the kernel device to device): with fewer slots than pages each slot is
    refilled after the scatter that read it, pages already on the GPU go straight from there, and
    the blocks the engine computed (a chunk's leading ones, or a whole chunk) are left alone."""
    rng = random.Random(12)
    src = make_cache(4, 64, block_shape=(2, 16, 8, 128), device="cuda", seed=12)
    ids = [rng.sample(range(64), 4) for _ in range(5)]
    pages = [torch.empty(page_bytes(src, 4), dtype=torch.uint8).pin_memory() for _ in ids]
    gpu_ops.gather_chunks(src, ids, pages)
    pages[3] = pages[3].to("cuda")  # a GPU-tier page among host ones
    dst = make_cache(4, 64, block_shape=(2, 16, 8, 128), device="cuda", seed=13)
    expected = [layer.clone() for layer in dst]
    flat = rng.sample(range(64), 20)
    targets = [flat[i : i + 4] for i in range(0, 20, 4)]
    skips = [2, 0, 4, 1, 0]  # the third chunk computed whole: not copied at all
    for layer_src, layer_exp in zip(src, expected, strict=True):
        for chunk_ids, t_ids, skip in zip(ids, targets, skips, strict=True):
            layer_exp[t_ids[skip:]] = layer_src[chunk_ids[skip:]]
    staging = torch.full((slots, page_bytes(src, 4) + 64), 0xCD, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # dst and the pages were written on the default stream
    copy = gpu_ops.scatter_staged_async(pages, dst, targets, skips, stream, staging)
    copy.wait()
    for got, want in zip(dst, expected, strict=True):
        assert torch.equal(as_bytes(got), as_bytes(want))


@pytest.mark.gpu
@gpu
def test_a_staging_ring_that_cannot_hold_a_page_is_refused_before_anything_moves():
    cache = make_cache(2, 16, device="cuda", seed=14)
    page = torch.zeros(page_bytes(cache, 2), dtype=torch.uint8).pin_memory()
    before = [layer.clone() for layer in cache]
    small = torch.empty((4, page.numel() - 1), dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError, match=r"staging holds 4 slots of \d+ bytes; a page is \d+"):
        gpu_ops.scatter_staged_async([page], cache, [[0, 1]], None, torch.cuda.Stream(), small)
    strided = torch.empty((4, 2 * page.numel()), dtype=torch.uint8, device="cuda")[:, ::2]
    with pytest.raises(ValueError, match=r"staging's slots are not contiguous rows \(strides \(\d+, 2\)\)"):
        gpu_ops.scatter_staged_async([page], cache, [[0, 1]], None, torch.cuda.Stream(), strided)
    on_host = torch.empty((4, page.numel()), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"staging is torch.uint8 \(4, \d+\) on cpu"):
        gpu_ops.scatter_staged_async([page], cache, [[0, 1]], None, torch.cuda.Stream(), on_host)
    torch.cuda.synchronize()
    assert all(torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(cache, before, strict=True))
