"""Our chunk keys against vLLM's own block hashes, on vLLM's own ``Request``: never shared where
vLLM's prefix cache would not share (no engine started).

The oracle: for every pair of request variants over one prompt (salts, adapters, multimodal items
in several places) and every chunk, if vLLM's hash of the chunk's last block differs between the
two, our chunk keys differ too. Where vLLM adds nothing to the tokens (plain requests), our keys
are today's, so plain prompts still share. Prompt embeddings are never keyed.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from lmcache_p2p.adapter_id import AdapterIds, AdapterUnreadable, lora_id_of  # noqa: E402
from lmcache_p2p.keys import chunk_hash_array, chunk_hashes  # noqa: E402
from lmcache_p2p.tenancy import PROMPT_EMBEDS, request_keys  # noqa: E402

try:  # vLLM 0.32's pickle-based sha256; 0.27.1 has the CBOR one only
    from vllm.utils.hashing import sha256 as vllm_hash
except ImportError:  # pragma: no cover - older releases
    from vllm.utils.hashing import sha256_cbor as vllm_hash

BLOCK = 16
CHUNK = 256
TOKENS = list(np.random.default_rng(5).integers(10, 30_000, 768))  # 3 chunks


def write_adapter(directory: str, seed: int) -> str:
    """Adapter files as vLLM finds them (their content is all the keys care about here)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        f.write('{"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"]}')
    weights = np.random.default_rng(seed).normal(size=4096).astype(np.float32).tobytes()
    with open(os.path.join(directory, "adapter_model.safetensors"), "wb") as f:
        f.write(weights)
    return directory


def image(identifier: str, offset: int, length: int = 100) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=identifier,
        mm_position=PlaceholderRange(offset=offset, length=length),
    )


def vllm_request(name: str, **kw) -> Request:
    init_none_hash(vllm_hash)
    return Request(
        request_id=name,
        prompt_token_ids=list(TOKENS),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, vllm_hash),
        **kw,
    )


