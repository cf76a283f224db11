"""Two controllers under load, one killed with ``kill -9`` and restarted: what clients and engines
lose, whether the survivor's index stays complete, and how long the restarted one takes to be
complete again.

    .venv/bin/python benchmarks/bench_controller_failover.py [--ranks 200] [--prompts 50] [--chunks 100]
        [--clients 8] [--engines 2] [--rounds 3] [--before-s 5] [--down-s 10] [--after-s 5]

Set-up, once: two real ``lmcache_controller`` processes (A and B, default flags: 5 s heartbeats);
``--ranks`` stand-in ranks in one process (``lmcache_p2p.testing.link_fleet``: the worker's real
controller links to both, over stores of chunk hashes), which store ``--prompts`` prompts of
``--chunks`` chunks each (1M keys by default) as key events to both controllers; ``--engines``
stand-in engines (``lmcache_p2p.testing.standin``: the real cache engine and worker) given both
controllers, A first.

Each round: ``--clients`` threads ask ``/lookup`` for random stand-in prompts in a loop, A first,
retried as ``lmcache_router`` retries its ``/route`` (``ControllerChoice``: on a connection error
or a 5xx the next controller in the same request, and stay with the one that answered); each
engine asks for peer holders of random stand-in prompts in a loop (its scheduler's lookup, 1 s
for the controller, nothing pulled). After ``--before-s`` A is killed with SIGKILL; after
``--down-s`` B's index is checked (every stand-in rank's every key) and A is started again on the
same ports; the time until A's index holds every key again is measured; the load goes on
``--after-s`` more. Counted per round:

* clients: requests, failed (no controller answered, after the retry), wrong (an answer without
  the prompt's holder and its whole length), switches;
* peer lookups: blind (a ``timeout`` miss: no controller answered in time), slow (answered, but
  after one lookup timeout or more), false misses (a controller answered "not held" for a prompt
  a rank holds: its index was incomplete), the slowest, and those a restarted controller
  answered short that were checked with the other (``rechecked``);
* B complete while A was down; A complete again: seconds from its restart (process start) and
  from its HTTP answering.

Prints one JSON line per round, then a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from bench_controller_scale import LogDrain  # noqa: E402
from instances import InstanceProcess, instance_config  # noqa: E402
from protocol_client import ControllerProcess, wait_for  # noqa: E402

from lmcache_p2p.router.config import RouterConfig  # noqa: E402
from lmcache_p2p.router.controllers import ControllerChoice  # noqa: E402
from lmcache_p2p.testing.link_fleet import prompt_tokens  # noqa: E402
from lmcache_p2p.vocab import CPU, OFFER_TIMEOUT_S  # noqa: E402

MODEL = "qwen2.5-0.5b"  # the stand-in engines' model: the fleet registers its layout
TIMEOUT = "timeout"
# A controller's "not held" as the engine reports it (the rank tells never stored from evicted by
# its own memory): every prompt asked about is held by a stand-in rank, so each is a false miss.
FALSE_MISSES = ("not_held", "never_stored", "evicted")


# -- the stand-in fleet ----------------------------------------------------------------------------


class FleetProcess:
    """``python -m lmcache_p2p.testing.link_fleet`` driven over JSON lines."""

    def __init__(self, args, controllers: list[ControllerProcess], log_path: Path):
        self.log = open(log_path, "w")  # noqa: SIM115 -- the fleet writes to it until stop()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "lmcache_p2p.testing.link_fleet",
                *("--ranks", str(args.ranks), "--prompts", str(args.prompts), "--chunks", str(args.chunks)),
                *("--chunk-size", str(args.chunk_size), "--model", MODEL),
                *("--pull-urls", ",".join(f"127.0.0.1:{c.pull}" for c in controllers)),
                *("--reply-urls", ",".join(f"127.0.0.1:{c.reply}" for c in controllers)),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.request("ready", send=False)

    def request(self, op: str, send: bool = True) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if send:
            self.proc.stdin.write(json.dumps({"op": op}) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"link fleet exited (rc={self.proc.poll()}); see {self.log.name}")
        answer = json.loads(line)
        assert answer.get("ok"), answer
        return answer

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write('{"op": "quit"}\n')
            self.proc.stdin.flush()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


# -- what a round measures -------------------------------------------------------------------------


@dataclass
class Sample:
    at: float  # monotonic start
    seconds: float
    outcome: str  # clients: ok | wrong | failed; engines: hit | blind | false_miss | other
    via: str = ""  # clients: the controller that answered


@dataclass
class Load:
    """The client and engine loops of one round, each thread with its own list."""

    clients: list[list[Sample]] = field(default_factory=list)
    engines: list[list[Sample]] = field(default_factory=list)
    switches: list[int] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)


class Prompts:
    """Stand-in prompts to ask about: (rank, prompt) and the /lookup body, made once."""

    def __init__(self, args, count: int, seed: int):
        rng = random.Random(seed)
        self.items = []
        for _ in range(count):
            rank, prompt = rng.randrange(args.ranks), rng.randrange(args.prompts)
            tokens = prompt_tokens(rank, prompt, args.chunks, args.chunk_size).tolist()
            body = json.dumps({"tokens": tokens}).encode()
            self.items.append((f"fleet-{rank}", tokens, body))
        self.full = args.chunks * args.chunk_size


def client_loop(urls: list[str], prompts: Prompts, pause: float, out: list[Sample], load: Load, slot: int) -> None:
    """``/lookup`` with lmcache_router's rule for its controllers: on a connection error or a 5xx,
    the next controller within the same request, and stay with the one that answered."""
    defaults = RouterConfig(controller_url=",".join(urls))
    choice = ControllerChoice(defaults.controller_urls)
    timeout = httpx.Timeout(defaults.route_timeout_s, connect=defaults.connect_timeout_s)
    headers = {"content-type": "application/json"}
    rng = random.Random(slot)
    with httpx.Client(timeout=timeout, trust_env=False) as http:
        while not load.stop.is_set():
            instance, _, body = rng.choice(prompts.items)
            t0 = time.monotonic()
            answer, via, failures = None, "", []
            for url in choice.order():
                try:
                    response = http.post(f"{url}/lookup", content=body, headers=headers)
                except httpx.HTTPError as e:
                    failures.append(f"{url}: {type(e).__name__}")
                    continue
                if response.status_code >= 500:
                    failures.append(f"{url}: HTTP {response.status_code}")
                    continue
                if response.status_code == 200:
                    answer, via = response.json(), url
                    choice.answered(url, failures)
                break
            seconds = time.monotonic() - t0
            if answer is None:
                outcome = "failed"
            elif answer["layout_info"].get(instance) == [CPU, prompts.full]:
                outcome = "ok"
            else:
                outcome = "wrong"
            out.append(Sample(t0, seconds, outcome, via))
            load.switches[slot] = choice.switches
            time.sleep(pause)


def engine_loop(engine: InstanceProcess, prompts: Prompts, pause: float, out: list[Sample], load: Load, slot: int):
    """The engine's peer lookup (``offer``: the controller's holders and the pull policy's
    decision, nothing pulled) of random stand-in prompts."""
    rng = random.Random(1000 + slot)
    chunks = len(prompts.items[0][1]) // int(engine.config["chunk_size"])
    while not load.stop.is_set():
        _, tokens, _ = rng.choice(prompts.items)
        t0 = time.monotonic()
        try:
            answer = engine.request("offer", tokens=tokens)
        except AssertionError as e:  # the stand-in answered an error, or exited
            out.append(Sample(t0, time.monotonic() - t0, f"other:{str(e)[:200]}"))
            return
        seconds = time.monotonic() - t0
        if answer["offered"] == chunks:
            outcome = "hit"
        elif answer["miss"] == TIMEOUT:
            outcome = "blind"
        elif answer["miss"] in FALSE_MISSES:
            outcome = "false_miss"
        else:
            outcome = f"other:{answer['miss']}"
        out.append(Sample(t0, seconds, outcome))
        time.sleep(pause)


def start_load(args, urls: list[str], engines: list[InstanceProcess], prompts: Prompts) -> Load:
    load = Load()
    for slot in range(args.clients):
        load.clients.append([])
        load.switches.append(0)
        thread = threading.Thread(
            target=client_loop,
            args=(urls, prompts, args.client_pause_s, load.clients[slot], load, slot),
            daemon=True,
        )
        load.threads.append(thread)
    for slot, engine in enumerate(engines):
        load.engines.append([])
        thread = threading.Thread(
            target=engine_loop,
            args=(engine, prompts, args.engine_pause_s, load.engines[slot], load, slot),
            daemon=True,
        )
        load.threads.append(thread)
    for thread in load.threads:
        thread.start()
    return load


# -- index completeness ----------------------------------------------------------------------------


def index_gap(controller: ControllerProcess, args, engines: int) -> dict | None:
    """What ``controller``'s index lacks: stand-in ranks missing or short of keys, engines not
    registered; None when it holds every rank's every key."""
    try:
        stats = controller.http.get("/controller/key-stats", timeout=2.0).json()
    except (httpx.HTTPError, ValueError) as e:
        return {"error": type(e).__name__}
    want = args.prompts * args.chunks
    instances = stats["instances"]
    short = sum(1 for n in range(args.ranks) if instances.get(f"fleet-{n}", {}).get(CPU, 0) != want)
    engines_missing = engines - sum(1 for name in instances if name.startswith("engine-"))
    if short or engines_missing:
        return {"ranks_short": short, "engines_missing": engines_missing, "total_keys": stats["total_keys"]}
    return None


