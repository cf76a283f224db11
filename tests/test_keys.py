"""Chunk keys: chained, deterministic across processes and PYTHONHASHSEED, prefix-faithful."""

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from lmcache_p2p.keys import ChunkKey, LayoutFingerprint, chunk_hashes, chunk_spans

TOKENS = [random.Random(7).randrange(128_256) for _ in range(1000)]

LLAMA_8B = LayoutFingerprint(
    model="meta-llama/Llama-3.1-8B",
    dtype="bfloat16",
    block_size=16,
    block_shape=(2, 16, 8, 128),
    block_stride=(32768, 2048, 128, 1),
    num_layers=32,
)


def test_full_chunks_only_with_their_spans():
    spans = chunk_spans(TOKENS, 256)
    assert [(s.start, s.end) for s in spans] == [(0, 256), (256, 512), (512, 768)]
    assert chunk_spans(TOKENS[:255], 256) == []


def test_hash_is_chained_over_the_whole_prefix():
    base = chunk_hashes(TOKENS, 256)
    changed = list(TOKENS)
    changed[300] += 1  # inside chunk 1
    other = chunk_hashes(changed, 256)
    assert other[0] == base[0] and other[1] != base[1] and other[2] != base[2]
    # A prefix of the tokens hashes to a prefix of the hashes.
    assert chunk_hashes(TOKENS[:600], 256) == base[:2]
    # Same chunk content at another position is another key (it follows a different prefix).
    assert chunk_hashes(TOKENS[256:512] * 2, 256)[1] != chunk_hashes(TOKENS[256:512], 256)[0]


def test_lists_arrays_and_tensors_agree():
    expected = chunk_hashes(TOKENS, 128)
    assert chunk_hashes(np.array(TOKENS, dtype=np.int64), 128) == expected
    assert chunk_hashes(np.array(TOKENS, dtype=np.int32), 128) == expected
    assert chunk_hashes(torch.tensor(TOKENS), 128) == expected


def test_format_is_frozen():
    """Stored keys (disk files, peers on other versions) depend on these exact values."""
    assert chunk_hashes(list(range(512)), 256) == [12307815340238632950, 173415604738354948]


def test_same_hashes_under_any_pythonhashseed():
    code = (
        "import json,sys; from lmcache_p2p.keys import chunk_hashes; "
        "print(json.dumps(chunk_hashes(json.loads(sys.stdin.read()), 256)))"
    )
    results = set()
    for seed in ("0", "123", "random", "4242"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            input=json.dumps(TOKENS),
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        results.add(out.stdout.strip())
    assert results == {json.dumps(chunk_hashes(TOKENS, 256))}


def test_layout_fingerprint_distinguishes_every_field():
    base = LLAMA_8B.digest
    variants = [
        LayoutFingerprint(**{**{f: getattr(LLAMA_8B, f) for f in LLAMA_8B.__struct_fields__}, field: value})
        for field, value in [
            ("model", "other"),
            ("dtype", "float16"),
            ("block_size", 32),
            ("block_shape", (2, 16, 8, 64)),
            ("block_stride", (1, 2, 3, 4)),
            ("num_layers", 31),
            ("tp_size", 2),
            ("tp_rank", 1),
        ]
    ]
    digests = {v.digest for v in variants}
    assert base not in digests and len(digests) == len(variants)
    assert LLAMA_8B.digest == LayoutFingerprint(**{f: getattr(LLAMA_8B, f) for f in LLAMA_8B.__struct_fields__}).digest


def test_llama_8b_chunk_is_32_mib():
    assert LLAMA_8B.bytes_per_token * 256 == 32 * 2**20


def test_chunk_key_text_round_trip():
    key = ChunkKey(LLAMA_8B.digest, chunk_hashes(TOKENS, 256)[0])
    assert ChunkKey.parse(str(key)) == key


def test_chunk_size_must_be_positive():
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_hashes(TOKENS, 0)


def test_hash_array_is_the_same_chain_as_uint64():
    from lmcache_p2p.keys import chunk_hash_array

    arr = chunk_hash_array(TOKENS, 256)
    assert arr.dtype == np.uint64 and arr.tolist() == chunk_hashes(TOKENS, 256)
    assert chunk_hash_array(TOKENS[:10], 256).tolist() == []


def test_hash_arrays_and_lists_become_the_python_ints_keys_are_made_of():
    from lmcache_p2p.keys import chunk_hash_array, hash_list

    expected = chunk_hashes(TOKENS, 256)
    for hashes in (chunk_hash_array(TOKENS, 256), expected, [np.uint64(h) for h in expected]):
        as_ints = hash_list(hashes)
        assert as_ints == expected and all(type(h) is int for h in as_ints)


def test_unknown_dtype_is_named():
    odd = LayoutFingerprint(**{**{f: getattr(LLAMA_8B, f) for f in LLAMA_8B.__struct_fields__}, "dtype": "int4"})
    with pytest.raises(ValueError, match="unknown KV cache dtype 'int4'"):
        _ = odd.bytes_per_token
