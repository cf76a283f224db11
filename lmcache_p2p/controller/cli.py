"""``lmcache_controller``: as the seeds start it,

    PYTHONHASHSEED=123 lmcache_controller --host localhost --port 9000 \
        --monitor-ports '{"pull": 8300, "reply": 8400, "heartbeat": 8082}'

(PYTHONHASHSEED is accepted and unnecessary.) Every port is bound before anything else starts,
so a bad flag or a port in use ends the process with one line naming it, not a traceback.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

from lmcache_p2p.controller.settings import ControllerSettings, SettingsError, build_parser, load_settings

logger = logging.getLogger("lmcache_p2p.controller")


# Connections waiting in the kernel for accept: bursts of clients connecting at once wait here
# rather than being refused by the kernel; the cap applies once they are accepted.
HTTP_BACKLOG = 1024


def _bind_http(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    addr = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)[0][4]
    return socket.create_server(addr, family=family, backlog=HTTP_BACKLOG)


async def _serve(settings: ControllerSettings, http_socket: socket.socket, t0: float) -> int:
    from lmcache_p2p.controller.api import create_app
    from lmcache_p2p.controller.service import Controller
    from lmcache_p2p.http_listener import BoundedServer, ConnectionLimits

    controller = Controller(settings)
    try:
        controller.bind()
    except SettingsError as e:
        print(f"lmcache_controller: {e}", file=sys.stderr)
        return 1
    app = create_app(controller)
    limits = ConnectionLimits(
        max_connections=settings.http_max_connections,
        header_timeout_s=settings.http_header_timeout,
        keep_alive_s=settings.http_keep_alive,
        backlog=HTTP_BACKLOG,
        max_per_address=settings.http_max_connections_per_address,
        cap_flag="--http-max-connections",
        per_address_flag="--http-max-connections-per-address",
    )
    server = BoundedServer(
        app, http_socket, limits, "controller", log_level="warning", access_log=False, lifespan="off"
    )
    counts = server.counts
    controller.metrics.read_counter(
        "lmcache_controller_http_connections_refused_total",
        "HTTP connections closed on accept, every open one having sent a request: at_cap (--http-max-connections), "
        "per_address (--http-max-connections-per-address), no_descriptors (EMFILE)",
        lambda: [({"reason": k}, float(v)) for k, v in counts.refused.items()],
    )
    controller.metrics.read_counter(
        "lmcache_controller_http_connections_closed_total",
        "HTTP connections closed before a complete request header: header_timeout, header_too_large, and "
        "evicted_at_cap, evicted_per_address, evicted_no_descriptors (the oldest, to admit a newcomer)",
        lambda: [({"reason": k}, float(v)) for k, v in counts.closed.items()],
    )
    controller.start()
    logger.info(
        "HTTP API on http://%s:%d (WebUI at /, metrics at /metrics), ready in %.0f ms",
        settings.host,
        settings.port,
        (time.perf_counter() - t0) * 1e3,
    )
    try:
        await server.serve()
    finally:
        controller.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    t0 = time.perf_counter()
    args = build_parser().parse_args(argv)
    try:
        settings = load_settings(args)
    except SettingsError as e:
        print(f"lmcache_controller: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="[%(asctime)s] lmcache_controller %(levelname)s: %(message)s"
    )
    try:
        http_socket = _bind_http(settings.host, settings.port)
    except OSError as e:
        why = (
            "the port is already in use (another lmcache_controller running?)"
            if e.errno == errno.EADDRINUSE
            else e.strerror or str(e)
        )
        print(f"lmcache_controller: cannot bind HTTP {settings.host}:{settings.port}: {why}", file=sys.stderr)
        return 1
    run: Callable[[Coroutine[Any, Any, int]], int]
    try:
        import uvloop

        run = uvloop.run
    except ImportError:  # uvloop is an optional speed-up (uvicorn[standard])
        run = asyncio.run
    try:
        return run(_serve(settings, http_socket, t0))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
