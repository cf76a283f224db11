"""vLLM on a GPU host, end to end (issue 8): peer sharing, CPU offload, miss overhead, and greedy
equality with KV pulled from a peer. ``run_e2e.sh`` runs every step; each step also runs alone:

    python benchmarks/gpu/e2e.py model   --out DIR            # Llama-3.1-8B shape, bf16, random weights
    python benchmarks/gpu/e2e.py peer    --model DIR --workdir W   # seed 004: controller + 2 engines
    python benchmarks/gpu/e2e.py offload --model DIR --connector on|off   # seed 002 shape, offline
    python benchmarks/gpu/e2e.py report  W                 # one JSON object and a table

Every step prints one JSON object on stdout; progress goes to stderr.

The model is Llama-3.1-8B's shape (32 layers, hidden 4096, 32 heads, 8 KV heads, MLP 14336, bf16)
with random weights of a trained model's scale and a tokenizer trained locally (a 1,024-token
vocabulary: embeddings and the LM head are smaller than the real 128k, which the prefill barely
notices). Documents are token ids, so every engine sees exactly the same prompt.
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

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # InstanceProcess: a JSON-lines child with its log and config file
from instances import config_override  # noqa: E402

CONNECTOR = {
    "kv_connector": "LMCacheConnectorV1",
    "kv_connector_module_path": "lmcache_p2p.integration.vllm",
    "kv_role": "kv_both",
}
LLAMA_8B = dict(
    num_layers=32,
    hidden_size=4096,
    num_heads=32,
    num_kv_heads=8,
    intermediate_size=14336,
    max_positions=32768,
    dtype="bfloat16",
    initializer_range=0.02,
)
# The load of a hit (CPU pool into vLLM's GPU blocks); the pull's line is demo.P2P_LINE.
LOAD_LINE = re.compile(
    r"Retrieved (\d+) out of total (\d+) tokens\. size: ([\d.]+) gb, cost ([\d.]+) ms, "
    r"throughput: ([\d.]+) GB/s(?! \(from)"
)


# Where a pull's batches spent their time (after the pull's line; summed over its batches).
PULL_PHASES = re.compile(
    r"\[(?P<batches>\d+) batches, ms summed: slots (?P<slots>[\d.]+), holder (?P<holder>[\d.]+) "
    r"\(its write (?P<holder_write>[\d.]+)\), queue\+wire (?P<queue_wire>[\d.]+), land (?P<land>[\d.]+), "
    r"verify (?P<verify>[\d.]+)\]"
)
# Landed GPU tier pages checked on the device behind the pull, a line for each of its requests.
DEVICE_CHECK = re.compile(
    r"checked (\d+) landed chunk\(s\) on the device in ([\d.]+) ms "
    r"\(on the GPU ([\d.]+), waiting ([\d.]+)\): (\d+) differ"
)
# A load beside the steps' way through engine 2's rank, one DEBUG line once reported (--timeline:
# LMCACHE_LOG_LEVEL=DEBUG there): ms from the rank's first sight of the request to each point
# ("-" where it did not pass one), in load_jobs.LoadTimeline's order.
LOAD_TIMELINE = re.compile(
    r"request (?P<req>\S+) timeline, ms from first seen: (?P<points>.*?) \(first seen at [\d.]+ s monotonic; "
    r"(?P<pieces>\d+) piece\(s\); a computing step waited (?P<step_wait>[\d.]+) ms for its copy\)"
)
# Its gaps (name: from point, to point), in order, then the spans worth a median of their own.
TIMELINE_GAPS = {
    "seen_to_offer": ("first seen", "offer"),
    "offer_to_granted": ("offer", "granted"),
    "granted_to_pull_start": ("granted", "pull start"),
    "pull": ("pull start", "pull end"),
    "pull_end_to_load_queued": ("pull end", "load queued"),  # negative: copying began while pulling
    "load_queued_to_load_start": ("load queued", "load start"),  # what the load waited for on the device
    "load": ("load start", "load end"),
    "load_end_to_reported": ("load end", "reported"),
    "pull_end_to_load_end": ("pull end", "load end"),  # what the load added after the pull
    "granted_to_reported": ("granted", "reported"),
}


def load_timelines(log: str, request_prefix: str) -> dict[int, dict]:
    """The DEBUG timeline lines of ``log`` for requests ``<request_prefix><i>[-suffix]``, by
    ``i``: each point's ms from first seen (``first seen`` is 0), pieces and the computing
    step's wait."""
    out = {}
    for m in LOAD_TIMELINE.finditer(log):
        index = re.fullmatch(re.escape(request_prefix) + r"(\d+)(?:-\w+)?", m["req"])
        if index is None:
            continue
        points: dict[str, float | None] = {"first seen": 0.0}
        for part in m["points"].split(", "):
            name, value = part.rsplit(" ", 1)
            points[name] = None if value == "-" else float(value)
        out[int(index[1])] = {"points": points, "pieces": int(m["pieces"]), "step_wait_ms": float(m["step_wait"])}
    return out


