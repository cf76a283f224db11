"""KV gather/scatter throughput on a GPU: the CUDA kernels of csrc/ (and the torch fallback) against
the torch copy ceiling measured in the same run.

Llama-3.1-8B's KV shape (32 layers, 8 KV heads, head size 128, bf16, 16-token blocks in vLLM's
flash layout): a 256-token chunk is 16 blocks of 64 KiB per layer, 32 MiB in all. For batches of
1..32 chunks at random block ids:

* gather GPU cache -> pinned host pages, and scatter back (the CPU tier's path);
* gather GPU cache -> GPU pages, and scatter back (a GPU staging buffer's path);
* the ceiling: one contiguous torch ``copy_`` of the same bytes, GPU <-> pinned host and GPU <-> GPU;
* the device checksum of a 10,000-token document (39 pages in VRAM): page_checksum.cu against
  the torch definition in lmcache_p2p.device_checksum (``--checksum-only``: that alone).

    python benchmarks/bench_kernels.py [--batches 1,2,4,8,16,32] [--reps 20]   # prints one JSON object
    python benchmarks/bench_kernels.py --checksum-only [--reps 10]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import time
from functools import partial

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import torch  # noqa: E402

from lmcache_p2p import gpu_ops, kv_kernels  # noqa: E402
from lmcache_p2p.testing.standin import MODEL_SHAPES, StandInKV  # noqa: E402

SHAPE = MODEL_SHAPES["llama-3.1-8b"]
CHUNK = 256
BLOCKS_PER_CHUNK = CHUNK // SHAPE.block_size


def llama_cache(num_blocks: int) -> tuple[list[torch.Tensor], int]:
    """Llama-3.1-8B's paged KV on the GPU (vLLM's flash layout) filled with random bytes, and
    the bytes of one chunk page."""
    kv = StandInKV(SHAPE, num_blocks, device="cuda")
    for layer in kv.layers:
        layer.view(torch.int16).random_()
    return kv.layers, CHUNK * kv.chunk_bytes_per_token


def timings(fn, reps: int) -> list[float]:
    """Seconds of each of ``reps`` runs of ``fn`` (which returns after its work is complete),
    after a warm-up."""
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def timed(fn, reps: int) -> float:
    """Median seconds of ``fn``, after a warm-up."""
    return statistics.median(timings(fn, reps))


def device_checksum_of_a_document(reps: int) -> dict:
    """The device checksum of one document's 39 pages of 32 MiB in VRAM: the kernel (one launch)
    against the torch code (the definition, and the fallback), which must agree."""
    from lmcache_p2p import device_checksum

    page_bytes, pages_per_document = 32 << 20, 39
    pages = list(torch.randint(0, 256, (pages_per_document, page_bytes), dtype=torch.uint8, device="cuda"))
    weights = device_checksum.weights_for(page_bytes // 4, pages[0].device)
    out: dict = {"bench": "device_checksum", "pages": pages_per_document, "page_bytes": page_bytes}
    runs = {
        "kernel": partial(device_checksum.device_checksums, pages),
        "torch": lambda: device_checksum._as_uint64(device_checksum._checksums(pages, weights)),
    }
    for name, fn in runs.items():
        ms = [t * 1e3 for t in timings(fn, reps)]
        out[name] = {
            "ms_median": round(statistics.median(ms), 3),
            "ms_min": round(min(ms), 3),
            "ms_max": round(max(ms), 3),
            "GB/s_median": round(pages_per_document * page_bytes / 1e6 / statistics.median(ms), 1),
        }
    assert runs["kernel"]() == runs["torch"](), "the kernel and the torch definition disagree"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,2,4,8,16,32")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--num-blocks", type=int, default=4096, help="cache blocks per layer (4096 = 8 GiB)")
    parser.add_argument("--checksum-only", action="store_true", help="only the device checksum of a document")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels needs a CUDA device")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    batches = [int(b) for b in args.batches.split(",")]
    t0 = time.perf_counter()
    assert kv_kernels.load() is not None, "the CUDA kernels did not build"
    build_s = time.perf_counter() - t0
    print(f"[bench_kernels] kernels built or loaded in {build_s:.1f} s", file=sys.stderr, flush=True)
    checksum = device_checksum_of_a_document(args.reps)
    if args.checksum_only:
        print(json.dumps(checksum))
        return

    cache, chunk_bytes = llama_cache(args.num_blocks)
    most = max(batches)
    host = torch.empty(most * chunk_bytes, dtype=torch.uint8).pin_memory()
    device_pages = torch.empty(most * chunk_bytes, dtype=torch.uint8, device="cuda")
    contiguous = torch.empty(most * chunk_bytes, dtype=torch.uint8, device="cuda")
    rng = random.Random(0)

    results = []
    for n in batches:
        ids = [rng.sample(range(args.num_blocks), BLOCKS_PER_CHUNK) for _ in range(n)]
        flat = rng.sample(range(args.num_blocks), n * BLOCKS_PER_CHUNK)  # scatter targets, all distinct
        targets = [flat[i * BLOCKS_PER_CHUNK : (i + 1) * BLOCKS_PER_CHUNK] for i in range(n)]
        nbytes = n * chunk_bytes
        host_pages = [host[i * chunk_bytes : (i + 1) * chunk_bytes] for i in range(n)]
        gpu_pages = [device_pages[i * chunk_bytes : (i + 1) * chunk_bytes] for i in range(n)]

        def rate(seconds: float, nbytes: int = nbytes) -> float:
            return round(nbytes / seconds / 1e9, 2)

        row = {"chunks": n, "bytes": nbytes}
        row["ceiling_d2h_gbps"] = rate(
            timed(lambda nbytes=nbytes: host[:nbytes].copy_(contiguous[:nbytes], non_blocking=True), args.reps)
        )
        row["ceiling_h2d_gbps"] = rate(
            timed(lambda nbytes=nbytes: contiguous[:nbytes].copy_(host[:nbytes], non_blocking=True), args.reps)
        )
        row["ceiling_d2d_gbps"] = rate(
            timed(lambda nbytes=nbytes: device_pages[:nbytes].copy_(contiguous[:nbytes]), args.reps)
        )
        row["gather_to_host_gbps"] = rate(timed(partial(gpu_ops.gather_chunks, cache, ids, host_pages), args.reps))
        row["scatter_from_host_gbps"] = rate(
            timed(partial(gpu_ops.scatter_chunks, host_pages, cache, targets), args.reps)
        )
        row["gather_to_gpu_gbps"] = rate(timed(partial(gpu_ops.gather_chunks, cache, ids, gpu_pages), args.reps))
        row["scatter_from_gpu_gbps"] = rate(
            timed(partial(gpu_ops.scatter_chunks, gpu_pages, cache, targets), args.reps)
        )
        os.environ["LMCACHE_KV_KERNELS"] = "torch"  # the fallback, for comparison (load() is cached: force per call)
        kv_kernels.load.cache_clear()
        row["torch_gather_to_host_gbps"] = rate(
            timed(partial(gpu_ops.gather_chunks, cache, ids, host_pages), max(3, args.reps // 4))
        )
        row["torch_scatter_from_host_gbps"] = rate(
            timed(partial(gpu_ops.scatter_chunks, host_pages, cache, targets), max(3, args.reps // 4))
        )
        del os.environ["LMCACHE_KV_KERNELS"]
        kv_kernels.load.cache_clear()
        kv_kernels.load()
        row["gather_to_host_vs_ceiling"] = round(row["gather_to_host_gbps"] / row["ceiling_d2h_gbps"], 3)
        row["scatter_from_host_vs_ceiling"] = round(row["scatter_from_host_gbps"] / row["ceiling_h2d_gbps"], 3)
        results.append(row)
        print(
            f"[bench_kernels] {n} chunks: gather->host {row['gather_to_host_gbps']} GB/s "
            f"({row['gather_to_host_vs_ceiling']:.0%} of {row['ceiling_d2h_gbps']}), scatter<-host "
            f"{row['scatter_from_host_gbps']} GB/s "
            f"({row['scatter_from_host_vs_ceiling']:.0%} of {row['ceiling_h2d_gbps']})",
            file=sys.stderr,
            flush=True,
        )

    print(
        json.dumps(
            {
                "bench": "kernels",
                "gpu": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "shape": "llama-3.1-8b bf16, 32 layers, 16-token blocks, 256-token chunks",
                "chunk_bytes": chunk_bytes,
                "kernel_build_or_load_s": round(build_s, 1),
                "results": results,
                "device_checksum": checksum,
            }
        )
    )


if __name__ == "__main__":
    main()
