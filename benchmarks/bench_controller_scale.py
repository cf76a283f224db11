"""Controller at fleet scale: N worker ranks registered, heartbeating, and still commandable.

    .venv/bin/python benchmarks/bench_controller_scale.py [--ranks 10000] [--tp 8] [--idle-s 30]
    .venv/bin/python benchmarks/bench_controller_scale.py --views-pollers 4 [--rounds 3] [--probe-s 10]

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

With ``--views-pollers N`` it measures instead what polled read views cost the heartbeats: for
``--view-cache-s`` 0 (every poll builds its view) and then 1 (the default), a controller with
``--ranks`` heartbeating ranks, one member heartbeating every 20 ms from a process of its own (its
round trips: p50, p99, max), first idle, then while N client threads in another process poll
``/controller/workers``, ``/controller/dashboard`` and ``/`` back to back; ``--rounds`` pairs of
that. One JSON line per setting: each round's round trips idle and loaded, loaded over idle, the
polls served per second and the views built meanwhile (lmcache_controller_view_builds_total).

Targets: >= 10,000 ranks registered and commandable; under read load a heartbeat's round trip
within 10x its idle value.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import statistics
import sys
import threading
import time

import httpx
import zmq

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from fake_fleet import FakeFleet  # noqa: E402
from protocol_client import CPU, ControllerProcess  # noqa: E402

from lmcache_p2p.protocol import Heartbeat, HeartbeatReply, controller_reply_decoder, encode  # noqa: E402
from lmcache_p2p.testing.measure import cpu_seconds, spread_ms  # noqa: E402


def proc_status(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


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


# -- read views under polling (--views-pollers) ---------------------------------------------------

VIEW_PATHS = ("/controller/workers", "/controller/dashboard", "/")
PROBE_GAP_S = 0.02  # the measured member heartbeats this often (the fleet's ranks every 5 s)
PROBE_WARMUP = 5  # first round trips not counted: the connection's handshake


def probe_heartbeats(port: int, epoch: str, instance_id: str, rank: int, seconds: float, out) -> None:
    """In a process of its own (no GIL shared with the pollers or the fleet): one member's
    heartbeats, one at a time, every PROBE_GAP_S for ``seconds``; their round trips in ms."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    beat = encode(Heartbeat(instance_id=instance_id, rank=rank, controller_epoch=epoch))
    samples: list[float] = []
    unanswered = unknown = 0
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
        request_id = n.to_bytes(8, "little")
        t0 = time.perf_counter()
        sock.send_multipart([request_id, beat])
        answered = False
        while sock.poll(max(1, int((t0 + 10 - time.perf_counter()) * 1000))):
            got, payload = sock.recv_multipart()
            if got == request_id:  # an earlier, unanswered beat's late reply is skipped
                answered = True
                break
        rtt_ms = (time.perf_counter() - t0) * 1e3
        if not answered:
            unanswered += 1
        else:
            reply = controller_reply_decoder.decode(payload)
            unknown += not (isinstance(reply, HeartbeatReply) and reply.status == "ok")
            if n > PROBE_WARMUP:
                samples.append(rtt_ms)
        time.sleep(max(0.0, PROBE_GAP_S - rtt_ms / 1e3))
    sock.close(0)
    ctx.term()
    out.put({"samples": samples, "unanswered": unanswered, "unknown": unknown})


def poll_views(base_url: str, paths: list[str], clients: int, stop, out) -> None:
    """In a process of its own: ``clients`` threads, each GETting every one of ``paths`` back to
    back until ``stop`` is set; what they were served."""
    served = {path: 0 for path in paths}
    failed: list[str] = []
    mb = [0.0]
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(base_url=base_url, timeout=60) as http:
            while not stop.is_set():
                for path in paths:
                    r = http.get(path)
                    with lock:
                        if r.status_code == 200:
                            served[path] += 1
                            mb[0] += len(r.content) / 1e6
                        else:
                            failed.append(f"{path}: {r.status_code}")

    t0 = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.monotonic() - t0
    out.put({"served": served, "seconds": seconds, "mb": mb[0], "failed": failed[:5]})


def progress(started: float, what: str) -> None:
    """A line on stderr per phase, so that a slow or stuck run says where it is."""
    print(f"[{time.monotonic() - started:6.1f} s] {what}", file=sys.stderr, flush=True)


def view_builds(controller: ControllerProcess) -> dict[str, float]:
    return {
        view: controller.metric("lmcache_controller_view_builds_total", view=view) for view in ("workers", "dashboard")
    }


def probe_round(mp, controller: ControllerProcess, fleet: FakeFleet, seconds: float) -> dict:
    instance_id, rank = fleet.ranks[0]
    out = mp.Queue()
    port = fleet.heartbeat_port or controller.heartbeat
    probe = mp.Process(target=probe_heartbeats, args=(port, fleet.epoch, instance_id, rank, seconds, out))
    probe.start()
    result = out.get(timeout=seconds + 120)
    probe.join()
    return result


