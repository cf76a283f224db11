"""Controller at fleet scale: N worker ranks registered, heartbeating, and still commandable.

    .venv/bin/python benchmarks/bench_controller_scale.py [--ranks 10000] [--tp 8] [--idle-s 30]

Starts a real ``lmcache_controller`` and, in this process, ``--ranks`` fake ranks (instances of
``--tp`` ranks): one ROUTER bound to one command port per rank answers every command, one DEALER
registers them (pipelined) and another heartbeats each at the interval the controller asks for
(5 s by default), spread evenly, with zeroed traffic totals as real workers send. Prints one JSON
object: registration time, the controller's RSS and open descriptors, its CPU while idle with
every rank heartbeating, /lookup and /controller/workers latency at that size, and a /clear to one
instance (its answer, its event's status, its latency).

The fake ranks share this process's connections to the controller; real ranks each hold three
(pull, reply, heartbeat), plus the controller's command channel to them when open: about five
descriptors per rank in the controller. 10,000 real ranks need ``ulimit -n`` of 65536 for the
controller (LimitNOFILE= under systemd); the controller raises its soft limit to the hard one
itself and logs its capacity. This process needs one descriptor per fake rank plus a few hundred.

Target (issue 18): >= 10,000 ranks registered and commandable.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from fake_fleet import FakeFleet  # noqa: E402
from protocol_client import CPU, ControllerProcess  # noqa: E402


def proc_status(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def timed_ms(call, repeat: int) -> dict:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        call()
        samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    return {"p50_ms": round(statistics.median(samples), 2), "max_ms": round(samples[-1], 2)}


class LogDrain:
    """Reads the controller's log as it comes, so a long run never blocks it on a full pipe."""

    def __init__(self, controller: ControllerProcess):
        self.lines: list[str] = []
        assert controller.proc is not None and controller.proc.stdout is not None
        self._stdout = controller.proc.stdout
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._stdout:
            self.lines.append(line.rstrip("\n"))

    def grep(self, text: str) -> list[str]:
        return [line for line in self.lines if text in line]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=10_000)
    ap.add_argument("--tp", type=int, default=8, help="ranks per instance")
    ap.add_argument("--idle-s", type=float, default=30.0, help="CPU is measured over this long, after one interval")
    args = ap.parse_args()
    if args.ranks % args.tp:
        ap.error(f"--ranks {args.ranks} is not a multiple of --tp {args.tp}")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < args.ranks + 512 <= hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    controller = ControllerProcess().start()
    assert controller.proc is not None
    pid = controller.proc.pid
    log = LogDrain(controller)
    fleet = None
    try:
        time.sleep(1.0)
        result: dict = {
            "bench": "controller_scale",
            "ranks": args.ranks,
            "tp": args.tp,
            "instances": args.ranks // args.tp,
            "fd_limit_here": {"soft": soft, "hard": hard},
            "controller_rss_mb_empty": round(proc_status(pid, "VmRSS") / 1024, 1),
        }
        fds_resting = open_fds(pid)
        t0 = time.perf_counter()
        fleet = FakeFleet(controller, args.ranks, tp=args.tp, prefix="scale")
        result["bind_command_ports_s"] = round(time.perf_counter() - t0, 2)

        t0 = time.perf_counter()
        replies = fleet.register_all()
        seconds = time.perf_counter() - t0
        refused = [r.error for r in replies.values() if not r.ok]
        listed = len(controller.http.get("/controller/workers").json()["workers"])
        result["registration"] = {
            "seconds": round(seconds, 2),
            "ranks_per_s": round(args.ranks / seconds),
            "accepted": args.ranks - len(refused),
            "refused": len(refused),
            "first_refusal": refused[0] if refused else None,
            "listed_by_controller": listed,
        }
        result["controller_rss_mb_registered"] = round(proc_status(pid, "VmRSS") / 1024, 1)

        # Each registration is followed by a probe of the rank's command port (a ZMQ handshake,
        # 32 at a time): done when the controller's descriptors are back to their resting count.
        t0, settled = time.monotonic(), 0
        while settled < 3 and time.monotonic() - t0 < 60:
            settled = settled + 1 if open_fds(pid) <= fds_resting + 4 else 0
            time.sleep(0.2)
        result["registration"]["probes_done_after_s"] = round(time.monotonic() - t0 - 0.6, 1)
        # The same ranks before their first heartbeat (the controller reaps only after 30 s of
        # silence): what the liveness sweeps and the traffic sampler cost on their own.
        cpu0, t0 = cpu_seconds(pid), time.monotonic()
        time.sleep(5.0)
        result["controller_cpu_percent_registered_silent"] = round(
            100 * (cpu_seconds(pid) - cpu0) / (time.monotonic() - t0), 1
        )

        fleet.start_heartbeats()
        time.sleep(fleet.heartbeat_interval + 1.0)  # every rank has beaten once
        sent0, cpu0, t0 = fleet.heartbeats_sent, cpu_seconds(pid), time.monotonic()
        time.sleep(args.idle_s)
        cpu1, t1, sent1 = cpu_seconds(pid), time.monotonic(), fleet.heartbeats_sent
        result["idle_with_heartbeats"] = {
            "seconds": round(t1 - t0, 1),
            "heartbeat_interval_s": fleet.heartbeat_interval,
            "heartbeats_per_s": round((sent1 - sent0) / (t1 - t0)),
            "controller_cpu_percent": round(100 * (cpu1 - cpu0) / (t1 - t0), 1),
            "answered_unknown": fleet.heartbeats_unknown,  # a rank reaped or forgotten: should stay 0
        }
        result["controller_rss_mb_heartbeating"] = round(proc_status(pid, "VmRSS") / 1024, 1)
        result["controller_open_fds"] = open_fds(pid)
        result["controller_threads"] = proc_status(pid, "Threads")

        # Reads that walk the registry, at this size.
        tokens = list(range(1, 1 + 4096))
        result["lookup_4k_tokens"] = timed_ms(lambda: controller.api("/lookup", {"tokens": tokens}), 50)
        result["controller_workers_view"] = timed_ms(lambda: controller.http.get("/controller/workers"), 5)

        # A command to one instance (all its ranks) still works among all of them.
        target = fleet.ranks[len(fleet.ranks) // 2][0]
        before = dict(fleet.commands)
        t0 = time.perf_counter()
        r = controller.post("/clear", {"instance_id": target, "location": CPU})
        clear_ms = (time.perf_counter() - t0) * 1e3
        answer = r.json()
        event = controller.api("/check_finish", {"event_id": answer["event_id"]}) if r.status_code == 200 else {}
        result["clear_one_instance"] = {
            "instance_id": target,
            "http_status": r.status_code,
            "event_status": event.get("status"),
            "ms": round(clear_ms, 2),
            "ranks_commanded": fleet.commands["ClearCommand"] - before.get("ClearCommand", 0),
        }
        result["workers_after"] = len(controller.http.get("/controller/workers").json()["workers"])
        result["controller_log"] = {
            "capacity": (log.grep("command bus: ") or [""])[0].split("command bus: ", 1)[-1],
            "warnings": len(log.grep(" WARNING: ")),
            "errors": len(log.grep(" ERROR: ")),
        }
    finally:
        if fleet is not None:
            fleet.close()
        controller.stop()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
