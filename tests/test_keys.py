"""Chunk keys: chained, deterministic across processes and PYTHONHASHSEED, prefix-faithful."""

import json
import os
import random
import subprocess
import sys

import msgspec
import numpy as np
import pytest
import torch

from lmcache_p2p.keys import (
    KEY_FORMAT,
    ROOT_HASH,
    ChunkKey,
    KeyIdentity,
    LayoutFingerprint,
    MMPlacement,
    chunk_hash_array,
    chunk_hashes,
    chunk_spans,
)

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
            ("key_format", 2),
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


# -- key format 2: the request's identity and multimodal items (tenants) --------------------------

PLAIN_512 = [12307815340238632950, 173415604738354948]
SQL = KeyIdentity(lora_name="sql", lora_id="00112233445566778899aabbccddeeff")


def test_requests_without_identity_keep_their_format_1_keys():
    """No mesh-wide flush on upgrade: a request with no salt, adapter or image keys as before."""
    for identity in (None, KeyIdentity(), KeyIdentity(cache_salt=""), KeyIdentity(cache_salt=None)):
        assert chunk_hashes(list(range(512)), 256, identity=identity) == PLAIN_512
        assert chunk_hash_array(list(range(512)), 256, identity=identity, mm=()).tolist() == PLAIN_512
    assert KeyIdentity().root() == ROOT_HASH == 14287894157753494900


def test_identity_keys_are_frozen():
    """Keys of salted, adapter and multimodal requests are stored too: these values are the format."""
    tokens = list(range(512))
    assert chunk_hashes(tokens, 256, identity=KeyIdentity(cache_salt="tenant-a")) == [
        9429944085672418988,
        909815262289038140,
    ]
    assert chunk_hashes(tokens, 256, identity=SQL) == [8778613100297320381, 7644705253436755387]
    salted_sql = KeyIdentity(cache_salt="tenant-a", lora_name="sql", lora_id=SQL.lora_id)
    assert chunk_hashes(tokens, 256, identity=salted_sql) == [3151032844107956619, 9938384862833033134]
    assert chunk_hashes(list(range(768)), 256, mm=[MMPlacement("img-a", 300, 100)]) == [
        PLAIN_512[0],
        13558112133085992813,
        1156639928041558728,
    ]
    assert KeyIdentity(cache_salt="tenant-a").root() == 3142784674804417745


def test_a_salt_changes_every_chunk_and_two_salts_share_none():
    a = chunk_hashes(TOKENS, 128, identity=KeyIdentity(cache_salt="tenant-a"))
    b = chunk_hashes(TOKENS, 128, identity=KeyIdentity(cache_salt="tenant-b"))
    plain = chunk_hashes(TOKENS, 128)
    assert len(a) == len(b) == len(plain) == 7
    assert not set(a) & set(b) and not set(a) & set(plain) and not set(b) & set(plain)
    # Still a chain: a prefix of the tokens hashes to a prefix of the keys.
    assert chunk_hashes(TOKENS[:300], 128, identity=KeyIdentity(cache_salt="tenant-a")) == a[:2]


def test_an_adapter_is_its_name_and_its_id():
    other_id = KeyIdentity(lora_name="sql", lora_id="ffeeddccbbaa99887766554433221100")
    other_name = KeyIdentity(lora_name="chat", lora_id=SQL.lora_id)
    keys = [chunk_hashes(TOKENS, 256, identity=i)[0] for i in (SQL, other_id, other_name, None)]
    assert len(set(keys)) == 4


