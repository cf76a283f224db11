"""Routing a multi-user, multi-turn chat workload over vLLM CPU engines with P2P on: lmcache_router
under each of its policies, and the independent ``vllm-router`` (PyPI, Rust) under its own
policies, side by side in one run on one fleet. Prints one JSON line per policy run and a
summary line.

    pip install 'lmcache-p2p[bench]'    # vllm-router==0.1.17
    .venv/bin/python benchmarks/bench_routing.py [--engines 2] [--users 6] [--turns 4] [--runs 3]
                                                 [--router-replicas 1] [--workload chat|rag]

The workload: every user's conversation opens with one shared system prompt
(``--system-words``), then each turn appends the user's message (``--turn-words``) and the
engine's answer (``--max-tokens``) to that user's own history, so each request's prompt is the
previous one plus a little. Users run at once (each one turn at a time, ``--think-s`` apart).
Every policy run draws new texts (its own system prompt, its own users), so nothing one run left
in any cache helps the next, and policies take turns in a rotated order from run to run.

``--workload rag`` is the case an index of what the engines hold is for: traffic the router did
not see. Before the users start, a batch job (an ingestion pipeline warming the fleet, another
router replica, an operator's ``/move``) sends ``--docs`` documents of ``--doc-words`` words
straight to the engines, each to one engine picked at random (seeded), bypassing the router
under test, which starts before it. Then every user asks ``--turns`` questions, each about a
document picked at random (prompt: the document, then the question). A router that knows where
each document's KV is sends the first question about it to its holder (a local hit); one that
learns only from the requests it routed sends it by load or at random, and a miss there costs a
peer pull (or a recompute) instead of a local hit. The controller learns of the documents from
the engines' workers; vllm-router's ``kv_aware`` from the engines' KV events, which it receives
for the ingestion too (it is subscribed before it starts); ``cache_aware`` never sees them.

Per policy run: mean and p90 TTFT (client side: request sent to first streamed token), where the
prompt tokens came from (vLLM's ``prompt_tokens_by_source``: its own prefix cache, our connector
(``external_kv_transfer``: our CPU tier plus peer pulls, split by the pull lines the engines
log), computed), and requests per engine (vLLM's ``request_success`` counters): all read from the
engines, the same way for every router.

With ``--router-replicas N`` every policy runs as N router processes and the users' requests go
to them in turn, as behind a load balancer in front of a highly available router tier: each
vllm-router replica then keeps its own prefix tree from the requests it saw, while every
lmcache_router replica asks the one controller, whose index holds what the engines hold.

Routers:
* ``kv-aware``, ``round-robin``, ``least-loaded``: lmcache_router (tokenizes on an engine, asks
  the controller's POST /route, forwards);
* ``vllm-router:cache_aware``: vllm-router's approximate prefix tree over request text, with its
  load-balance thresholds;
* ``vllm-router:kv_aware``: vllm-router fed by every engine's KV event stream
  (``--kv-events-config`` on the engines, ``--kv-event-source`` on the router), which carries
  our CPU and disk tiers beside the GPU cache;
* ``vllm-router:round_robin`` for reference.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import itertools
import json
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import zmq
from prometheus_client.parser import text_string_to_metric_families

from lmcache_p2p.testing.ports import free_ports
from lmcache_p2p.testing.processes import P2P_LINE, ServedProcess, stream_completion, wait_indexed
from lmcache_p2p.testing.served_fleet import ServedFleet
from lmcache_p2p.testing.tiny_model import build, sample_text

LMCACHE_POLICIES = ("kv-aware", "round-robin", "least-loaded")
VLLM_ROUTER_POLICIES = ("cache_aware", "kv_aware", "round_robin")
KV_BLOCK_SIZE = 128  # vLLM's CPU backend default block size, which the engines run with
SOURCES = ("local_cache_hit", "external_kv_transfer", "local_compute")


def text(words: int, rng: random.Random) -> str:
    return sample_text(words, seed=rng.randrange(1 << 30))


# -- the engines' own counters -------------------------------------------------------------------


def engine_counters(url: str) -> dict[str, float]:
    """Prompt tokens by source and finished requests, from one engine's /metrics."""
    page = httpx.get(f"{url}/metrics", timeout=10).text
    out = {source: 0.0 for source in SOURCES} | {"requests": 0.0}
    for family in text_string_to_metric_families(page):
        for sample in family.samples:
            if sample.name == "vllm:prompt_tokens_by_source_total":
                source = sample.labels.get("source", "")
                if source in out:
                    out[source] += sample.value
            elif sample.name == "vllm:request_success_total":
                out["requests"] += sample.value
    return out