@pytest.fixture
def variants(tmp_path):
    """Request variants over one prompt, each with vLLM's block hashes and our chunk keys."""
    adapters = AdapterIds()
    path_p, path_q = str(tmp_path / "p" / "sql"), str(tmp_path / "q" / "sql")
    write_adapter(path_p, seed=1)
    write_adapter(path_q, seed=1)  # the same files at another path

    def ours(request: Request) -> list[int]:
        keys = request_keys(request, adapters)
        assert not keys.unkeyed, keys.unkeyed
        return chunk_hashes(request.prompt_token_ids, CHUNK, identity=keys.identity, mm=keys.mm)

    def both(name: str, **kw) -> tuple[list, list[int]]:
        request = vllm_request(name, **kw)
        return [request.block_hashes[(i + 1) * CHUNK // BLOCK - 1] for i in range(3)], ours(request)

    built = {
        "plain": both("plain"),
        "salt a": both("salt a", cache_salt="tenant-a"),
        "salt b": both("salt b", cache_salt="tenant-b"),
        "sql at P, files X": both("sql P X", lora_request=LoRARequest("sql", 1, path_p)),
        "sql at Q, files X": both("sql Q X", lora_request=LoRARequest("sql", 1, path_q)),
        "chat at P, files X": both("chat P X", lora_request=LoRARequest("chat", 2, path_p)),
        "img-a @300": both("a300", mm_features=[image("img-a", 300)]),
        "img-b @300": both("b300", mm_features=[image("img-b", 300)]),
        "img-a @310": both("a310", mm_features=[image("img-a", 310)]),
        "img-a @600": both("a600", mm_features=[image("img-a", 600)]),
        "two images": both("two", mm_features=[image("img-a", 300), image("img-b", 500)]),
        "two images swapped": both("swapped", mm_features=[image("img-b", 300), image("img-a", 500)]),
        "salt a + img-a @300": both("salt img", cache_salt="tenant-a", mm_features=[image("img-a", 300)]),
    }
    # The same name and path string with other files: another host's adapter (vLLM cannot tell).
    shutil.rmtree(path_p)
    write_adapter(path_p, seed=2)
    built["sql at P, files Y"] = both("sql P Y", lora_request=LoRARequest("sql", 1, path_p))
    return built


def test_our_keys_differ_wherever_vllm_s_block_hashes_differ(variants):
    names = list(variants)
    compared = 0
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            (theirs_1, ours_1), (theirs_2, ours_2) = variants[first], variants[second]
            for chunk in range(3):
                if theirs_1[chunk] != theirs_2[chunk]:
                    compared += 1
                    assert ours_1[chunk] != ours_2[chunk], (first, second, chunk)
    assert compared > 100
    # Plain keys are today's: what vLLM shares without extra keys, we share too.
    assert variants["plain"][1] == chunk_hashes(TOKENS, CHUNK)


def test_each_variant_s_keys_are_its_own(variants):
    plain = variants["plain"][1]
    for salted in ("salt a", "salt b", "sql at P, files X", "sql at P, files Y", "sql at Q, files X"):
        assert not set(variants[salted][1]) & set(plain), salted  # every chunk of it differs
    # Two adapters with one name and one path on two hosts: vLLM's hash is the same, ours is not.
    assert variants["sql at P, files X"][0] == variants["sql at P, files Y"][0]
    assert not set(variants["sql at P, files X"][1]) & set(variants["sql at P, files Y"][1])
    # An image keys the chunk it overlaps and the ones after; the text before it stays shared.
    for name in ("img-a @300", "img-b @300", "img-a @310"):
        assert variants[name][1][0] == plain[0] and variants[name][1][1] != plain[1]
    assert variants["img-a @600"][1][:2] == plain[:2] and variants["img-a @600"][1][2] != plain[2]
    assert variants["img-a @300"][1][1:] != variants["img-b @300"][1][1:]
    assert variants["two images"][1][1] != variants["two images swapped"][1][1]


def test_a_request_with_prompt_embeddings_is_not_keyed():
    torch = pytest.importorskip("torch")
    request = vllm_request("embeds", prompt_embeds=torch.randn(len(TOKENS), 8))
    keys = request_keys(request)
    assert keys.unkeyed == PROMPT_EMBEDS and keys.describe() == "not keyed (prompt_embeds)"


def test_request_keys_describe_without_the_salt(tmp_path):
    path = write_adapter(str(tmp_path / "sql"), seed=1)
    request = vllm_request(
        "all", cache_salt="tenant-secret", lora_request=LoRARequest("sql", 1, path), mm_features=[image("i", 5)]
    )
    keys = request_keys(request)
    text = keys.describe()
    assert "tenant-secret" not in text and text.startswith("salt#") and "adapter sql (id " in text
    assert text.endswith("1 multimodal item(s)") and not keys.plain and not keys.blendable
    assert keys.lora == ("sql", lora_id_of(path, path)[0])
    assert request_keys(vllm_request("plain")).plain and request_keys(vllm_request("plain")).blendable
    assert request_keys(vllm_request("salted", cache_salt="s")).blendable


def test_adapter_ids_follow_the_files_and_the_path_string(tmp_path):
    ids = AdapterIds()
    here = write_adapter(str(tmp_path / "host1" / "sql"), seed=1)
    copy = str(tmp_path / "host2" / "sql")
    shutil.copytree(here, copy)
    first = ids.get("sql", here)
    # Another host with a byte copy, given the same path string, has the same id.
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path / "host1")
        on_host1 = ids.get("sql", "sql")
        os.chdir(tmp_path / "host2")
        on_host2 = ids.get("sql", "sql")
    finally:
        os.chdir(cwd)
    assert on_host1.lora_id == on_host2.lora_id != first.lora_id  # the path string is part of it
    assert ids.get("sql", here) is first  # cached: nothing hashed again
    # One byte changed in place, size and mtime kept: the inode or mtime change is picked up.
    weights = os.path.join(here, "adapter_model.safetensors")
    with open(weights, "rb") as f:
        data = bytearray(f.read())
    data[100] ^= 1
    stat = os.stat(weights)
    with open(weights + ".new", "wb") as f:
        f.write(data)
    os.replace(weights + ".new", weights)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert ids.get("sql", here).lora_id != first.lora_id
    os.remove(os.path.join(here, "adapter_config.json"))
    with pytest.raises(AdapterUnreadable, match="no adapter_config.json"):
        ids.get("sql", here)
    with pytest.raises(AdapterUnreadable, match="not a directory here"):
        ids.get("sql", str(tmp_path / "nowhere" / "sql"))


def test_an_unreadable_adapter_makes_the_request_unkeyed_and_says_so(tmp_path, caplog):
    request = vllm_request("gone", lora_request=LoRARequest("sql", 1, str(tmp_path / "missing")))
    with caplog.at_level("WARNING", logger="lmcache_p2p.tenancy"):
        keys = request_keys(request)
        request_keys(request)  # the same adapter again within the minute: one line
    assert keys.unkeyed.startswith("adapter sql: ") and keys.identity is None
    lines = [r.getMessage() for r in caplog.records if "neither looked up nor stored" in r.getMessage()]
    assert len(lines) == 1 and "adapter sql (" in lines[0]


def test_token_ids_as_vllm_0_34_hands_them_hash_alike():
    from array import array

    class TokenBuffer(array):  # vLLM 0.34's prompt_token_ids: an array('i') subclass
        pass

    buffer = TokenBuffer("i", TOKENS)
    assert chunk_hash_array(np.asarray(buffer, dtype=np.int64), CHUNK).tolist() == chunk_hashes(TOKENS, CHUNK)
    assert chunk_hashes(buffer, CHUNK) == chunk_hashes(TOKENS, CHUNK)


# -- the connector's scheduler half on vLLM's Request ------------------------------------------


def test_the_scheduler_side_keys_by_salt_and_adapter_and_never_keys_what_it_cannot(tmp_path):
    """What the ranks are asked and told to store: a salted request's salted keys with its adapter
    reported; nothing at all for prompt embeddings, an unreadable adapter, or a request the
    scheduler scheduled before asking us (its NewRequestData carries no cache_salt)."""
    import uuid
    from types import SimpleNamespace

    torch = pytest.importorskip("torch")
    from test_connector_units import _scheduler, _step

    from lmcache_p2p.integration.vllm.lookup_channel import LookupReply, LookupServer, socket_path
    from lmcache_p2p.keys import KeyIdentity
    from lmcache_p2p.protocol import unpack_hashes

    engine_id = uuid.uuid4().hex
    asked: dict[str, tuple[list[int], list[str] | None]] = {}

    def handle(request):
        if request.hashes is not None:
            asked[request.req_id] = (unpack_hashes(request.hashes).tolist(), request.lora)
        return LookupReply(seq=request.seq, req_id=request.req_id, hit_tokens=0)

    path = write_adapter(str(tmp_path / "sql"), seed=1)
    lora_id = lora_id_of(path, path)[0]
    server = LookupServer(socket_path(engine_id, 0, 0), handle)
    scheduler = _scheduler(engine_id)
    try:
        salted = vllm_request("salted", cache_salt="tenant-a", lora_request=LoRARequest("sql", 1, path))
        embeds = vllm_request("embeds", prompt_embeds=torch.randn(len(TOKENS), 8))
        gone = vllm_request("gone", lora_request=LoRARequest("sql", 1, str(tmp_path / "missing")))
        assert scheduler.get_num_new_matched_tokens(salted, 0) == (0, False)
        assert scheduler.get_num_new_matched_tokens(embeds, 0) == (0, False)
        assert scheduler.get_num_new_matched_tokens(gone, 0) == (0, False)
        identity = KeyIdentity(cache_salt="tenant-a", lora_name="sql", lora_id=lora_id)
        assert asked == {"salted": (chunk_hashes(TOKENS, CHUNK, identity=identity), ["sql", lora_id])}

        def new(req_id: str):
            return SimpleNamespace(
                req_id=req_id, prompt_token_ids=list(TOKENS), block_ids=(list(range(48)),), num_computed_tokens=0
            )

        meta = scheduler.build_connector_meta(
            _step(
                [new(r) for r in ("salted", "embeds", "gone", "unseen")],
                {r: 768 for r in ("salted", "embeds", "gone", "unseen")},
            )
        )
        assert [(s.req_id, list(s.chunk_hashes)) for s in meta.stores] == [
            ("salted", chunk_hashes(TOKENS, CHUNK, identity=identity))
        ]
        assert not meta.loads
    finally:
        scheduler.close()
        server.close()
