"""``lmcache-p2p``: operator tools that need no engine.

lmcache-p2p config [--tp-size N]     validate the LMCACHE_CONFIG_FILE / LMCACHE_* settings
lmcache-p2p config --markdown        the documentation's table of every key
lmcache-p2p hash [--chunk-size N]    chunk hashes of a JSON token-id list (stdin or argument)
lmcache-p2p ray-register [--address A]
                                     make Ray Serve LLM set LMCacheConnectorV1 up as lmcache-p2p
                                     in a Ray cluster (once per cluster; docs/ray_serve.md)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from lmcache_p2p import version_line
from lmcache_p2p.config import MARKDOWN_BEGIN, MARKDOWN_END, ConfigError, LMCacheConfig, key_table_markdown
from lmcache_p2p.keys import chunk_spans


def _config(args: argparse.Namespace) -> int:
    if args.markdown:
        return _config_markdown(args.into)
    try:
        # What an engine started here gets: the file (--file or LMCACHE_CONFIG_FILE), then LMCACHE_*.
        cfg = LMCacheConfig.load(file=args.file)
        if args.tp_size:
            cfg.validate_for_tp(args.tp_size)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 1
    shown = {k: {"value": v, "from": cfg.sources.get(k, "default")} for k, v in cfg.to_dict().items()}
    print(json.dumps(shown, indent=2))
    return 0


def _config_markdown(into: str | None) -> int:
    table = key_table_markdown()
    if into is None:
        print(table)
        return 0
    with open(into, encoding="utf-8") as fh:
        text = fh.read()
    begin, end = text.find(MARKDOWN_BEGIN), text.find(MARKDOWN_END)
    if begin < 0 or end < begin:
        print(f"config --into: {into} has no {MARKDOWN_BEGIN!r} ... {MARKDOWN_END!r} block", file=sys.stderr)
        return 1
    with open(into, "w", encoding="utf-8") as fh:
        fh.write(text[:begin] + table + text[end + len(MARKDOWN_END) :])
    print(f"config --into: wrote the key table into {into}", file=sys.stderr)
    return 0


def _hash(args: argparse.Namespace) -> int:
    text = args.tokens if args.tokens is not None else sys.stdin.read()
    try:
        tokens = json.loads(text)
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ValueError
    except ValueError:
        print("hash: expected a JSON list of token ids, e.g. [128000, 849, 21435]", file=sys.stderr)
        return 1
    spans = chunk_spans(tokens, args.chunk_size)
    print(json.dumps([{"start": s.start, "end": s.end, "hash": f"{s.chunk_hash:016x}"} for s in spans]))
    return 0


def _ray_register(args: argparse.Namespace) -> int:
    try:
        import ray

        from lmcache_p2p.integration import ray as ray_integration
    except ImportError as e:
        print(
            f"ray-register: Ray Serve LLM is not importable here ({e}); install it as docs/ray_serve.md says",
            file=sys.stderr,
        )
        return 1
    try:
        ray.init(address=args.address, logging_level=logging.WARNING, log_to_driver=False)
    except ConnectionError as e:
        print(f"ray-register: no Ray cluster at --address {args.address}: {e}", file=sys.stderr)
        return 1
    try:
        ray_integration.register()
        backend = ray_integration.registered_backend()
    finally:
        ray.shutdown()
    print(json.dumps({"address": args.address, ray_integration.CONNECTOR_NAME: backend}))
    return 0 if backend == ray_integration.BACKEND_PATH else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lmcache-p2p", description="lmcache-p2p operator tools (no engine needed)")
    parser.add_argument("--version", action="version", version=version_line("lmcache-p2p"))
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("config", help="validate and show the effective configuration and where each value came from")
    p.add_argument(
        "--file", help="a YAML file instead of LMCACHE_CONFIG_FILE's (LMCACHE_* variables still win, as in an engine)"
    )
    p.add_argument("--markdown", action="store_true", help="print the documentation's table of every key instead")
    p.add_argument("--into", metavar="FILE", help="with --markdown: replace the table's marked block in FILE")
    p.add_argument("--tp-size", type=int, default=0, help="also check per-rank port lists for this TP size")
    p.set_defaults(run=_config)
    p = sub.add_parser("hash", help="chained chunk hashes of a token-id list")
    p.add_argument("tokens", nargs="?", help="JSON list of token ids (default: read stdin)")
    p.add_argument("--chunk-size", type=int, default=256)
    p.set_defaults(run=_hash)
    p = sub.add_parser("ray-register", help="make Ray Serve LLM's LMCacheConnectorV1 set up as lmcache-p2p")
    p.add_argument("--address", default="auto", help="the Ray cluster (HOST:PORT of the head; default: auto)")
    p.set_defaults(run=_ray_register)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