def peer_tokens(fleet: ServedFleet, offsets: dict[str, int]) -> tuple[int, dict[str, int]]:
    """Tokens pulled from peers since ``offsets`` (each engine log's length then), and new offsets."""
    total, now = 0, {}
    for name in fleet.instance_ids:
        log = fleet.processes[name].log()
        total += sum(int(m["tokens"]) for m in P2P_LINE.finditer(log[offsets.get(name, 0) :]))
        now[name] = len(log)
    return total, now


# -- the workload --------------------------------------------------------------------------------


async def one_turn(url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, str]:
    """(TTFT in s, text) of one streamed completion (demo.stream_completion, on a thread, so that
    users run at once)."""
    answer = await asyncio.to_thread(stream_completion, url, model, prompt, max_tokens)
    if answer["ttft_s"] is None:
        raise RuntimeError(f"{url}: a stream without tokens")
    return answer["ttft_s"], answer["text"]


async def chat_workload(urls: list[str], model: str, args, seed: int) -> tuple[list[float], int]:
    """Every user's turns, each sent to the next of ``urls`` (router replicas behind a load
    balancer that takes requests in turn); (TTFTs in s, failed requests)."""
    # One thread per user: asyncio's default pool has min(32, cores + 4) threads, and a request
    # waiting for a thread would wait outside the TTFT it is timed by.
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=args.users))
    rng = random.Random(seed)
    sent = itertools.count()
    system = f"System: {text(args.system_words, rng)}\n"
    histories = [system for _ in range(args.users)]
    ttfts: list[float] = []
    failures = 0

    async def user(u: int) -> None:
        nonlocal failures
        user_rng = random.Random(seed * 1000 + u)
        await asyncio.sleep(u * args.stagger_s)
        for _ in range(args.turns):
            histories[u] += f"User: {text(args.turn_words, user_rng)}\nAssistant:"
            try:
                url = urls[next(sent) % len(urls)]
                ttft, answer = await one_turn(url, model, histories[u], args.max_tokens)
            # urllib's HTTP and connection errors are OSErrors; a stream cut short is an
            # HTTPException; an SSE error event has no "choices" (KeyError).
            except (OSError, ValueError, RuntimeError, KeyError, http.client.HTTPException) as e:
                failures += 1
                print(f"  user {u}: {e}", file=sys.stderr)
                answer = ""
            else:
                ttfts.append(ttft)
            histories[u] += answer + "\n"
            await asyncio.sleep(args.think_s)

    await asyncio.gather(*(user(u) for u in range(args.users)))
    return ttfts, failures


def ingest_documents(fleet: ServedFleet, args, seed: int) -> list[tuple[str, int]]:
    """The batch job of ``--workload rag``: ``--docs`` documents, each sent straight to one engine
    picked at random (not through a router), and held there once the controller has indexed it;
    [(document prompt, engine index)]."""
    rng = random.Random(seed)
    documents = []
    for d in range(args.docs):
        document = f"Document {d}: {text(args.doc_words, rng)}\n"
        engine = rng.randrange(len(fleet.engine_urls))
        stream_completion(fleet.engine_urls[engine], fleet.model, document, 1)
        if not wait_indexed(fleet.engine_urls[engine], fleet.controller_url, fleet.model, document):
            print(f"  document {d}: not indexed 10 s after engine{engine + 1} computed it", file=sys.stderr)
        documents.append((document, engine))
    # vllm-router's kv_aware hears of them through the engines' KV events: let those arrive too.
    time.sleep(2 * fleet.heartbeat_s)
    return documents


