"""Peer-to-peer pull throughput between two instance processes, with the raw NIXL and raw socket ceilings.

Two stand-in instances (real cache engine, worker and P2P; Llama-3.1-8B page shape, 256-token
chunks = 32 MiB) and a real controller on 127.0.0.1. Instance 1 holds N chunks; instance 2 asks
for the prompt and pulls them (controller lookup + transfer + checksum verification + admit),
for N = 1, 8, 64, over nixl and over tcp. In the same run, right after each size's pulls: two
bare NIXL agents in two processes WRITE the same bytes page by page (the same descriptor shape
our channel uses), and a plain socket between two processes moves the same bytes (``sendall``
from resident pages, ``recv_into`` resident pages): the ceilings the two channels are held to.
For tcp also as many plain sockets as the channel has streams, the ceiling of its own design.
Before those, per channel, the first pull of a freshly started instance (its connection to the
holder cold) against the next ones (warm). Last, the CPU an idle nixl instance burns with NIXL's
progress thread unpaused (0 us) and paused (200 us).

With ``--concurrent N``, only this: N prompts of ``--chunks`` chunks each, pulled at once from one
holder (as vLLM's scheduler asks requests that arrive together), and when each pull ended, with
the holder's pulls taking turns (``p2p_prefix_pull_turns: True``) and sharing one pipeline (the
pull pump, the default); and one pull alone for scale.

    python benchmarks/bench_p2p.py [--batches 1,8,64] [--reps 7]   # prints one JSON object
    python benchmarks/bench_p2p.py --concurrent 4 [--chunks 4] [--channel tcp] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from instances import InstanceProcess, instance_config, tokens  # noqa: E402
from protocol_client import ControllerProcess, wait_for  # noqa: E402

from lmcache_p2p.storage.memory import PagePool  # noqa: E402
from lmcache_p2p.testing.standin import MODEL_SHAPES  # noqa: E402
from lmcache_p2p.transfer.tcp_transport import STREAMS as TCP_STREAMS  # noqa: E402

CHUNK_TOKENS = 256
SHAPE = MODEL_SHAPES["llama-3.1-8b"]
PAGE_BYTES = CHUNK_TOKENS * SHAPE.num_layers * 2 * SHAPE.kv_heads * SHAPE.head_size * SHAPE.dtype.itemsize  # 32 MiB
FRESH_PAGES = 8  # pages per first-touch measurement
RAW_SOCKET_PAGES = 8  # the raw socket cycles through this many resident pages on each side
FIRST_PULL_CHUNKS = 1  # the cold/warm first-pull measurement pulls this many chunks


# -- raw NIXL ceiling --------------------------------------------------------------------------------


def _raw_agent(name: str, pages: int, fill: int, conn) -> None:
    """The writer's buffer holds ``pages`` pages; the reader's holds ``pages`` written ones and
    FRESH_PAGES never written (the first-touch measurement)."""
    os.dup2(2, 1)  # NIXL logs to stdout; the bench's stdout is its JSON
    import numpy as np
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    if name == "reader":
        pages += FRESH_PAGES
    buf = torch.empty((pages * PAGE_BYTES,), dtype=torch.uint8)
    buf[: (pages - (FRESH_PAGES if name == "reader" else 0)) * PAGE_BYTES].fill_(fill)
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
        fresh = len(peer_descs) - FRESH_PAGES
        while (job := conn.recv()) is not None:
            n, reps = job
            if n == "fresh":  # once: into reader pages nobody has written yet
                n, reps, dst = FRESH_PAGES, 1, list(range(fresh, fresh + FRESH_PAGES))
            else:
                dst = list(range(n))
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                handle = agent.make_prepped_xfer("WRITE", local, list(range(n)), remote, dst)
                state = agent.transfer(handle)
                while state == "PROC":
                    state = agent.check_xfer_state(handle)
                times.append(time.perf_counter() - t0)
                handle.release()
                assert state == "DONE", state
            conn.send(n * PAGE_BYTES / statistics.median(times) / 1e9)
    else:
        conn.recv()  # stay alive until the writer is done


class RawNixl:
    """Two bare NIXL agents in two processes; ``measure(n, reps)`` WRITEs n pages, median GB/s."""

    def __init__(self, pages: int):
        ctx = mp.get_context("spawn")
        (self.conn, w_child), (self.r_conn, r_child) = ctx.Pipe(), ctx.Pipe()
        self.procs = [
            ctx.Process(target=_raw_agent, args=("writer", pages, 1, w_child)),
            ctx.Process(target=_raw_agent, args=("reader", pages, 0, r_child)),
        ]
        for proc in self.procs:
            proc.start()
        w_info, r_info = self.conn.recv(), self.r_conn.recv()
        self.conn.send(r_info)
        self.r_conn.send(w_info)
        self.measure(1, 3)  # connection warm-up

    def measure(self, n: int, reps: int) -> float:
        self.conn.send((n, reps))
        return self.conn.recv()

    def measure_fresh(self) -> float:
        """A WRITE into FRESH_PAGES pages the reader never wrote: the reader's page faults are
        taken by the writer's copy, from the other process."""
        self.conn.send(("fresh", 1))
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        self.r_conn.send(None)
        for proc in self.procs:
            proc.join(60)


