"""Tensor parallelism on vLLM (CPU; CUDA with ``--gpu-util``): two engines at
``--tensor-parallel-size N`` (seed 004's config, a port per rank), engine 2 pulling engine 1's
KV rank by rank. Prints one JSON object.

    .venv/bin/python benchmarks/bench_tp.py [--tp 2] [--channel tcp] [--prompts 5] [--words 2500]
                                            [--torch-compile] [--busy-threads 4] [--pull-policy always]
    python benchmarks/bench_tp.py --gpu-util 0.4 --model DIR [--dtype bfloat16] --channel nixl   # GPU host

For each of ``--prompts`` distinct documents: engine 1 computes it cold, then engine 2 gets the
same prompt (each request ``--gap-s`` after the one before, so that neither engine runs beside
the other's after-step spin: ``demo.ASK_GAP_WHY``) and pulls every chunk from engine 1, each rank
from the same rank. Reported: the start-up time of the two engines, the TTFT of each engine's
first request (``first_forward_ttft_ms``: vLLM builds its kernels then; with ``--torch-compile``
a TP engine also compiles with inductor), cold and peer-hit TTFT (client side, to the first streamed token;
median and every run), each rank's pulls (ms and GB/s from the rank's own log line), and
whether engine 2's greedy output equals engine 1's. The engines share this host's cores (ranks
pinned, ``served_fleet.tp_engine_env``), so TTFT here is mostly scheduling on a small host;
the pull figures are what the mesh adds. ``--busy-threads N`` keeps N processes spinning on core 0
(where rank 0's compute is bound) while the prompts run: what a crowded core costs rank 0's pulls.

``--gpu-util F``: the engines run on CUDA (vLLM's GPU build), each at that memory share, every
rank of both engines on the host's GPUs (TP=2 on a two-GPU host: rank r of each engine on GPU r);
``--model DIR`` serves another local model (benchmarks/gpu/e2e.py builds Llama-3.1-8B's shape).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from lmcache_p2p.testing.processes import ASK_GAP_S, peer_pulls, stream_completion, wait_indexed
from lmcache_p2p.testing.served_fleet import ServedFleet
from lmcache_p2p.testing.tiny_model import MODEL_NAME, build, sample_text


def _spin_on_core_0() -> None:
    """Busy on core 0, yielding it as often as it can (as a step loop's spin does), until killed."""
    os.sched_setaffinity(0, {0})
    while True:
        os.sched_yield()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--channel", default="tcp", choices=("tcp", "nixl"))
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--words", type=int, default=2500)
    parser.add_argument(
        "--gap-s",
        type=float,
        default=ASK_GAP_S,
        help="seconds between engine 1's answer and engine 2's request, as in make demo (demo.ASK_GAP_WHY)",
    )
    parser.add_argument(
        "--torch-compile",
        action="store_true",
        help="leave vLLM's torch.compile on (TORCHDYNAMO_DISABLE=0): first_forward_ttft_ms shows what it costs",
    )
    parser.add_argument("--gpu-util", type=float, default=None, help="engines on CUDA at this memory share each")
    parser.add_argument("--model", default=None, help="a local model directory (default: the tiny model, built)")
    parser.add_argument("--dtype", default=None, help="vLLM's --dtype (default float32)")
    parser.add_argument(
        "--cpu-gb",
        type=float,
        default=0.5,
        help="each rank's CPU pool: it must hold a prompt's chunks (1 GB: 7,000 tokens of an 8B model at TP=1)",
    )
    parser.add_argument(
        "--busy-threads",
        type=int,
        default=0,
        help="processes spinning on core 0 (rank 0's) while the prompts run, as other work on a crowded host: "
        "what it costs rank 0's pulls",
    )
    parser.add_argument(
        "--pull-policy",
        default="auto",
        choices=("auto", "always"),
        help="engine 2's p2p_pull_policy; always: every prompt is pulled, however slow its pulls measured",
    )
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_tp_"))
    model = args.model or build(str(workdir / MODEL_NAME))
    engine_args = ("--max-num-seqs", "4", *(("--dtype", args.dtype) if args.dtype else ()))
    fleet = ServedFleet(
        workdir,
        model,
        tp=args.tp,
        ports_per_rank=True,
        engine_extra={
            "transfer_channel": args.channel,
            "enable_async_loading": True,
            "p2p_pull_policy": args.pull_policy,
            "extra_config": {"lookup_backoff_time": 0.001},
        },
        engine_args=engine_args,
        engine_env={"TORCHDYNAMO_DISABLE": "0"} if args.torch_compile else {},
        gpu_memory_utilization=args.gpu_util,
        cpu_gb=args.cpu_gb,
    )
    result: dict = {
        "tp": args.tp,
        "channel": args.channel,
        "torch_compile": args.torch_compile,
        "prompts": args.prompts,
        "gap_s": args.gap_s,
        "device": "cuda" if args.gpu_util is not None else "cpu",
        "model": model,
        "dtype": args.dtype or "float32",
        "cpu_gb": args.cpu_gb,
        "busy_threads_on_core_0": args.busy_threads,
        "pull_policy": args.pull_policy,
        "workdir": str(workdir),  # the engines' logs
    }
    busy: list[multiprocessing.Process] = []
    try:
        started = time.monotonic()
        fleet.start(timeout=600)
        result["startup_s"] = round(time.monotonic() - started, 1)
        e1, e2 = fleet.engine_urls
        first = fleet.first_forward(args.words)  # engine 1's, then engine 2's
        result["first_forward_ttft_ms"] = [round(t * 1e3, 1) for t in first]
        cold, peer, equal = [], [], 0
        busy = [multiprocessing.Process(target=_spin_on_core_0, daemon=True) for _ in range(args.busy_threads)]
        for process in busy:
            process.start()
        for i in range(args.prompts):
            prompt = sample_text(args.words, seed=i)
            time.sleep(args.gap_s)  # engine 2's processes spin for a second after its last answer
            on_e1 = stream_completion(e1, model, prompt)
            answered = time.monotonic()
            if not wait_indexed(e1, fleet.controller_url, model, prompt):
                raise RuntimeError(f"prompt {i}: the controller had not indexed engine 1's whole prompt after 10 s")
            time.sleep(max(0.0, args.gap_s - (time.monotonic() - answered)))
            on_e2 = stream_completion(e2, model, prompt)
            if on_e1["ttft_s"] is None or on_e2["ttft_s"] is None:
                raise RuntimeError(f"prompt {i}: a stream without tokens")
            cold.append(on_e1["ttft_s"] * 1e3)
            peer.append(on_e2["ttft_s"] * 1e3)
            equal += on_e1["text"] == on_e2["text"]
        body = {"model": model, "prompt": prompt}
        result["prompt_tokens"] = len(httpx.post(f"{e1}/tokenize", json=body, timeout=30).json()["tokens"])
        result["cold_ttft_ms"] = {"median": round(statistics.median(cold), 1), "runs": [round(x, 1) for x in cold]}
        result["peer_ttft_ms"] = {"median": round(statistics.median(peer), 1), "runs": [round(x, 1) for x in peer]}
        result["peer_over_cold"] = round(statistics.median(peer) / statistics.median(cold), 3)
        result["greedy_equal"] = f"{equal}/{args.prompts}"
        pulls = peer_pulls(fleet.processes["engine2"].log())
        by_rank = {}
        for rank in range(args.tp):
            mine = [p for p in pulls if p["rank"] == rank]
            by_rank[str(rank)] = {
                "pulls": len(mine),
                "from_same_rank": all(p["peer_rank"] == rank for p in mine),
                "tokens": int(mine[-1]["tokens"]) if mine else 0,
                "median_ms": round(statistics.median(float(p["ms"]) for p in mine), 2) if mine else None,
                "median_GB/s": round(statistics.median(float(p["gbps"]) for p in mine), 3) if mine else None,
                "gb_each": float(mine[-1]["gb"]) if mine else 0.0,
            }
        result["pulls_by_rank"] = by_rank
    except (RuntimeError, OSError, ValueError) as exc:  # a stalled start, a failed request: say so
        result["error"] = str(exc).splitlines()[0]
    finally:
        for process in busy:
            process.kill()
        fleet.stop()
    print(json.dumps(result))
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
