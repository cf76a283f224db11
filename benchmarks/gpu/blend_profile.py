"""Where a blend's time goes on a GPU, without vLLM: the blender over a transformers Llama of
Llama-3.1-8B's shape (random bf16 weights), against that model's own full prefill (transformers,
SDPA), on one prompt of ``--tokens`` tokens made of ``--segments`` cached segments and a short
new tail. Prints one JSON line per method with its time's spread over ``--repeats`` and the
blender's phases (benchmarks/../lmcache_p2p/blend/timing.py: device ms per phase).

    python benchmarks/gpu/blend_profile.py [--tokens 8192] [--segments 6] [--repeats 3]

It times the blend alone (the cached KV is on the device already, placed and re-rotated): the
rank's page loads, re-rotation and block writes are timed in the engine (bench_blend.py --engine
logs each blend's phases).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lmcache_p2p.blend.blender import blend  # noqa: E402
from lmcache_p2p.blend.models import HFDecoder, hf_prefill_kv  # noqa: E402
from lmcache_p2p.blend.rope import rotate_keys  # noqa: E402
from lmcache_p2p.blend.timing import PhaseTimer  # noqa: E402


def llama_8b_shape(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=32768,
        rope_theta=500000.0,
        architectures=["LlamaForCausalLM"],
        attn_implementation="sdpa",
    )
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    return model.eval()


def spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 1), "min": round(min(values), 1), "max": round(max(values), 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--segments", type=int, default=6)
    parser.add_argument("--tail", type=int, default=64, help="new tokens after the last cached segment")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--ratios", default="0,0.05,0.15,0.3")
    parser.add_argument("--check-layer", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = llama_8b_shape(args.layers)
    adapter = HFDecoder(model)
    generator = torch.Generator().manual_seed(0)
    n = args.tokens
    ids = torch.randint(100, 32000, (n,), generator=generator).cuda()
    cut = n - args.tail
    bounds = [round(i * cut / args.segments) for i in range(args.segments + 1)]
    shape = (n, adapter.num_kv_heads, adapter.head_dim)
    keys = [torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in range(args.layers)]
    values = [torch.zeros_like(k) for k in keys]
    cached = torch.zeros(n, dtype=torch.bool, device="cuda")
    for start, end in zip(bounds, bounds[1:], strict=False):
        k, v = hf_prefill_kv(model, ids[start:end])
        for layer in range(args.layers):
            keys[layer][start:end] = rotate_keys(k[layer], start, adapter.inv_freq)
            values[layer][start:end] = v[layer]
        cached[start:end] = True
    del k, v

    def full() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model(input_ids=ids[None], use_cache=True)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    full()  # warm-up
    full_ms = [full() for _ in range(args.repeats)]
    print(json.dumps({"method": "full prefill (transformers, SDPA)", "tokens": n, "ms": spread(full_ms)}), flush=True)
    for ratio in (float(r) for r in args.ratios.split(",")):
        check = 0 if ratio == 0 else args.check_layer
        runs, phases = [], []
        for repeat in range(args.repeats + 1):  # the first is a warm-up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            timer = PhaseTimer(torch.device("cuda"))
            blend(adapter, ids, keys, values, cached, ratio, check, timer)
            summary = timer.summary()
            ms = (time.perf_counter() - t0) * 1e3
            if repeat:
                runs.append(ms)
                phases.append(summary)
        names = list(phases[0])
        line = {
            "method": "naive reuse" if ratio == 0 else f"blend {ratio:g}",
            "check_layer": check,
            "tokens": n,
            "ms": spread(runs),
            "vs_full": round(statistics.median(runs) / statistics.median(full_ms), 3),
            "phases_device_ms": {p: round(statistics.median(s[p][0] for s in phases), 1) for p in names},
            "phases_host_ms": {p: round(statistics.median(s[p][1] for s in phases), 1) for p in names},
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
        }
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