# -- raw socket ceiling ------------------------------------------------------------------------------


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("raw socket closed")
        got += n


def _raw_socket_sender(streams: int, conn) -> None:
    """On each connection, sends ``n`` pages (cycling through RAW_SOCKET_PAGES resident ones)
    each time it is asked, one thread per connection."""
    buf = np.full(RAW_SOCKET_PAGES * PAGE_BYTES, 1, dtype=np.uint8)  # written: resident
    with socket.create_server(("127.0.0.1", 0)) as listener:
        conn.send(listener.getsockname()[1])
        socks = [listener.accept()[0] for _ in range(streams)]
    view = buf.data

    def serve(sock: socket.socket) -> None:
        ask = bytearray(8)
        with sock:
            while True:
                try:
                    _recv_exact(sock, memoryview(ask))
                except ConnectionError:
                    return
                for i in range(int.from_bytes(ask, "little")):
                    j = i % RAW_SOCKET_PAGES
                    sock.sendall(view[j * PAGE_BYTES : (j + 1) * PAGE_BYTES])

    threads = [threading.Thread(target=serve, args=(sock,)) for sock in socks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _raw_socket_receiver(port: int, streams: int, conn) -> None:
    buf = np.full(RAW_SOCKET_PAGES * PAGE_BYTES, 0, dtype=np.uint8)
    view = buf.data
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]

    def pull(sock: socket.socket, count: int) -> None:
        sock.sendall(count.to_bytes(8, "little"))
        for i in range(count):
            j = i % RAW_SOCKET_PAGES
            _recv_exact(sock, view[j * PAGE_BYTES : (j + 1) * PAGE_BYTES])

    while (job := conn.recv()) is not None:
        n, reps = job
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            # The pages split over the connections as evenly as they go (a page is not cut).
            threads = [
                threading.Thread(target=pull, args=(sock, n // streams + (k < n % streams)))
                for k, sock in enumerate(socks)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            times.append(time.perf_counter() - t0)
        conn.send(n * PAGE_BYTES / statistics.median(times) / 1e9)
    for sock in socks:
        sock.close()


class RawSocket:
    """Plain TCP sockets (``streams`` of them, one thread each end) between two processes on
    loopback; ``measure(n, reps)`` moves n pages from one to the other, median GB/s (asked for,
    sent, received into place)."""

    def __init__(self, streams: int = 1):
        self.streams = streams
        ctx = mp.get_context("spawn")
        (self.conn, r_child), (s_conn, s_child) = ctx.Pipe(), ctx.Pipe()
        sender = ctx.Process(target=_raw_socket_sender, args=(streams, s_child))
        sender.start()
        port = s_conn.recv()
        receiver = ctx.Process(target=_raw_socket_receiver, args=(port, streams, r_child))
        receiver.start()
        self.procs = [sender, receiver]
        self.measure(1, 3)  # warm-up

    def measure(self, n: int, reps: int) -> float:
        self.conn.send((n, reps))
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        for proc in self.procs:
            proc.join(30)


def local_first_touch() -> float:
    """GB/s of PagePool.make_resident on never-written pages (what a requester does before a
    peer writes into them)."""
    pool = PagePool(PAGE_BYTES, FRESH_PAGES * PAGE_BYTES, pin_memory=False)
    t0 = time.perf_counter()
    pool.make_resident(range(FRESH_PAGES))
    return FRESH_PAGES * PAGE_BYTES / (time.perf_counter() - t0) / 1e9


# -- our P2P pull -----------------------------------------------------------------------------------


def p2p(
    channel: str,
    batches: list[tuple[int, int]],
    tmp: Path,
    raw: RawNixl | RawSocket | None = None,
    device: str = "cpu",
    first_pull: dict | None = None,
    raw_streams: RawSocket | None = None,
    **extra,
) -> dict[int, dict]:
    """Median pull time per batch size; with ``raw``, the raw NIXL (or raw socket) figure for the
    same bytes is measured right after each one's pulls (same minute, same host noise). ``device`` is
    where the stand-ins' KV lives; ``extra`` goes into both instances' configs. With
    ``first_pull`` (a dict to fill), the puller's first pull is measured first: cold, then warm."""
    pool_gb = (max(n for n, _ in batches) + 2) * PAGE_BYTES / 2**30
    controller = ControllerProcess().start()
    procs = []
    try:
        common = dict(chunk_size=CHUNK_TOKENS, cpu_gb=pool_gb, **extra)
        holder = InstanceProcess(
            instance_config("bench_holder", controller, channel, **common),
            tmp,
            num_blocks=16,
            env={"OMP_NUM_THREADS": "1"},
            device=device,
        ).start()
        procs.append(holder)
        puller = InstanceProcess(
            instance_config("bench_puller", controller, channel, **common),
            tmp,
            num_blocks=16,
            env={"OMP_NUM_THREADS": "1"},
            device=device,
        ).start()
        procs.append(puller)
        started = time.perf_counter()
        if first_pull is not None:
            first_pull.update(measure_first_pull(controller, holder, puller, started))
        out = {}
        # Warm-up, untimed: connections, and a first pull of the largest batch so every pool page
        # has been touched once (the raw NIXL buffers are filled before timing too).
        for seed, (n, reps) in enumerate([(max(n for n, _ in batches), 1)] + batches):
            prompt = tokens(n * CHUNK_TOKENS, seed=1000 + seed)
            assert holder.request("fill", tokens=prompt)["stored"] == n * CHUNK_TOKENS
            holder.request("flush")
            wait_for(
                lambda prompt=prompt, n=n: (
                    controller.holders(prompt).get("bench_holder", [0, 0])[1] == n * CHUNK_TOKENS
                ),
                timeout=10,
                what="the controller to index the holder's chunks",
            )
            times = []
            before = puller.status()["p2p_client"]
            for _ in range(reps if seed else 1):
                puller.request("clear")
                answer = puller.request("lookup", tokens=prompt, timeout=120)
                assert answer["hit"] == n * CHUNK_TOKENS, answer
                times.append(answer["ms"] / 1e3)
            after = puller.status()["p2p_client"]
            if seed:
                t = statistics.median(times)
                out[n] = {
                    "GB/s": round(n * PAGE_BYTES / t / 1e9, 3),
                    "ms": round(t * 1e3, 2),
                    # summed over the pull's requests (they overlap), per pull
                    "request_ms": round((after["transfer_ms"] - before["transfer_ms"]) / reps, 2),
                    "land_verify_ms": round((after["verify_ms"] - before["verify_ms"]) / reps, 2),
                }
                if raw is not None:
                    label = "raw_nixl_GB/s" if isinstance(raw, RawNixl) else "raw_socket_GB/s"
                    out[n][label] = round(raw.measure(n, reps), 3)
                    out[n]["vs_raw"] = round(out[n]["GB/s"] / out[n][label], 3)
                if raw_streams is not None:  # as many plain sockets as our channel has streams
                    out[n]["raw_sockets_GB/s"] = round(raw_streams.measure(n, reps), 3)
                    out[n]["vs_raw_sockets"] = round(out[n]["GB/s"] / out[n]["raw_sockets_GB/s"], 3)
            holder.request("clear")
        return out
    finally:
        for proc in procs:
            proc.stop()
        controller.stop()


def measure_first_pull(controller, holder, puller, started: float, reps: int = 5) -> dict:
    """The first pull of a freshly started puller (its connection to the holder not made yet,
    unless it made it ahead of the pull) against the next ones, FIRST_PULL_CHUNKS chunks each.
    The puller's pool pages are written once first, so the difference is the connection, not the
    first touch of its memory (first_touch measures that)."""
    n = FIRST_PULL_CHUNKS
    own = tokens(n * CHUNK_TOKENS, seed=999)
    puller.request("fill", tokens=own)  # touches the pages the pull will get (freed last, taken first)
    puller.request("clear")
    prompt = tokens(n * CHUNK_TOKENS, seed=998)
    assert holder.request("fill", tokens=prompt)["stored"] == n * CHUNK_TOKENS
    holder.request("flush")
    wait_for(
        lambda: controller.holders(prompt).get("bench_holder", [0, 0])[1] == n * CHUNK_TOKENS,
        timeout=10,
        what="the controller to index the holder's chunks",
    )
    since_start = time.perf_counter() - started
    times = []
    for _ in range(1 + reps):
        puller.request("clear")
        answer = puller.request("lookup", tokens=prompt, timeout=120)
        assert answer["hit"] == n * CHUNK_TOKENS, answer
        times.append(answer["ms"])
    holder.request("clear")
    puller.request("clear")
    return {
        "chunks": n,
        "cold_ms": round(times[0], 2),
        "warm_ms": round(statistics.median(times[1:]), 2),
        "s_since_puller_start": round(since_start, 2),
    }


def idle_cpu(tmp: Path, delays_us=(0, 200), seconds: float = 3.0) -> dict[str, float]:
    """CPU (% of one core) an idle nixl instance burns, per NIXL progress-thread pause
    (config nixl_progress_delay_us; NIXL's own Python API uses 0)."""
    out = {}
    controller = ControllerProcess().start()
    try:
        for delay in delays_us:
            proc = InstanceProcess(
                instance_config(
                    f"idle_{delay}",
                    controller,
                    "nixl",
                    chunk_size=CHUNK_TOKENS,
                    cpu_gb=2 * PAGE_BYTES / 2**30,
                    nixl_progress_delay_us=delay,
                ),
                tmp,
                num_blocks=16,
                env={"OMP_NUM_THREADS": "1"},
            ).start()
            try:

                def cpu_ticks(proc: InstanceProcess = proc) -> int:  # utime + stime of every thread of the process
                    with open(f"/proc/{proc.proc.pid}/stat") as stat:
                        fields = stat.read().rsplit(")", 1)[1].split()
                    return int(fields[11]) + int(fields[12])

                time.sleep(1.0)  # past start-up
                before = cpu_ticks()
                time.sleep(seconds)
                out[f"progress_delay_{delay}us"] = round(
                    (cpu_ticks() - before) / os.sysconf("SC_CLK_TCK") / seconds * 100, 1
                )
            finally:
                proc.stop()
    finally:
        controller.stop()
    return out


def concurrent_pulls(channel: str, pulls: int, chunks: int, reps: int, tmp: Path) -> dict:
    """Each pull's end (ms from the ask, median over ``reps``) when ``pulls`` prompts of ``chunks``
    chunks are pulled at once from one holder: turns against the pump, each in a puller of its own
    (the key is per instance); and one prompt pulled alone in the pump's puller."""
    pool_gb = (pulls * chunks + 2) * PAGE_BYTES / 2**30
    controller = ControllerProcess().start()
    procs: list[InstanceProcess] = []

    def instance(name: str, **extra) -> InstanceProcess:
        config = instance_config(name, controller, channel, chunk_size=CHUNK_TOKENS, cpu_gb=pool_gb, **extra)
        proc = InstanceProcess(config, tmp, num_blocks=16, env={"OMP_NUM_THREADS": "1"}).start()
        procs.append(proc)
        return proc

    try:
        holder = instance("bench_holder")
        prompts = [tokens(chunks * CHUNK_TOKENS, seed=2000 + i) for i in range(pulls)]
        for prompt in prompts:
            assert holder.request("fill", tokens=prompt)["stored"] == chunks * CHUNK_TOKENS
        holder.request("flush")
        wait_for(
            lambda: all(controller.holders(p).get("bench_holder", [0, 0])[1] == chunks * CHUNK_TOKENS for p in prompts),
            timeout=20,
            what="the controller to index the holder's chunks",
        )
        out: dict = {}
        for mode, turns in (("turns", True), ("pump", False)):
            puller = instance(f"bench_puller_{mode}", p2p_prefix_pull_turns=turns)
            wait_for(lambda puller=puller: puller.status()["registered"], 20, "the puller registered")
            runs = []
            for rep in range(1 + reps):  # the first warms the connection and the pages, untimed
                puller.request("clear")
                answer = puller.request("lookup_together", prompts=[list(p) for p in prompts], timeout=300)
                assert answer["pulled"] == [chunks] * pulls, (mode, rep, answer)
                if rep:
                    runs.append(answer["done_s"])
            ends = [round(statistics.median(run[i] for run in runs) * 1e3, 1) for i in range(pulls)]
            out[mode] = {"done_ms": ends, "mean_done_ms": round(statistics.mean(ends), 1)}
            if not turns:
                alone = []
                for _ in range(reps):
                    puller.request("clear")
                    answer = puller.request("lookup_together", prompts=[list(prompts[0])], timeout=300)
                    alone.append(answer["done_s"][0])
                out["one_pull_alone_ms"] = round(statistics.median(alone) * 1e3, 1)
        return out
    finally:
        for proc in procs:
            proc.stop()
        controller.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8,64", help="chunks per pull")
    parser.add_argument("--reps", type=int, default=7, help="pulls per batch size (median reported)")
    parser.add_argument("--concurrent", type=int, default=0, help="only: this many pulls at once from one holder")
    parser.add_argument("--chunks", type=int, default=4, help="--concurrent: chunks per pull")
    parser.add_argument("--channel", default="tcp", choices=["tcp", "nixl"], help="--concurrent: the channel")
    args = parser.parse_args()
    if args.concurrent:
        with tempfile.TemporaryDirectory() as tmp:
            result = concurrent_pulls(args.channel, args.concurrent, args.chunks, args.reps, Path(tmp))
        print(
            json.dumps(
                {
                    "bench": "p2p_concurrent",
                    "channel": args.channel,
                    "pulls": args.concurrent,
                    "chunks_per_pull": args.chunks,
                    "chunk_bytes": PAGE_BYTES,
                    "reps": args.reps,
                    **result,
                    "note": "done_ms: when each pull ended, ms from the ask (median over reps), in the order asked; "
                    "turns = p2p_prefix_pull_turns True (one pull at a time per holder), pump = the default",
                }
            )
        )
        return
    batches = [(int(n), args.reps) for n in args.batches.split(",")]
    largest = max(n for n, _ in batches)
    raw = RawNixl(largest)
    first_touch = {
        "remote_nixl_write_GB/s": round(raw.measure_fresh(), 3),
        "local_make_resident_GB/s": round(local_first_touch(), 3),
    }
    raw_sockets: list[RawSocket] = []
    first_pull: dict[str, dict] = {"nixl": {}, "tcp": {}}
    try:
        raw_sockets = [RawSocket(1), RawSocket(TCP_STREAMS)]
        with tempfile.TemporaryDirectory() as tmp:
            nixl = p2p("nixl", batches, Path(tmp), raw, first_pull=first_pull["nixl"])
            tcp = p2p(
                "tcp", batches, Path(tmp), raw_sockets[0], first_pull=first_pull["tcp"], raw_streams=raw_sockets[1]
            )
            idle = idle_cpu(Path(tmp))
    finally:
        raw.close()
        for raw_socket in raw_sockets:
            raw_socket.close()
    print(
        json.dumps(
            {
                "bench": "p2p",
                "chunk_tokens": CHUNK_TOKENS,
                "chunk_bytes": PAGE_BYTES,
                "shape": "Llama-3.1-8B bf16",
                "p2p_nixl": nixl,
                "p2p_tcp": tcp,
                f"nixl_vs_raw_at_{largest}": nixl[largest]["vs_raw"],
                f"tcp_vs_raw_socket_at_{largest}": tcp[largest]["vs_raw"],
                "tcp_streams": TCP_STREAMS,
                "first_pull": first_pull,
                "first_touch": first_touch,
                "idle_instance_cpu_pct": idle,
                "note": "p2p = the requester's lookup call (controller lookup + transfer + checksum + admit); "
                "raw = two bare NIXL agents writing the same pages (nixl), or one plain socket between two "
                "processes moving the same bytes (tcp; raw_sockets: as many sockets as the channel has streams), "
                "measured just after; first_pull = a freshly started "
                "puller's first pull (cold connection) and the median of its next ones (warm)",
            }
        )
    )


if __name__ == "__main__":
    main()
