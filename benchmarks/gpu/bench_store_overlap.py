"""A store's gather beside a forward pass: how many CTAs it needs, and what it costs the GEMMs.

The engine's store path (``CacheEngine.store_async``) gathers a request's chunks from vLLM's KV
cache into pinned host pages on a copy stream while the next forward pass runs. This measures,
for one 10,000-token request of Llama-3.1-8B's KV shape (39 chunks, 1.31 GB) and each CTA cap:

* the gather alone (GB/s into host memory over PCIe);
* a prefill stand-in alone: bf16 GEMMs of an 8B MLP's shape (8192 x 4096 @ 4096 x 14336);
* both at once: the GEMMs' slowdown, and the gather's rate beside them.

    python benchmarks/gpu/bench_store_overlap.py [--caps 0,4,8,16,32,64] [--reps 5]   # one JSON object

Cap 0 is one CTA per (chunk, layer, block) unit: the whole GPU, as the synchronous path uses.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import torch  # noqa: E402

from benchmarks.bench_kernels import BLOCKS_PER_CHUNK, CHUNK, llama_cache, timed  # noqa: E402
from lmcache_p2p import gpu_ops, kv_kernels  # noqa: E402

DOC_CHUNKS = 10_000 // CHUNK  # 39 full chunks of a 10,000-token prompt


def gemms(a: torch.Tensor, w: torch.Tensor, n: int) -> None:
    for _ in range(n):
        torch.matmul(a, w)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--caps", default="0,2,4,8,16,32,64")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--gemms", type=int, default=40, help="GEMMs per forward-pass stand-in")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_store_overlap needs a CUDA device")
    assert kv_kernels.load() is not None, "the CUDA kernels did not build"
    caps = [int(c) for c in args.caps.split(",")]

    num_blocks = 2048
    cache, chunk_bytes = llama_cache(num_blocks)
    host = torch.empty(DOC_CHUNKS * chunk_bytes, dtype=torch.uint8).pin_memory()
    pages = [host[i * chunk_bytes : (i + 1) * chunk_bytes] for i in range(DOC_CHUNKS)]
    flat = random.Random(0).sample(range(num_blocks), DOC_CHUNKS * BLOCKS_PER_CHUNK)
    ids = [flat[i * BLOCKS_PER_CHUNK : (i + 1) * BLOCKS_PER_CHUNK] for i in range(DOC_CHUNKS)]
    nbytes = DOC_CHUNKS * chunk_bytes
    a = torch.randn(8192, 4096, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(4096, 14336, dtype=torch.bfloat16, device="cuda")
    main_stream = torch.cuda.current_stream()

    def gemm_alone() -> float:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(main_stream)
        gemms(a, w, args.gemms)
        end.record(main_stream)
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def together(cap: int) -> tuple[float, float]:
        """(GEMM seconds, gather seconds) with the gather launched just before the GEMMs."""
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record(main_stream)
        copy = gpu_ops.gather_chunks_async(cache, ids, pages, max_ctas=cap)
        gemms(a, w, args.gemms)
        end.record(main_stream)
        copy.wait()
        copy_s = time.perf_counter() - t0
        end.synchronize()
        return start.elapsed_time(end) / 1e3, copy_s

    gemm_alone()
    base = statistics.median(gemm_alone() for _ in range(args.reps))
    rows = []
    for cap in caps:
        alone = timed(lambda cap=cap: gpu_ops.gather_chunks_async(cache, ids, pages, max_ctas=cap).wait(), args.reps)
        runs = [together(cap) for _ in range(args.reps)]
        gemm_s = statistics.median(r[0] for r in runs)
        copy_s = statistics.median(r[1] for r in runs)
        row = {
            "ctas": cap or "one per block",
            "gather_alone_GB/s": round(nbytes / alone / 1e9, 2),
            "gemm_slowdown": round(gemm_s / base - 1, 4),
            "gather_beside_gemms_GB/s": round(nbytes / copy_s / 1e9, 2),
        }
        rows.append(row)
        print(f"[bench_store_overlap] {row}", file=sys.stderr, flush=True)
    print(
        json.dumps(
            {
                "bench": "store_overlap",
                "gpu": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "request": f"{DOC_CHUNKS} chunks of 256 tokens, {nbytes / 1e9:.2f} GB",
                "gemm": f"{args.gemms} x bf16 8192x4096 @ 4096x14336",
                "gemms_alone_s": round(base, 4),
                "results": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
