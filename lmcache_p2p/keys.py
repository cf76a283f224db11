"""Chunk keys: deterministic chained 64-bit hashes over token ids, and the layout fingerprint.

The hash of chunk *i* covers every token before it, so equal hashes mean equal prefixes:

    h_{-1} = ROOT_HASH
    h_i    = XXH3_64(tokens[i*C:(i+1)*C] as little-endian int32, seed=h_{i-1})

XXH3 is specified byte-for-byte and seeded explicitly, so the hashes are identical across
processes, machines and PYTHONHASHSEED values (the original needed PYTHONHASHSEED=123 on every
process because it used Python's ``hash``). The controller computes the same hashes for
``/lookup`` from this module alone: it needs xxhash and numpy, never torch or vLLM.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, TypeVar

import msgspec
import numpy as np
import xxhash

_xxh3 = xxhash.xxh3_64_intdigest
T = TypeVar("T")
R = TypeVar("R")

# The chain's root: XXH3 of a fixed tag. Changing it (or the token encoding) invalidates every
# stored key, so it carries the format version.
ROOT_HASH: int = _xxh3(b"lmcache-p2p/chunk-hash/v1")

TokenIds = Sequence[int] | np.ndarray
# A prompt's chained chunk hashes in order: a uint64 array (computed once per request, what the
# wire carries) or Python ints.
ChunkHashes = Sequence[int] | np.ndarray


class ChunkSpan(NamedTuple):
    """One full chunk of a token list: tokens[start:end] and its chained hash."""

    start: int
    end: int
    chunk_hash: int


def _as_int32_bytes(tokens: TokenIds) -> memoryview:
    if isinstance(tokens, np.ndarray):
        arr = tokens.astype("<i4", copy=False)
    elif hasattr(tokens, "numpy"):  # a torch tensor: keep torch an optional import here
        arr = tokens.numpy().astype("<i4", copy=False)
    else:
        arr = np.fromiter(tokens, dtype="<i4", count=len(tokens))
    return np.ascontiguousarray(arr).data.cast("B")


def chunk_spans(tokens: TokenIds, chunk_size: int) -> list[ChunkSpan]:
    """(start, end, hash) for every *full* chunk of ``tokens``; a partial tail is not a chunk."""
    return list(iter_chunk_spans(tokens, chunk_size))


def iter_chunk_spans(tokens: TokenIds, chunk_size: int) -> Iterator[ChunkSpan]:
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    data = _as_int32_bytes(tokens)
    step = chunk_size * 4
    h = ROOT_HASH
    for start in range(0, len(data) - step + 1, step):
        h = _xxh3(data[start : start + step], h)
        yield ChunkSpan(start // 4, start // 4 + chunk_size, h)


def chunk_hashes(tokens: TokenIds, chunk_size: int) -> list[int]:
    """Just the chained hashes of the full chunks, in order."""
    return [span.chunk_hash for span in iter_chunk_spans(tokens, chunk_size)]


def chunk_hash_array(tokens: TokenIds, chunk_size: int) -> np.ndarray:
    """The same hashes as a uint64 array, the form the controller's index and the wire take."""
    return np.fromiter((s.chunk_hash for s in iter_chunk_spans(tokens, chunk_size)), dtype=np.uint64)


def hash_list(hashes: ChunkHashes) -> list[int]:
    """``hashes`` as Python ints, the form chunk keys are made of (a numpy scalar in a key would
    compare equal but is another type)."""
    return hashes.tolist() if isinstance(hashes, np.ndarray) else [int(h) for h in hashes]


def payload_checksum(payload) -> int:
    """Checksum carried with every stored or transferred chunk payload (any bytes-like)."""
    # The hasher object, not the one-shot function: its update lets go of the GIL on buffers over
    # 64 KB, so the pages of a transfer are hashed on several cores at once (in_parallel).
    return xxhash.xxh3_64(payload).intdigest()


_parallel_pool: ThreadPoolExecutor | None = None
_parallel_lock = threading.Lock()


def in_parallel(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``[fn(x) for x in items]`` on a shared pool of threads (checksums of a batch of pages:
    one 32 MiB page takes ~3 ms on one core, and a peer pull moves dozens per request)."""
    global _parallel_pool
    if len(items) <= 1:
        return [fn(x) for x in items]
    with _parallel_lock:
        if _parallel_pool is None:
            _parallel_pool = ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="lmcache-checksum")
    return list(_parallel_pool.map(fn, items))


class LayoutFingerprint(msgspec.Struct, frozen=True):
    """What must match for one engine rank's chunk pages to be usable by another.

    Payloads are the engine's own paged-cache blocks as opaque bytes, so two ranks may exchange
    chunks only when every field here is equal (DESIGN.md §4).
    """

    model: str
    dtype: str
    block_size: int
    block_shape: tuple[int, ...]  # one layer's block, e.g. (2, 16, 8, 128) for GPU flash
    block_stride: tuple[int, ...]
    num_layers: int
    tp_size: int = 1
    tp_rank: int = 0

    @property
    def digest(self) -> int:
        """A 64-bit id of this layout, stable across processes (used in keys and file names)."""
        return _xxh3(msgspec.msgpack.encode(self))

    @property
    def bytes_per_token(self) -> int:
        """All layers' K and V bytes for one token (payload size = chunk_size * this)."""
        elems = 1
        for d in self.block_shape:
            elems *= d
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"unknown KV cache dtype {self.dtype!r}; expected one of {sorted(_DTYPE_BYTES)}")
        return elems * _DTYPE_BYTES[self.dtype] * self.num_layers // self.block_size


_DTYPE_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "uint8": 1,
}


class ChunkKey(msgspec.Struct, frozen=True, order=True):
    """A chunk's identity: the layout it was stored under and its chained token hash."""

    fingerprint: int
    chunk_hash: int

    def __str__(self) -> str:
        return f"{self.fingerprint:016x}:{self.chunk_hash:016x}"

    @classmethod
    def parse(cls, text: str) -> ChunkKey:
        fp, _, h = text.partition(":")
        return cls(int(fp, 16), int(h, 16))
