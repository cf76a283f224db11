"""A stalled holder must not stall the asking engine: vLLM CPU engines, engine 1 holding a prompt
per asker and one asking engine per lookup mode, each streaming a long generation while engine 1
is stopped with SIGSTOP and its prompt is sent to the asker (lmcache_p2p.testing.stalled_holder).
Prints JSON per asker and run: the stream's median gap between tokens, its largest gap around a
cold prompt (one prefill's cost) and around the stalled request, and the stalled request's time
(it recomputes once its pull gives up).

    python benchmarks/bench_stalled_holder.py [--model DIR] [--repeats 3] [--modes async,sync]

``async`` is the seeds' ``enable_async_loading: true`` (with ``lookup_backoff_time``), ``sync``
the default. Engines are pinned to cores in turn (an asker may share the stopped holder's).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from lmcache_p2p.testing.stalled_holder import LOOKUP_MODES, run
from lmcache_p2p.testing.tiny_model import build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model directory (default: the tests' tiny model, built here)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default=",".join(LOOKUP_MODES))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build(str(Path(tmp) / "model"))
        runs = []
        for repeat in range(args.repeats):
            for figures in run(model, Path(tmp) / f"run-{repeat}", args.modes.split(","), seed=100 + 10 * repeat):
                figures.pop("logs")
                print(json.dumps(figures), file=sys.stderr, flush=True)
                runs.append(figures)
    print(json.dumps({"runs": runs}, indent=1))


if __name__ == "__main__":
    main()