async def rag_workload(
    urls: list[str], model: str, documents: list[tuple[str, int]], args, seed: int
) -> tuple[list[float], int]:
    """Every user asks ``--turns`` questions, each about a document picked at random (prompt: the
    document, then the question), one at a time ``--think-s`` apart, users at once; requests go
    to ``urls`` in turn. (TTFTs in s, failed requests)."""
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=args.users))
    sent = itertools.count()
    ttfts: list[float] = []
    failures = 0

    async def user(u: int) -> None:
        nonlocal failures
        user_rng = random.Random(seed * 1000 + u)
        await asyncio.sleep(u * args.stagger_s)
        for _ in range(args.turns):
            document, _ = documents[user_rng.randrange(len(documents))]
            prompt = f"{document}Question: {text(args.turn_words, user_rng)}\nAnswer:"
            try:
                ttft, _ = await one_turn(urls[next(sent) % len(urls)], model, prompt, args.max_tokens)
            except (OSError, ValueError, RuntimeError, KeyError, http.client.HTTPException) as e:
                failures += 1
                print(f"  user {u}: {e}", file=sys.stderr)
            else:
                ttfts.append(ttft)
            await asyncio.sleep(args.think_s)

    await asyncio.gather(*(user(u) for u in range(args.users)))
    return ttfts, failures


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1] if len(values) > 1 else values[0]


# -- routers -------------------------------------------------------------------------------------


def forward_events(endpoint: str) -> str:
    """A loopback tcp address relaying an engine's KV events from ``endpoint`` (ipc): vllm-router
    takes only tcp://HOST:PORT and connects to it, and vLLM's publisher binds tcp only on every
    interface (``tcp://*:PORT``). A ZMQ forwarder (XSUB to XPUB) in this process joins the two."""
    ctx = zmq.Context.instance()
    xsub = ctx.socket(zmq.XSUB)
    xsub.connect(endpoint)
    xpub = ctx.socket(zmq.XPUB)
    port = xpub.bind_to_random_port("tcp://127.0.0.1")
    threading.Thread(target=zmq.proxy, args=(xsub, xpub), daemon=True, name="kv-event-forwarder").start()
    return f"tcp://127.0.0.1:{port}"


def start_vllm_router(fleet: ServedFleet, policy: str, replica: int = 0) -> tuple[ServedProcess, str]:
    command = [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port", "{port}"]
    command += ["--worker-urls", *fleet.engine_urls, "--policy", policy]
    # Its Prometheus exporter binds a fixed port by default: one of its own per replica.
    command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_ports(1)[0])]
    if policy == "kv_aware":
        # Fed by each engine's KV event stream, which carries our CPU and disk tiers (kv_events.py).
        for url, endpoint in zip(fleet.engine_urls, fleet.kv_event_endpoints, strict=True):
            command += ["--kv-event-source", f"{url}={forward_events(endpoint)}"]
        command += ["--kv-event-block-size", str(KV_BLOCK_SIZE), "--kv-event-model", fleet.model]
    return fleet.start_server(f"vllm-router-{policy}-{replica}", command)


def warm_up(fleet: ServedFleet, args) -> None:
    """Each engine's first requests (vLLM's first steps, the worker's first pull over a link) cost
    far more than steady state: pay them before the first policy, not in it. Every engine
    prefills a text of its own twice, then a text another engine holds (a peer pull)."""
    rng = random.Random(7)
    texts = [text(args.system_words, rng) for _ in fleet.engine_urls]

    for url, own in zip(fleet.engine_urls, texts, strict=True):
        for _ in range(2):
            stream_completion(url, fleet.model, own, args.max_tokens)
    time.sleep(2 * fleet.heartbeat_s)  # the controller learns who holds what
    for i, url in enumerate(fleet.engine_urls):
        stream_completion(url, fleet.model, texts[i - 1], args.max_tokens)


