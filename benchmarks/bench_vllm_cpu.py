"""Real vLLM on CPU with the connector: time to first token of a long prompt, cold vs. CPU-tier hit
vs. peer hit, and what the connector costs on a miss. Prints one JSON object.

    .venv/bin/python benchmarks/bench_vllm_cpu.py [--prompt-tokens 3000] [--prompts 6] [--remote] [--set KEY=VALUE]...

Engines are the offline driver (``lmcache_p2p.testing.offline_driver``: vLLM's ``LLM``
in one process, TTFT from vLLM's own request metrics) on the tiny local Llama, one OpenMP thread
each. Runs, each over the same distinct prompts, median reported:

* ``off``: vLLM with no connector (the baseline);
* ``cold``: engine A with the connector, seed-004 config (controller, P2P over NIXL, async
  lookups), nothing cached: every lookup misses locally and at the controller, then stores;
* ``cpu_hit``: the same prompts again on A (CPU tier);
* ``peer_hit``: the same prompts on engine B, which pulls A's chunks;
* ``remote_hit`` (``--remote``): A also writes behind to an ``lmcache_server`` on loopback, and
  the same prompts go to engine C (peers off, the store its only other tier), which fetches them;
* ``first_request``: what ``make demo`` shows, measured before anything else runs on the two
  connector engines: A's very first request (cold) and then B's very first request for the same
  prompt (a peer hit on an engine that has pulled nothing yet, so any first-connection cost is
  in it), over ``--first-runs`` fresh pairs of engines.

Both engines' CPU pools are small (``--pool-pages``) and first cycled by a warm-up pass of other
prompts, so the figures are the steady state of a pool in use. The warm-up pass itself (stores
into pages never written before) is reported as ``cold_fresh_pool``: on this VM a first write to
a page costs ~0.25 GB/s (see bench_p2p's first_touch), which a long-running engine pays once.

The tiny model computes a prefill in ~0.1 s, so the connector's fixed costs weigh far more here,
relative to the prefill, than they do on a real model on a GPU (issue 8 measures that).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from instances import InstanceProcess, config_override, instance_config  # noqa: E402
from protocol_client import ControllerProcess  # noqa: E402

from lmcache_p2p.testing import offline_driver  # noqa: E402
from lmcache_p2p.testing.processes import CPU_ENGINE_ENV  # noqa: E402

ENV = {**CPU_ENGINE_ENV, "VLLM_LOGGING_LEVEL": "WARNING"}
CHUNK = 256


def driver(model: str, config: dict, tmp: Path, name: str, connector: bool = True) -> InstanceProcess:
    command = offline_driver.command(model, "--max-model-len", "8192", "--kv-cache-mib", "512", connector=connector)
    return InstanceProcess(config, tmp, name=name, command=command, env=ENV).start(timeout=300)


def ttfts(engine: InstanceProcess, prompts: list[list[int]]) -> list[float]:
    return [engine.request("generate", prompt_ids=p, max_tokens=1, timeout=300)["ttft_s"] for p in prompts]


def first_request(
    model: str,
    controller: ControllerProcess,
    config: dict,
    tmp: Path,
    run: int,
    prompts: list[list[int]],
    gap_s: float,
) -> dict:
    """A fresh pair of engines: A's first request, then B's first request for the same prompt,
    ``gap_s`` after A answered (as make demo does: see ASK_GAP_WHY in lmcache_p2p/testing/processes.py)."""
    a = driver(model, instance_config(f"first_a{run}", controller, **config), tmp, f"first_a{run}")
    b = driver(model, instance_config(f"first_b{run}", controller, **config), tmp, f"first_b{run}")
    try:
        prompt = prompts[run]
        cold = ttfts(a, [prompt])[0]
        answered = time.monotonic()
        a.request("flush")
        deadline = time.monotonic() + 10
        while f"first_a{run}" not in controller.holders(prompt) and time.monotonic() < deadline:
            time.sleep(0.02)  # the controller indexes A's chunks from its worker's next batch
        time.sleep(max(0.0, gap_s - (time.monotonic() - answered)))
        peer = ttfts(b, [prompt])[0]
        return {
            "a_cold_ms": round(cold * 1e3, 1),
            "b_peer_hit_ms": round(peer * 1e3, 1),
            "b_chunks_pulled": b.status()["p2p_client"]["chunks_pulled"],
        }
    finally:
        a.stop(timeout=60)
        b.stop(timeout=60)


def summary(values: list[float], baseline: float = None) -> dict:
    out = {
        "median_ms": round(statistics.median(values) * 1e3, 2),
        "min_ms": round(min(values) * 1e3, 2),
        "max_ms": round(max(values) * 1e3, 2),
    }
    if baseline:
        out["vs_off"] = round(statistics.median(values) / baseline, 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--model-dir", default=None, help="reuse a built tiny model")
    parser.add_argument("--pool-pages", type=int, default=80, help="CPU pool size in chunk pages")
    parser.add_argument("--first-runs", type=int, default=3, help="fresh engine pairs for first_request")
    parser.add_argument(
        "--gap-s", type=float, default=2.0, help="first_request: seconds between A's answer and B's request"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        type=config_override,
        metavar="KEY=VALUE",
        help="a config key for both connector engines, VALUE read as YAML (repeatable), e.g. switch_interval_ms=0.5",
    )
    parser.add_argument(
        "--remote", action="store_true", help="also remote_hit: A writes to an lmcache_server, engine C fetches"
    )
    args = parser.parse_args()
    settings = dict(args.set)

    from lmcache_p2p.testing.tiny_model import build, sample_prompts

    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-cpu-"))
    model = build(args.model_dir or str(tmp / "tiny-llama"))
    # Warm-up prompts: enough to write every page of a pool once (their own seeds, never measured).
    cycle = args.pool_pages // (args.prompt_tokens // CHUNK) + 1
    prompts = sample_prompts(model, args.prompt_tokens, range(100, 100 + args.prompts))
    warm_a = sample_prompts(model, args.prompt_tokens, range(1000, 1000 + cycle))
    warm_b = sample_prompts(model, args.prompt_tokens, range(2000, 2000 + cycle))
    demo_prompt = sample_prompts(model, args.prompt_tokens, range(3000, 3000 + args.first_runs))
    print(f"bench_vllm_cpu: {args.prompts} prompts of {args.prompt_tokens} tokens, work dir {tmp}", file=sys.stderr)

    off_engine = driver(model, {}, tmp, "off", connector=False)
    ttfts(off_engine, warm_a[:1])
    off = ttfts(off_engine, prompts)
    off_engine.stop(timeout=60)

    controller = ControllerProcess().start()
    store = None
    if args.remote:
        from remote_stores import LmServer

        store = LmServer(max_size_gb=1.0, log_dir=tmp).start()
    remote_hit: list[float] = []
    remote_read = 0
    try:
        page_mib = 0.5  # one 256-token chunk of the tiny model: 2 layers x 2 x 256 x 2 heads x 64 x 4 B
        seed_004 = dict(
            chunk_size=CHUNK,
            channel="nixl",
            cpu_gb=args.pool_pages * page_mib / 1024,
            enable_async_loading=True,
            extra_config={"lookup_backoff_time": 0.001},
        )
        seed_004.update(settings)  # (a key set here wins over the seed's)
        first = []
        for run in range(args.first_runs):
            first.append(first_request(model, controller, seed_004, tmp, run, demo_prompt, args.gap_s))
        remote = {"remote_url": store.url} if store is not None else {}
        a = driver(model, instance_config("bench_a", controller, **seed_004, **remote), tmp, "a")
        b = driver(model, instance_config("bench_b", controller, **seed_004), tmp, "b")
        cold_fresh = ttfts(a, warm_a)[1:]  # the first request of an engine also pays start-up costs
        ttfts(b, warm_b)
        cold = ttfts(a, prompts)
        cpu_hit = ttfts(a, prompts)
        a.request("flush")  # the store's copies too
        peer_hit = ttfts(b, prompts)
        pulled = b.status()["p2p_client"]
        b.stop(timeout=60)
        if store is not None:
            c_config = instance_config("bench_c", controller, **seed_004, **remote, enable_p2p=False)
            c = driver(model, c_config, tmp, "c")
            ttfts(c, sample_prompts(model, args.prompt_tokens, range(4000, 4000 + cycle)))
            remote_hit = ttfts(c, prompts)
            remote_read = c.status()["storage"]["remote"]["chunks_read"]
            c.stop(timeout=60)
        a.stop(timeout=60)
    finally:
        controller.stop()
        if store is not None:
            store.kill()

    base = statistics.median(off)
    held = args.prompt_tokens // CHUNK * CHUNK
    print(
        json.dumps(
            {
                "bench": "vllm_cpu",
                "model": "tiny-llama (2 layers, hidden 128, fp32)",
                "prompt_tokens": args.prompt_tokens,
                "prompts": args.prompts,
                "chunk_tokens": CHUNK,
                "tokens_loadable": min(held, args.prompt_tokens - 1),
                "pool_pages": args.pool_pages,
                "config_set": settings,
                "ttft": {
                    "off": summary(off),
                    "cold_fresh_pool": summary(cold_fresh, base),
                    "cold": summary(cold, base),
                    "cpu_hit": summary(cpu_hit, base),
                    "peer_hit": summary(peer_hit, base),
                    **({"remote_hit": summary(remote_hit, base)} if remote_hit else {}),
                },
                "first_request": {
                    "gap_s": args.gap_s,
                    "runs": first,
                    "peer_hit_below_cold_in_every_run": all(r["b_peer_hit_ms"] < r["a_cold_ms"] for r in first),
                },
                "miss_overhead_pct": round((statistics.median(cold) / base - 1) * 100, 1),
                "peer_chunks_pulled": pulled["chunks_pulled"],
                **({"remote_chunks_read": remote_read} if args.remote else {}),
                "note": "TTFT from vLLM's request metrics (arrival to first token), median over the prompts; "
                "cold = connector on with nothing cached (local miss + controller lookup + store)",
            }
        )
    )


if __name__ == "__main__":
    main()
