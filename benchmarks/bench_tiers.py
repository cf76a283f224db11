"""CPU and disk tier throughput for 256-token chunks of the Llama-3.1-8B shape
(32 layers x 2 (K,V) x 8 KV heads x 128 dims x bf16 = 32 MiB a chunk). Prints one JSON object.

    .venv/bin/python benchmarks/bench_tiers.py [--cpu-gb 2] [--chunks 96] [--disk-dir /tmp/x]

cpu put: copy a chunk into a pool page (evicting LRU once the pool is full).
cpu get: pin a chunk and copy its page out (what a retrieve does before the scatter into vLLM).
disk write: header + payload to a temp file, rename (XXH3 checksum included).
disk read (cold): read_into a page with checksum verification, after the files were fsynced and
dropped from the page cache (posix_fadvise DONTNEED), so it measures the device, not RAM.
"""

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

from lmcache_p2p.keys import ChunkKey, LayoutFingerprint
from lmcache_p2p.storage import CpuTier, DiskTier, PagePool

LLAMA_8B = LayoutFingerprint(
    model="meta-llama/Llama-3.1-8B",
    dtype="bfloat16",
    block_size=16,
    block_shape=(2, 16, 8, 128),
    block_stride=(32768, 2048, 128, 1),
    num_layers=32,
)


def gbps(nbytes: int, seconds: list[float]) -> dict:
    p50 = statistics.median(seconds)
    return {
        "p50_ms": round(p50 * 1e3, 3),
        "gb_per_s": round(nbytes / p50 / 1e9, 2),
        "aggregate_gb_per_s": round(nbytes * len(seconds) / sum(seconds) / 1e9, 2),
    }


def drop_from_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--cpu-gb", type=float, default=2.0)
    ap.add_argument("--chunks", type=int, default=96, help="puts into the CPU tier (more than fit: evictions)")
    ap.add_argument("--disk-chunks", type=int, default=24)
    ap.add_argument("--disk-dir", default=None)
    ap.add_argument(
        "--disk-only",
        action="store_true",
        help="skip the CPU stage: disk figures from a process with no large touched buffer",
    )
    args = ap.parse_args()

    page = LLAMA_8B.bytes_per_token * args.chunk_size
    fp = LLAMA_8B.digest
    sources = [torch.randint(0, 256, (page,), dtype=torch.uint8) for _ in range(4)]
    sink = torch.empty(page, dtype=torch.uint8)

    result: dict = {"bench": "tiers", "chunk_bytes": page, "chunk_mib": page / 2**20}
    if not args.disk_only:
        tier = CpuTier(PagePool(page, int(args.cpu_gb * 2**30)))
        for i in range(tier.pool.num_pages):  # touch every page once so puts measure copies, not page faults
            tier.pool.page(i).fill_(0)
        puts, gets = [], []
        for i in range(args.chunks):
            t0 = time.perf_counter()
            tier.put(ChunkKey(fp, i), sources[i % 4])
            puts.append(time.perf_counter() - t0)
        held = tier.keys()
        for i in range(args.chunks):
            key = held[i % len(held)]
            t0 = time.perf_counter()
            with tier.pin(key) as chunk:
                sink.copy_(chunk.data)
            gets.append(time.perf_counter() - t0)
        result.update(
            cpu_pool_pages=tier.pool.num_pages,
            cpu_pinned=tier.pool.pinned,
            cpu_put=gbps(page, puts),
            cpu_get=gbps(page, gets),
            cpu_evictions=tier.evictions,
        )

    root = args.disk_dir or tempfile.mkdtemp(prefix="lmcache-bench-disk-")
    disk = DiskTier(root, (args.disk_chunks + 1) * (page + 4096))
    writes, reads = [], []
    payload = sources[0].numpy()
    for i in range(args.disk_chunks):
        t0 = time.perf_counter()
        disk.write(ChunkKey(fp, i), payload)
        writes.append(time.perf_counter() - t0)
    for i in range(args.disk_chunks):
        drop_from_page_cache(disk.path(ChunkKey(fp, i)))
    dest = sink.numpy()
    for i in range(args.disk_chunks):
        t0 = time.perf_counter()
        ok = disk.read_into(ChunkKey(fp, i), dest)
        reads.append(time.perf_counter() - t0)
        assert ok is not None
    if not args.disk_dir:
        shutil.rmtree(root)

    result.update(
        disk_write=gbps(page, writes), disk_read_cold=gbps(page, reads), torch_threads=torch.get_num_threads()
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
