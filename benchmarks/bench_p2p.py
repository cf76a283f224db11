"""Peer-to-peer pull throughput between two instance processes, with the raw NIXL ceiling.

Two stand-in instances (real cache engine, worker and P2P; Llama-3.1-8B page shape, 256-token
chunks = 32 MiB) and a real controller on 127.0.0.1. Instance 1 holds N chunks; instance 2 asks
for the prompt and pulls them (controller lookup + transfer + checksum verification + admit),
for N = 1, 8, 64, over nixl and over tcp. In the same run, two bare NIXL agents in two processes
WRITE the same bytes page by page (the same descriptor shape our channel uses): the ceiling.

    python benchmarks/bench_p2p.py            # prints one JSON object
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from instances import InstanceProcess, instance_config, tokens  # noqa: E402
from protocol_client import ControllerProcess  # noqa: E402

CHUNK_TOKENS = 256
PAGE_BYTES = CHUNK_TOKENS * 32 * 2 * 8 * 128 * 2  # Llama-3.1-8B bf16: 128 KiB per token -> 32 MiB


# -- raw NIXL ceiling --------------------------------------------------------------------------------

def _raw_agent(name: str, pages: int, fill: int, conn) -> None:
    import numpy as np
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    buf = torch.full((pages * PAGE_BYTES,), fill, dtype=torch.uint8)
    agent.register_memory([(buf.data_ptr(), buf.numel(), 0, "")], "DRAM")
    descs = np.zeros((pages, 3), dtype=np.uint64)
    descs[:, 0] = buf.data_ptr() + np.arange(pages, dtype=np.uint64) * np.uint64(PAGE_BYTES)
    descs[:, 1] = PAGE_BYTES
    conn.send((agent.get_agent_metadata(), descs))
    peer_meta, peer_descs = conn.recv()
    peer = agent.add_remote_agent(peer_meta)
    if name == "writer":
        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, "DRAM")
        remote = agent.prep_xfer_dlist(peer, peer_descs, "DRAM")
        results = {}
        for n, reps in conn.recv():
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                handle = agent.make_prepped_xfer("WRITE", local, list(range(n)), remote, list(range(n)))
                state = agent.transfer(handle)
                while state == "PROC":
                    state = agent.check_xfer_state(handle)
                times.append(time.perf_counter() - t0)
                handle.release()
                assert state == "DONE", state
            results[n] = n * PAGE_BYTES / statistics.median(times) / 1e9
        conn.send(results)
    conn.recv()  # stay alive until the writer is done


def raw_nixl(batches: list[tuple[int, int]]) -> dict[int, float]:
    ctx = mp.get_context("spawn")
    pages = max(n for n, _ in batches)
    (w_conn, w_child), (r_conn, r_child) = ctx.Pipe(), ctx.Pipe()
    writer = ctx.Process(target=_raw_agent, args=("writer", pages, 1, w_child))
    reader = ctx.Process(target=_raw_agent, args=("reader", pages, 0, r_child))
    writer.start()
    reader.start()
    w_info, r_info = w_conn.recv(), r_conn.recv()
    w_conn.send(r_info)
    r_conn.send(w_info)
    w_conn.send([(1, 3)] + batches)  # the first (1, 3) warms the connection up
    results = w_conn.recv()
    w_conn.send(None)
    r_conn.send(None)
    writer.join(60)
    reader.join(60)
    return {n: results[n] for n, _ in batches}


# -- our P2P pull -----------------------------------------------------------------------------------

def p2p(channel: str, batches: list[tuple[int, int]], tmp: Path) -> dict[int, dict]:
    pool_gb = (max(n for n, _ in batches) + 2) * PAGE_BYTES / 2**30
    controller = ControllerProcess().start()
    procs = []
    try:
        common = dict(chunk_size=CHUNK_TOKENS, cpu_gb=pool_gb)
        holder = InstanceProcess(instance_config("bench_holder", controller, channel, **common), tmp,
                                 num_blocks=16, env={"OMP_NUM_THREADS": "1"}).start()
        procs.append(holder)
        puller = InstanceProcess(instance_config("bench_puller", controller, channel, **common), tmp,
                                 num_blocks=16, env={"OMP_NUM_THREADS": "1"}).start()
        procs.append(puller)
        out = {}
        # Warm-up, untimed: connections, and a first pull of the largest batch so every pool page
        # has been touched once (the raw NIXL buffers are filled before timing too).
        for seed, (n, reps) in enumerate([(max(n for n, _ in batches), 1)] + batches):
            prompt = tokens(n * CHUNK_TOKENS, seed=1000 + seed)
            assert holder.request("fill", tokens=prompt)["stored"] == n * CHUNK_TOKENS
            holder.request("flush")
            deadline = time.monotonic() + 10
            while controller.post("/lookup", {"tokens": prompt}).json()["layout_info"].get("bench_holder", [0, 0])[1] \
                    < n * CHUNK_TOKENS and time.monotonic() < deadline:
                time.sleep(0.02)
            times = []
            for _ in range(reps):
                puller.request("clear")
                answer = puller.request("lookup", tokens=prompt, timeout=120)
                assert answer["hit"] == n * CHUNK_TOKENS, answer
                times.append(answer["ms"] / 1e3)
            if seed:
                t = statistics.median(times)
                out[n] = {"GB/s": round(n * PAGE_BYTES / t / 1e9, 3), "ms": round(t * 1e3, 2)}
            holder.request("clear")
        return out
    finally:
        for proc in procs:
            proc.stop()
        controller.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8,64", help="chunks per pull")
    parser.add_argument("--reps", type=int, default=5, help="pulls per batch size (median reported)")
    args = parser.parse_args()
    batches = [(int(n), args.reps if int(n) < 64 else max(3, args.reps // 2)) for n in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        raw = raw_nixl(batches)
        nixl = p2p("nixl", batches, Path(tmp))
        tcp = p2p("tcp", batches, Path(tmp))
    largest = max(n for n, _ in batches)
    print(json.dumps({
        "chunk_tokens": CHUNK_TOKENS, "chunk_bytes": PAGE_BYTES, "shape": "Llama-3.1-8B bf16",
        "raw_nixl_GBps": {n: round(v, 3) for n, v in raw.items()},
        "p2p_nixl": nixl, "p2p_tcp": tcp,
        f"nixl_vs_raw_at_{largest}": round(nixl[largest]["GB/s"] / raw[largest], 3),
        "note": "p2p times are the requester's lookup call: controller lookup + transfer + checksum + admit",
    }, indent=1))


if __name__ == "__main__":
    main()