def test_an_image_changes_the_chunks_from_the_one_it_overlaps_on():
    tokens = list(range(1024))
    plain = chunk_hashes(tokens, 256)
    image = chunk_hashes(tokens, 256, mm=[MMPlacement("img-a", 300, 100)])
    assert image[0] == plain[0]  # before the image: keyed as the text prefix alone
    assert image[1] != plain[1] and image[2] != plain[2] and image[3] != plain[3]
    another_image = chunk_hashes(tokens, 256, mm=[MMPlacement("img-b", 300, 100)])
    moved = chunk_hashes(tokens, 256, mm=[MMPlacement("img-a", 310, 100)])
    longer = chunk_hashes(tokens, 256, mm=[MMPlacement("img-a", 300, 101)])
    for other in (another_image, moved, longer):
        assert other[0] == plain[0] and other[1] != image[1]
    # An image spanning two chunks marks both; one in the last chunk leaves the rest as text.
    spanning = chunk_hashes(tokens, 256, mm=[MMPlacement("img-a", 500, 100)])
    assert spanning[:1] == plain[:1] and spanning[1] != plain[1] and spanning[2] != image[2]
    late = chunk_hashes(tokens, 256, mm=[MMPlacement("img-a", 800, 100)])
    assert late[:3] == plain[:3] and late[3] != plain[3]
    # The items' order in the request does not matter; their placement does.
    two = [MMPlacement("img-a", 300, 100), MMPlacement("img-b", 600, 100)]
    assert chunk_hashes(tokens, 256, mm=two) == chunk_hashes(tokens, 256, mm=two[::-1])


def test_identity_and_images_fold_together():
    tokens = list(range(768))
    salted = KeyIdentity(cache_salt="tenant-a")
    both = chunk_hashes(tokens, 256, identity=salted, mm=[MMPlacement("img-a", 300, 100)])
    assert both[0] == chunk_hashes(tokens, 256, identity=salted)[0]
    assert both[1] != chunk_hashes(tokens, 256, mm=[MMPlacement("img-a", 300, 100)])[1]


def test_salts_are_shown_as_a_short_digest_only():
    tag = KeyIdentity(cache_salt="tenant-a").salt_tag()
    assert tag is not None and tag.startswith("salt#") and len(tag) == 13 and "tenant" not in tag
    assert tag != KeyIdentity(cache_salt="tenant-b").salt_tag()
    assert KeyIdentity().salt_tag() is None


def test_segment_keys_of_a_salted_request_are_its_own():
    from lmcache_p2p.blend.segments import segment_chunks

    doc = TOKENS[:600]
    plain = [c.key for c in segment_chunks(doc, 256)]
    assert [c.key for c in segment_chunks(doc, 256, KeyIdentity())] == plain
    salted = [c.key for c in segment_chunks(doc, 256, KeyIdentity(cache_salt="tenant-a"))]
    assert not set(salted) & set(plain)


def test_format_1_layouts_keep_their_digest_and_format_2_is_another_exchange_digest():
    # LLAMA_8B.digest before key formats existed: disk directories and remote keys use it.
    assert LLAMA_8B.key_format == 1 and LLAMA_8B.digest == 3310875617721177190
    v2 = msgspec.structs.replace(LLAMA_8B, key_format=KEY_FORMAT)
    assert KEY_FORMAT == 2
    assert v2.storage_digest == LLAMA_8B.storage_digest == LLAMA_8B.digest
    assert v2.digest != LLAMA_8B.digest and v2 != LLAMA_8B


def test_a_register_without_key_format_is_format_1():
    from lmcache_p2p.protocol import Register

    class OldLayout(msgspec.Struct):  # what a sender from before key formats encodes
        model: str
        dtype: str
        block_size: int
        block_shape: tuple[int, ...]
        block_stride: tuple[int, ...]
        num_layers: int
        tp_size: int = 1
        tp_rank: int = 0

    old = OldLayout(**{f: getattr(LLAMA_8B, f) for f in OldLayout.__struct_fields__})
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=LayoutFingerprint).key_format == 1
    register = {
        "type": "register",
        "version": 1,
        "instance_id": "old",
        "rank": 0,
        "host": "h",
        "worker_port": 1,
        "layout": msgspec.to_builtins(old),
        "chunk_size": 256,
        "locations": ["LocalCPUBackend"],
    }
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(register), type=Register)
    assert decoded.layout.key_format == 1 and decoded.layout.digest == LLAMA_8B.digest and decoded.adapters is None
