"""Seed 000's prefill/decode on a GPU host: ``MultiConnector`` with our ``LMCacheConnectorV1`` first
and vLLM's ``NixlConnector`` (GPU buffers) second, two vLLM OpenAI servers and the P/D proxy flow.
Prints one JSON object.

    python benchmarks/gpu/pd.py --model DIR [--workdir W] [--gpus 0,0] [--docs 4 --tokens 10000] [--dtype float32]

1. **single**: one plain engine (no connector) answers every document, greedy: the reference
   outputs and a cold TTFT; then it stops.
2. **pd cold**: each document through the proxy (prefill engine: one token, KV kept; decode engine:
   reads it over NIXL, then generates). TTFT is the time to the decode engine's first streamed
   token, the prefill included.
3. **pd repeat**: the same documents again: our CPU tier answers on the prefill engine (and on the
   decode engine, which stored what NIXL delivered), so no NIXL read is needed.

Outputs of 2 and 3 must equal 1's. The decode engine's NIXL metrics and both engines' "LMCache hit"
lines say where the KV came from. Every request asks for its top-2 logprobs, so where an output
first differs from the single engine's the JSON says by how much the two engines' top two tokens
were apart there (``first_difference``): a random-weight model's logits are nearly flat, and a
gap of a few thousandths of a nat is a tie that rounding breaks, not KV that arrived wrong.
``--dtype float32`` runs all three engines in float32, where such ties are far rarer.

The seed's config names ``LMCacheConnectorV1`` without a module path, so our plugin must be
visible to vLLM as an installed distribution's ``vllm.general_plugins`` entry point. Where the
project is only on ``PYTHONPATH`` (the GPU machine), a ``lmcache_p2p-0.0.0.dist-info`` folder on the
path with a ``METADATA`` (``Name: lmcache-p2p``) and an ``entry_points.txt`` copied from
pyproject.toml's ``[project.entry-points."vllm.general_plugins"]`` is enough; without it the
engines fail at start-up importing the original ``lmcache``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from threading import Thread
from typing import NamedTuple
from urllib import request as urlrequest

from lmcache_p2p.testing.pd_proxy import make_server, seed_kv_transfer_config
from lmcache_p2p.testing.ports import free_ports
from lmcache_p2p.testing.processes import ServedProcess

CHUNK = 256
# Seed 000's kv_transfer_config, GPU buffers (NIXL's default kv_buffer_device on a GPU host).
KV_TRANSFER_CONFIG = seed_kv_transfer_config()


def say(*args) -> None:
    print("[pd]", *args, file=sys.stderr, flush=True)


def start(
    name: str, model: str, workdir: Path, gpu: str, util: float, connector: bool, cpu_gb: float, dtype: str
) -> tuple[ServedProcess, str]:
    http, side = free_ports(2)
    extra = ["--port", str(http), "--enforce-eager", "--max-model-len", "16384", "--gpu-memory-utilization", str(util)]
    extra += ["--dtype", dtype]
    extra += ["--no-enable-prefix-caching", "--enable-prompt-tokens-details"]
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": gpu,
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side),
        "LMCACHE_LOCAL_CPU": "True",
        "LMCACHE_CHUNK_SIZE": str(CHUNK),
        "LMCACHE_MAX_LOCAL_CPU_SIZE": str(cpu_gb),
        "UCX_TLS": os.environ.get("UCX_TLS", "all"),  # the seed's
    }
    if connector:
        extra += ["--kv-transfer-config", json.dumps(KV_TRANSFER_CONFIG)]
    # The module, not the `vllm` script: a vLLM carried as files (the device) has no scripts.
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *extra]
    process = ServedProcess(name, command, workdir / f"{name}.log", env).start()
    return process, f"http://127.0.0.1:{http}"


class Answer(NamedTuple):
    ttft_s: float
    text: str
    tokens: list[str]  # the generated tokens, as vLLM names them in its logprobs
    top2: list[dict[str, float]]  # each position's two likeliest tokens and their logprobs


def stream_answer(url: str, body: dict) -> Answer:
    """Time to the first streamed text, the whole text, and each token's top-2 logprobs."""
    req = urlrequest.Request(
        url + "/v1/completions",
        data=json.dumps({**body, "stream": True, "logprobs": 2}).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    ttft, text, tokens, top2 = None, [], [], []
    with urlrequest.urlopen(req, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            choice = json.loads(line[5:])["choices"][0]
            piece = choice.get("text", "")
            if piece and ttft is None:
                ttft = time.perf_counter() - t0
            text.append(piece)
            logprobs = choice.get("logprobs") or {}
            tokens += logprobs.get("tokens") or []
            top2 += [dict(t or {}) for t in logprobs.get("top_logprobs") or []]
    assert ttft is not None, "no token streamed"
    return Answer(ttft, "".join(text), tokens, top2)


def first_difference(got: Answer, ref: Answer) -> dict | None:
    """Where ``got``'s tokens first leave ``ref``'s, and how close a call it was there: the gap
    between the two tokens' logprobs in each engine's own distribution (None where a token is
    not in that engine's top two). None when the tokens are equal."""
    pairs = zip(got.tokens, ref.tokens, strict=False)
    i = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
    if i is None:
        if len(got.tokens) == len(ref.tokens):
            return None
        return {"token": min(len(got.tokens), len(ref.tokens)), "length_differs": True}
    a, b = got.tokens[i], ref.tokens[i]

    def gap(top: dict[str, float]) -> float | None:
        return round(abs(top[a] - top[b]), 5) if a in top and b in top else None

    return {
        "token": i,
        "of": len(ref.tokens),
        "single_gap_nats": gap(ref.top2[i]) if i < len(ref.top2) else None,
        "pd_gap_nats": gap(got.top2[i]) if i < len(got.top2) else None,
    }


def nixl_metrics(url: str) -> dict[str, float]:
    with urlrequest.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(vllm:(?:nixl\w*|prompt_tokens_by_source_total\{[^}]*\}))\S*\s+(\S+)$", line)
        if m and not line.startswith("#"):
            out[m[1]] = out.get(m[1], 0.0) + float(m[2])
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 3) for k, v in after.items() if v != before.get(k, 0.0)}


