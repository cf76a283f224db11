"""A CPU stand-in for an engine rank: paged KV tensors of a real model's shape, a deterministic
"prefill", and the real :class:`CacheEngine` on top. Tests and benchmarks run it as a process
(``python -m lmcache_p2p.testing.standin``) to exercise workers, the controller and P2P transfers
without an inference engine; operators can use it to smoke-test a mesh.

The KV of a chunk is a pure function of its chained hash (so of the whole prefix) and the TP
rank: two instances that "prefill" the same prompt hold identical bytes, and a chunk that
landed in the wrong rank or the wrong blocks is detected by :meth:`StandInKV.matches`.

Process protocol (:mod:`lmcache_p2p.testing.jsonlines`): one JSON object per line on stdin, one
JSON answer per line on stdout (logs go to stderr). Operations: ``prefill``, ``fill``, ``lookup``,
``offer``, ``retrieve``, ``corrupt``, ``clear``, ``status``, ``flush``, ``quit``; see :func:`handler`.
Requests name prompts by their tokens; the handler hashes them into chunk keys once per request,
as the vLLM connector's scheduler half does, and the engine sees only the keys. A request may
carry the identity a vLLM request's keys are made with: ``cache_salt``, ``lora`` ([name,
lora_id]) and ``mm`` ([[identifier, offset, length], ...]).

``LMCACHE_TEST_KEY_FORMAT=1`` starts a stand-in whose layout says key format 1: an engine from
before tenant-safe keys, for the tests of what separates the two.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmcache_p2p.keys import (
    KEY_FORMAT,
    ChunkHashes,
    KeyIdentity,
    LayoutFingerprint,
    MMPlacement,
    chunk_hash_array,
    hash_list,
)
from lmcache_p2p.testing import jsonlines, sync_engine


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    kv_heads: int
    head_size: int
    dtype: torch.dtype = torch.bfloat16
    block_size: int = 16


MODEL_SHAPES = {
    "llama-3.1-8b": ModelShape("meta-llama/Llama-3.1-8B", num_layers=32, kv_heads=8, head_size=128),
    "qwen2.5-0.5b": ModelShape("Qwen/Qwen2.5-0.5B", num_layers=24, kv_heads=2, head_size=64),
}


class StandInKV:
    """Per-layer paged KV in vLLM's GPU flash layout ``[num_blocks, 2, block_size, heads, head_size]``."""

    def __init__(self, shape: ModelShape, num_blocks: int, tp_size: int = 1, tp_rank: int = 0, device: str = "cpu"):
        if shape.kv_heads % tp_size:
            raise ValueError(f"{shape.kv_heads} KV heads do not split over tp_size={tp_size}")
        self.shape = shape
        self.tp_size, self.tp_rank = tp_size, tp_rank
        block = (2, shape.block_size, shape.kv_heads // tp_size, shape.head_size)
        self.layers = [
            torch.zeros(num_blocks, *block, dtype=shape.dtype, device=device) for _ in range(shape.num_layers)
        ]

    def layout(self) -> LayoutFingerprint:
        first = self.layers[0]
        return LayoutFingerprint(
            model=self.shape.name,
            dtype=str(first.dtype).removeprefix("torch."),
            block_size=self.shape.block_size,
            block_shape=tuple(first.shape[1:]),
            block_stride=tuple(first.stride()[1:]),
            num_layers=len(self.layers),
            tp_size=self.tp_size,
            tp_rank=self.tp_rank,
            key_format=int(os.environ.get("LMCACHE_TEST_KEY_FORMAT", KEY_FORMAT)),
        )

    @property
    def chunk_bytes_per_token(self) -> int:
        return self.layout().bytes_per_token

    def chunk_payload(self, chunk_hash: int, chunk_size: int) -> torch.Tensor:
        """The bytes a real prefill of this chunk would produce here (rank-specific)."""
        nbytes = chunk_size * self.chunk_bytes_per_token
        seed = (chunk_hash ^ (0x9E3779B97F4A7C15 * (self.tp_rank + 1))) & 0x7FFFFFFFFFFFFFFF
        words = torch.arange(nbytes // 8, dtype=torch.int64).mul_(0x5DEECE66D).add_(seed)
        return words.view(torch.uint8)

    def _blocks(self, index: int, chunk_size: int, block_ids: Sequence[int]) -> list[int]:
        """The blocks of chunk ``index``."""
        per_chunk = chunk_size // self.shape.block_size
        return list(block_ids[index * per_chunk : (index + 1) * per_chunk])

    def prefill(self, chunk_hashes: ChunkHashes, block_ids: Sequence[int], chunk_size: int) -> None:
        """Write the KV of the prompt whose chunks are ``chunk_hashes`` into ``block_ids``."""
        from lmcache_p2p.gpu_ops import scatter_chunk

        for index, chunk_hash in enumerate(hash_list(chunk_hashes)):
            scatter_chunk(
                self.chunk_payload(chunk_hash, chunk_size), self.layers, self._blocks(index, chunk_size, block_ids)
            )

    def matches(self, chunk_hashes: ChunkHashes, block_ids: Sequence[int], chunk_size: int, num_tokens: int) -> bool:
        """Whether the blocks of the first ``num_tokens`` hold exactly what prefill would put there."""
        from lmcache_p2p.gpu_ops import gather_chunk

        page = torch.empty(chunk_size * self.chunk_bytes_per_token, dtype=torch.uint8)
        for index, chunk_hash in enumerate(hash_list(chunk_hashes)[: num_tokens // chunk_size]):
            gather_chunk(self.layers, self._blocks(index, chunk_size, block_ids), page)
            if not torch.equal(page, self.chunk_payload(chunk_hash, chunk_size)):
                return False
        return True

    def wipe(self) -> None:
        for layer in self.layers:
            layer.zero_()


def request_identity(request: dict) -> tuple[KeyIdentity | None, tuple[MMPlacement, ...]]:
    """A request's ``cache_salt``, ``lora`` ([name, lora_id]) and ``mm`` fields as key material."""
    lora = request.get("lora")
    ident = KeyIdentity(
        cache_salt=request.get("cache_salt") or None,
        lora_name=lora[0] if lora else None,
        lora_id=lora[1] if lora else None,
    )
    mm = tuple(MMPlacement(str(i), int(o), int(n)) for i, o, n in request.get("mm") or ())
    return (None if ident.plain else ident), mm


def handler(engine, kv: StandInKV, chunk_size: int, prefill_tokens_per_s: float | None = None):
    """The stand-in's operations, for :func:`lmcache_p2p.testing.jsonlines.serve`. With
    ``prefill_tokens_per_s``, each ``prefill`` is reported to the engine as a forward pass at
    that rate (its measured prefill rate, which the pull policy weighs pulls against)."""
    blocks = list(range(kv.layers[0].shape[0]))

    def handle(request: dict) -> dict:
        op = request["op"]
        t0 = time.perf_counter()  # "ms" covers the whole op, hashing the prompt included
        tokens = request.get("tokens", [])
        identity, mm = request_identity(request)
        if identity is not None and identity.lora_name is not None:
            engine.note_adapter(identity.lora_name, identity.lora_id)  # as the connector's worker half does
        # the prompt's keys, once
        num_tokens, hashes = len(tokens), chunk_hash_array(tokens, chunk_size, identity=identity, mm=mm)
        answer: dict[str, Any]
        if op == "prefill":
            kv.prefill(hashes, blocks, chunk_size)
            if prefill_tokens_per_s:
                engine.observe_prefill(num_tokens, num_tokens / prefill_tokens_per_s)
            answer = {"stored": sync_engine.store(engine, hashes, kv.layers, blocks, num_tokens=num_tokens)}
        elif op == "fill":  # store the chunks' payloads with no KV tensors involved (benchmarks)
            answer = {
                "stored": chunk_size
                * sum(engine.storage.put(h, kv.chunk_payload(h, chunk_size)) for h in hash_list(hashes))
            }
        elif op == "corrupt":  # flip one byte of a stored chunk after its checksum (fault tests)
            chunk = engine.storage.pin(int(hashes[request["chunk"]]))
            with chunk:
                _ = chunk.checksum  # the stored checksum keeps describing the good bytes
                chunk.data[12345] ^= 0xFF
            answer = {}
        elif op == "clear":
            answer = {"dropped": engine.storage.clear()}
        elif op == "lookup":
            answer = {"hit": sync_engine.lookup(engine, hashes, num_tokens, fetch_missing=request.get("peers", True))}
        elif op == "offer":  # an engine's peer lookup alone (its scheduler's question, nothing pulled)
            first = engine.lookup_async(hashes)
            answer = {
                "local": len(first.sources),
                "offered": first.offer.chunks if first.offer is not None else 0,
                "miss": first.miss.reason if first.miss is not None else None,
                "detail": first.miss.detail if first.miss is not None else "",
            }
        elif op == "lookup_together":  # several prompts' peer pulls started at once, as vLLM's
            # scheduler does with requests that arrive together: when each pull ended (s from start),
            # the chunks each was offered and pulled, and why not more
            # (each prompt's peer offer, then its pull, as a granted load starts it)
            lookups = [engine.lookup_async(chunk_hash_array(p, chunk_size)) for p in request["prompts"]]
            offers = [lookup.offer for lookup in lookups]
            futures = [engine.pull_offer_async(offer) if offer is not None else None for offer in offers]
            done_s: list = [None] * len(futures)
            for i, future in enumerate(futures):
                if future is not None:
                    future.add_done_callback(lambda _, i=i: done_s.__setitem__(i, time.perf_counter() - t0))
            pulled = [future.result(timeout=60) if future is not None else None for future in futures]
            # A future's callbacks run just after its waiters wake: wait for the last one's time.
            while any(f is not None and d is None for f, d in zip(futures, done_s, strict=True)):
                time.sleep(0.001)
            answer = {
                "done_s": done_s,
                "offered": [offer.chunks if offer is not None else 0 for offer in offers],
                "pulled": [p.chunks if p is not None else 0 for p in pulled],
                # why a pull ended short, or why none was offered (None: held whole, here or pulled)
                "miss": [
                    (p.miss.reason if p.miss is not None else None)
                    if p is not None
                    else (lookup.miss.reason if lookup.miss is not None else None)
                    for p, lookup in zip(pulled, lookups, strict=True)
                ],
            }
        elif op == "retrieve":
            kv.wipe()
            n = sync_engine.retrieve(engine, hashes, kv.layers, blocks, num_tokens=num_tokens)
            answer = {"retrieved": n, "exact": kv.matches(hashes, blocks, chunk_size, n)}
        elif op == "status":
            answer = engine.status()
        elif op == "flush":
            engine.flush()
            answer = {}
        else:
            raise ValueError(f"unknown op {op!r}")
        answer["ms"] = (time.perf_counter() - t0) * 1e3
        return answer

    return handle


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lmcache_p2p.testing.standin", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODEL_SHAPES), default="llama-3.1-8b")
    parser.add_argument("--num-blocks", type=int, default=256, help="KV blocks per layer")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where the KV tensors live (cpu, cuda, cuda:1...)")
    parser.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=None,
        help="report each prefill to the engine as computed at this rate (a measured prefill rate; "
        "without it the rate stays at its start-up value: prefill_tokens_per_s, else the device default)",
    )
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    answers = jsonlines.claim_stdout()
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from lmcache_p2p.config import LMCacheConfig
    from lmcache_p2p.worker import build_engine

    config = LMCacheConfig.load()
    kv = StandInKV(MODEL_SHAPES[args.model], args.num_blocks, args.tp_size, args.rank, args.device)
    device = kv.layers[0].device
    engine = build_engine(config, kv.layout(), rank=args.rank, device=device if device.type == "cuda" else None)
    jsonlines.answer(answers, {"ok": True, "ready": True, "page_bytes": engine.storage.page_bytes})
    try:
        jsonlines.serve(handler(engine, kv, config.chunk_size, args.prefill_tokens_per_s), sys.stdin, answers)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
