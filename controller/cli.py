"""``lmcache_controller`` entry point (the server itself lands with the Controller issue)."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmcache_controller",
        description="lmcache-p2p controller: chunk index, lookup/move/copy/clear/pin API, WebUI",
    )
    parser.add_argument("--host", default="localhost", help="HTTP bind host (default: localhost)")
    parser.add_argument("--port", type=int, default=9000, help="HTTP port (default: 9000)")
    parser.add_argument("--monitor-ports", default='{"pull": 8300, "reply": 8400, "heartbeat": 8082}',
                        help="JSON map of ZMQ ports: pull, reply, heartbeat")
    return parser


def main(argv: "list[str] | None" = None) -> int:
    build_parser().parse_args(argv)
    print("lmcache_controller: the controller server is not built yet (Controller issue); see --help",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
