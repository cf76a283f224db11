"""Blending's core (issue 23), on a real Llama (transformers, the tiny model's weights and
tokenizer and a GQA Llama 3 RoPE variant): segments and their keys, RoPE re-rotation against the
model's own rotary embedding, and the blender against a plain prefill of the same prompt."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from lmcache_p2p.blend.blender import blend
from lmcache_p2p.blend.models import HFDecoder, hf_prefill_kv
from lmcache_p2p.blend.rope import rotate_keys
from lmcache_p2p.blend.segments import (
    SEGMENT_ROOT_HASH,
    segment_chunks,
    separator_ids,
    split_segments,
)
from lmcache_p2p.blend.support import (
    UnsupportedModel,
    UnsupportedRope,
    check_architecture,
    check_full_attention,
    check_rope_kind,
)
from lmcache_p2p.keys import chunk_hashes
from lmcache_p2p.testing.tiny_model import sample_text

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def gqa_decoder(request):
    """A decoder of each supported family in miniature, GQA (4 query heads on 2 KV heads): Llama 3
    (llama3 RoPE), Qwen2 (biases in q/k/v), Qwen3 (per-head q/k norms before RoPE)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    shape = dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.2,  # peaked attention, as the tiny model's: context matters
    )
    if request.param == "llama":
        return LlamaForCausalLM(LlamaConfig(**shape, rope_parameters=LLAMA3_ROPE)).eval()
    rope = {"rope_type": "default", "rope_theta": 1000000.0}
    if request.param == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**shape, rope_parameters=rope)).eval()
    return Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=32, rope_parameters=rope)).eval()


def encode(tokenizer):
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


# -- segments and keys ---------------------------------------------------------------------------


def test_the_separator_is_found_in_context_and_splits_a_prompt_into_its_segments(tokenizer):
    sep = separator_ids(encode(tokenizer))
    docs = [sample_text(40, seed) for seed in (1, 2, 3)]
    ids = tokenizer.encode(" # # ".join(docs), add_special_tokens=False)
    segments = split_segments(ids, sep)
    assert len(segments) == 3
    # Each segment decodes to its document (the separator's spaces go with it or the next word).
    for segment, doc in zip(segments, docs, strict=True):
        assert tokenizer.decode(ids[segment.start : segment.end]).strip() == doc.strip()
    assert split_segments(ids[: segments[0].end], sep) == [segments[0]]  # no separator: one segment
    with pytest.raises(ValueError, match="blend_special_str is empty"):
        separator_ids(encode(tokenizer), "")


def test_a_segment_has_the_same_keys_wherever_it_appears_and_not_a_prefix_chunks():
    rng = np.random.default_rng(0)
    doc = rng.integers(10, 1000, 600).tolist()
    keys = [c.key for c in segment_chunks(doc, 256)]
    assert [(c.start, c.end) for c in segment_chunks(doc, 256)] == [(0, 256), (256, 512), (512, 600)]
    assert keys == [c.key for c in segment_chunks(list(doc), 256)]  # deterministic
    assert keys[:2] != chunk_hashes(doc, 256)  # another root: never a prefix chunk's key
    assert keys[0] != SEGMENT_ROOT_HASH
    # A tail is keyed with its length: the same leading tokens, shorter, are another key.
    assert segment_chunks(doc[:599], 256)[-1].key != keys[-1]
    assert segment_chunks(doc[:599], 256)[:2] == segment_chunks(doc, 256)[:2]


# -- RoPE ----------------------------------------------------------------------------------------


