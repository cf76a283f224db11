"""Chunk-hash throughput: 128k tokens, 256-token chunks. Prints one JSON object.

    .venv/bin/python benchmarks/bench_keys.py [--tokens 131072] [--repeat 200]

Target (issue 2): hashing 128k tokens in under 2 ms.
"""

import argparse
import json
import random
import statistics
import time

import numpy as np

from lmcache_p2p.keys import chunk_hashes


def time_ms(fn, repeat: int) -> list[float]:
    fn()  # warm up
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def summary(samples: list[float], tokens: int) -> dict:
    p50 = statistics.median(samples)
    return {"p50_ms": round(p50, 4), "p99_ms": round(sorted(samples)[int(len(samples) * 0.99) - 1], 4),
            "mtokens_per_s": round(tokens / p50 / 1e3, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=131_072)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    rng = random.Random(0)
    as_list = [rng.randrange(128_256) for _ in range(args.tokens)]
    as_array = np.array(as_list, dtype=np.int32)
    result = {
        "bench": "chunk_hashes",
        "tokens": args.tokens,
        "chunk_size": args.chunk_size,
        "from_python_list": summary(time_ms(lambda: chunk_hashes(as_list, args.chunk_size), args.repeat), args.tokens),
        "from_int32_array": summary(time_ms(lambda: chunk_hashes(as_array, args.chunk_size), args.repeat), args.tokens),
        "target_ms": 2.0,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
