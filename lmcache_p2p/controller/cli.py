"""``lmcache_controller``: as the seeds start it,

    PYTHONHASHSEED=123 lmcache_controller --host localhost --port 9000 \
        --monitor-ports '{"pull": 8300, "reply": 8400, "heartbeat": 8082}'

(PYTHONHASHSEED is accepted and unnecessary.) Every port is bound before anything else starts,
so a bad flag or a port in use ends the process with one line naming it, not a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

from lmcache_p2p.controller.settings import ControllerSettings, SettingsError, build_parser, load_settings

logger = logging.getLogger("lmcache_p2p.controller")


def _bind_http(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    addr = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)[0][4]
    return socket.create_server(addr, family=family, backlog=1024)


async def _serve(settings: ControllerSettings, http_socket: socket.socket, t0: float) -> int:
    import uvicorn

    from lmcache_p2p.controller.api import create_app
    from lmcache_p2p.controller.service import Controller

    controller = Controller(settings)
    try:
        controller.bind()
    except SettingsError as e:
        print(f"lmcache_controller: {e}", file=sys.stderr)
        return 1
    app = create_app(controller)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
    controller.start()
    logger.info(
        "HTTP API on http://%s:%d (WebUI at /, metrics at /metrics), ready in %.0f ms",
        settings.host,
        settings.port,
        (time.perf_counter() - t0) * 1e3,
    )
    try:
        await server.serve(sockets=[http_socket])
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
        print(
            f"lmcache_controller: cannot bind HTTP {settings.host}:{settings.port}: {e.strerror or e}", file=sys.stderr
        )
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