def timeline_summary(timelines: dict[int, dict], ttfts_ms: list[float]) -> dict:
    """Medians over requests of each gap of TIMELINE_GAPS (those that passed both points), and of
    the first token after the load was reported: the client's TTFT (from submission, a few ms
    before the rank first sees the request) less the report's offset."""

    def median(values: list[float]) -> float | None:
        return round(statistics.median(values), 2) if values else None

    gaps: dict[str, list[float]] = {name: [] for name in TIMELINE_GAPS}
    after_report: list[float] = []
    for index, timeline in timelines.items():
        points = timeline["points"]
        for name, (a, b) in TIMELINE_GAPS.items():
            if points.get(a) is not None and points.get(b) is not None:
                gaps[name].append(points[b] - points[a])
        if points.get("reported") is not None and index < len(ttfts_ms):
            after_report.append(ttfts_ms[index] - points["reported"])
    out: dict = {"requests": len(timelines)}
    out.update({f"{name}_median": median(values) for name, values in gaps.items()})
    out["reported_to_first_token_median"] = median(after_report)
    out["pieces_median"] = median([t["pieces"] for t in timelines.values()])
    out["step_wait_ms_median"] = median([t["step_wait_ms"] for t in timelines.values()])
    return out


def say(*args) -> None:
    print("[e2e]", *args, file=sys.stderr, flush=True)


def documents(model_dir: str, count: int, tokens: int, first_seed: int = 0) -> list[list[int]]:
    from lmcache_p2p.testing.tiny_model import sample_prompts

    return sample_prompts(model_dir, tokens, range(first_seed, first_seed + count))


# -- model --------------------------------------------------------------------------------------


def cmd_model(args) -> dict:
    from lmcache_p2p.testing.tiny_model import build

    t0 = time.perf_counter()
    out = build(args.out, device="cuda", **LLAMA_8B)
    return {"step": "model", "dir": out, "shape": LLAMA_8B, "s": round(time.perf_counter() - t0, 1)}


# -- peer sharing (seed 004) ------------------------------------------------------------------------


def cmd_engine(args) -> None:
    """One engine (vLLM's AsyncLLM with our connector) driven by JSON lines: ``round`` runs a
    list of prompts ``inflight`` at a time and answers each one's time to first token, the
    round's time and the greedy token ids; ``quit`` stops it."""
    import asyncio

    from lmcache_p2p.testing import jsonlines

    answers = jsonlines.claim_stdout()  # before vLLM prints anything

    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    extra = (
        {"dtype": "float32", "max_model_len": min(args.max_model_len, 8192)}
        if args.cpu_smoke
        else {"gpu_memory_utilization": args.gpu_util, "max_model_len": args.max_model_len}
    )
    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=args.model,
            enforce_eager=not args.graphs,
            kv_transfer_config=CONNECTOR,
            **({"async_scheduling": False} if args.no_async_scheduling else {}),
            **extra,
        )
    )
    loop = asyncio.new_event_loop()

    async def one(prompt: list[int], output_len: int, rid: str) -> dict:
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        t0 = time.perf_counter()
        ttft, token_ids = None, []
        async for out in engine.generate({"prompt_token_ids": prompt}, params, rid):
            if ttft is None and out.outputs and out.outputs[0].token_ids:
                ttft = time.perf_counter() - t0
            token_ids = list(out.outputs[0].token_ids)
        return {"ttft_s": ttft, "total_s": time.perf_counter() - t0, "token_ids": token_ids}

    async def run(request: dict) -> dict:
        gate = asyncio.Semaphore(request["inflight"])

        async def gated(i: int, prompt: list[int]) -> dict:
            async with gate:
                return await one(prompt, request["output_len"], f"{request['name']}-{i}")

        t0 = time.perf_counter()
        results = await asyncio.gather(*(gated(i, p) for i, p in enumerate(request["prompts"])))
        return {"round_s": time.perf_counter() - t0, "results": results}

    def handle(request: dict) -> dict:
        if request["op"] == "round":
            return loop.run_until_complete(run(request))
        raise ValueError(f"unknown op {request['op']!r}")

    jsonlines.answer(answers, {"ok": True, "ready": True})
    try:
        jsonlines.serve(handle, sys.stdin, answers)
    finally:
        engine.shutdown()