def summary(ttfts: list[float]) -> dict:
    return {
        "mean_ttft_s": round(statistics.mean(ttfts), 4),
        "min_s": round(min(ttfts), 4),
        "max_s": round(max(ttfts), 4),
        "ttfts_s": [round(t, 4) for t in ttfts],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--workdir", default="/tmp/lmcache-pd")
    parser.add_argument("--gpus", default="0,0", help="prefill,decode GPU ids (0,0: both on one)")
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=10000)
    parser.add_argument("--output-len", type=int, default=32)
    # Pinned, per engine: two engines of 40 GB each were killed at start-up on a 128 GiB host.
    parser.add_argument("--cpu-gb", type=float, default=20, help="each engine's CPU pool (pinned), GB")
    parser.add_argument("--util", type=float, help="each P/D engine's --gpu-memory-utilization (0.42 on one GPU)")
    parser.add_argument("--dtype", default="auto", help="vLLM's --dtype for all three engines (float32: fewer ties)")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    from lmcache_p2p.testing.tiny_model import sample_prompts

    docs = sample_prompts(args.model, args.tokens, range(100, 100 + args.docs))
    gp, gd = args.gpus.split(",")
    one_gpu = gp == gd
    body = {"model": args.model, "max_tokens": args.output_len, "temperature": 0.0, "ignore_eos": True}
    result: dict = {
        "docs": args.docs,
        "tokens": args.tokens,
        "output_len": args.output_len,
        "gpus": args.gpus,
        "dtype": args.dtype,
    }

    say("single engine (no connector): reference outputs")
    single, url = start("single", args.model, workdir, gp, 0.85, False, args.cpu_gb, args.dtype)
    try:
        single.wait_http(url + "/health", timeout=900)
        stream_answer(url, {**body, "prompt": docs[0][:200]})  # warm-up
        ref = [stream_answer(url, {**body, "prompt": d}) for d in docs]
    finally:
        single.stop(timeout=60)
    result["single"] = summary([r.ttft_s for r in ref])

    util = args.util or (0.42 if one_gpu else 0.85)
    # One after the other: vLLM sizes its KV cache from the GPU memory free while it profiles,
    # and an engine loading its weights beside it on the same GPU left the other 1.9 GiB (float32).
    prefill, purl = start("prefill", args.model, workdir, gp, util, True, args.cpu_gb, args.dtype)
    decode = None
    proxy = None
    try:
        prefill.wait_http(purl + "/health", timeout=900)
        decode, durl = start("decode", args.model, workdir, gd, util, True, args.cpu_gb, args.dtype)
        decode.wait_http(durl + "/health", timeout=900)
        proxy = make_server(purl, durl, port=0)
        Thread(target=proxy.serve_forever, daemon=True).start()
        xurl = f"http://127.0.0.1:{proxy.server_address[1]}"
        stream_answer(xurl, {**body, "prompt": docs[0][:200]})  # warm-up: NIXL's handshake, no full chunk
        texts: dict[str, list[str]] = {}
        for name in ("pd_cold", "pd_repeat"):
            before = nixl_metrics(durl)
            runs = [stream_answer(xurl, {**body, "prompt": d}) for d in docs]
            result[name] = summary([run.ttft_s for run in runs])
            texts[name] = [run.text for run in runs]
            result[name]["outputs_equal_single"] = [run.text == r.text for run, r in zip(runs, ref, strict=True)]
            # Where each output first differs from the single engine's (characters; len = equal).
            result[name]["common_prefix_chars"] = [
                len(os.path.commonprefix([run.text, r.text])) for run, r in zip(runs, ref, strict=True)
            ]
            result[name]["first_difference"] = [first_difference(run, r) for run, r in zip(runs, ref, strict=True)]
            result[name]["decode_metrics_delta"] = delta(before, nixl_metrics(durl))
            say(name, json.dumps(result[name]))
        result["pd_repeat_equals_pd_cold"] = texts["pd_repeat"] == texts["pd_cold"]
        result["single_output_chars"] = [len(r.text) for r in ref]
        for engine, log in (("prefill", prefill.log()), ("decode", decode.log())):
            hits = re.findall(r"Total tokens (\d+), LMCache hit tokens: (\d+), need to load: (\d+)", log)
            result[f"{engine}_lookups"] = [[int(x) for x in h] for h in hits]
            result[f"{engine}_errors"] = len(re.findall(r" ERROR |Traceback|Potentially invalid KV", log))
    finally:
        if proxy is not None:
            proxy.shutdown()
        engines = [p for p in (prefill, decode) if p is not None]
        for p in engines:
            p.terminate()
        for p in engines:
            p.stop(timeout=60)
    result["repeat_over_cold"] = round(result["pd_repeat"]["mean_ttft_s"] / result["pd_cold"]["mean_ttft_s"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