def test_rerotation_equals_the_models_own_rope_at_the_new_positions(gqa_decoder):
    adapter = HFDecoder(gqa_decoder)
    torch.manual_seed(1)
    raw = torch.randn(50, 2 * adapter.head_dim)  # pre-RoPE keys of 50 tokens, two KV heads
    old, new = torch.arange(50) + 7, torch.arange(50) + 1900

    def at(positions):  # the model's rotary embedding, as its attention applies it
        return adapter._rotate(raw, 2, positions, gqa_decoder.model.rotary_emb(raw, positions[None])).view(50, 2, -1)

    moved = rotate_keys(at(old), new - old, adapter.inv_freq)
    # Exact up to float32 angles: position x inv_freq rounds to ~1e-4 rad near position 1,900,
    # in the model's own rotary embedding as in ours.
    assert torch.allclose(moved, at(new), atol=3e-4), (moved - at(new)).abs().max()
    assert torch.allclose(rotate_keys(moved, old - new, adapter.inv_freq), at(old), atol=3e-4)  # and back
    assert torch.allclose(rotate_keys(at(old), 0, adapter.inv_freq), at(old))
    check_rope_kind("llama3")
    with pytest.raises(UnsupportedRope, match="rope_type 'yarn'"):
        check_rope_kind("yarn")
    with pytest.raises(UnsupportedModel, match="supports LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM; this"):
        check_architecture(["Qwen2MoeForCausalLM"])


def test_a_model_with_sliding_window_layers_is_refused_by_name():
    from transformers import Qwen2Config, Qwen3Config

    check_full_attention(Qwen3Config())  # full attention in every layer (its sliding_window is unused)
    with pytest.raises(UnsupportedModel, match="sliding-window layers"):
        check_full_attention(Qwen2Config(use_sliding_window=True))
    with pytest.raises(UnsupportedModel, match=r"sliding-window layers \(sliding_attention\)"):
        check_full_attention(Qwen3Config(num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"]))


# -- the blender ---------------------------------------------------------------------------------


def blended_prompt(model, segment_lengths=(40, 60, 50), sep=(5, 6), seed=3):
    """Token ids of segments joined by ``sep``, and each segment's KV computed on its own (as a
    store would), normalised to position 0, then moved to its place in this prompt."""
    g = torch.Generator().manual_seed(seed)
    segments = [torch.randint(10, 500, (n,), generator=g) for n in segment_lengths]
    adapter = HFDecoder(model)
    layers = model.config.num_hidden_layers
    kv_heads, dim = adapter.num_kv_heads, adapter.head_dim
    parts, cached = [], []
    for i, segment in enumerate(segments):
        if i:
            parts.append(torch.tensor(sep))
            cached.append(torch.zeros(len(sep), dtype=torch.bool))
        parts.append(segment)
        cached.append(torch.ones(len(segment), dtype=torch.bool))
    ids = torch.cat(parts)
    keys = [torch.zeros(len(ids), kv_heads, dim) for _ in range(layers)]
    values = [torch.zeros(len(ids), kv_heads, dim) for _ in range(layers)]
    start = 0
    for i, segment in enumerate(segments):
        start += len(sep) if i else 0
        k, v = hf_prefill_kv(model, segment)  # computed alone, at positions 0..n-1
        for layer in range(layers):
            keys[layer][start : start + len(segment)] = rotate_keys(k[layer], start, adapter.inv_freq)
            values[layer][start : start + len(segment)] = v[layer]
        start += len(segment)
    return ids, keys, values, torch.cat(cached)


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor], layer: int) -> float:
    return float((got[layer] - want[layer]).norm() / want[layer].norm())


def test_blending_everything_is_a_full_prefill_and_recomputing_more_gets_closer(gqa_decoder):
    adapter = HFDecoder(gqa_decoder)
    ids, keys, values, cached = blended_prompt(gqa_decoder)
    full_k, full_v = hf_prefill_kv(gqa_decoder, ids)
    last = gqa_decoder.config.num_hidden_layers - 1

    # Layer 0's KV has no context: a segment computed alone and moved equals the full prefill's.
    assert torch.allclose(keys[0][cached], full_k[0][cached], atol=1e-4)
    assert torch.allclose(values[0][cached], full_v[0][cached], atol=1e-4)

    everything = blend(adapter, ids, keys, values, cached, ratio=1.0)
    assert everything.recomputed.tolist() == list(range(len(ids)))
    for layer in range(last + 1):
        assert torch.allclose(everything.keys[layer], full_k[layer], atol=1e-4), layer
        assert torch.allclose(everything.values[layer], full_v[layer], atol=1e-4), layer

    errors = {}
    for ratio in (0.0, 0.15, 0.5):
        result = blend(adapter, ids, keys, values, cached, ratio=ratio, check_layer=1)
        # The separators (uncached) are always recomputed, and the share asked of the cached.
        uncached = set(torch.nonzero(~cached).flatten().tolist())
        assert uncached <= set(result.recomputed.tolist())
        assert len(result.recomputed) == len(uncached) + round(int(cached.sum()) * ratio)
        errors[ratio] = relative_error(result.values, full_v, last)
    naive = relative_error(values, full_v, last)
    assert naive > 0.05, naive  # the segments do need each other: reuse as is is off
    assert errors[0.5] < errors[0.15] < naive, (errors, naive)

    # The inputs are left as they were: a blend does not write into the cache it reads.
    assert torch.equal(keys[0], blended_prompt(gqa_decoder)[1][0])


