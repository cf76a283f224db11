"""A stalled holder must not stall the asking engine: vLLM CPU engines, engine 1 holding a prompt
per asker and one asking engine per lookup mode, each streaming a long generation while engine 1
is stopped with SIGSTOP and its prompt is sent to the asker (lmcache_p2p.testing.stalled_holder).
Prints JSON per asker and run: the stream's median gap between tokens, its largest gap around a
cold prompt (one prefill's cost) and around the stalled request, and the stalled request's time
(it recomputes once its pull gives up).

    python benchmarks/bench_stalled_holder.py [--model DIR] [--repeats 3] [--modes async,sync] [--stores]

``async`` is the seeds' ``enable_async_loading: true`` (with ``lookup_backoff_time``), ``sync``
the default. Engines are pinned to cores in turn (an asker may share the stopped holder's).
``--stores`` measures the same with a stopped remote store instead of a holder: a Redis
(Debian's ``redis-server``) and an ``lmcache_server``, an engine for each, peers off
(:func:`~lmcache_p2p.testing.stalled_holder.run_stalled_stores`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from lmcache_p2p.testing.stalled_holder import LOOKUP_MODES, run, run_stalled_stores  # noqa: E402
from lmcache_p2p.testing.tiny_model import build  # noqa: E402


def stopped_stores(model: str, workdir: Path, seed: int) -> list[dict]:
    from redis_servers import RedisServer
    from remote_stores import LmServer

    with RedisServer(workdir / "redis") as redis_server, LmServer(log_dir=workdir) as lm_server:
        assert redis_server.process.proc is not None and lm_server.proc is not None
        stores = [
            ("redis", redis_server.url(), redis_server.process.proc.send_signal),
            ("lmcache_server", lm_server.url, lm_server.proc.send_signal),
        ]
        return run_stalled_stores(model, workdir / "fleet", stores, seed=seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model directory (default: the tests' tiny model, built here)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default=",".join(LOOKUP_MODES))
    parser.add_argument("--stores", action="store_true", help="a stopped remote store instead of a holder")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build(str(Path(tmp) / "model"))
        runs = []
        for repeat in range(args.repeats):
            workdir = Path(tmp) / f"run-{repeat}"
            if args.stores:
                workdir.mkdir(parents=True)
                measured = stopped_stores(model, workdir, seed=300 + 10 * repeat)
            else:
                measured = run(model, workdir, args.modes.split(","), seed=100 + 10 * repeat)
            for figures in measured:
                figures.pop("logs")
                print(json.dumps(figures), file=sys.stderr, flush=True)
                runs.append(figures)
    print(json.dumps({"runs": runs}, indent=1))


if __name__ == "__main__":
    main()