def summarize(name: str, answer: dict) -> dict:
    results = answer["results"]
    r = {
        "mean_ttft_s": round(statistics.mean(x["ttft_s"] for x in results), 4),
        "ttfts_s": [round(x["ttft_s"], 4) for x in results],
        "round_s": round(answer["round_s"], 3),
        "prompts": len(results),
        "successful": sum(1 for x in results if x["token_ids"]),
    }
    say(f"{name} round mean TTFT: {r['mean_ttft_s']:.3f}s")
    say(f"{name} round time: {r['round_s']:.3f}s")
    say(f"{name} round prompt count: {r['prompts']} (successful {r['successful']})")
    return r


def cmd_peer(args) -> dict:
    from instances import InstanceProcess

    from lmcache_p2p.testing.processes import ServedProcess

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    gpus = [g.strip() for g in args.gpus.split(",")]
    if len(gpus) != 2:
        raise SystemExit(f"--gpus takes two GPU indices (engine 1's, engine 2's), got {args.gpus!r}")
    sizes = [int(t) for t in str(args.doc_tokens).split(",")]
    # room for the longest document and its output, in whole 16-token blocks
    max_model_len = max(16384, -(-(max(sizes) + args.output_len + 64) // 16) * 16)
    procs: list = []
    try:
        controller_bin = str(Path(sys.executable).with_name("lmcache_controller"))
        controller = ServedProcess(
            "controller",
            [
                controller_bin,
                "--host",
                "localhost",
                "--port",
                "9000",
                "--monitor-ports",
                '{"pull": 8300, "reply": 8400, "heartbeat": 8082}',
            ],
            workdir / "controller.log",
        ).start()
        procs.append(controller)
        controller.wait_http("http://localhost:9000/controller/workers", 60)
        engines = []
        for i in (1, 2):
            overrides: dict = {"max_local_cpu_size": args.cpu_gb}
            if args.gpu_tier_gb:
                overrides.update(local_gpu=True, max_local_gpu_size=args.gpu_tier_gb)
            if args.channel:
                overrides["transfer_channel"] = args.channel
            if args.pull_policy:
                overrides["p2p_pull_policy"] = args.pull_policy
            overrides.update(args.set)
            config = yaml_config(REPO / "configs" / f"example{i}.yaml", **overrides)
            cmd = [sys.executable, __file__, "engine", "--model", args.model, "--gpu-util", str(args.gpu_util)]
            cmd += ["--max-model-len", str(max_model_len)]
            if args.graphs:
                cmd.append("--graphs")
            if args.no_async_scheduling:
                cmd.append("--no-async-scheduling")
            env = {}
            if args.timeline and i == 2:  # its loads' DEBUG timeline lines (engine2_load_timeline_ms)
                env["LMCACHE_LOG_LEVEL"] = "DEBUG"
            if args.cpu_smoke:  # the same flow on vLLM's CPU build with the tiny model (checks this script)
                from lmcache_p2p.testing.processes import CPU_ENGINE_ENV

                cmd, env = cmd + ["--cpu-smoke"], {**env, **CPU_ENGINE_ENV}
            else:
                # The engine's GPU first (vLLM takes cuda:0), the other still visible: CUDA IPC
                # into the peer's staging buffer needs its device visible here.
                mine = gpus[i - 1]
                env["CUDA_VISIBLE_DEVICES"] = ",".join([mine] + [g for g in dict.fromkeys(gpus) if g != mine])
            engine = InstanceProcess(config, workdir, name=f"engine{i}", command=cmd, env=env)
            engine.start(timeout=600)  # one at a time: each profiles the GPU memory left
            say(f"engine {i} up")
            procs.append(engine)
            engines.append(engine)
        out = {
            "step": "peer",
            "docs": args.docs,
            "doc_tokens": sizes[0] if len(sizes) == 1 else sizes,
            "output_len": args.output_len,
            "inflight": args.inflight,
            "gpus": gpus,
            "gpu_util": args.gpu_util,
            "gpu_tier_gb": args.gpu_tier_gb,
            "channel": args.channel or "as in the YAMLs",
            "pull_policy": args.pull_policy or "auto",
            "config_set": dict(args.set),
            "cuda_graphs": args.graphs,
            "async_scheduling": False if args.no_async_scheduling else "vLLM's default",
        }
        for i, engine in enumerate(engines, start=1):  # a short request each first, not timed
            engine.request(
                "round",
                timeout=300,
                name="hello",
                prompts=documents(args.model, 1, 512, 10_000 + i),
                output_len=4,
                inflight=1,
            )
        # Each repeat: new documents, engine 1 cold then from its own cache, engine 2 from engine 1.
        if len(sizes) == 1:
            out.update(_repeats(args, engines, sizes[0], args.docs))
            return out
        # The curve: each document length on the same engines, as many documents as fit
        # --curve-tokens (at least --inflight), shortest first.
        out["curve"] = []
        for tokens in sizes:
            docs = max(args.inflight, min(args.docs, args.curve_tokens // tokens))
            say(f"curve: {docs} documents of {tokens} tokens")
            # seeds apart from every other length's (a shorter document of one seed is a prefix of the longer)
            waves = _repeats(args, engines, tokens, docs, seed_offset=20 * tokens)
            out["curve"].append({"doc_tokens": tokens, "docs": docs, **waves})
        return out
    finally:
        for proc in reversed(procs):
            proc.stop()


def _repeats(args, engines: list, tokens: int, count: int, seed_offset: int = 0) -> dict:
    """``args.repeats`` waves of ``count`` new documents of ``tokens`` tokens (seeds from
    ``seed_offset``): the first wave's figures, with every wave and the ratios' spreads when there
    are several."""
    waves = [
        _peer_wave(args, engines, documents(args.model, count, tokens, first_seed=1000 * r + seed_offset), r, tokens)
        for r in range(args.repeats)
    ]
    out = dict(waves[0])
    if args.repeats > 1:
        out["repeats"] = waves
        for key in ("ttft_ratio", "peer_vs_own_hit_ttft_ratio", "round_ratio"):
            out[f"{key}_spread"] = spread([w[key] for w in waves])
    return out


def _peer_wave(args, engines: list, docs: list[list[int]], repeat: int, doc_tokens: int) -> dict:
    """One measurement: engine 1's warmup (cold) and query (its own cache) rounds, then engine
    2's (from engine 1), over ``docs``; what engine 2's log says about this wave's pulls and loads."""
    from protocol_client import wait_for

    from lmcache_p2p.testing.processes import P2P_LINE

    out: dict = {"repeat": repeat}
    log_from = len(engines[1].log())
    texts = {}
    for i, engine in enumerate(engines, start=1):
        if i == 2:  # every full chunk of this wave's documents is at engine 1 before engine 2 asks
            wait_for(
                lambda: all(_held_by_engine1(doc) >= (doc_tokens // 256) * 256 for doc in docs),
                timeout=60,
                what="engine 1's chunks at the controller",
                interval=0.2,  # each ask is one /lookup per document
            )
        for name in ("warmup", "query"):
            answer = engine.request(
                "round",
                timeout=900,
                name=f"e{i}{name}",
                prompts=docs,
                output_len=args.output_len,
                inflight=args.inflight,
            )
            out[f"engine{i}_{name}"] = summarize(f"engine {i} {name}", answer)
            texts[(i, name)] = [x["token_ids"] for x in answer["results"]]
    log2 = engines[1].log()[log_from:]
    pulls = [
        {k: v if k in ("peer", "channel") else float(v) for k, v in m.groupdict().items()}
        for m in P2P_LINE.finditer(log2)
    ]
    loads = [dict(tokens=int(m[0]), gb=float(m[2]), ms=float(m[3]), gbps=float(m[4])) for m in LOAD_LINE.findall(log2)]
    out["engine2_pulls"] = {
        "count": len(pulls),
        "tokens": int(sum(p["tokens"] for p in pulls)),
        "checksum_mismatches": log2.count("checksum mismatch"),
        "gb": round(sum(p["gb"] for p in pulls), 3),
        "median_GB/s": statistics.median(p["gbps"] for p in pulls) if pulls else None,
        "min_GB/s": min((p["gbps"] for p in pulls), default=None),
        "max_GB/s": max((p["gbps"] for p in pulls), default=None),
        "median_ms": statistics.median(p["ms"] for p in pulls) if pulls else None,
        "channels": sorted({p["channel"] for p in pulls}),
    }
    phases = [{k: float(v) for k, v in m.groupdict().items()} for m in PULL_PHASES.finditer(log2)]
    out["engine2_pull_phases_median_ms"] = (
        {k: statistics.median(p[k] for p in phases) for k in phases[0]} if phases else None
    )
    out["engine2_loads"] = {
        "count": len(loads),
        "median_GB/s": statistics.median(p["gbps"] for p in loads) if loads else None,
        "median_ms": statistics.median(p["ms"] for p in loads) if loads else None,
    }
    e1, e2 = out["engine1_warmup"], out["engine2_warmup"]
    out["ttft_ratio"] = round(e2["mean_ttft_s"] / e1["mean_ttft_s"], 4)
    # the peer hit against the engine's own prefix-cache hit of the same documents
    out["peer_vs_own_hit_ttft_ratio"] = round(e2["mean_ttft_s"] / out["engine1_query"]["mean_ttft_s"], 4)
    out["round_ratio"] = round(e2["round_s"] / e1["round_s"], 4)
    # Greedy outputs: engine 2 (KV from the peer) against engine 1 (cold); engine 1's own
    # query round (vLLM's prefix cache) shows how far numerics alone move them.
    cold = texts[(1, "warmup")]
    out["greedy_equal_peer_vs_cold"] = sum(a == b for a, b in zip(cold, texts[(2, "warmup")], strict=True))
    out["greedy_equal_own_cache_vs_cold"] = sum(a == b for a, b in zip(cold, texts[(1, "query")], strict=True))
    # (one result per prompt, in order; ignore_eos makes every output output_len tokens long)
    for key, other in (("peer", texts[(2, "warmup")]), ("own_cache", texts[(1, "query")])):
        out[f"greedy_leading_tokens_equal_{key}_vs_cold"] = [
            next((k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
            for a, b in zip(cold, other, strict=True)
        ]
    landed_lines = list(re.finditer(r"; (\d+) chunk\(s\) landed in the GPU tier \((\d+) checked on the device", log2))
    from_gpu_tier = [int(m[1]) for m in re.finditer(r"\((\d+) of \d+ chunks from the GPU tier\)", log2)]
    # How long steps that loaded landed chunks held their output for those chunks' checksum checks.
    check_waits = [float(m[1]) for m in re.finditer(r"step waited ([\d.]+) ms for the checksum checks", log2)]
    # Each warmup hit's timeline in the scheduler: first seen -> hit known (its pull done) -> its
    # load scheduled in a step. Requests go in a window of ``inflight``; with equal output
    # lengths the window refills in groups (requests 0, 4, 8, ... first), and the first of a
    # group does not wait for the others' pulls, so it is reported apart.
    scheduled = [
        (int(m[1]), float(m[2]), float(m[3]))
        for m in re.finditer(
            r"Reqid: e2warmup-(\d+)(?:-\w+)?, loading \d+ tokens (?:in this step|beside the steps), ([\d.]+) ms after"
            r" the request was"
            r" first seen \(hit known at ([\d.]+) ms\)",
            log2,
        )
    ]
    # ... and its first token, from the client's TTFT (taken from submission, a few ms before
    # the scheduler first sees it): what the load step and the output path add.
    ttfts_ms = [t * 1e3 for t in out["engine2_warmup"]["ttfts_s"]]
    out["engine2_hit_timeline_ms"] = {
        group: {
            "requests": len(rows),
            "hit_known_median": statistics.median(r[2] for r in rows) if rows else None,
            "load_scheduled_median": statistics.median(r[1] for r in rows) if rows else None,
            "load_scheduled_max": max((r[1] for r in rows), default=None),
            "first_token_median": statistics.median(ttfts_ms[r[0]] for r in rows) if rows else None,
            "first_token_after_load_scheduled_median": (
                statistics.median(ttfts_ms[r[0]] - r[1] for r in rows) if rows else None
            ),
        }
        for group, rows in (
            ("first_of_group", [r for r in scheduled if r[0] % args.inflight == 0]),
            ("others", [r for r in scheduled if r[0] % args.inflight]),
        )
    }
    # pull_before_grant: how long each warmup hit's pull held it back before vLLM granted it.
    before_grant = [
        float(m[1]) for m in re.finditer(r"Reqid: e2warmup-\d+(?:-\w+)?, pulled before its grant in ([\d.]+) ms", log2)
    ]
    out["engine2_pulled_before_grant_ms"] = (
        {"requests": len(before_grant), "median": statistics.median(before_grant), "max": max(before_grant)}
        if before_grant
        else None
    )
    # Where each warmup hit's load went on engine 2's rank (--timeline), gap by gap.
    out["engine2_load_timeline_ms"] = timeline_summary(load_timelines(log2, "e2warmup-"), ttfts_ms)
    checks = [(int(m[1]), float(m[2]), float(m[3]), float(m[4]), int(m[5])) for m in DEVICE_CHECK.finditer(log2)]
    out["engine2_device_checks"] = {
        "count": len(checks),
        "chunks": sum(c[0] for c in checks),
        "differ": sum(c[4] for c in checks),
        "median_ms": statistics.median(c[1] for c in checks) if checks else None,
        "median_gpu_ms": statistics.median(c[2] for c in checks) if checks else None,
        "median_wait_ms": statistics.median(c[3] for c in checks) if checks else None,
    }
    out["engine2_gpu_tier"] = {
        "chunks_landed": sum(int(m[1]) for m in landed_lines),
        "chunks_checked_on_device": sum(int(m[2]) for m in landed_lines),
        "chunks_loaded": sum(from_gpu_tier),
        "steps_waiting_for_checks": len(check_waits),
        "check_wait_ms_median": statistics.median(check_waits) if check_waits else None,
        "check_wait_ms_max": max(check_waits, default=None),
    }
    return out


def _held_by_engine1(tokens: list[int]) -> int:
    """Tokens of ``tokens`` the controller's /lookup says engine 1 holds. Asked per document, not
    counted from key-stats: a CPU pool smaller than all repeats' documents evicts older waves'
    chunks, so a running total of indexed chunks need not grow by a whole wave."""
    import httpx

    answer = httpx.post("http://localhost:9000/lookup", json={"tokens": tokens}, timeout=30).json()
    # layout_info: {instance: [location, tokens held]}
    return answer["layout_info"].get("lmcache_instance_1", [None, 0])[1]


def yaml_config(path: Path, **overrides) -> dict:
    import yaml

    config = yaml.safe_load(path.read_text())
    config.update(overrides)
    return config


# -- CPU offload and miss overhead (seed 002) ---------------------------------------------------------


def _profiler():
    import torch.profiler as tp

    return tp.profile(activities=[tp.ProfilerActivity.CPU, tp.ProfilerActivity.CUDA], record_shapes=False)


def _write_profile(profiler, out_dir: Path) -> dict:
    """Run 2's profile: tables of the top operators by host and by device time, a Chrome trace,
    and the device's busy time split by kind (kernels, copies) for the JSON."""
    out_dir.mkdir(parents=True, exist_ok=True)
    events = profiler.key_averages()
    for sort in ("cpu_time_total", "self_cpu_time_total", "device_time_total"):
        (out_dir / f"run2_by_{sort}.txt").write_text(events.table(sort_by=sort, row_limit=40))
    profiler.export_chrome_trace(str(out_dir / "run2_trace.json"))
    device_ms: dict[str, float] = {}
    for event in events:
        us = getattr(event, "self_device_time_total", 0) or 0
        if us <= 0:
            continue
        kind = "memcpy" if "memcpy" in event.key.lower() else "kernel"
        device_ms[kind] = device_ms.get(kind, 0.0) + us / 1e3
    return {"device_ms": {k: round(v, 1) for k, v in device_ms.items()}, "dir": str(out_dir)}


def cmd_offload(args) -> dict:
    """Seed 002's shape in one offline engine: 10 prompts x 10,000 tokens, max_tokens=1, prefix
    caching off, GPU memory capped at 24 GB so their KV does not fit. Run 1 and run 2 are the same
    prompts (run 2 reuses the KV offloaded to CPU, when the connector is on); run 3 is new prompts
    (every chunk a miss), for the connector's cost when nothing is reused."""
    import torch

    if args.profile_dir:  # the engine core in this process, where the profiler sees it
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.connector == "on":
        os.environ.update(
            {"LMCACHE_CHUNK_SIZE": "256", "LMCACHE_LOCAL_CPU": "True", "LMCACHE_MAX_LOCAL_CPU_SIZE": str(args.cpu_gb)}
        )
        if args.layerwise:
            os.environ["LMCACHE_USE_LAYERWISE"] = "True"
        if args.async_loads:
            os.environ["LMCACHE_ASYNC_KV_LOADS"] = "True"
        for key, value in args.set:
            if value is not None:
                os.environ[f"LMCACHE_{key.upper()}"] = str(value)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    total_gb = torch.cuda.get_device_properties(0).total_memory / 2**30
    llm = LLM(
        model=args.model,
        max_model_len=16384,
        enable_prefix_caching=False,
        enforce_eager=not args.graphs,  # the seed leaves vLLM's CUDA graphs on; earlier runs had them off
        gpu_memory_utilization=args.gpu_gb / total_gb,
        kv_transfer_config=KVTransferConfig(**CONNECTOR) if args.connector == "on" else None,
    )
    params = SamplingParams(temperature=0, max_tokens=1)
    reused = documents(args.model, args.prompts, args.tokens, first_seed=100)
    fresh = documents(args.model, args.prompts, args.tokens, first_seed=200)
    llm.generate([{"prompt_token_ids": p} for p in documents(args.model, 2, 512, first_seed=300)], params)  # warm-up
    from lmcache_p2p.config import LMCacheConfig

    config = LMCacheConfig.load() if args.connector == "on" else None  # what the engine read from LMCACHE_*
    out = {
        "step": "offload",
        "connector": args.connector,
        "prompts": args.prompts,
        "tokens": args.tokens,
        "gpu_gb": args.gpu_gb,
        "store_ctas": config.store_ctas if config else None,
        "use_layerwise": args.layerwise,
        "async_kv_loads": config.async_kv_loads if config else None,
        "cuda_graphs": args.graphs,
        "set": dict(args.set) if args.connector == "on" else {},
    }
    cache = llm.llm_engine.vllm_config.cache_config
    out["gpu_kv_blocks"] = getattr(cache, "num_gpu_blocks", None)
    # Run 2 again (--run2-repeats): the same state each time (prefix caching is off, so every
    # prompt comes from the CPU tier again), a spread from one engine start.
    runs = [("run1", reused), ("run2", reused)]
    runs += [(f"run2_again{i}", reused) for i in range(1, args.run2_repeats)]
    runs += [("run3_new_prompts", fresh)]
    for name, prompts in runs:
        profiler = _profiler() if args.profile_dir and name == "run2" else None
        # The engine's log lines carry wall-clock times in this format: a run's window in them.
        say(f"{name} starts at {_log_time()}")
        t0 = time.perf_counter()
        if profiler is not None:
            profiler.start()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        if profiler is not None:
            torch.cuda.synchronize()
            profiler.stop()
        out[f"{name}_s"] = round(time.perf_counter() - t0, 3)
        if profiler is not None:
            out["run2_profile"] = _write_profile(profiler, Path(args.profile_dir))
        say(f"connector {args.connector}: {name} {out[f'{name}_s']:.2f} s, ends at {_log_time()}")
    if args.profile_dir:
        out["run2_again_python_profile"] = _python_profile(llm, reused, params, Path(args.profile_dir))
    out["speedup_run1_over_run2"] = round(out["run1_s"] / out["run2_s"], 2)
    if args.run2_repeats > 1:
        out["speedup_spread"] = spread(
            [round(out["run1_s"] / out[name + "_s"], 2) for name, _ in runs if name.startswith("run2")]
        )
    return out


def spread(values: list[float]) -> dict:
    """Repeats reported as min, median and max, not the best one."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _log_time() -> str:
    """Now, as the engines' log lines write it (logging's asctime: local time, milliseconds)."""
    now = time.time()
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)) + f",{int(now * 1000) % 1000:03d}"


def _python_profile(llm, prompts, params, out_dir: Path) -> dict:
    """Run 2's prompts once more (their KV still in the CPU pool) under cProfile: the host-side
    time torch.profiler cannot attribute (in issue 21's first profile ~60% of run 2 was host time
    between GPU work: scheduler, connector, sampling). Writes the top functions by cumulative and
    by own time."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    t0 = time.perf_counter()
    profile.enable()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    profile.disable()
    seconds = time.perf_counter() - t0
    for sort in ("cumulative", "tottime"):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(sort).print_stats(60)
        (out_dir / f"run2_again_python_by_{sort}.txt").write_text(text.getvalue())
    return {"s": round(seconds, 3), "dir": str(out_dir)}


# -- report -----------------------------------------------------------------------------------------


def cmd_report(args) -> dict:
    w = Path(args.workdir)
    load = lambda name: json.loads((w / name).read_text()) if (w / name).exists() else None  # noqa: E731
    peer, on, off = load("peer.json"), load("offload_on.json"), load("offload_off.json")
    out = {"step": "report", "peer": peer, "offload_on": on, "offload_off": off}
    if on and off:
        out["miss_overhead_run3"] = round(on["run3_new_prompts_s"] / off["run3_new_prompts_s"] - 1, 4)
        out["miss_overhead_run1"] = round(on["run1_s"] / off["run1_s"] - 1, 4)
    return out


def add_set_argument(parser: argparse.ArgumentParser, text: str) -> None:
    """--set KEY=VALUE, repeatable: config keys for the engines the command starts."""
    parser.add_argument("--set", action="append", default=[], type=config_override, metavar="KEY=VALUE", help=text)


def add_graphs_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--graphs",
        action="store_true",
        help="vLLM's CUDA graphs (its default, which the seeds keep; without it: enforce_eager, as earlier runs)",
    )


def add_async_scheduling_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="vLLM's async_scheduling off (on by default where vLLM can): a finished load is then seen by the "
        "step that reports it rather than the one after",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("model")
    p.add_argument("--out", required=True)
    p = sub.add_parser("peer")
    p.add_argument("--model", required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--docs", type=int, default=20)
    p.add_argument(
        "--doc-tokens", default="10000", help="tokens per document; a comma list (2000,8000,...) measures a curve"
    )
    p.add_argument(
        "--curve-tokens", type=int, default=128_000, help="with a curve: documents per length fit this many tokens"
    )
    p.add_argument("--output-len", type=int, default=100)
    p.add_argument("--inflight", type=int, default=4)
    p.add_argument("--gpu-util", type=float, default=0.4, help="per engine (0.4: two engines share one GPU)")
    p.add_argument("--gpus", default="0,0", help="engine 1's and engine 2's GPU: 0,0 shares one, 0,1 one each")
    p.add_argument("--cpu-gb", type=float, default=30, help="max_local_cpu_size per engine (the seed asks 100)")
    p.add_argument("--cpu-smoke", action="store_true", help="vLLM's CPU build and the tiny model: checks the script")
    p.add_argument("--channel", choices=["nixl", "tcp"], help="override the YAMLs' transfer_channel")
    p.add_argument("--pull-policy", choices=["auto", "always"], help="override p2p_pull_policy (default auto)")
    p.add_argument("--gpu-tier-gb", type=float, default=0, help="local_gpu with this max_local_gpu_size (0: off)")
    p.add_argument("--repeats", type=int, default=1, help="measurements with new documents on the same engines")
    p.add_argument(
        "--timeline",
        action="store_true",
        help="engine 2 at LMCACHE_LOG_LEVEL=DEBUG: each load's timeline line, summed up in engine2_load_timeline_ms",
    )
    add_set_argument(p, "a config key for both engines, VALUE read as YAML (e.g. p2p_batch_chunks=16); repeatable")
    add_graphs_argument(p)
    add_async_scheduling_argument(p)
    p = sub.add_parser("engine")
    p.add_argument("--max-model-len", type=int, default=16384)
    add_graphs_argument(p)
    add_async_scheduling_argument(p)
    p.add_argument("--model", required=True)
    p.add_argument("--gpu-util", type=float, default=0.4)
    p.add_argument("--cpu-smoke", action="store_true")
    p = sub.add_parser("offload")
    p.add_argument("--model", required=True)
    p.add_argument("--connector", choices=["on", "off"], required=True)
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--tokens", type=int, default=10_000)
    p.add_argument("--gpu-gb", type=float, default=24, help="GPU memory for the engine (the seed's 24 GB)")
    p.add_argument("--layerwise", action="store_true", help="use_layerwise: loads overlap the forward pass")
    p.add_argument(
        "--async-loads",
        action="store_true",
        help="async_kv_loads True: every load runs beside the steps (default auto: those from host memory)",
    )
    p.add_argument("--cpu-gb", type=float, default=30)
    add_graphs_argument(p)
    p.add_argument("--run2-repeats", type=int, default=1, help="run 2 this many times (each from the CPU tier)")
    add_set_argument(p, "a config key with the connector on (as LMCACHE_KEY), e.g. load_staging_mb=0; repeatable")
    p.add_argument(
        "--profile-dir",
        help="profile run 2 with torch.profiler (engine in this process): its top operators by host "
        "and by device time, and a Chrome trace; then run 2's prompts once more under cProfile; "
        "all written here",
    )
    p = sub.add_parser("report")
    p.add_argument("workdir")
    args = parser.parse_args()
    if args.cmd == "engine":
        return cmd_engine(args)
    from lmcache_p2p.testing import jsonlines

    result = jsonlines.claim_stdout()  # progress, vLLM and its engine processes print to stderr
    out = {"model": cmd_model, "peer": cmd_peer, "offload": cmd_offload, "report": cmd_report}[args.cmd](args)
    print(json.dumps(out), file=result, flush=True)


if __name__ == "__main__":
    main()