def wait_complete(controller: ControllerProcess, args, engines: int, timeout: float) -> float | None:
    """Seconds until ``controller``'s index is complete (polled every 0.1 s); None past ``timeout``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if index_gap(controller, args, engines) is None:
            return time.monotonic() - t0
        time.sleep(0.1)
    return None


# -- one round -------------------------------------------------------------------------------------


def summarise(load: Load, t_kill: float, t_restart: float, t_end: float) -> tuple[dict, dict]:
    clients = [s for samples in load.clients for s in samples]
    lookups = [s for samples in load.engines for s in samples]

    def count(samples: list[Sample], outcome: str, since: float = 0.0, until: float = float("inf")) -> int:
        return sum(1 for s in samples if s.outcome == outcome and since <= s.at < until)

    span = t_end - min((s.at for s in clients + lookups), default=t_end)
    client_line = {
        "requests": len(clients),
        "per_s": round(len(clients) / span, 1) if span > 0 else 0,
        "failed": count(clients, "failed"),
        "wrong": count(clients, "wrong"),
        "wrong_after_restart": count(clients, "wrong", since=t_restart),
        "switches": sum(load.switches),
        "p50_ms": round(1e3 * statistics.median(s.seconds for s in clients), 1) if clients else None,
        "max_s": round(max((s.seconds for s in clients), default=0.0), 2),
    }
    slow = [s for s in lookups if s.outcome != "blind" and s.seconds >= OFFER_TIMEOUT_S]
    engine_line = {
        "lookups": len(lookups),
        "hits": count(lookups, "hit"),
        "blind": count(lookups, "blind"),
        "slow": len(slow),
        "false_misses": count(lookups, "false_miss"),
        "false_misses_while_down": count(lookups, "false_miss", since=t_kill, until=t_restart),
        "false_misses_after_restart": count(lookups, "false_miss", since=t_restart),
        "other": dict(Counter(s.outcome.removeprefix("other:") for s in lookups if s.outcome.startswith("other:"))),
        "p50_ms": round(1e3 * statistics.median(s.seconds for s in lookups), 1) if lookups else None,
        "max_s": round(max((s.seconds for s in lookups), default=0.0), 2),
    }
    return client_line, engine_line


def rechecked(engines: list[InstanceProcess]) -> int:
    """Peer lookups whose short answer from a restarted controller was checked with the next one."""
    return sum(link.get("p2p_lookups_rechecked", 0) for e in engines for link in e.status()["controllers"])


def one_round(
    number: int, args, a: ControllerProcess, b: ControllerProcess, engines, prompts
) -> tuple[dict, ControllerProcess]:
    urls = [a.url, b.url]
    rechecked_before = rechecked(engines)
    load = start_load(args, urls, engines, prompts)
    time.sleep(args.before_s)
    t_kill = time.monotonic()
    a.kill()
    time.sleep(args.down_s)
    gap_b = index_gap(b, args, len(engines))
    t_restart = time.monotonic()
    restarted = ControllerProcess(ports=a.ports)
    restarted.start()
    LogDrain(restarted)
    http_up_s = time.monotonic() - t_restart
    complete_s = wait_complete(restarted, args, len(engines), args.complete_timeout_s)
    time.sleep(args.after_s)
    load.stop.set()
    t_end = time.monotonic()
    for thread in load.threads:
        thread.join(30)
    clients, lookups = summarise(load, t_kill, t_restart, t_end)
    lookups["rechecked"] = rechecked(engines) - rechecked_before
    line = {
        "bench": "controller_failover",
        "round": number,
        "clients": clients,
        "peer_lookups": lookups,
        "survivor_complete": gap_b is None,
        "survivor_gap": gap_b,
        "survivor_gap_at_end": index_gap(b, args, len(engines)),
        "restarted_http_up_s": round(http_up_s, 2),
        "restarted_complete_s": None if complete_s is None else round(http_up_s + complete_s, 2),
        "restarted_complete_after_http_s": None if complete_s is None else round(complete_s, 2),
    }
    return line, restarted


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=200, help="stand-in ranks (one rank per instance)")
    ap.add_argument("--prompts", type=int, default=50, help="prompts each stand-in rank holds")
    ap.add_argument("--chunks", type=int, default=100, help="chunks per prompt (keys: ranks x prompts x chunks)")
    ap.add_argument("--chunk-size", type=int, default=16)
    ap.add_argument("--clients", type=int, default=8, help="client threads on /lookup")
    ap.add_argument("--client-pause-s", type=float, default=0.02, help="each client's pause between requests")
    ap.add_argument("--engines", type=int, default=2, help="stand-in engines doing peer lookups")
    ap.add_argument("--engine-pause-s", type=float, default=0.02, help="each engine's pause between peer lookups")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before-s", type=float, default=5.0, help="load before the kill")
    ap.add_argument("--down-s", type=float, default=10.0, help="how long A stays down")
    ap.add_argument("--after-s", type=float, default=5.0, help="load after A is complete again")
    ap.add_argument("--complete-timeout-s", type=float, default=60.0)
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench_controller_failover_"))
    t_start = time.monotonic()
    a, b = ControllerProcess().start(), ControllerProcess().start()
    drains = [LogDrain(a), LogDrain(b)]
    fleet = None
    engines: list[InstanceProcess] = []
    lines: list[dict] = []
    try:
        keys = args.ranks * args.prompts * args.chunks
        t0 = time.monotonic()
        fleet = FleetProcess(args, [a, b], workdir / "fleet.log")
        both = {
            "controller_pull_url": f"127.0.0.1:{a.pull},127.0.0.1:{b.pull}",
            "controller_reply_url": f"127.0.0.1:{a.reply},127.0.0.1:{b.reply}",
        }
        for n in range(args.engines):
            config = instance_config(
                f"engine-{n}", a, chunk_size=args.chunk_size, cpu_gb=0.05, p2p_pull_policy="always", **both
            )
            engines.append(InstanceProcess(config, workdir, model=MODEL, num_blocks=8).start())
        wait_for(
            lambda: all(s["registered"] == args.ranks for s in fleet.request("status")["controllers"]),
            120,
            "every stand-in rank registered with both controllers",
            interval=0.5,
        )
        registered_s = time.monotonic() - t0
        t0 = time.monotonic()
        fleet.request("admit")
        admitted_s = time.monotonic() - t0
        for controller in (a, b):
            if wait_complete(controller, args, len(engines), 300) is None:
                raise AssertionError(f"{controller.url}: index incomplete: {index_gap(controller, args, len(engines))}")
        loaded_s = time.monotonic() - t0
        rss = {}
        for name, c in (("a", a), ("b", b)):
            assert c.proc is not None
            rss[name] = round(
                int(Path(f"/proc/{c.proc.pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
            )
        setup = {
            "bench": "controller_failover_setup",
            "ranks": args.ranks,
            "engines": args.engines,
            "keys": keys,
            "registered_s": round(registered_s, 2),
            "admit_s": round(admitted_s, 2),
            "both_indexes_complete_s": round(loaded_s, 2),
            "controller_rss_mb": rss,
        }
        print(json.dumps(setup), flush=True)
        prompts = Prompts(args, 400, seed=7)
        for number in range(1, args.rounds + 1):
            line, a = one_round(number, args, a, b, engines, prompts)
            lines.append(line)
            print(json.dumps(line), flush=True)
    finally:
        for engine in engines:
            engine.stop()
        if fleet is not None:
            fleet.stop()
        a.stop()
        b.stop()
    del drains

    def spread(values: list) -> dict:
        values = [v for v in values if v is not None]
        return {"min": min(values), "max": max(values)} if values else {}

    summary = {
        "bench": "controller_failover_summary",
        "args": vars(args),
        "rounds": len(lines),
        "client_requests": sum(r["clients"]["requests"] for r in lines),
        "client_failed": sum(r["clients"]["failed"] for r in lines),
        "client_wrong": sum(r["clients"]["wrong"] for r in lines),
        "peer_lookups": sum(r["peer_lookups"]["lookups"] for r in lines),
        "peer_blind": sum(r["peer_lookups"]["blind"] for r in lines),
        "peer_slow": spread([r["peer_lookups"]["slow"] for r in lines]),
        "peer_slowest_s": spread([r["peer_lookups"]["max_s"] for r in lines]),
        "peer_false_misses": sum(r["peer_lookups"]["false_misses"] for r in lines),
        "peer_rechecked": [r["peer_lookups"]["rechecked"] for r in lines],
        "survivor_complete_every_round": all(r["survivor_complete"] for r in lines),
        "restarted_complete_s": spread([r["restarted_complete_s"] for r in lines]),
        "restarted_http_up_s": spread([r["restarted_http_up_s"] for r in lines]),
        "wall_s": round(time.monotonic() - t_start, 1),
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
