"""Chunk keys: deterministic chained 64-bit hashes over token ids, and the layout fingerprint.

The hash of chunk *i* covers every token before it, so equal hashes mean equal prefixes:

    h_{-1} = ROOT_HASH
    h_i    = XXH3_64(tokens[i*C:(i+1)*C] as little-endian int32, seed=h_{i-1})

XXH3 is specified byte-for-byte and seeded explicitly, so the hashes are identical across
processes, machines and PYTHONHASHSEED values (the original needed PYTHONHASHSEED=123 on every
process because it used Python's ``hash``). The controller computes the same hashes for
``/lookup`` from this module alone: it needs xxhash and numpy, never torch or vLLM.

Tenants (key format 2). vLLM's prefix cache shares a block between two requests only when their
cache_salt, LoRA adapter, multimodal inputs and prompt embeddings agree too; our keys carry the
same material, so two requests vLLM would not share never share through any tier or peer:

    h_{-1} = identity.root()        (ROOT_HASH for a request without salt and adapter)
    M_i    = [(identifier, offset - i*C, length) of every multimodal item overlapping chunk i]
    seed_i = h_{i-1}                                            when M_i is empty
             XXH3_64(MM_TAG + msgpack(M_i), seed=h_{i-1})      otherwise
    h_i    = XXH3_64(tokens[i*C:(i+1)*C] as little-endian int32, seed=seed_i)

The material folds into seeds, never into the hashed token bytes, so a request with none of it
(no salt, no adapter, no multimodal item) keys exactly as format 1 did: stored chunks keep their
keys across the upgrade. Requests with prompt embeddings are not keyed at all (tenancy.py).
The layout's ``key_format`` tells engines with different rules apart (:class:`LayoutFingerprint`).
"""

from __future__ import annotations

import asyncio
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

# The rules chunk keys are made by: 1, tokens only; 2, plus the request's identity (cache_salt,
# LoRA adapter) and multimodal items. Keys of plain requests are the same under both. Engines of
# different formats never exchange chunks: it is part of the layout's exchange digest.
KEY_FORMAT = 2
IDENTITY_TAG = b"lmcache-p2p/identity/v1\x00"
MM_TAG = b"lmcache-p2p/mm/v1\x00"
_msgpack = msgspec.msgpack.Encoder()

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


class KeyIdentity(msgspec.Struct, frozen=True):
    """Who a request's KV belongs to, beyond its tokens: its cache_salt and its LoRA adapter.

    ``lora_id`` tells two adapters with one name apart (32 hex characters: a digest of the
    adapter's path and weights, adapter_id.py); it is set whenever ``lora_name`` is. An empty salt
    is no salt, as in vLLM. The salt is never printed: :meth:`salt_tag` names it in logs."""

    cache_salt: str | None = None
    lora_name: str | None = None
    lora_id: str | None = None

    @property
    def plain(self) -> bool:
        """No salt and no adapter: keys are format 1's."""
        return not self.cache_salt and self.lora_name is None

    def fold(self, seed: int) -> int:
        """``seed`` with this identity folded in (``seed`` itself when plain): the root of a
        request's prefix chain (seeded with ROOT_HASH) or of its segments' (SEGMENT_ROOT_HASH)."""
        if self.plain:
            return seed
        parts: list[tuple[str, ...]] = []
        if self.lora_name is not None:
            parts.append(("lora", self.lora_name, self.lora_id or ""))
        if self.cache_salt:
            parts.append(("salt", self.cache_salt))
        return _xxh3(IDENTITY_TAG + _msgpack.encode(parts), seed)

    def root(self) -> int:
        return self.fold(ROOT_HASH)

    def salt_tag(self) -> str | None:
        """The salt as logs and answers show it: ``salt#`` and 8 hex digits of a hash of it."""
        return salt_tag(self.cache_salt)


def salt_tag(cache_salt: str | None) -> str | None:
    """``salt#<8 hex>``: a short digest that tells salts apart in logs without revealing one."""
    if not cache_salt:
        return None
    return f"salt#{_xxh3(b'lmcache-p2p/salt-tag/v1' + cache_salt.encode('utf-8')) & 0xFFFFFFFF:08x}"


class MMPlacement(NamedTuple):
    """One multimodal item of a prompt: vLLM's identifier of it (its content hash, or the user's
    uuid) and the placeholder tokens it takes, [offset, offset + length)."""

    identifier: str
    offset: int
    length: int


def chunk_spans(
    tokens: TokenIds, chunk_size: int, *, identity: KeyIdentity | None = None, mm: Sequence[MMPlacement] = ()
) -> list[ChunkSpan]:
    """(start, end, hash) for every *full* chunk of ``tokens``; a partial tail is not a chunk."""
    return list(iter_chunk_spans(tokens, chunk_size, identity=identity, mm=mm))


