"""The remote tier (``remote_url``) against real stores, beside the CPU tier and a P2P pull, in one run.

256-token chunks of the Llama-3.1-8B bf16 page shape (32 layers x 2 x 8 KV heads x 128 x bf16 =
32 MiB a chunk; the layout a stand-in instance of that model reports). N chunks (``--chunks``,
default 16 = 512 MiB) per measurement, ``--reps`` times (default 3); every throughput is reported
as the median, min and max over the reps (a spread, not the best run). GB/s are 1e9 bytes of
payload per second (the 40-byte value header is not counted).

For each store, started fresh and stopped before the next one (``lmcache_server`` as its console
script, Debian's ``redis-server``, a Redis Cluster of 3 masters with no replicas; all on
127.0.0.1, sharing this machine's cores with the bench):

* ``put``: N chunks ``StorageManager.put`` into a writer's CPU tier and written behind to the
  store by its remote tier (exists round, XXH3 of the page, framing copy, put), timed from the
  first put to ``flush()`` done: what an engine's stored chunks take to reach the store.
  ``store_path_ms`` is the part the engine's own thread waits for (the N CPU-tier puts).
  ``raw_put``: the same bytes (framed before timing) through ``RemoteStore.put`` directly, in the
  tier's batches of ``WRITE_BATCH_CHUNKS``: the ceiling.
* ``get``: a reader holding none of them locally runs ``RemoteTier.fetch_prefix_into`` of the N chunks
  (one exists round, get rounds of at most ``FETCH_BATCH_BYTES``, header + XXH3 check, copy
  into CPU pages, admit). ``raw_get``: ``RemoteStore.get`` of the same keys in the same rounds:
  the ceiling.
* ``lookup``: ``RemoteTier.prefix_length`` of a 40-chunk prefix (a 10,240-token prompt) the store
  holds, and of one that misses at chunk 0; p50/p90/p99 of ``--lookups`` calls (default 200)
  after 20 untimed. The 40 held keys carry header-sized values (an exists round never reads a
  value, and the store also holds the N full chunks of the last rep meanwhile).

Writer and reader are one pair of storage managers per store, their pools written once before
timing and cleared between reps (a pool in use, not first-touch page faults; see bench_p2p's
first_touch), the store cleared between reps; fresh chunk hashes every rep. One untimed warm-up
of 2 chunks per store opens the connections. Within a rep: put, get, raw get, clear, raw put, so
each figure and its ceiling are taken in the same few seconds of this noisy, shared VM. The CPU
tier runs one untimed rep first.

Beside them, in the same run: the CPU tier (``put``: ``StorageManager.put`` of the N pages;
``pin_copy_out``: pin each and copy its page out), and a P2P pull of N chunks between two
stand-in instance processes (``bench_p2p.p2p``, which reports the median of ``--reps`` pulls
after one untimed pull; nixl, and tcp unless ``--p2p nixl``).

    .venv/bin/python benchmarks/bench_remote.py [--chunks 16] [--reps 3] [--lookups 200] \
        [--backends lm,redis,redis-cluster] [--p2p nixl,tcp]     # prints one JSON object

``--mac-comparison`` measures instead what the mesh secret costs (docs/security.md): per store,
``put`` and ``get`` as above by a pair of storage managers without a mesh secret and a pair with
one (values MAC'd with HMAC-SHA256 and checked on read; ``lmcache_server`` started a second time
with ``--mesh-secret-file``, its clients authenticating), the two taking turns within each rep
(which goes first alternates). It prints JSON lines: the hash rates on one 32 MiB page (the MAC,
keyed BLAKE2b beside it, XXH3), then one line per store with both sets of figures side by side.

    .venv/bin/python benchmarks/bench_remote.py --mac-comparison [--backends lm,redis] [--reps 3]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import hmac
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_p2p  # noqa: E402  (it puts tests/ on sys.path)
from redis_servers import RedisCluster, RedisServer  # noqa: E402
from remote_stores import LmServer  # noqa: E402

from lmcache_p2p.config import LMCacheConfig  # noqa: E402
from lmcache_p2p.keys import ChunkKey, payload_checksum  # noqa: E402
from lmcache_p2p.remote.auth import ValueMac  # noqa: E402
from lmcache_p2p.remote.connect import open_store  # noqa: E402
from lmcache_p2p.remote.store import RemoteStore  # noqa: E402
from lmcache_p2p.remote.tier import (  # noqa: E402
    FETCH_BATCH_BYTES,
    HEADER_BYTES,
    WRITE_BATCH_CHUNKS,
    frame_value,
    remote_key,
)
from lmcache_p2p.remote.url import parse_remote_url  # noqa: E402
from lmcache_p2p.storage import StorageManager  # noqa: E402
from lmcache_p2p.testing.standin import StandInKV  # noqa: E402

CHUNK_TOKENS = bench_p2p.CHUNK_TOKENS
PAGE_BYTES = bench_p2p.PAGE_BYTES  # 32 MiB
LAYOUT = StandInKV(bench_p2p.SHAPE, num_blocks=1).layout()  # what a Llama-3.1-8B stand-in reports
assert LAYOUT.bytes_per_token * CHUNK_TOKENS == PAGE_BYTES == 32 * 2**20

LOOKUP_CHUNKS = 40  # a 10,240-token prompt
LOOKUP_WARMUP = 20
WARMUP_CHUNKS = 2
# Round trips of 512 MiB on a busy 2-core VM: a timeout here would be a dropped write, not a
# figure, so it is wider than the config's default (it bounds stalls; it does not pace anything).
TIMEOUT_S = 10.0
BACKENDS = ("lm", "redis", "redis-cluster")
HIT_BASE = 0x7E57 << 40
MISS_BASE = 0x3155 << 40
MESH_SECRET = "bench-remote-mesh-secret-0123456789"  # --mac-comparison's


def log(msg: str) -> None:
    print(f"[bench_remote {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def spread(values: list[float], digits: int = 3) -> dict:
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }


def percentiles_ms(seconds: list[float]) -> dict:
    ms = np.array(seconds) * 1e3
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"p50": round(float(p50), 3), "p90": round(float(p90), 3), "p99": round(float(p99), 3), "calls": len(ms)}


def manager(pages: int, url: str | None = None, mesh_secret: str | None = None) -> StorageManager:
    """A storage manager whose CPU pool holds ``pages`` chunks, every page written once; with
    ``mesh_secret`` its remote tier MACs what it writes and checks what it reads."""
    raw: dict = {
        "chunk_size": CHUNK_TOKENS,
        "local_cpu": True,
        "max_local_cpu_size": (pages + 0.5) * PAGE_BYTES / 2**30,
    }
    if mesh_secret is not None:
        raw["mesh_secret"] = mesh_secret
    if url is not None:
        raw.update(remote_url=url, remote_timeout_s=TIMEOUT_S, remote_write_queue_chunks=max(1024, 2 * pages))
    mgr = StorageManager(LMCacheConfig.from_dict(raw), LAYOUT)
    assert mgr.cpu is not None and mgr.cpu.pool.num_pages == pages, mgr.stats()
    mgr.cpu.pool.buffer.fill_(1)
    return mgr


def make_sources(n: int) -> torch.Tensor:
    """``n`` distinct 32 MiB pages: one random page, each copy stamped with its index."""
    page = np.random.default_rng(2024).integers(0, 256, PAGE_BYTES, dtype=np.uint8)
    out = np.empty((n, PAGE_BYTES), dtype=np.uint8)
    for i in range(n):
        out[i] = page
        out[i, :8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)
    return torch.from_numpy(out)


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return round(total / 1024, 1)


# -- the CPU tier --------------------------------------------------------------------------------------


def cpu_tier(sources: torch.Tensor, reps: int) -> dict:
    n = len(sources)
    mgr = manager(n)
    sink = torch.ones(PAGE_BYTES, dtype=torch.uint8)
    puts, outs = [], []
    try:
        for rep in range(reps + 1):  # rep 0 untimed
            mgr.clear()
            hashes = [(rep << 32) | i for i in range(n)]
            t0 = time.perf_counter()
            for h, src in zip(hashes, sources, strict=True):
                assert mgr.put(h, src)
            t_put = time.perf_counter() - t0
            t0 = time.perf_counter()
            for h in hashes:
                chunk = mgr.pin(h)
                assert chunk is not None
                with chunk:
                    sink.copy_(chunk.data)
            t_out = time.perf_counter() - t0
            if rep:
                puts.append(gbps(n * PAGE_BYTES, t_put))
                outs.append(gbps(n * PAGE_BYTES, t_out))
        return {"put_GB/s": spread(puts), "pin_copy_out_GB/s": spread(outs), "pool_pinned": mgr.cpu.pool.pinned}
    finally:
        mgr.close()


# -- the stores ------------------------------------------------------------------------------------------


class Backend:
    """A store started for the bench: its URL, how to empty it, its processes; stopped by close()."""

    def __init__(self, kind: str, n: int, mesh_secret: str | None = None):
        self.kind = kind
        self.lm: LmServer | None = None
        self.redis: RedisServer | None = None
        self.cluster: RedisCluster | None = None
        if kind == "lm":
            # N chunks and the lookup keys, with room to spare: nothing is evicted.
            size = round((n + 2) * PAGE_BYTES / 2**30 + 0.25, 3)
            self.lm = LmServer(max_size_gb=size, mesh_secret=mesh_secret)
        elif kind == "redis":
            self.redis = RedisServer()
        elif kind == "redis-cluster":
            self.cluster = RedisCluster(masters=3)
        else:
            raise ValueError(f"unknown backend {kind!r}; expected one of {', '.join(BACKENDS)}")

    def start(self) -> Backend:
        if self.lm is not None:
            self.lm.start()
        elif self.redis is not None:
            self.redis.start()
        elif self.cluster is not None:
            self.cluster.start()
        return self

    @property
    def url(self) -> str:
        if self.lm is not None:
            return self.lm.url
        if self.redis is not None:
            return self.redis.url()
        assert self.cluster is not None
        return self.cluster.url

    def pids(self) -> list[int]:
        if self.lm is not None:
            assert self.lm.proc is not None
            return [self.lm.proc.pid]
        if self.redis is not None:
            assert self.redis.process.proc is not None
            return [self.redis.process.proc.pid]
        assert self.cluster is not None
        return [node.proc.pid for node in self.cluster.nodes if node.proc is not None]

    def clear(self, store: RemoteStore) -> None:
        if self.lm is not None:
            store.clear()  # LmServerStore's CLEAR
        elif self.redis is not None:
            with self.redis.client() as c:
                c.flushall()
        else:
            assert self.cluster is not None
            for i in range(len(self.cluster.nodes)):
                with self.cluster.node_client(i) as c:
                    c.flushall()

    def close(self) -> None:
        if self.lm is not None:
            self.lm.kill()
        if self.redis is not None:
            self.redis.close()
        if self.cluster is not None:
            self.cluster.close()


def write_behind(writer: StorageManager, hashes: list[int], sources: torch.Tensor) -> tuple[float, float]:
    """(seconds from the first put to the write-behind flushed, seconds of the puts alone)."""
    assert writer.remote is not None
    before = writer.remote.counters.chunks_written
    t0 = time.perf_counter()
    for h, src in zip(hashes, sources, strict=True):
        assert writer.put(h, src)
    t_admit = time.perf_counter() - t0
    assert writer.flush(120), "the write-behind did not finish in 120 s"
    took = time.perf_counter() - t0
    c = writer.remote.counters
    written = c.chunks_written - before
    assert written == len(hashes), f"{written} of {len(hashes)} written: {writer.remote.stats()}"
    return took, t_admit


def fetch(reader: StorageManager, hashes: list[int], sources: torch.Tensor) -> float:
    reader.clear()
    assert reader.remote is not None
    t0 = time.perf_counter()
    got = reader.remote.fetch_prefix_into(reader, hashes)
    took = time.perf_counter() - t0
    assert got == len(hashes), f"fetched {got} of {len(hashes)}: {reader.stats()}"
    for i in (0, len(hashes) - 1):  # the bytes are the writer's (untimed)
        chunk = reader.pin(hashes[i])
        assert chunk is not None
        with chunk:
            assert torch.equal(chunk.data, sources[i]), f"chunk {i} differs"
    return took


def raw_get(store: RemoteStore, names: list[bytes]) -> float:
    """``store.get`` of ``names`` in the tier's fetch rounds; values dropped after each round."""
    per_round = max(1, FETCH_BATCH_BYTES // (PAGE_BYTES + HEADER_BYTES))
    t0 = time.perf_counter()
    for start in range(0, len(names), per_round):
        values = store.get(names[start : start + per_round])
        assert all(v is not None and len(v) == PAGE_BYTES + HEADER_BYTES for v in values)
        del values
    return time.perf_counter() - t0


def raw_put(store: RemoteStore, names: list[bytes], frames: list[bytearray]) -> float:
    """``store.put`` of the framed values under ``names``, in the tier's write batches."""
    t0 = time.perf_counter()
    items = list(zip(names, frames, strict=True))
    for start in range(0, len(items), WRITE_BATCH_CHUNKS):
        store.put(items[start : start + WRITE_BATCH_CHUNKS])
    return time.perf_counter() - t0


def timed_calls(call: Callable[[], int], expect: int, count: int) -> list[float]:
    for _ in range(LOOKUP_WARMUP):
        assert call() == expect
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        got = call()
        times.append(time.perf_counter() - t0)
        assert got == expect, f"prefix_length {got}, expected {expect}"
    return times


def remote_backend(kind: str, sources: torch.Tensor, frames: list[bytearray], reps: int, lookups: int) -> dict:
    n = len(sources)
    nbytes = n * PAGE_BYTES
    backend = Backend(kind, n)
    writer = reader = store = None
    try:
        t_start = time.perf_counter()
        backend.start()
        started_s = time.perf_counter() - t_start
        url = backend.url
        log(f"{kind}: {url} up in {started_s:.2f} s")
        store = open_store(parse_remote_url(url), TIMEOUT_S)
        writer, reader = manager(n, url), manager(n, url)
        assert writer.remote is not None and reader.remote is not None

        # Warm-up, untimed: every client's connections, the server's first values.
        warm = [(0xFFFF << 32) | i for i in range(WARMUP_CHUNKS)]
        write_behind(writer, warm, sources[:WARMUP_CHUNKS])
        fetch(reader, warm, sources[:WARMUP_CHUNKS])
        raw_get(store, [remote_key(reader.key(h)) for h in warm])

        puts, admits, raw_puts, gets, raw_gets = [], [], [], [], []
        for rep in range(reps):
            backend.clear(store)
            writer.clear()
            hashes = [((rep + 1) << 32) | i for i in range(n)]
            names = [remote_key(writer.key(h)) for h in hashes]
            took, t_admit = write_behind(writer, hashes, sources)
            puts.append(gbps(nbytes, took))
            admits.append(t_admit * 1e3)
            gets.append(gbps(nbytes, fetch(reader, hashes, sources)))
            raw_gets.append(gbps(nbytes, raw_get(store, names)))
            backend.clear(store)
            raw_puts.append(gbps(nbytes, raw_put(store, names, frames)))
            log(
                f"{kind} rep {rep + 1}/{reps}: put {puts[-1]:.2f} (raw {raw_puts[-1]:.2f}) GB/s, "
                f"get {gets[-1]:.2f} (raw {raw_gets[-1]:.2f}) GB/s"
            )
        server_rss = rss_mib(backend.pids())  # holding the N chunks of the last raw put

        # Lookups: 40 held keys (header-sized values), 40 keys none of which is held.
        hit = [reader.key(HIT_BASE + i) for i in range(LOOKUP_CHUNKS)]
        miss = [reader.key(MISS_BASE + i) for i in range(LOOKUP_CHUNKS)]
        store.put([(remote_key(k), bytes(HEADER_BYTES)) for k in hit])
        tier = reader.remote
        hit_s = timed_calls(lambda: tier.prefix_length(hit), LOOKUP_CHUNKS, lookups)
        miss_s = timed_calls(lambda: tier.prefix_length(miss), 0, lookups)
        assert tier.counters.errors == 0 and writer.remote.counters.errors == 0, tier.stats()
        out = {
            "url": url,
            "server_start_s": round(started_s, 2),
            "put_GB/s": spread(puts),
            "store_path_ms": spread(admits, 2),
            "raw_put_GB/s": spread(raw_puts),
            "get_GB/s": spread(gets),
            "raw_get_GB/s": spread(raw_gets),
            "put_vs_raw": round(statistics.median(puts) / statistics.median(raw_puts), 3),
            "get_vs_raw": round(statistics.median(gets) / statistics.median(raw_gets), 3),
            f"lookup_{LOOKUP_CHUNKS}_hit_ms": percentiles_ms(hit_s),
            f"lookup_{LOOKUP_CHUNKS}_miss_ms": percentiles_ms(miss_s),
            "server_rss_mib": server_rss,
        }
        log(
            f"{kind}: lookup of {LOOKUP_CHUNKS} p50 {out[f'lookup_{LOOKUP_CHUNKS}_hit_ms']['p50']} ms hit, "
            f"{out[f'lookup_{LOOKUP_CHUNKS}_miss_ms']['p50']} ms miss"
        )
        return out
    finally:
        for mgr in (writer, reader):
            if mgr is not None:
                mgr.close()
        if store is not None:
            store.close()
        backend.close()
        log(f"{kind}: stopped")


# -- --mac-comparison -----------------------------------------------------------------------------------


def hash_rates(page: np.ndarray, tries: int = 5) -> dict:
    """GB/s of the value MAC (HMAC-SHA256), keyed BLAKE2b and XXH3 on one page, best of ``tries``."""
    key = bytes(32)

    def best(f: Callable[[], object]) -> float:
        times = []
        for _ in range(tries):
            t0 = time.perf_counter()
            f()
            times.append(time.perf_counter() - t0)
        return round(gbps(page.nbytes, min(times)), 3)

    return {
        "hmac_sha256_GB/s": best(lambda: hmac.digest(key, page, "sha256")),
        "blake2b_keyed_GB/s": best(lambda: hashlib.blake2b(page, key=key, digest_size=32).digest()),
        "xxh3_GB/s": best(lambda: payload_checksum(page)),
        "value_mac_GB/s": best(lambda: ValueMac(MESH_SECRET).tag(b"k", bytes(HEADER_BYTES), page)),
    }


def mac_comparison(kind: str, sources: torch.Tensor, reps: int) -> dict:
    """put and get GB/s of one store without and with the mesh secret, taking turns each rep."""
    n = len(sources)
    nbytes = n * PAGE_BYTES
    plain = Backend(kind, n)
    # lmcache_server with a secret refuses clients without one: the MAC'd pair gets its own.
    secured = Backend(kind, n, MESH_SECRET) if kind == "lm" else plain
    backends = [plain] if secured is plain else [plain, secured]
    modes = {"plain": (plain, None), "mac": (secured, MESH_SECRET)}
    pairs: dict[str, tuple[StorageManager, StorageManager]] = {}
    stores: dict[str, RemoteStore] = {}
    try:
        for backend in backends:
            backend.start()
        for k, (mode, (backend, secret)) in enumerate(modes.items()):
            pairs[mode] = (manager(n, backend.url, secret), manager(n, backend.url, secret))
            stores[mode] = open_store(parse_remote_url(backend.url).with_mesh_secret(secret), TIMEOUT_S)
            # Keys of their own: on Redis both pairs share the store, and a writer skips keys held.
            warm = [(0xFFFF << 32) | (k << 16) | i for i in range(WARMUP_CHUNKS)]
            write_behind(pairs[mode][0], warm, sources[:WARMUP_CHUNKS])
            fetch(pairs[mode][1], warm, sources[:WARMUP_CHUNKS])
        figures: dict[str, dict[str, list[float]]] = {m: {"put": [], "get": []} for m in modes}
        for rep in range(reps):
            for i, mode in enumerate(("plain", "mac") if rep % 2 == 0 else ("mac", "plain")):
                writer, reader = pairs[mode]
                modes[mode][0].clear(stores[mode])
                writer.clear()
                hashes = [((2 * rep + i + 1) << 32) | j for j in range(n)]
                took, _ = write_behind(writer, hashes, sources)
                figures[mode]["put"].append(gbps(nbytes, took))
                figures[mode]["get"].append(gbps(nbytes, fetch(reader, hashes, sources)))
                put, get = figures[mode]["put"][-1], figures[mode]["get"][-1]
                log(f"{kind} rep {rep + 1}/{reps} {mode}: put {put:.2f}, get {get:.2f} GB/s")
        for mode, (_, reader) in pairs.items():
            stats = reader.remote.stats() if reader.remote is not None else {}
            assert stats["mac_failures"] == 0 and stats["values_authenticated"] == (mode == "mac"), stats
        med = {m: {op: statistics.median(v) for op, v in f.items()} for m, f in figures.items()}
        return {
            "bench": "remote-mac",
            "store": kind,
            "chunks": n,
            "reps": reps,
            "put_GB/s": spread(figures["plain"]["put"]),
            "put_mac_GB/s": spread(figures["mac"]["put"]),
            "get_GB/s": spread(figures["plain"]["get"]),
            "get_mac_GB/s": spread(figures["mac"]["get"]),
            "put_mac_vs_plain": round(med["mac"]["put"] / med["plain"]["put"], 3),
            "get_mac_vs_plain": round(med["mac"]["get"] / med["plain"]["get"], 3),
        }
    finally:
        for writer, reader in pairs.values():
            writer.close()
            reader.close()
        for store in stores.values():
            store.close()
        for backend in backends:
            backend.close()


def run_mac_comparison(backends: list[str], n: int, reps: int) -> None:
    sources = make_sources(n)
    print(json.dumps({"bench": "remote-mac", "hashes_on_one_page": hash_rates(sources[0].numpy())}), flush=True)
    for kind in backends:
        print(json.dumps(mac_comparison(kind, sources, reps)), flush=True)
        gc.collect()


# -- main ------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=16, help="chunks per measurement (32 MiB each)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (median, min and max reported)")
    parser.add_argument("--lookups", type=int, default=200, help="timed prefix_length calls per case")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="stores to measure, in order")
    parser.add_argument("--p2p", default="nixl,tcp", help="P2P channels to pull over ('none': no P2P)")
    parser.add_argument(
        "--mac-comparison",
        action="store_true",
        help="put and get with and without the mesh secret's value MACs, side by side (JSON lines)",
    )
    args = parser.parse_args()
    if args.chunks < WARMUP_CHUNKS or args.reps < 1 or args.lookups < 1:
        parser.error(f"--chunks must be at least {WARMUP_CHUNKS}, --reps and --lookups at least 1")
    backends = [b for b in args.backends.split(",") if b]
    for b in backends:
        if b not in BACKENDS:
            parser.error(f"unknown backend {b!r}; expected some of {','.join(BACKENDS)}")
    channels = [] if args.p2p == "none" else [c for c in args.p2p.split(",") if c]
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    n, reps = args.chunks, args.reps
    if args.mac_comparison:
        run_mac_comparison(backends, n, reps)
        return
    t_run = time.perf_counter()

    log(f"{n} chunks of {PAGE_BYTES / 2**20:.0f} MiB ({n * PAGE_BYTES / 2**20:.0f} MiB), {reps} reps")
    sources = make_sources(n)
    result: dict = {
        "bench": "remote",
        "shape": "Llama-3.1-8B bf16",
        "chunk_tokens": CHUNK_TOKENS,
        "chunk_bytes": PAGE_BYTES,
        "chunks": n,
        "bytes": n * PAGE_BYTES,
        "reps": reps,
        "torch_threads": torch.get_num_threads(),
    }
    log("cpu tier")
    result["cpu_tier"] = cpu_tier(sources, reps)

    # The raw puts' values, framed once (their headers name rep 1's keys: no reader checks them).
    checksums = [payload_checksum(src.numpy()) for src in sources]
    frames = [
        frame_value(ChunkKey(LAYOUT.digest, (1 << 32) | i), src.numpy(), cs)
        for i, (src, cs) in enumerate(zip(sources, checksums, strict=True))
    ]
    result["remote"] = {}
    for kind in backends:
        result["remote"][kind] = remote_backend(kind, sources, frames, reps, args.lookups)
        gc.collect()
    del frames, sources
    gc.collect()

    for channel in channels:
        log(f"p2p {channel}: {n} chunks, {reps} pulls")
        with tempfile.TemporaryDirectory(prefix="bench-remote-p2p-") as tmp:
            pulled = bench_p2p.p2p(channel, [(n, reps)], Path(tmp))
        result[f"p2p_{channel}"] = pulled[n]
        log(f"p2p {channel}: {pulled[n]['GB/s']} GB/s")

    summary = {
        "cpu_tier": {
            "put_GB/s": result["cpu_tier"]["put_GB/s"]["median"],
            "get_GB/s": result["cpu_tier"]["pin_copy_out_GB/s"]["median"],
        }
    }
    for kind, r in result["remote"].items():
        summary[kind] = {
            "put_GB/s": r["put_GB/s"]["median"],
            "raw_put_GB/s": r["raw_put_GB/s"]["median"],
            "get_GB/s": r["get_GB/s"]["median"],
            "raw_get_GB/s": r["raw_get_GB/s"]["median"],
            "lookup_hit_p50_ms": r[f"lookup_{LOOKUP_CHUNKS}_hit_ms"]["p50"],
            "lookup_miss_p50_ms": r[f"lookup_{LOOKUP_CHUNKS}_miss_ms"]["p50"],
        }
    for channel in channels:
        summary[f"p2p_{channel}"] = {"get_GB/s": result[f"p2p_{channel}"]["GB/s"]}
    result["summary_medians"] = summary
    result["run_s"] = round(time.perf_counter() - t_run, 1)
    result["note"] = (
        "remote put = N CPU-tier puts written behind to the store, first put to flush() done "
        "(store_path_ms: the puts alone); raw_put = RemoteStore.put of the same framed bytes; "
        "get = RemoteTier.fetch_prefix_into by a reader holding none of them (exists + gets + XXH3 + copy into "
        "CPU pages); raw_get = RemoteStore.get of the same keys in the same rounds; lookup = "
        f"RemoteTier.prefix_length of {LOOKUP_CHUNKS} chunks, held or missing at chunk 0; "
        "cpu_tier put = StorageManager.put, pin_copy_out = pin + copy of the page; p2p = bench_p2p.p2p's "
        "median pull of N chunks between two stand-in instances (controller lookup + transfer + checksum + "
        "admit). Spreads are over reps; all stores on 127.0.0.1, sharing the machine with the bench"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
