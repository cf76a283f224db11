"""What Python's thread switch interval costs a pull's check, and what a shorter one costs the engine.

Our worker's threads share the GIL with vLLM's step loop. A pull's device check is a dozen torch
calls, each of which gives the GIL up and asks for it back; while the step loop runs Python, the
thread gets it back only when the switch interval (Python's default: 5 ms) ends. This measures it
on CPU, with a pure-Python loop standing in for the step loop:

* ``check_ms``: one ``device_checksums`` of ``--pages`` pages (CPU tensors: torch's definition of
  the checksum, ~4 torch calls a page) on a thread beside the loop, median and p90 of ``--reps``;
* ``alone_ms``: the same call with the loop stopped (the floor);
* ``loop_slowdown``: 1 - the loop's iterations a second with a check every ``--every-ms`` on the
  side / the loop's alone, three runs alternated (what the checks, and a shorter interval, take
  from the engine's Python).

    python benchmarks/bench_switch_interval.py [--intervals 5,1,0.5,0.1] [--pages 4] [--reps 40]

Prints one JSON object. The GPU runs set the interval with ``switch_interval_ms`` (e2e.py --set).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from lmcache_p2p.device_checksum import device_checksums  # noqa: E402


class PythonLoop:
    """A thread running pure Python until stopped, counting its iterations (the step loop's stand-in)."""

    def __init__(self) -> None:
        self.iterations = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        x = 0
        while not self._stop.is_set():
            for i in range(1000):
                x += i
            self.iterations += 1

    def __enter__(self) -> PythonLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def timed_check(pages: list[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    device_checksums(pages)
    return (time.perf_counter() - t0) * 1e3


def loop_rate(seconds: float, pages: list[torch.Tensor] | None, every_ms: float) -> float:
    """The loop's iterations a second over ``seconds``, with a check every ``every_ms`` if pages."""
    with PythonLoop() as loop:
        time.sleep(0.1)
        start, t0 = loop.iterations, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            if pages is not None:
                device_checksums(pages)
            time.sleep(every_ms / 1e3)
        return (loop.iterations - start) / (time.perf_counter() - t0)


def spread(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {
        "median": round(statistics.median(xs), 3),
        "p90": round(xs[int(0.9 * (len(xs) - 1))], 3),
        "min": round(xs[0], 3),
        "max": round(xs[-1], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--intervals", default="5,1,0.5,0.1", help="switch intervals to compare, ms")
    parser.add_argument("--pages", type=int, default=4)
    parser.add_argument("--page-kib", type=int, default=64)
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--every-ms", type=float, default=20.0, help="a check this often in the slowdown run")
    parser.add_argument("--seconds", type=float, default=2.0, help="length of each loop-rate run")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pages = [torch.randint(0, 256, (args.page_kib * 1024,), dtype=torch.uint8) for _ in range(args.pages)]
    default = sys.getswitchinterval()
    alone = [timed_check(pages) for _ in range(args.reps)]
    rows = []
    try:
        for ms in (float(x) for x in args.intervals.split(",")):
            sys.setswitchinterval(ms / 1e3)
            checks = []
            with PythonLoop():
                time.sleep(0.05)
                for _ in range(args.reps):
                    checks.append(timed_check(pages))
                    time.sleep(0.005)  # the next pull comes later; the loop runs alone meanwhile
            # Alternated three times: the loop's rate drifts with what else the machine runs.
            slowdowns = []
            for _ in range(3):
                bare = loop_rate(args.seconds, None, args.every_ms)
                slowdowns.append(1 - loop_rate(args.seconds, pages, args.every_ms) / bare)
            rows.append({"switch_interval_ms": ms, "check_ms": spread(checks), "loop_slowdown": spread(slowdowns)})
    finally:
        sys.setswitchinterval(default)
    print(
        json.dumps(
            {
                "bench": "switch_interval",
                "pages": args.pages,
                "page_kib": args.page_kib,
                "reps": args.reps,
                "torch_threads": 1,
                "alone_ms": spread(alone),
                "runs": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
