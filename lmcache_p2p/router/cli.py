"""``lmcache_router``: the OpenAI-compatible proxy in front of a fleet of vLLM engines::

    lmcache_router --controller-url http://127.0.0.1:9000 --port 8100 [--policy kv-aware]

Flags are checked and the port is bound before anything else starts, so a bad flag or a port in
use ends the process with one line naming it, not a traceback. docs/router.md has the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import urllib.parse
from collections.abc import Mapping

from lmcache_p2p import version_line
from lmcache_p2p.http_body import DEFAULT_MAX_BODY_BYTES
from lmcache_p2p.router.config import RouterConfig
from lmcache_p2p.router.policies import POLICY_NAMES
from lmcache_p2p.router.tokenizer import LocalTokenizer, TokenizerError

PROG = "lmcache_router"
API_TOKEN_ENV = "LMCACHE_API_TOKEN"  # the controller's variable: one token for both
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

BACKLOG = 2048  # connections the kernel queues for accept; the cap applies once accepted

logger = logging.getLogger("lmcache_p2p.router")


class FlagError(ValueError):
    """A flag's value that cannot be used; the message names the flag."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="OpenAI-compatible proxy that sends each request to the engine the lmcache-p2p controller's "
        "POST /route ranks first (or as --policy orders them), falling back to the next when one is down.",
    )
    p.add_argument("--version", action="version", version=version_line(PROG))
    p.add_argument(
        "--controller-url",
        required=True,
        help="the controller's HTTP API, e.g. http://127.0.0.1:9000; several controllers of one mesh: "
        "comma-separated, asked in that order (the next on a connection error or a 5xx)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8100, help="port to serve on (default 8100; 0: any free port)")
    p.add_argument(
        "--policy", choices=POLICY_NAMES, default="kv-aware", help="how engines are ordered (default kv-aware)"
    )
    p.add_argument(
        "--api-token-file",
        help=f"file holding the controller's API token (or set {API_TOKEN_ENV}); sent as a bearer token to /route",
    )
    p.add_argument("--model", help="route only to instances serving this model (the controller's model name)")
    p.add_argument(
        "--tokenizer",
        help="tokenize in the router with this tokenizer (the engines' model directory or hub id; needs "
        "transformers) instead of asking an engine's /tokenize, saving an HTTP round trip to a busy engine",
    )
    p.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        default="info",
        help="debug, info (default: one line per request), warning, error",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds an engine may take to answer (a non-streamed generation answers at its end; default 600)",
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=2.0,
        help="seconds to connect to an engine or the controller before trying the next (default 2)",
    )
    p.add_argument(
        "--engine-cooldown",
        type=float,
        default=10.0,
        help="seconds an engine that could not be reached is tried last (default 10)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="N",
        help=f"largest request body accepted; a bigger one is refused with 413 before it is read "
        f"(default {DEFAULT_MAX_BODY_BYTES}, 4 MiB, as the controller's)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=RouterConfig.max_connections,
        metavar="N",
        help=f"open client connections at most (default {RouterConfig.max_connections}, lowered to half the free "
        "file descriptors); a newcomer past it closes the oldest connection that has sent no request, or is "
        "closed at once when every one has; both counted in /router/stats and logged",
    )
    p.add_argument(
        "--max-connections-per-address",
        type=int,
        default=RouterConfig.max_connections_per_address,
        metavar="N",
        help=f"open connections from one client address at most (default "
        f"{RouterConfig.max_connections_per_address}); past it a newcomer closes that address's oldest connection "
        "that has sent no request, or is closed at once; raise it for a proxy in front of the router",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=RouterConfig.header_timeout_s,
        metavar="S",
        help="close a connection that sends no complete request header within S seconds of connecting or of "
        f"its last response (default {RouterConfig.header_timeout_s:g})",
    )
    p.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=RouterConfig.keep_alive_s,
        metavar="S",
        help=f"close an idle keep-alive connection after S seconds (default {RouterConfig.keep_alive_s:g})",
    )
    return p


def normalize_controller_url(raw: str) -> str:
    """``http(s)://host[:port]`` without a trailing slash; a bare ``host:port`` means http."""
    url = raw.strip()
    if "://" not in url:
        url = f"http://{url}"
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018  (raises ValueError on a bad port)
    except ValueError as e:
        raise FlagError(f"--controller-url {raw!r}: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FlagError(
            f"--controller-url {raw!r}: expected an http:// or https:// URL with a host, e.g. http://127.0.0.1:9000"
        )
    if parts.query or parts.fragment:
        raise FlagError(f"--controller-url {raw!r}: expected no query or fragment")
    return url.rstrip("/")


