"""Chunk-hash throughput: 128k tokens, 256-token chunks; and the key work one request costs the
vLLM connector. Prints one JSON object.

    .venv/bin/python benchmarks/bench_keys.py [--tokens 131072] [--repeat 200]
        [--request-tokens 100000] [--store-steps 10] [--polls 5] [--request-repeat 50]

Target (issue 2): hashing 128k tokens in under 2 ms.

``request_keys`` times, for one prompt, the CPU work of turning it into keys and moving it
between the scheduler and a rank, in both flows:

* ``old``: the prompt as tokens everywhere. The rank hashed it for the lookup, again to pin the
  hit, and again on every store step (step *i* of *N* hands over the first (i+1)/N of the prompt,
  as chunked prefill does); every lookup poll sent the int32 prompt over the lookup channel
  (encoded, then decoded by the rank); every store step pickled its tokens into the step's
  metadata and the load pickled the prompt (unpickled by the rank).
* ``new``: the scheduler hashes once; its one ask carries the packed hashes (a lookup is never
  polled now: what is not held is offered and pulled by the load); the rank turns hashes into
  ints where it indexes them (lookup, pin, each store step); steps and the load pickle hash
  slices.
"""

import argparse
import json
import pickle
import random
import statistics
import time

import msgspec
import numpy as np

from lmcache_p2p.integration.vllm.lookup_channel import LookupRequest
from lmcache_p2p.keys import chunk_hash_array, chunk_hashes, chunk_spans, hash_list
from lmcache_p2p.protocol import pack_hashes, unpack_hashes


class _TokensLookupRequest(msgspec.Struct, tag="lookup"):
    """The lookup request as it was when it carried the prompt's tokens."""

    seq: int
    req_id: str
    tokens: bytes  # little-endian int32
    use_peers: bool
    wait_s: float


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
    return {
        "p50_ms": round(p50, 4),
        "p99_ms": round(sorted(samples)[int(len(samples) * 0.99) - 1], 4),
        "mtokens_per_s": round(tokens / p50 / 1e3, 1),
    }


def spread(samples: list[float]) -> dict:
    deciles = statistics.quantiles(samples, n=10)
    return {
        "p50_ms": round(statistics.median(samples), 3),
        "p10_ms": round(deciles[0], 3),
        "p90_ms": round(deciles[-1], 3),
    }


def request_keys(tokens: np.ndarray, chunk_size: int, store_steps: int, polls: int, repeat: int) -> dict:
    """Old against new per-request key work for one prompt (int32 ``tokens``); see the module doc."""
    encoder = msgspec.msgpack.Encoder()
    old_decoder = msgspec.msgpack.Decoder(_TokensLookupRequest)
    new_decoder = msgspec.msgpack.Decoder(LookupRequest)
    n = len(tokens)
    step_ends = [(i + 1) * n // store_steps // chunk_size * chunk_size for i in range(store_steps)]

    def old() -> None:
        for seq in range(polls):  # the rank decoded every poll; the first one's tokens started the lookup
            as_bytes = np.asarray(tokens, dtype="<i4").tobytes()
            wire = encoder.encode(_TokensLookupRequest(seq, "req", as_bytes, True, 0.0))
            request = old_decoder.decode(wire)
            if seq == 0:
                asked = np.frombuffer(request.tokens, dtype="<i4").astype(np.int32)
        chunk_hash_array(asked, chunk_size).tolist()  # lookup
        chunk_spans(asked, chunk_size)  # pin the hit
        pickle.loads(pickle.dumps(tokens))  # the load's spec
        for end in step_ends:
            step = pickle.loads(pickle.dumps(tokens[:end]))  # the step's spec
            chunk_spans(step, chunk_size)  # the store

    def new() -> None:
        hashes = chunk_hash_array(tokens, chunk_size)  # the scheduler, once
        wire = encoder.encode(LookupRequest(0, "req", True, hashes=pack_hashes(hashes), num_tokens=n))
        held = unpack_hashes(new_decoder.decode(wire).hashes)  # asked once: a lookup is never polled now
        hash_list(held)  # lookup
        hash_list(held)  # pin the hit
        pickle.loads(pickle.dumps(hashes))  # the load's spec
        for end in step_ends:
            hash_list(pickle.loads(pickle.dumps(hashes[: end // chunk_size])))  # the step's spec, the store

    old_ms, new_ms = time_ms(old, repeat), time_ms(new, repeat)
    saved = statistics.median(old_ms) - statistics.median(new_ms)
    return {
        "prompt_tokens": n,
        "chunk_size": chunk_size,
        "store_steps": store_steps,
        "polls": polls,
        "repeat": repeat,
        "old": spread(old_ms),
        "new": spread(new_ms),
        "saved_p50_ms": round(saved, 3),
        "saved_p50_pct": round(100 * saved / statistics.median(old_ms), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=131_072)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--request-tokens", type=int, default=100_000)
    ap.add_argument("--store-steps", type=int, default=10)
    ap.add_argument("--polls", type=int, default=5)
    ap.add_argument("--request-repeat", type=int, default=50)
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
        "request_keys": request_keys(
            np.array([rng.randrange(128_256) for _ in range(args.request_tokens)], dtype=np.int32),
            args.chunk_size,
            args.store_steps,
            args.polls,
            args.request_repeat,
        ),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