def iter_chunk_spans(
    tokens: TokenIds, chunk_size: int, *, identity: KeyIdentity | None = None, mm: Sequence[MMPlacement] = ()
) -> Iterator[ChunkSpan]:
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    data = _as_int32_bytes(tokens)
    step = chunk_size * 4
    h = ROOT_HASH if identity is None else identity.root()
    if not mm:  # format 1's loop: plain requests key exactly as before
        for start in range(0, len(data) - step + 1, step):
            h = _xxh3(data[start : start + step], h)
            yield ChunkSpan(start // 4, start // 4 + chunk_size, h)
        return
    items = sorted(mm, key=lambda f: (f.offset, f.length, f.identifier))
    first = 0  # items before this one end before the current chunk
    for start in range(0, len(data) - step + 1, step):
        lo = start // 4
        hi = lo + chunk_size
        while first < len(items) and items[first].offset + items[first].length <= lo:
            first += 1
        material = []
        k = first
        while k < len(items) and items[k].offset < hi:
            item = items[k]
            if item.offset + item.length > lo:
                material.append((item.identifier, item.offset - lo, item.length))
            k += 1
        seed = _xxh3(MM_TAG + _msgpack.encode(material), h) if material else h
        h = _xxh3(data[start : start + step], seed)
        yield ChunkSpan(lo, hi, h)


def chunk_hashes(
    tokens: TokenIds, chunk_size: int, *, identity: KeyIdentity | None = None, mm: Sequence[MMPlacement] = ()
) -> list[int]:
    """Just the chained hashes of the full chunks, in order."""
    return [span.chunk_hash for span in iter_chunk_spans(tokens, chunk_size, identity=identity, mm=mm)]


def chunk_hash_array(
    tokens: TokenIds, chunk_size: int, *, identity: KeyIdentity | None = None, mm: Sequence[MMPlacement] = ()
) -> np.ndarray:
    """The same hashes as a uint64 array, the form the controller's index and the wire take."""
    spans = iter_chunk_spans(tokens, chunk_size, identity=identity, mm=mm)
    return np.fromiter((s.chunk_hash for s in spans), dtype=np.uint64)


def hash_list(hashes: ChunkHashes) -> list[int]:
    """``hashes`` as Python ints, the form chunk keys are made of (a numpy scalar in a key would
    compare equal but is another type)."""
    return hashes.tolist() if isinstance(hashes, np.ndarray) else [int(h) for h in hashes]


def payload_checksum(payload) -> int:
    """Checksum carried with every stored or transferred chunk payload (any bytes-like)."""
    # The hasher object, not the one-shot function: its update lets go of the GIL on buffers over
    # 64 KB, so the pages of a transfer are hashed on several cores at once (in_parallel).
    return xxhash.xxh3_64(payload).intdigest()


# Payloads up to this size are hashed where they are (~0.1 ms at XXH3's ~30 GB/s), not on
# threads: on an engine's busy host the hop to a thread and back hands the GIL around a loaded core
# several times, and costs more than the hashing (a 1 MiB pull's answer took seconds under CI load).
INLINE_HASH_BYTES = 4 << 20

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


async def hashed(fn: Callable[[T], R], items: Sequence[T], nbytes: float) -> list[R]:
    """``[fn(x) for x in items]`` for an event loop: in place when they hash ``nbytes`` of at
    most :data:`INLINE_HASH_BYTES`, else :func:`in_parallel` on a thread (``nbytes`` infinite for
    work that must not run on the loop, such as a device copy)."""
    if nbytes <= INLINE_HASH_BYTES:
        return [fn(x) for x in items]
    return await asyncio.to_thread(in_parallel, fn, items)


class _LayoutV1(msgspec.Struct, frozen=True):
    """The layout as format 1 encoded it: the same fields in the same order, so the same bytes and
    the same digest. It names the chunks' storage namespace, which formats 1 and 2 share."""

    model: str
    dtype: str
    block_size: int
    block_shape: tuple[int, ...]
    block_stride: tuple[int, ...]
    num_layers: int
    tp_size: int = 1
    tp_rank: int = 0


class LayoutFingerprint(msgspec.Struct, frozen=True):
    """What must match for one engine rank's chunk pages to be usable by another.

    Payloads are the engine's own paged-cache blocks as opaque bytes, so two ranks may exchange
    chunks only when every field here is equal (DESIGN.md §4). ``key_format`` is the rule their
    chunk keys were made by (:data:`KEY_FORMAT`); a sender that does not say is format 1.
    """

    model: str
    dtype: str
    block_size: int
    block_shape: tuple[int, ...]  # one layer's block, e.g. (2, 16, 8, 128) for GPU flash
    block_stride: tuple[int, ...]
    num_layers: int
    tp_size: int = 1
    tp_rank: int = 0
    key_format: int = 1

    @property
    def storage_digest(self) -> int:
        """The namespace of this layout's stored chunks (ChunkKey, disk directories, remote keys):
        format 1's digest for every key format, so chunks stored before an upgrade keep their
        address (plain keys are the same under both formats)."""
        fields = {f: getattr(self, f) for f in _LayoutV1.__struct_fields__}
        return _xxh3(msgspec.msgpack.encode(_LayoutV1(**fields)))

    @property
    def digest(self) -> int:
        """A 64-bit id of this layout and key format, stable across processes: what two ranks
        exchanging chunks must share (peer hellos and pulls compare it; the controller groups
        peers by it). Format 1's is its storage digest, as before."""
        if self.key_format == 1:
            return self.storage_digest
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
