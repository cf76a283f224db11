"""Controller load: ingest over real ZMQ, /lookup latency over real HTTP, and RSS.

    .venv/bin/python benchmarks/bench_controller.py [--max-keys 10000000]

Starts a real ``lmcache_controller``, registers ``--instances`` x ``--ranks`` workers over ZMQ,
pushes random chunk keys in ``--batch``-key KeyEvents batches until 100k, 1M (and ``--max-keys``)
keys are held, and at each size times /lookup of 1k, 4k and 25.6k-token prompts (held by two
instances, so lookups walk a multi-holder prefix) on one keep-alive HTTP connection. Prints one
JSON object. Targets (issue 3): ingest >= 1M keys/s; /lookup of 25.6k tokens at 1M keys < 1 ms
p50 and < 3 ms p99; RSS < 150 MB idle; <= 60 bytes per (key, holder) at 10M.

/route (issue 22) is timed the same way, on the same prompts at the same sizes, next to /lookup
(``route`` beside ``lookup`` in each size, ``route_vs_lookup_p50`` for each prompt). The workers
register with p2p ports and heartbeat an engine load, so /route ranks every instance with its
peer-pull and load terms. Target: /route within 2x of /lookup's latency.

    .venv/bin/python benchmarks/bench_controller.py --auth-comparison [--instances 100 --ranks 2]

(issue 18) /lookup throughput from ``--clients`` (8) concurrent clients for ``--seconds``, an open
controller against a secured one (mesh secret: CurveZMQ on the workers' sockets; API token with
--protect-reads, so every /lookup carries and is checked for its bearer token), alternated
``--rounds`` times. Target: the secured mesh within 10% of the open one.

    .venv/bin/python benchmarks/bench_controller.py --identity --max-keys 1000000 --repeat 50

(tenants) What a request's identity costs /lookup and /route: besides the random keys, the
25.6k-token prompt's keys are admitted as engines make them for four bodies (plain; with a
cache_salt; salt and a LoRA adapter the ranks reported in their Register; salt, adapter and two
mm_features), and each body is timed at every size up to 1M keys (``identity_lookup`` and
``identity_route``, with each one's p50 over the plain body's); ``lookup_breakdown_25.6k_ms``
gains the steps ``decode_identity``, ``resolve_identity`` and ``hash_chunks_identity``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import threading
import time

import numpy as np
import zmq

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from protocol_client import ControllerProcess, layout  # noqa: E402

from lmcache_p2p.controller.api import _LookupFastPath, parse_token_array  # noqa: E402
from lmcache_p2p.controller.index import ChunkIndex  # noqa: E402
from lmcache_p2p.keys import chunk_hash_array  # noqa: E402
from lmcache_p2p.mesh_security import MeshSecurity, client_socket, server_socket  # noqa: E402
from lmcache_p2p.protocol import (  # noqa: E402
    PROTOCOL_VERSION,
    EngineLoad,
    Heartbeat,
    KeyEvents,
    Register,
    controller_reply_decoder,
    encode,
    pack_hashes,
)

CHUNK = 256
CPU = "LocalCPUBackend"
# --identity: the adapter every bench rank reports, and the bodies timed besides the plain one.
LORA_ID = "0123456789abcdef0123456789abcdef"
MM_FEATURES = [
    {"identifier": "f" * 64, "offset": 1_000, "length": 1_200},
    {"identifier": "e" * 64, "offset": 5_000, "length": 1_200},
]
IDENTITY_BODIES = {
    "plain": {},
    "salt": {"cache_salt": "tenant-a"},
    "salt+lora": {"cache_salt": "tenant-a", "lora": "sql"},
    "salt+lora+2mm": {"cache_salt": "tenant-a", "lora": "sql", "mm_features": MM_FEATURES},
}


def identity_keys(tokens, extra: dict) -> np.ndarray:
    """The prompt's keys as an engine makes them for a request with ``extra``'s identity."""
    from lmcache_p2p.keys import KeyIdentity, MMPlacement

    ident = KeyIdentity(
        cache_salt=extra.get("cache_salt"),
        lora_name=extra.get("lora"),
        lora_id=LORA_ID if extra.get("lora") else None,
    )
    mm = [MMPlacement(f["identifier"], f["offset"], f["length"]) for f in extra.get("mm_features", ())]
    return chunk_hash_array(tokens, CHUNK, identity=None if ident.plain else ident, mm=mm)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Load:
    def __init__(
        self,
        controller: ControllerProcess,
        instances: int,
        ranks: int,
        security: MeshSecurity | None = None,
        adapters: dict[str, str] | None = None,
    ):
        self.ctx = zmq.Context()
        self.security = security
        self.push = self.ctx.socket(zmq.PUSH)
        client_socket(self.push, security)
        self.push.setsockopt(zmq.SNDHWM, 0)
        self.push.connect(f"tcp://127.0.0.1:{controller.pull}")
        self.workers = [(f"bench-inst-{i}", r) for i in range(instances) for r in range(ranks)]
        self.seq = {w: 0 for w in self.workers}
        # One command port for every rank: the controller checks that a new rank's command port
        # answers a handshake (and drops a rank whose port does not).
        self.commands = self.ctx.socket(zmq.ROUTER)
        server_socket(self.commands, security, "bench commands", 4 * 2**20)
        command_port = self.commands.bind_to_random_port("tcp://127.0.0.1")
        req = self.ctx.socket(zmq.DEALER)
        client_socket(req, security)
        req.connect(f"tcp://127.0.0.1:{controller.reply}")
        self.epoch = ""
        for n, (inst, rank) in enumerate(self.workers):
            req.send_multipart(
                [
                    b"%d" % n,
                    encode(
                        Register(
                            version=PROTOCOL_VERSION,
                            instance_id=inst,
                            rank=rank,
                            host="127.0.0.1",
                            worker_port=command_port,
                            layout=layout("bench-model", rank, ranks),
                            chunk_size=CHUNK,
                            locations=[CPU],
                            # Peers for /route's pull term (nothing connects to them here).
                            p2p_init_port=9100 + rank,
                            p2p_lookup_port=9200 + rank,
                            serve_url=f"http://127.0.0.1:{18000 + n // ranks}",
                            adapters=adapters,
                        )
                    ),
                ]
            )
            assert req.poll(5000), "controller did not answer register"
            self.epoch = controller_reply_decoder.decode(req.recv_multipart()[1]).controller_epoch
        req.close()
        self.heartbeat = self.ctx.socket(zmq.DEALER)
        client_socket(self.heartbeat, security)
        self.heartbeat.connect(f"tcp://127.0.0.1:{controller.heartbeat}")
        self.beat()

    def beat(self) -> None:
        """One heartbeat per rank, with an engine load for /route (and liveness: the bench runs
        longer than --worker-timeout)."""
        for n, (inst, rank) in enumerate(self.workers):
            load = EngineLoad(running=n % 5, waiting=n % 3, kv_usage=(n % 10) / 10, prefill_tokens_per_s=10_000.0)
            message = Heartbeat(instance_id=inst, rank=rank, controller_epoch=self.epoch, load=load)
            self.heartbeat.send_multipart([b"%d" % n, encode(message)])
        for _ in self.workers:
            assert self.heartbeat.poll(5000), "controller did not answer a heartbeat"
            self.heartbeat.recv_multipart()

    def close(self) -> None:
        if self.security is not None:  # its ZAP handler holds a socket: destroy() would wait for it
            self.security.detach(self.ctx)
        self.ctx.destroy(linger=0)

    def admit(self, worker, keys: np.ndarray) -> None:
        self.seq[worker] += 1
        inst, rank = worker
        self.push.send(
            encode(
                KeyEvents(instance_id=inst, rank=rank, location=CPU, seq=self.seq[worker], admitted=pack_hashes(keys))
            ),
            copy=False,
        )


def wait_keys(controller: ControllerProcess, expected: int, timeout: float = 300, headers: dict | None = None) -> None:
    deadline = time.monotonic() + timeout
    while controller.http.get("/controller/key-stats", headers=headers).json()["total_keys"] < expected:
        if time.monotonic() > deadline:
            raise RuntimeError(f"controller did not reach {expected} keys in {timeout}s")
        time.sleep(0.005)


def ingest(
    controller: ControllerProcess, load: Load, rng: np.random.Generator, count: int, batch: int, headers=None
) -> dict:
    before = controller.http.get("/controller/key-stats", headers=headers).json()["total_keys"]
    keys = rng.integers(1, 2**63, size=count, dtype=np.int64).astype(np.uint64)
    t0 = time.perf_counter()
    for i, start in enumerate(range(0, count, batch)):
        load.admit(load.workers[i % len(load.workers)], keys[start : start + batch])
    wait_keys(controller, before + count, headers=headers)
    seconds = time.perf_counter() - t0
    return {"keys": count, "seconds": round(seconds, 3), "keys_per_s": round(count / seconds)}


def time_lookups(
    port: int, prompts: dict[str, list[int]], repeat: int, path: str = "/lookup", extra: dict | None = None
) -> dict:
    """p50/p99 of ``path`` (/lookup or /route) per prompt, one keep-alive connection, and what the
    last answer said (so a run that answered nothing useful shows it). ``extra``: more body fields
    (a request's identity)."""
    conn = http.client.HTTPConnection("127.0.0.1", port)
    out = {}
    for name, tokens in prompts.items():
        body = json.dumps({"tokens": tokens, **(extra or {})}).encode()
        samples = []
        for i in range(repeat + 20):
            t0 = time.perf_counter()
            conn.request("POST", path, body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            if i >= 20:  # warm-up excluded
                samples.append((time.perf_counter() - t0) * 1e3)
        assert resp.status == 200, (path, resp.status, data[:500])
        answer = json.loads(data)
        samples.sort()
        out[name] = {
            "p50_ms": round(statistics.median(samples), 3),
            "p99_ms": round(samples[int(len(samples) * 0.99) - 1], 3),
        }
        if path == "/lookup":
            out[name]["matched_tokens"] = max((v[1] for v in answer["layout_info"].values()), default=0)
            out[name]["holders"] = len(answer["holders"])
        else:
            best = answer["ranked"][0]
            out[name].update(
                chosen=answer["chosen"],
                local_tokens=best["local_tokens"],
                expected_ttft_ms=best["expected_ttft_ms"],
                ranked=len(answer["ranked"]),
                skipped=len(answer["skipped"]),
            )
    conn.close()
    return out


def lookup_breakdown(tokens: list[int], repeat: int, identity: bool = False) -> dict:
    """Where a /lookup's server-side time goes, step by step, timed in this process with the
    controller's own functions (the rest of the HTTP figure is uvicorn + FastAPI). With
    ``identity``, the steps a body with a salt, an adapter and two mm_features adds."""
    import msgspec

    body = json.dumps({"tokens": tokens}).encode()
    raw = bytes(msgspec.json.decode(body, type=_LookupFastPath).tokens)
    array = parse_token_array(raw)
    hashes = chunk_hash_array(array, CHUNK)
    index = ChunkIndex()
    index.add(1, hashes)
    steps = {
        "extract_tokens_json": lambda: msgspec.json.decode(body, type=_LookupFastPath),
        "parse_int64": lambda: parse_token_array(raw),
        "hash_chunks": lambda: chunk_hash_array(array, CHUNK),
        "index_prefix_walk": lambda: index.prefix_holders(hashes),
    }
    if identity:
        from protocol_client import register_message

        from lmcache_p2p.controller.identity import from_body, resolve
        from lmcache_p2p.controller.registry import Registry

        fields = IDENTITY_BODIES["salt+lora+2mm"]
        identity_body = json.dumps({"tokens": tokens, **fields}).encode()
        registry = Registry()
        registry.register(register_message("bench", adapters={"sql": LORA_ID}))
        decoded = msgspec.json.decode(identity_body, type=_LookupFastPath)
        ident = from_body(decoded)
        variant = resolve(registry, ident).variants[0]
        steps["decode_identity"] = lambda: from_body(msgspec.json.decode(identity_body, type=_LookupFastPath))
        steps["resolve_identity"] = lambda: resolve(registry, ident)
        steps["hash_chunks_identity"] = lambda: chunk_hash_array(array, CHUNK, identity=variant.identity, mm=ident.mm)
    out = {}
    for name, step in steps.items():
        samples = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            step()
            samples.append((time.perf_counter() - t0) * 1e3)
        out[name] = round(statistics.median(samples), 3)
    return out


def concurrent_lookups(port: int, tokens: list[int], clients: int, seconds: float, headers: dict) -> dict:
    """``clients`` threads, each on its own keep-alive connection, asking /lookup back to back for
    ``seconds``: requests per second answered, and the latency spread."""
    body = json.dumps({"tokens": tokens}).encode()
    samples: list[list[float]] = [[] for _ in range(clients)]
    stop = time.monotonic() + seconds

    def client(out: list[float]) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port)
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            conn.request("POST", "/lookup", body, {"Content-Type": "application/json", **headers})
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200, resp.status
            out.append((time.perf_counter() - t0) * 1e3)
        conn.close()

    threads = [threading.Thread(target=client, args=(out,)) for out in samples]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    merged = sorted(x for out in samples for x in out)
    return {
        "requests": len(merged),
        "req_per_s": round(len(merged) / elapsed, 1),
        "p50_ms": round(statistics.median(merged), 2),
        "p99_ms": round(merged[int(len(merged) * 0.99) - 1], 2),
    }


def auth_comparison(args) -> dict:
    """/lookup from ``--clients`` concurrent clients against an open controller and a secured one
    (mesh secret: CurveZMQ on every worker socket; API token with --protect-reads: the bearer
    checked on every /lookup), alternated ``--rounds`` times, each with ``--instances`` x
    ``--ranks`` registered workers and ``--keys`` keys."""
    import tempfile

    workdir = tempfile.mkdtemp(prefix="bench-auth-")
    secret_file, token_file = os.path.join(workdir, "mesh.secret"), os.path.join(workdir, "api.token")
    for path, value in ((secret_file, "bench-mesh-secret-" + "x" * 16), (token_file, "bench-api-token-" + "y" * 16)):
        with open(path, "w") as f:
            f.write(value + "\n")
        os.chmod(path, 0o600)
    tokens = np.random.default_rng(1).integers(0, 128_000, args.lookup_tokens).tolist()
    out: dict = {
        "bench": "controller_auth",
        "clients": args.clients,
        "seconds": args.seconds,
        "workers": args.instances * args.ranks,
        "keys": args.keys,
        "lookup_tokens": args.lookup_tokens,
        "runs": [],
    }
    for round_ in range(args.rounds):
        for mode in ("open", "secured"):
            secured = mode == "secured"
            flags = ["--log-level", "warning"]
            env = {"LMCACHE_MESH_SECRET": "", "LMCACHE_API_TOKEN": ""}
            if secured:
                flags += ["--mesh-secret-file", secret_file, "--api-token-file", token_file, "--protect-reads"]
            controller = ControllerProcess(*flags, env=env, reads_protected=secured).start()
            try:
                with open(secret_file) as f:
                    security = MeshSecurity(f.read().strip()) if secured else None
                load = Load(controller, args.instances, args.ranks, security)
                hashes = chunk_hash_array(tokens, CHUNK)
                for rank in range(args.ranks):
                    load.admit(("bench-inst-0", rank), hashes)
                headers = _auth(secured, token_file)
                ingest(controller, load, np.random.default_rng(round_), args.keys, args.batch, headers=headers)
                lookups = concurrent_lookups(controller.http_port, tokens, args.clients, args.seconds, headers)
                run = {"round": round_, "mode": mode, **lookups}
                out["runs"].append(run)
                print(json.dumps(run), file=sys.stderr)
                load.close()
            finally:
                controller.stop()
    for mode in ("open", "secured"):
        rates = [r["req_per_s"] for r in out["runs"] if r["mode"] == mode]
        p99s = [r["p99_ms"] for r in out["runs"] if r["mode"] == mode]
        out[mode] = {"req_per_s": rates, "p99_ms": p99s}
    median = {mode: statistics.median(out[mode]["req_per_s"]) for mode in ("open", "secured")}
    out["secured_vs_open_req_per_s"] = round(median["secured"] / median["open"], 3)
    return out


def _auth(secured: bool, token_file: str) -> dict:
    if not secured:
        return {}
    with open(token_file) as f:
        return {"Authorization": f"Bearer {f.read().strip()}"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--instances", type=int, default=16)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=300)
    ap.add_argument("--max-keys", type=int, default=10_000_000, help="last size, for bytes per (key, holder)")
    ap.add_argument("--auth-comparison", action="store_true", help="/lookup from concurrent clients: open vs secured")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--lookup-tokens", type=int, default=4_000)
    ap.add_argument(
        "--identity",
        action="store_true",
        help="also time the 25.6k prompt's /lookup and /route with a salt, an adapter and mm_features",
    )
    args = ap.parse_args()
    if args.auth_comparison:
        print(json.dumps(auth_comparison(args)))
        return

    controller = ControllerProcess("--log-level", "warning").start()
    pid = controller.proc.pid
    try:
        time.sleep(1.0)  # let the interpreter settle before the idle reading
        result: dict = {
            "bench": "controller",
            "startup_s": round(controller.ready_after, 3),
            "rss_idle_mb": round(rss_mb(pid), 1),
            "instances": args.instances,
            "ranks": args.ranks,
            "batch_keys": args.batch,
        }
        load = Load(controller, args.instances, args.ranks, adapters={"sql": LORA_ID} if args.identity else None)
        rng = np.random.default_rng(0)

        # Query prompts, held by two instances (rank 0) so /lookup walks a two-holder prefix.
        prompt_rng = np.random.default_rng(1)
        prompts = {
            f"{n // 1000}k" if n % 1000 == 0 else f"{n / 1000:g}k": prompt_rng.integers(0, 128_000, n).tolist()
            for n in (1_000, 4_000, 25_600)
        }
        for tokens in prompts.values():
            hashes = chunk_hash_array(tokens, CHUNK)
            for rank in range(args.ranks):  # every TP rank holds its own part of each chunk
                load.admit(("bench-inst-0", rank), hashes)
                load.admit(("bench-inst-1", rank), hashes[: len(hashes) // 2])
        if args.identity:  # the 25.6k prompt under each identity, held the same way
            for name, extra in IDENTITY_BODIES.items():
                if name == "plain":
                    continue
                keyed = identity_keys(prompts["25.6k"], extra)
                for rank in range(args.ranks):
                    load.admit(("bench-inst-0", rank), keyed)
                    load.admit(("bench-inst-1", rank), keyed[: len(keyed) // 2])
        held = 0
        result["sizes"] = {}
        for target in (100_000, 1_000_000, args.max_keys):
            if target <= held:
                continue
            stats = ingest(controller, load, rng, target - held, args.batch)
            held = target
            rss = rss_mb(pid)
            timed = target <= 1_000_000
            load.beat()  # alive through the timing below
            lookups = time_lookups(controller.http_port, prompts, args.repeat) if timed else None
            routes = time_lookups(controller.http_port, prompts, args.repeat, "/route") if timed else None
            identity_timed: dict = {}
            if timed and args.identity:
                longest = {"25.6k": prompts["25.6k"]}
                for path, key in (("/lookup", "identity_lookup"), ("/route", "identity_route")):
                    runs = {
                        name: time_lookups(controller.http_port, longest, args.repeat, path, extra)["25.6k"]
                        for name, extra in IDENTITY_BODIES.items()
                    }
                    base = runs["plain"]["p50_ms"]
                    for found in runs.values():
                        found["p50_vs_plain"] = round(found["p50_ms"] / base, 3)
                    identity_timed[key] = runs
            result["sizes"][str(target)] = {
                **identity_timed,
                "ingest": stats,
                "rss_mb": round(rss, 1),
                "bytes_per_key_holder": round((rss - result["rss_idle_mb"]) * 2**20 / target, 1),
                "lookup": lookups,
                "route": routes,
                "route_vs_lookup_p50": (
                    {name: round(routes[name]["p50_ms"] / lookups[name]["p50_ms"], 2) for name in prompts}
                    if lookups and routes
                    else None
                ),
            }
            print(f"{target} keys: {stats['keys_per_s']:,} keys/s, RSS {rss:.0f} MB", file=sys.stderr)
        result["lookup_breakdown_25.6k_ms"] = lookup_breakdown(prompts["25.6k"], args.repeat, args.identity)
        print(json.dumps(result))
    finally:
        controller.stop()


if __name__ == "__main__":
    main()