def views_round(mp, controller: ControllerProcess, fleet: FakeFleet, args: argparse.Namespace) -> dict:
    """One member's heartbeat round trips idle, then while ``args.views_pollers`` clients poll the views."""
    seconds = args.probe_s
    idle = probe_round(mp, controller, fleet, seconds)
    builds0 = view_builds(controller)
    stop, polled = mp.Event(), mp.Queue()
    pollers = mp.Process(target=poll_views, args=(controller.url, args.views_paths, args.views_pollers, stop, polled))
    pollers.start()
    time.sleep(2.0)  # the pollers' interpreter started and every client polling
    loaded = probe_round(mp, controller, fleet, seconds)
    stop.set()
    polls = polled.get(timeout=300)
    pollers.join()
    builds = {k: v - builds0[k] for k, v in view_builds(controller).items()}
    idle_ms, loaded_ms = spread_ms(idle["samples"]), spread_ms(loaded["samples"])
    return {
        "idle": idle_ms,
        "loaded": loaded_ms,
        "loaded_over_idle": {
            k: round(loaded_ms[k] / idle_ms[k], 1) for k in ("p50_ms", "p99_ms", "max_ms") if k in loaded_ms
        },
        "unanswered": idle["unanswered"] + loaded["unanswered"],
        "answered_unknown": idle["unknown"] + loaded["unknown"],
        "polls_per_s": round(sum(polls["served"].values()) / polls["seconds"], 1),
        "served": polls["served"],
        "mb_per_s": round(polls["mb"] / polls["seconds"], 1),
        "failed": polls["failed"],
        "view_builds": builds,
    }


def rounds_spread(rounds: list[dict]) -> dict:
    """Each figure over the rounds: [min, median, max]."""
    figures = {
        f"{phase}_{k}": [r[phase][k] for r in rounds]
        for phase in ("idle", "loaded", "loaded_over_idle")
        for k in ("p50_ms", "p99_ms", "max_ms")
    }
    figures["polls_per_s"] = [r["polls_per_s"] for r in rounds]
    return {name: [min(v), statistics.median(v), max(v)] for name, v in figures.items()}


def views_under_load(args: argparse.Namespace, cache_s: float) -> dict:
    """A controller with ``args.ranks`` heartbeating ranks and ``--view-cache-s cache_s``, its
    heartbeats measured idle and under polling, ``args.rounds`` times."""
    started = time.monotonic()
    mp = multiprocessing.get_context("spawn")  # the children share no threads or sockets with this one
    controller = ControllerProcess("--view-cache-s", str(cache_s)).start()
    LogDrain(controller)  # read, so that its log never fills the pipe
    fleet = None
    try:
        fleet = FakeFleet(controller, args.ranks, tp=args.tp, prefix="views")
        replies = fleet.register_all()
        refused = sum(not r.ok for r in replies.values())
        progress(started, f"--view-cache-s {cache_s}: {args.ranks} ranks registered, {refused} refused")
        fleet.start_heartbeats()
        time.sleep(fleet.heartbeat_interval + 1.0)  # every rank has beaten once
        rounds = []
        for n in range(args.rounds):
            rounds.append(views_round(mp, controller, fleet, args))
            progress(started, f"--view-cache-s {cache_s}: round {n + 1} of {args.rounds} done")
        sizes = {path: len(controller.http.get(path).content) for path in VIEW_PATHS}
    finally:
        if fleet is not None:
            fleet.close()
        controller.stop()
        progress(started, f"--view-cache-s {cache_s}: controller and fleet stopped")
    return {
        "bench": "views_under_load",
        "view_cache_s": cache_s,
        "ranks": args.ranks,
        "refused": refused,
        "pollers": args.views_pollers,
        "paths": args.views_paths,
        "bytes": sizes,
        "probe_s": args.probe_s,
        "rounds": rounds,
        "spread": rounds_spread(rounds),
        "fleet_heartbeats_unknown": fleet.heartbeats_unknown,
        "seconds": round(time.monotonic() - started, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=10_000)
    ap.add_argument("--tp", type=int, default=8, help="ranks per instance")
    ap.add_argument("--idle-s", type=float, default=30.0, help="CPU is measured over this long, after one interval")
    ap.add_argument(
        "--views-pollers", type=int, default=0, help="measure heartbeats while this many clients poll the read views"
    )
    ap.add_argument("--rounds", type=int, default=3, help="--views-pollers: idle/loaded pairs per setting")
    ap.add_argument("--probe-s", type=float, default=10.0, help="--views-pollers: seconds of heartbeats per phase")
    ap.add_argument("--views-paths", nargs="+", default=list(VIEW_PATHS), help="--views-pollers: what they poll")
    ap.add_argument(
        "--view-cache-s", type=float, nargs="+", default=[0.0, 1.0], help="--views-pollers: the settings compared"
    )
    args = ap.parse_args()
    if args.ranks % args.tp:
        ap.error(f"--ranks {args.ranks} is not a multiple of --tp {args.tp}")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < args.ranks + 512 <= hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if args.views_pollers:
        for cache_s in args.view_cache_s:
            print(json.dumps(views_under_load(args, cache_s)), flush=True)
        return

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
