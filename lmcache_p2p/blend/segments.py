"""Segments of a prompt for non-prefix reuse (CacheBlend, issue 23): where they are and their keys.

A blended prompt is text segments joined by a separator string (``blend_special_str``, default
``" # # "``): a system prompt, retrieved documents in any order, a question. A segment's KV is
stored under keys of *its own tokens*, not chained to what precedes it, so the same document
after another system prompt or in another place hits:

    s_{-1} = SEGMENT_ROOT_HASH
    s_i    = XXH3_64(segment[i*C:(i+1)*C] as little-endian int32, seed=s_{i-1})     (full chunks)
    tail   = XXH3_64(the rest as little-endian int32 + its length as int32, seed=s_last)

The root differs from prefix chunks' (keys.ROOT_HASH), so a segment chunk is never mistaken for
the prefix chunk of the same tokens (their KV differs: a segment's is computed without context
and stored at positions normalised to 0). The tail is a key of its own: a document rarely ends on
a chunk boundary, and dropping its last partial chunk (as prefix chunks do) would leave those
tokens to recompute in every reuse. Its length goes into the hash so tails of different lengths
with the same leading bytes cannot collide.

The separator is found by token ids, as the tokenizer produces it *inside* a text: a BPE
tokenizer merges a leading or trailing space into the neighbouring word, so ``encode(" # # ")``
alone often is not what appears between two segments (the original matched the isolated
encoding and missed). :func:`separator_ids` takes the ids from an encoding in context.

Pure numpy and xxhash, like keys.py: the controller may compute these too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import xxhash

from lmcache_p2p.keys import KeyIdentity, TokenIds

_xxh3 = xxhash.xxh3_64_intdigest

# The root of every segment's chain; carries the format version like keys.ROOT_HASH.
SEGMENT_ROOT_HASH: int = _xxh3(b"lmcache-p2p/segment-hash/v1")
DEFAULT_SEPARATOR = " # # "


class Segment(NamedTuple):
    """tokens[start:end] of a prompt: one segment, separators excluded."""

    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


class SegmentChunk(NamedTuple):
    """One keyed piece of a segment: its tokens [start, end) within the *segment* (0-based) and
    its key. Every piece is ``chunk_size`` long but the last, which may be shorter."""

    start: int
    end: int
    key: int


def separator_ids(encode: Callable[[str], Sequence[int]], separator: str = DEFAULT_SEPARATOR) -> list[int]:
    """The token ids ``separator`` becomes between two words, as ``encode`` (a tokenizer's encode
    without special tokens) produces them in context. A trailing space goes with the next word,
    as BPE tokenizers merge it (`` # # Omega`` -> `` #``, `` #``, `` Omega``): the separator is
    the ids before the space-led word, and a segment after a separator starts with a space-led
    token (the same text at the very start of a prompt tokenizes without it, and keys apart).
    Raises ValueError when the separator vanishes into its neighbours."""
    if not separator:
        raise ValueError("blend_special_str is empty: segments need a separator")
    left = list(encode("Alpha"))
    both = list(encode("Alpha" + separator + "Omega"))
    start = 0
    while start < min(len(left), len(both)) and left[start] == both[start]:
        start += 1
    for word in (" Omega", "Omega"):
        right = list(encode(word))
        if start == len(left) and len(both) - start > len(right) and both[len(both) - len(right) :] == right:
            return both[start : len(both) - len(right)]
    raise ValueError(
        f"blend_special_str {separator!r} does not survive tokenization between two words "
        f"(encoded in context: {both}); choose a separator the tokenizer keeps as tokens of its own"
    )


def split_segments(tokens: TokenIds, separator: Sequence[int]) -> list[Segment]:
    """The segments of ``tokens`` between occurrences of ``separator`` (token ids), in order,
    empty ones left out. A prompt without a separator is one segment."""
    ids = np.asarray(tokens, dtype=np.int64)
    sep = np.asarray(separator, dtype=np.int64)
    n, m = len(ids), len(sep)
    if m == 0:
        raise ValueError("empty separator")
    starts: list[int] = []
    if n >= m:
        # Candidate positions where the first separator token occurs, confirmed in full; matches
        # do not overlap (scan left to right).
        candidates = np.flatnonzero(ids[: n - m + 1] == sep[0])
        next_free = 0
        for pos in candidates.tolist():
            if pos >= next_free and np.array_equal(ids[pos : pos + m], sep):
                starts.append(pos)
                next_free = pos + m
    segments = []
    begin = 0
    for pos in starts:
        if pos > begin:
            segments.append(Segment(begin, pos))
        begin = pos + m
    if begin < n:
        segments.append(Segment(begin, n))
    return segments


def segment_chunks(
    segment_tokens: TokenIds, chunk_size: int, identity: KeyIdentity | None = None
) -> list[SegmentChunk]:
    """The keyed pieces of one segment's tokens: full chunks chained from SEGMENT_ROOT_HASH (with
    the request's identity folded in: a salted request's segments are its tenant's alone), then
    the partial tail (if any) keyed with its length."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    data = np.ascontiguousarray(np.asarray(segment_tokens, dtype="<i4"))
    n = len(data)
    out = []
    h = SEGMENT_ROOT_HASH if identity is None else identity.fold(SEGMENT_ROOT_HASH)
    full = n - n % chunk_size
    for start in range(0, full, chunk_size):
        h = _xxh3(data[start : start + chunk_size].tobytes(), h)
        out.append(SegmentChunk(start, start + chunk_size, h))
    if full < n:
        tail = data[full:].tobytes() + np.int32(n - full).astype("<i4").tobytes()
        out.append(SegmentChunk(full, n, _xxh3(tail, h)))
    return out