def test_bad_blend_parameters_are_named(gqa_decoder):
    adapter = HFDecoder(gqa_decoder)
    ids, keys, values, cached = blended_prompt(gqa_decoder, (8, 8))
    with pytest.raises(ValueError, match="blend_recompute_ratios: 1.5"):
        blend(adapter, ids, keys, values, cached, ratio=1.5)
    with pytest.raises(ValueError, match="blend_check_layers: layer 9"):
        blend(adapter, ids, keys, values, cached, ratio=0.1, check_layer=9)


# -- the selected tokens' attention kernel (GPU) ---------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on the H200 device)")


def reference_attention(q, k, v, q_pos, scale):
    """Masked attention in float32, GQA by repeating KV heads: what the kernel must equal."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
    mask = torch.arange(k.shape[1], device=q.device)[None, :] <= q_pos[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1).reshape(q.shape[0], -1)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "dtype"), [(32, 8, 128, torch.bfloat16), (4, 2, 32, torch.float32)]
)
def test_the_selected_token_kernel_equals_masked_attention(heads, kv_heads, head_dim, dtype):
    from lmcache_p2p.blend.sparse_attention import selected_attention

    torch.manual_seed(0)
    keys = 3000  # not a multiple of the kernel's blocks
    q_pos = torch.sort(torch.randperm(keys, device="cuda")[:517]).values  # a 17% selection, scattered
    q_pos[0], q_pos[-1] = 0, keys - 1  # the first query sees one key; the last, all of them
    q = torch.randn(len(q_pos), heads, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(keys, kv_heads, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(keys, kv_heads, head_dim, device="cuda", dtype=dtype)
    got = selected_attention(q, k, v, q_pos, head_dim**-0.5)
    want = reference_attention(q, k, v, q_pos, head_dim**-0.5)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.allclose(got.float(), want, atol=2e-2, rtol=2e-2), float((got.float() - want).abs().max())


@pytest.mark.gpu
@gpu
def test_a_blend_on_the_gpu_equals_the_same_blend_on_the_cpu(gqa_decoder):
    """The GPU path (fused causal attention up to the check layer, the kernel past it) selects the
    same tokens and gives the same KV as the CPU path (masked SDPA), up to float32 rounding."""
    adapter = HFDecoder(gqa_decoder)
    ids, keys, values, cached = blended_prompt(gqa_decoder)
    want = blend(adapter, ids, keys, values, cached, ratio=0.15, check_layer=1)
    model = gqa_decoder.to("cuda")
    try:
        got = blend(
            HFDecoder(model),
            ids.cuda(),
            [k.cuda() for k in keys],
            [v.cuda() for v in values],
            cached.cuda(),
            ratio=0.15,
            check_layer=1,
        )
    finally:
        gqa_decoder.to("cpu")
    assert got.recomputed.cpu().tolist() == want.recomputed.tolist()
    for layer, (k, v) in enumerate(zip(got.keys, got.values, strict=True)):
        assert float((k.cpu() - want.keys[layer]).norm() / want.keys[layer].norm()) < 1e-4, layer
        assert float((v.cpu() - want.values[layer]).norm() / want.values[layer].norm()) < 1e-4, layer