def normalize_controller_urls(raw: str) -> str:
    """``--controller-url``'s one URL or comma-separated URLs, each normalised, joined by commas."""
    items = raw.split(",")
    for i, item in enumerate(items, 1):
        if not item.strip():
            raise FlagError(f"--controller-url {raw!r}: item {i} of {len(items)} is empty")
    return ",".join(normalize_controller_url(item) for item in items)


def read_api_token(path: str | None, env: Mapping[str, str]) -> str | None:
    """The controller's API token from ``--api-token-file`` or ``LMCACHE_API_TOKEN`` (one of them:
    two sources that could disagree are refused, as the controller refuses them). Checked like the
    controller checks it, so a token the controller would refuse is caught here."""
    from lmcache_p2p.mesh_security import MeshSecretError, check_secret, read_secret_file

    from_env = env.get(API_TOKEN_ENV)
    if path is not None and from_env:
        raise FlagError(
            f"the API token is given twice (--api-token-file and {API_TOKEN_ENV}); give it in one place only"
        )
    try:
        if path is not None:
            return read_secret_file(path, "an API token")
        if from_env:
            return check_secret(from_env, "an API token")
    except MeshSecretError as e:
        where = f"--api-token-file {path}" if path is not None else API_TOKEN_ENV
        raise FlagError(f"{where} {e}") from None
    return None


def config_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> RouterConfig:
    if not 0 <= args.port <= 65535:
        raise FlagError(f"--port {args.port}: expected 0-65535")
    for flag, value in (
        ("--request-timeout", args.request_timeout),
        ("--connect-timeout", args.connect_timeout),
        ("--engine-cooldown", args.engine_cooldown),
        ("--header-timeout", args.header_timeout),
    ):
        if not value > 0 or value == float("inf"):
            raise FlagError(f"{flag} {value}: expected seconds > 0")
    if not 1 <= args.keep_alive_timeout < float("inf"):
        raise FlagError(f"--keep-alive-timeout {args.keep_alive_timeout}: expected seconds >= 1")
    if args.max_connections < 1:
        raise FlagError(f"--max-connections {args.max_connections}: expected a number >= 1")
    if args.max_connections_per_address < 1:
        raise FlagError(f"--max-connections-per-address {args.max_connections_per_address}: expected a number >= 1")
    if args.max_body_bytes < 1:
        raise FlagError(f"--max-body-bytes {args.max_body_bytes}: expected a number of bytes >= 1")
    if args.model is not None and not args.model.strip():
        raise FlagError("--model '': expected a model name")
    return RouterConfig(
        controller_url=normalize_controller_urls(args.controller_url),
        policy=args.policy,
        api_token=read_api_token(args.api_token_file, env),
        model=args.model,
        connect_timeout_s=args.connect_timeout,
        route_timeout_s=max(2.0, args.connect_timeout),
        request_timeout_s=args.request_timeout,
        cooldown_s=args.engine_cooldown,
        tokenizer=args.tokenizer,
        max_body_bytes=args.max_body_bytes,
        max_connections=args.max_connections,
        max_connections_per_address=args.max_connections_per_address,
        header_timeout_s=args.header_timeout,
        keep_alive_s=args.keep_alive_timeout,
    )


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    addr = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)[0][4]
    return socket.create_server(addr, family=family, backlog=BACKLOG)


async def serve(config: RouterConfig, sock: socket.socket, tokenizer: LocalTokenizer | None = None) -> None:
    from lmcache_p2p.http_listener import BoundedServer, ConnectionLimits
    from lmcache_p2p.router.app import create_app

    app = create_app(config, tokenizer=tokenizer)
    limits = ConnectionLimits(
        config.max_connections,
        config.header_timeout_s,
        config.keep_alive_s,
        BACKLOG,
        max_per_address=config.max_connections_per_address,
    )
    server = BoundedServer(app, sock, limits, "router", log_level="warning", access_log=False, lifespan="on")
    app.state.router.listener_counts = server.counts  # for /router/stats
    host, port = sock.getsockname()[:2]
    logger.info("lmcache_router serving on http://%s:%d", host if ":" not in host else f"[{host}]", port)
    await server.serve()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args, os.environ)
    except FlagError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    tokenizer = None
    if config.tokenizer is not None:
        try:
            tokenizer = LocalTokenizer(config.tokenizer)
        except TokenizerError as e:
            print(f"{PROG}: {e}", file=sys.stderr)
            return 2
    # Logging is set up only once the flags all hold: a refused command leaves its caller's alone.
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s] lmcache_router %(levelname)s: %(message)s")
    if args.log_level != "debug":
        # httpx logs every request at INFO: twice the lines of ours, with none of the numbers.
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)
    if tokenizer is not None:
        logger.info("tokenizing locally with %s", config.tokenizer)
    try:
        sock = bind(args.host, args.port)
    except OSError as e:
        print(f"{PROG}: cannot bind --host {args.host} --port {args.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    try:
        asyncio.run(serve(config, sock, tokenizer))
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
