"""What the WebUI costs: page weight, load time in headless Chromium, and the price of the 2 s poll
(``GET /controller/dashboard``) on the controller, with real traffic behind it.

A real controller and two stand-in instances (real cache engine, worker and P2P over NIXL,
Llama-3.1-8B page shape, 32-token chunks) exchange traffic for ``--traffic-s`` seconds: each
round, instance 1 prefills a new prompt and instance 2 asks for it (a peer pull), asks again
for an older one (a local hit) and for one nobody has (a miss). Then the page is loaded
``--loads`` times, and the dashboard endpoint is timed with the two instances and again with
``--fake-workers`` more registered workers. ``--screenshot PATH`` saves the page after the traffic
(docs/webui.png is made this way).

    python benchmarks/bench_webui.py [--traffic-s 60] [--screenshot docs/webui.png]   # prints JSON
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
from browser import Chromium  # noqa: E402
from instances import InstanceProcess, instance_config, tokens  # noqa: E402
from protocol_client import ControllerProcess, FakeWorker, wait_for  # noqa: E402

CHUNK = 32
CPU = "LocalCPUBackend"


def progress(message: str) -> None:
    print(f"[bench_webui] {message}", file=sys.stderr, flush=True)


def make_traffic(controller, a: InstanceProcess, b: InstanceProcess, seconds: float) -> dict:
    rounds = pulled = 0
    old = pinned = None
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        rounds += 1
        prompt = tokens(8 * CHUNK, seed=1000 + rounds)
        a.prefill(prompt)
        wait_for(lambda prompt=prompt: controller.holders(prompt).get("lmcache_instance_1"), what="A's keys")
        pulled += b.lookup(prompt)
        if old is not None:
            b.lookup(old)  # local hit
        b.lookup(tokens(4 * CHUNK, seed=-rounds), peers=True)  # nobody has it: a miss
        old = prompt
        if rounds % 5 == 0:
            event = controller.api(
                "/copy",
                {
                    "old_position": ["lmcache_instance_1", CPU],
                    "new_position": ["lmcache_instance_2", CPU],
                    "tokens": prompt,
                },
            )
            controller.finish(event["event_id"])
            # One pinned prompt at a time: pins outlive eviction, and a pool full of them
            # refuses every pull ("no free page in the CPU pool (every page is pinned)").
            if pinned is not None:
                controller.api(
                    "/pin", {"instance_id": "lmcache_instance_2", "location": CPU, "tokens": pinned, "unpin": True}
                )
            controller.api("/pin", {"instance_id": "lmcache_instance_2", "location": CPU, "tokens": prompt})
            pinned = prompt
        time.sleep(0.5)
    return {"rounds": rounds, "tokens_pulled": pulled}


def time_dashboard(controller, calls: int) -> dict:
    latencies, size = [], 0
    for _ in range(calls):
        t0 = time.perf_counter()
        response = controller.http.get("/controller/dashboard")
        latencies.append((time.perf_counter() - t0) * 1e3)
        size = len(response.content)
    return {
        "median_ms": round(statistics.median(latencies), 2),
        "p95_ms": round(sorted(latencies)[int(0.95 * calls)], 2),
        "bytes": size,
    }


def page_loads(chromium: Chromium, url: str, loads: int) -> dict:
    weights, requests, dcl = [], [], []
    for _ in range(loads):
        page, log = chromium.open(url)
        page.wait_for_selector("#refreshed:not(:empty)", timeout=10_000)  # the first poll rendered
        timing = page.evaluate(
            "() => { const n = performance.getEntriesByType('navigation')[0];"
            " return {dcl: n.domContentLoadedEventEnd}; }"
        )
        weights.append(log.response_bytes)
        requests.append(len(log.requests))
        dcl.append(timing["dcl"])
        assert not log.console_errors and not log.page_errors, (log.console_errors, log.page_errors)
        page.close()
    return {
        "bytes_transferred_first_poll": max(weights),
        "requests": max(requests),
        "dom_content_loaded_ms_median": round(statistics.median(dcl), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traffic-s", type=float, default=60.0)
    parser.add_argument("--loads", type=int, default=10)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--fake-workers", type=int, default=64)
    parser.add_argument("--screenshot", type=Path)
    args = parser.parse_args()

    controller = ControllerProcess("--worker-timeout", "6").start()
    tmp = Path(tempfile.mkdtemp(prefix="bench_webui_"))
    instances = [
        InstanceProcess(instance_config(f"lmcache_instance_{i}", controller, "nixl", chunk_size=CHUNK), tmp).start()
        for i in (1, 2)
    ]
    chromium = Chromium()
    fakes: list[FakeWorker] = []
    try:
        progress(f"{args.traffic_s:.0f} s of traffic between two instances")
        traffic = make_traffic(controller, *instances, args.traffic_s)
        overview = controller.http.get("/controller/dashboard").json()["overview"]
        url = controller.url + "/"
        if args.screenshot:
            page, _ = chromium.open(url, width=1400, height=1300)
            page.wait_for_selector("#refreshed:not(:empty)")
            page.locator("tr.instance[data-instance=lmcache_instance_2]").click()
            args.screenshot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(args.screenshot))  # the first screenful: overview to the newest events
            page.close()
            progress(f"screenshot saved to {args.screenshot}")
        progress(f"{args.loads} page loads, {args.calls} dashboard calls")
        loads = page_loads(chromium, url, args.loads)
        two = time_dashboard(controller, args.calls)
        progress(f"registering {args.fake_workers} more workers")
        for i in range(args.fake_workers):
            fake = FakeWorker(controller, f"fake_instance_{i}", answer_commands=False)
            fake.register()
            fake.admit_tokens(tokens(64 * 16, seed=i))
            fakes.append(fake)
        wait_for(
            lambda: len(controller.http.get("/controller/workers").json()["workers"]) == 2 + args.fake_workers,
            what="fake workers registered",
        )
        many = time_dashboard(controller, args.calls)
        print(
            json.dumps(
                {
                    "bench": "webui",
                    "traffic": traffic,
                    "overview_after_traffic": {
                        k: overview[k] for k in ("hit_ratio", "lookups_per_s", "p2p_bytes_per_s", "traffic_totals")
                    },
                    "page": loads,
                    "dashboard_endpoint": {"workers_2": two, f"workers_{2 + args.fake_workers}": many},
                },
                indent=2,
            )
        )
    finally:
        for fake in fakes:
            fake.close()
        chromium.close()
        for proc in instances:
            proc.stop()
        controller.stop()


if __name__ == "__main__":
    main()
