"""What a second controller costs the workers: CPU and messages, one controller against two.

    .venv/bin/python benchmarks/bench_controller_ha.py [--workers 4] [--prompts 40] [--idle-s 10] [--rounds 2]

For each setting (one controller, then two, alternated ``--rounds`` times) it starts real
``lmcache_controller`` processes and ``--workers`` stand-in instances (the real cache engine and
worker, real ZMQ) whose ``controller_pull_url``/``controller_reply_url`` name them; each worker
stores ``--prompts`` prompts of 16 chunks (every chunk a key event to every controller) and then
idles ``--idle-s`` seconds (heartbeats only). Per worker: CPU seconds over the stores and over
the idle time (from /proc), and the messages it sent (registrations, heartbeats, key-event
batches, summed over its controllers, from its status). Prints one JSON line per round and
setting, then a summary with the ratio two/one.
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
from instances import InstanceProcess, instance_config, tokens  # noqa: E402
from protocol_client import ControllerProcess, wait_for  # noqa: E402

CHUNK = 32
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def run(setting: int, args, workdir: Path) -> dict:
    controllers = [ControllerProcess().start() for _ in range(setting)]
    workers: list[InstanceProcess] = []
    try:
        urls = {
            "controller_pull_url": ",".join(f"127.0.0.1:{c.pull}" for c in controllers),
            "controller_reply_url": ",".join(f"127.0.0.1:{c.reply}" for c in controllers),
        }
        for i in range(args.workers):
            config = instance_config(f"bench_{setting}_{i}", controllers[0], chunk_size=CHUNK, cpu_gb=1.0, **urls)
            workers.append(InstanceProcess(config, workdir, num_blocks=16 * 2).start())
        for w in workers:
            wait_for(lambda w=w: w.status()["registered"], 30, f"{w.name} registered")
        before = [cpu_s(w.proc.pid) for w in workers]
        t0 = time.monotonic()
        for p in range(args.prompts):
            for i, w in enumerate(workers):
                w.prefill(tokens(16 * CHUNK, seed=setting * 100_000 + i * 1000 + p))
        for w in workers:
            w.request("flush")
        store_s = time.monotonic() - t0
        mid = [cpu_s(w.proc.pid) for w in workers]
        time.sleep(args.idle_s)
        after = [cpu_s(w.proc.pid) for w in workers]
        sent = []
        for w in workers:
            links = w.status().get("controllers") or [{"stats": w.status()["link"]}]
            stats = [link.get("stats", link) for link in links]
            sent.append(sum(s["heartbeats"] + s["batches_sent"] + s["registrations"] for s in stats))
        return {
            "bench": "controller_ha",
            "controllers": setting,
            "workers": args.workers,
            "key_events_per_worker": args.prompts * 16,
            "store_cpu_s_per_worker": round(statistics.fmean(m - b for m, b in zip(mid, before, strict=True)), 3),
            "store_wall_s": round(store_s, 2),
            "idle_cpu_pct_per_worker": round(
                100 * statistics.fmean(a - m for a, m in zip(after, mid, strict=True)) / args.idle_s, 2
            ),
            "messages_sent_per_worker": round(statistics.fmean(sent), 1),
        }
    finally:
        for w in workers:
            w.stop()
        for c in controllers:
            c.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=40, help="prompts of 16 chunks each worker stores")
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench_controller_ha_"))
    results: dict[int, list[dict]] = {1: [], 2: []}
    for _ in range(args.rounds):
        for setting in (1, 2):
            line = run(setting, args, workdir)
            results[setting].append(line)
            print(json.dumps(line), flush=True)
    summary: dict = {"bench": "controller_ha_summary", "args": vars(args)}
    for key in ("store_cpu_s_per_worker", "idle_cpu_pct_per_worker", "messages_sent_per_worker"):
        one = [r[key] for r in results[1]]
        two = [r[key] for r in results[2]]
        summary[key] = {"one": one, "two": two, "two_over_one": round(statistics.fmean(two) / statistics.fmean(one), 2)}
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
