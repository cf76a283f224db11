"""The blender through vLLM's own Llama modules against the same through transformers' (issue 23).

One real vLLM CPU engine (``LLM``, no connector) and transformers load the same checkpoint. A
prompt of three segments joined by the separator gets its cached KV the way a store makes it
(each segment alone through transformers, moved to its place), then is blended at each ratio
twice: inside the engine's worker through :class:`VllmDecoder` (``LLM.apply_model``), and here
through :class:`HFDecoder`. Prints one JSON line: the largest difference per ratio, the tokens
recomputed, and how far the engine's full blend (ratio 1.0) is from transformers' plain prefill.

    python -m lmcache_p2p.testing.blend_check MODEL_DIR [--ratios 1.0,0.15]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from typing import Any

import torch

from lmcache_p2p.blend.blender import blend
from lmcache_p2p.blend.models import HFDecoder, hf_prefill_kv
from lmcache_p2p.blend.rope import rotate_keys
from lmcache_p2p.blend.segments import separator_ids, split_segments
from lmcache_p2p.testing.tiny_model import sample_text


def engine_blend(
    model: Any, token_ids: torch.Tensor, keys: list, values: list, cached: torch.Tensor, ratio: float
) -> dict:
    """Runs in the engine's worker (``LLM.apply_model``): the blend through vLLM's modules."""
    from lmcache_p2p.integration.vllm.blend_model import VllmDecoder

    result = blend(VllmDecoder(model), token_ids, keys, values, cached, ratio=ratio)
    return {"keys": result.keys, "values": result.values, "recomputed": result.recomputed}


def report_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest absolute difference over every layer."""
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--ratios", default="1.0,0.15", help="must include 1.0")
    parser.add_argument("--words", type=int, default=60, help="words per segment")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # apply_model in this process

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    hf_adapter = HFDecoder(hf)
    sep = separator_ids(lambda t: tokenizer.encode(t, add_special_tokens=False))
    text = " # # ".join(sample_text(args.words, seed) for seed in (11, 12, 13))
    ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False))
    segments = split_segments(ids.tolist(), sep)
    layers = hf.config.num_hidden_layers
    shape = (len(ids), hf_adapter.num_kv_heads, hf_adapter.head_dim)
    keys = [torch.zeros(shape) for _ in range(layers)]
    values = [torch.zeros(shape) for _ in range(layers)]
    cached = torch.zeros(len(ids), dtype=torch.bool)
    for segment in segments[:-1]:  # the last segment is the new text
        k, v = hf_prefill_kv(hf, ids[segment.start : segment.end])
        for layer in range(layers):
            keys[layer][segment.start : segment.end] = rotate_keys(k[layer], segment.start, hf_adapter.inv_freq)
            values[layer][segment.start : segment.end] = v[layer]
        cached[segment.start : segment.end] = True

    llm = LLM(
        args.model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=4096,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=256 << 20,
        distributed_executor_backend="uni",
        seed=0,
    )
    report: dict = {"tokens": len(ids), "segments": len(segments), "cached_tokens": int(cached.sum())}
    for ratio in [float(r) for r in args.ratios.split(",")]:
        in_engine = functools.partial(engine_blend, token_ids=ids, keys=keys, values=values, cached=cached, ratio=ratio)
        (engine,) = llm.apply_model(in_engine)
        ours = blend(hf_adapter, ids, keys, values, cached, ratio=ratio)
        if ratio == 1.0:
            engine_keys_at_1 = engine["keys"]
        report[f"ratio_{ratio:g}"] = {
            "max_key_difference": report_difference(engine["keys"], ours.keys),
            "max_value_difference": report_difference(engine["values"], ours.values),
            "recomputed_equal": bool(torch.equal(engine["recomputed"], ours.recomputed)),
            "recomputed": len(ours.recomputed),
        }
    # A full blend through the engine's modules is the plain prefill transformers computes.
    full_keys, _ = hf_prefill_kv(hf, ids)
    report["engine_full_blend_vs_hf_prefill"] = report_difference(full_keys, engine_keys_at_1)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
