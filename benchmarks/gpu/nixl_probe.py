"""Which NIXL/UCX setup moves GPU memory fast between two processes on one host?

Two bare NIXL agents in two processes; the writer WRITEs a 1 GiB buffer (64 descriptors of
16 MiB) into the reader's, for each memory pairing (DRAM->DRAM, VRAM->VRAM, DRAM->VRAM) under
each UCX transport setting. Every case runs in fresh processes (UCX reads its environment once)
with a time limit; a case that fails reports its error instead of a rate.

    python benchmarks/gpu/nixl_probe.py [--tls default,cuda_ipc+cuda_copy+sm+self+tcp,...]  # JSON
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback

DESCS, DESC_BYTES = 64, 16 * 2**20
DEFAULT_TLS = [
    "default",
    "cuda_ipc,cuda_copy,sm,self,tcp",
    "cuda_ipc,cuda_copy,tcp",
    "sm,cuda_copy,self,tcp",
    "tcp,cuda_copy",
]
PAIRS = [("DRAM", "DRAM"), ("VRAM", "VRAM"), ("DRAM", "VRAM"), ("VRAM", "DRAM")]


def _agent(role: str, mem: str, tls: str, conn) -> None:
    try:
        os.dup2(2, 1)
        if tls != "default":
            os.environ["UCX_TLS"] = tls
        import numpy as np
        import torch
        from nixl._api import nixl_agent, nixl_agent_config

        agent = nixl_agent(role, nixl_agent_config(backends=["UCX"]))
        on_gpu = mem == "VRAM"
        buf = torch.empty(DESCS * DESC_BYTES, dtype=torch.uint8, device="cuda" if on_gpu else "cpu")
        if not on_gpu:
            buf = buf.pin_memory()
        buf.fill_(7 if role == "writer" else 0)
        dev = torch.cuda.current_device() if on_gpu else 0
        agent.register_memory([(buf.data_ptr(), buf.numel(), dev, "")], mem)
        descs = np.zeros((DESCS, 3), dtype=np.uint64)
        descs[:, 0] = buf.data_ptr() + np.arange(DESCS, dtype=np.uint64) * np.uint64(DESC_BYTES)
        descs[:, 1] = DESC_BYTES
        descs[:, 2] = dev
        conn.send((agent.get_agent_metadata(), descs, mem))
        peer_meta, peer_descs, peer_mem = conn.recv()
        peer = agent.add_remote_agent(peer_meta)
        if role == "writer":
            local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, mem)
            remote = agent.prep_xfer_dlist(peer, peer_descs, peer_mem)
            times = []
            for rep in range(6):
                t0 = time.perf_counter()
                handle = agent.make_prepped_xfer("WRITE", local, list(range(DESCS)), remote, list(range(DESCS)))
                state = agent.transfer(handle)
                deadline = time.monotonic() + 30
                while state == "PROC" and time.monotonic() < deadline:
                    state = agent.check_xfer_state(handle)
                handle.release()
                if state != "DONE":
                    raise RuntimeError(f"transfer state {state}")
                if rep:
                    times.append(time.perf_counter() - t0)
            conn.send({"gbps": round(DESCS * DESC_BYTES / statistics.median(times) / 1e9, 2)})
        else:
            conn.recv()
            if on_gpu:
                torch.cuda.synchronize()
            ok = bool((buf[:: 2**20] == 7).all())
            conn.send({"data_ok": ok})
    except Exception as e:
        with contextlib.suppress(Exception):
            conn.send({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-800:]})


def case(src: str, dst: str, tls: str, limit: float = 90.0) -> dict:
    ctx = mp.get_context("spawn")
    (w, w_child), (r, r_child) = ctx.Pipe(), ctx.Pipe()
    procs = [
        ctx.Process(target=_agent, args=("writer", src, tls, w_child)),
        ctx.Process(target=_agent, args=("reader", dst, tls, r_child)),
    ]
    for p in procs:
        p.start()
    out: dict = {"src": src, "dst": dst, "ucx_tls": tls}
    try:
        for conn in (w, r):
            if not conn.poll(limit):
                raise TimeoutError("agent did not start")
        w_info, r_info = w.recv(), r.recv()
        if isinstance(w_info, dict) or isinstance(r_info, dict):
            out.update(w_info if isinstance(w_info, dict) else r_info)
            return out
        w.send(r_info)
        r.send(w_info)
        if not w.poll(limit):
            raise TimeoutError(f"no result in {limit:.0f} s")
        out.update(w.recv())
        r.send(None)
        if r.poll(30):
            out.update(r.recv())
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tls", default=";".join(DEFAULT_TLS), help="UCX_TLS settings separated by ';'")
    args = parser.parse_args()
    results = []
    for tls in args.tls.split(";"):
        for src, dst in PAIRS:
            result = case(src, dst, tls)
            print(
                f"[nixl_probe] {src}->{dst} UCX_TLS={tls}: "
                f"{result.get('gbps', result.get('error'))} {'' if result.get('data_ok', True) else 'DATA WRONG'}",
                file=sys.stderr,
                flush=True,
            )
            results.append(result)
    print(json.dumps({"bench": "nixl_probe", "bytes": DESCS * DESC_BYTES, "results": results}))


if __name__ == "__main__":
    main()