def start_routers(fleet: ServedFleet, policy: str, args, seed: int) -> list[tuple[ServedProcess, str]]:
    """``--router-replicas`` routers of ``policy``, each its own process (with its own state:
    vllm-router's prefix tree; lmcache_router's cooldowns, while /route is the one controller's)."""
    routers = []
    for replica in range(args.router_replicas):
        if policy.startswith("vllm-router:"):
            routers.append(start_vllm_router(fleet, policy.split(":", 1)[1], replica))
        else:
            extra = ("--tokenizer", fleet.model) if args.router_tokenizer == "local" else ()
            routers.append(fleet.start_router(policy, f"lmcache-router-{policy}-{seed}-{replica}", *extra))
    return routers


def run_policy(fleet: ServedFleet, policy: str, args, seed: int) -> dict:
    routers = start_routers(fleet, policy, args, seed)
    urls = [url for _, url in routers]
    before = {name: engine_counters(u) for name, u in zip(fleet.instance_ids, fleet.engine_urls, strict=True)}
    _, offsets = peer_tokens(fleet, {})
    documents: list[tuple[str, int]] = []
    if args.workload == "rag":  # after the routers start: vllm-router's kv_aware hears its events
        documents = ingest_documents(fleet, args, seed)
        before = {name: engine_counters(u) for name, u in zip(fleet.instance_ids, fleet.engine_urls, strict=True)}
        _, offsets = peer_tokens(fleet, {})
    t0 = time.perf_counter()
    if args.workload == "rag":
        ttfts, failures = asyncio.run(rag_workload(urls, fleet.model, documents, args, seed))
    else:
        ttfts, failures = asyncio.run(chat_workload(urls, fleet.model, args, seed))
    wall = time.perf_counter() - t0
    time.sleep(1.5)  # the engines' metrics are published on their stats interval
    after = {name: engine_counters(u) for name, u in zip(fleet.instance_ids, fleet.engine_urls, strict=True)}
    peer, _ = peer_tokens(fleet, offsets)
    # What lmcache_router spent before forwarding, per replica (vllm-router reports no such figures).
    overheads = (
        [] if policy.startswith("vllm-router:") else [httpx.get(f"{u}/router/stats", timeout=10).json() for u in urls]
    )
    for router, _ in routers:
        router.stop()
        del fleet.processes[router.name]
    delta = {n: {k: after[n][k] - before[n][k] for k in after[n]} for n in after}
    by_source = {s: sum(d[s] for d in delta.values()) for s in SOURCES}
    prompt_tokens = sum(by_source.values()) or 1.0
    external = by_source["external_kv_transfer"]
    return {
        "bench": "routing",
        "workload": args.workload,
        "policy": policy,
        "seed": seed,
        "requests": len(ttfts) + failures,
        "failures": failures,
        "mean_ttft_ms": round(statistics.fmean(ttfts) * 1e3, 1),
        "p90_ttft_ms": round(p90(ttfts) * 1e3, 1),
        "wall_s": round(wall, 1),
        "prompt_tokens": int(prompt_tokens),
        "token_share": {
            "engine_prefix_cache": round(by_source["local_cache_hit"] / prompt_tokens, 3),
            "our_tiers": round(max(0.0, external - peer) / prompt_tokens, 3),
            "peer_pull": round(min(peer, external) / prompt_tokens, 3),
            "recompute": round(by_source["local_compute"] / prompt_tokens, 3),
        },
        "requests_per_engine": {n: int(d["requests"]) for n, d in delta.items()},
        "router_replicas": len(routers),
        "documents_per_engine": [sum(1 for _, e in documents if e == i) for i in range(len(fleet.engine_urls))]
        if documents
        else None,
        "router_mean_tokenize_ms": [o.get("mean_tokenize_ms") for o in overheads] or None,
        "router_mean_route_ms": [o.get("mean_route_ms") for o in overheads] or None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default=None, help="model, logs (default: a temporary directory)")
    parser.add_argument(
        "--workload",
        choices=("chat", "rag"),
        default="chat",
        help="chat: multi-turn conversations on a shared system prompt; rag: questions about documents "
        "a batch job sent straight to the engines first (see above)",
    )
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--users", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=1500)
    parser.add_argument("--turn-words", type=int, default=200, help="a user's turn (rag: a question)")
    parser.add_argument("--docs", type=int, default=12, help="rag: documents the batch job sends to the engines")
    parser.add_argument("--doc-words", type=int, default=4000, help="rag: words per document")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--think-s", type=float, default=1.0, help="pause between a user's turns")
    parser.add_argument("--stagger-s", type=float, default=0.5, help="users start this far apart")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument(
        "--router-replicas",
        type=int,
        default=1,
        help="routers per policy, each its own process, taking the requests in turn (as behind a load balancer)",
    )
    parser.add_argument(
        "--router-tokenizer",
        choices=("local", "engine"),
        default="local",
        help="lmcache_router tokenizes with the model's tokenizer (--tokenizer) or asks an engine's /tokenize",
    )
    parser.add_argument(
        "--pin-engines",
        action="store_true",
        help="each engine's processes on a core of their own (ServedFleet.pin_engines), as a fleet's "
        "engines do not share cores; routers, controller and clients share them all",
    )
    parser.add_argument("--layers", type=int, default=4, help="the local random Llama's depth")
    parser.add_argument("--hidden", type=int, default=256, help="... and width")
    parser.add_argument(
        "--policies",
        default=",".join([*LMCACHE_POLICIES, *(f"vllm-router:{p}" for p in VLLM_ROUTER_POLICIES)]),
        help="comma-separated; lmcache_router's names, or vllm-router:POLICY",
    )
    args = parser.parse_args()
    if args.router_replicas < 1:
        parser.error(f"--router-replicas {args.router_replicas}: expected 1 or more")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for policy in policies:
        if policy not in LMCACHE_POLICIES and not re.fullmatch(r"vllm-router:\w+", policy):
            parser.error(f"--policies: unknown policy {policy!r}")
    if any(p.startswith("vllm-router:") for p in policies):
        try:
            import vllm_router  # noqa: F401
        except ImportError:
            parser.error("--policies names vllm-router, which is not installed: pip install 'lmcache-p2p[bench]'")

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-routing-"))
    model = build(
        str(workdir / f"llama-{args.layers}x{args.hidden}"),
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_heads=max(2, args.hidden // 64),
        num_kv_heads=max(2, args.hidden // 64),
    )
    env = {"VLLM_LOGGING_LEVEL": "WARNING"}
    # KV events cost every engine work on every step: on only when a router reads them.
    events = "vllm-router:kv_aware" in policies
    fleet = ServedFleet(
        workdir / "fleet", model, engines=args.engines, engine_env=env, kv_events=events, pin_engines=args.pin_engines
    )
    results = []
    try:
        print(f"starting {args.engines} engines, logs in {fleet.workdir}", file=sys.stderr, flush=True)
        fleet.start()
        warm_up(fleet, args)
        for run in range(args.runs):
            order = policies[run % len(policies) :] + policies[: run % len(policies)]
            for n, policy in enumerate(order):
                seed = 1000 * (run + 1) + n
                result = run_policy(fleet, policy, args, seed)
                result["run"] = run + 1
                results.append(result)
                print(json.dumps(result), flush=True)
    finally:
        fleet.stop()
    summary: dict = {"bench": "routing_summary", "runs": args.runs, "workload": vars(args) | {"workdir": str(workdir)}}
    for policy in policies:
        means = [r["mean_ttft_ms"] for r in results if r["policy"] == policy]
        summary[policy] = {
            "mean_ttft_ms": means,
            "failures": sum(r["failures"] for r in results if r["policy"] == policy),
        }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
