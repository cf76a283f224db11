"""What ``lmcache_router``'s flags set: a plain dataclass, so cli.py checks the flags before it
loads the app (FastAPI, httpx)."""

from __future__ import annotations

from dataclasses import dataclass

from lmcache_p2p.http_body import DEFAULT_MAX_BODY_BYTES


@dataclass(frozen=True)
class RouterConfig:
    """What ``lmcache_router``'s flags set (cli.py validates them)."""

    # e.g. http://127.0.0.1:9000, no trailing slash; several controllers: comma-separated, asked
    # in that order (controllers.py)
    controller_url: str
    policy: str = "kv-aware"
    api_token: str | None = None  # the controller's API token (sent as a bearer token)
    model: str | None = None  # only instances serving this model (passed to /route)
    connect_timeout_s: float = 2.0  # an engine or the controller that does not accept by then is down
    route_timeout_s: float = 2.0  # /route answers in microseconds; past this, route without it
    tokenize_timeout_s: float = 10.0
    request_timeout_s: float = 600.0  # a non-streamed generation answers only at its end
    cooldown_s: float = 10.0  # an unreachable engine goes last in every order for this long
    tokenizer: str | None = None  # a local tokenizer (model dir or hub id); None: the engines' /tokenize
    # A request body over this is a 413 before it is read (the controller's bound, http_body.py).
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # Connection bounds (lmcache_p2p/http_listener.py). Each client connection may hold a stream for
    # minutes, and each costs a second descriptor toward an engine: 2,048 (the listen backlog) is
    # lowered to half the free descriptors at start. Header timeout and keep-alive: as the controller's.
    max_connections: int = 2048
    # One client address may hold at most half of them, so one client (a proxy in front, whose
    # connections all come from one address, keeps room for its bursts) never takes the rest.
    max_connections_per_address: int = 1024
    header_timeout_s: float = 10.0
    keep_alive_s: float = 5.0

    @property
    def controller_urls(self) -> tuple[str, ...]:
        return tuple(self.controller_url.split(","))
