"""Controller settings: the seeds' flags, the same keys in a YAML ``--config``, and their checks.

Two secrets are resolved here (issue 18), each from exactly one place, never from a flag's value
(a command line is visible to every user of the host):

* the mesh secret, which authenticates every ZMQ socket (CurveZMQ, :mod:`lmcache_p2p.mesh_security`):
  ``--mesh-secret-file PATH`` (or ``mesh_secret_file`` in ``--config``), or the environment
  variable ``LMCACHE_MESH_SECRET`` (or ``mesh_secret`` in ``--config``), the same variable
  instances read;
* the HTTP API token: ``--api-token-file PATH`` (``api_token_file``) or ``LMCACHE_API_TOKEN``
  (``api_token``); ``--protect-reads`` makes the read-only routes ask for it too.

A file that is missing, unreadable or empty, a secret shorter than 16 characters, or two sources
for one secret is a :class:`SettingsError` naming the flag, key or variable.

POST /route's weights (:data:`ROUTE_WEIGHTS`, used by routing.py's ``expected_ttft_ms``) are
``--route-*`` flags and the same keys in ``--config``; a value out of range is a SettingsError
naming the flag.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import yaml

from lmcache_p2p import version_line
from lmcache_p2p.mesh_security import MESH_SECRET_ENV, MeshSecretError, check_secret, read_secret_file

# Consistent with the worker (DESIGN.md §7): a worker heartbeats every 5 s by default
# (lmcache_worker_heartbeat_time) and is reaped after 30 s of silence, six missed beats.
DEFAULT_HEALTH_CHECK_INTERVAL = 5.0
DEFAULT_WORKER_TIMEOUT = 30.0
DEFAULT_COMMAND_TIMEOUT = 5.0
MONITOR_PORT_KEYS = ("pull", "reply", "heartbeat")
DEFAULT_HEARTBEAT_PORT = 8082  # seed 003 starts the controller without one
API_TOKEN_ENV = "LMCACHE_API_TOKEN"
# ZMQ_MAXMSGSIZE of each monitor socket: ZMQ drops a connection that sends a bigger frame before
# it allocates anything for it. Each bound is the largest message legitimately sent there, with room:
# * reply: a ResyncBatch of 65,536 keys is 512 KiB (8 bytes a key), a P2PLookup of a 1M-token
#   prompt in 16-token chunks as much, a Register ~1 KiB: 4 MiB is 8x the largest;
# * heartbeat: a Heartbeat is under 1 KiB (traffic totals, a batch number per location);
# * pull: a KeyEvents batch is cut at 4,096 keys (32 KiB), but a burst that outruns the flush
#   loop is coalesced into one batch: 32 MiB holds 4M keys. A bigger one would be dropped with
#   the connection and recovered like any lost batch (the sequence gap asks for a re-sync).
MONITOR_MAX_MESSAGE_BYTES = {"pull": 32 * 2**20, "reply": 4 * 2**20, "heartbeat": 1 * 2**20}
# The HTTP API's connection bounds (lmcache_p2p/http_listener.py). Its clients are a few operators'
# browsers and scripts and the routers, each with a handful of keep-alive connections: 1,024 is
# far past that, and far below the descriptors a controller of many ranks needs for ZMQ. A legitimate
# client sends a request's headers in one packet right after connecting: 10 s is for slow links.
# Keep-alive: uvicorn's default.
DEFAULT_HTTP_MAX_CONNECTIONS = 1024
# One client address may hold at most half of them: a router (or a proxy in front of the API,
# whose connections all come from one address) keeps room for its bursts, and every other client
# still finds the other half (lmcache_p2p/connection_book.py).
DEFAULT_HTTP_MAX_CONNECTIONS_PER_ADDRESS = 512
DEFAULT_HTTP_HEADER_TIMEOUT = 10.0
DEFAULT_HTTP_KEEP_ALIVE = 5.0


# POST /route's weights (routing.py: expected_ttft_ms). Each is a ControllerSettings field, a
# --route-* flag and a --config key: (default, must be > 0 (else >= 0), what it is). The defaults are for
# GPU engines: Llama-3.1-8B-class KV (128 KiB a token) on H100/H200 hosts.
ROUTE_WEIGHTS: dict[str, tuple[float, bool, str]] = {
    # The pull policy's start-up value for cuda (pull_policy.DEFAULT_PREFILL_TOKENS_PER_S): a
    # conservative engine, so that a cache hit is never valued below what it saves.
    "route_prefill_tokens_per_s": (10_000.0, True, "prefill rate, tokens/s, of an engine that reports none"),
    # A cold engine's first prefill steps can run several times slower than the rest (CPU engines
    # here: 1,394 against 7,794 tokens/s on two equal engines' first steps), and an engine the
    # router then avoids measures nothing more. A rate measured over fewer steps than this stands
    # only when no candidate's is measured over more; otherwise their median stands in.
    "route_prefill_min_steps": (5.0, False, "prefill steps an engine's measured rate needs to count"),
    # A nixl peer pull moved 4.7 GB/s here (BENCHMARKS.md); the fixed cost covers a pull's
    # round trips and first-batch latency.
    "route_pull_gbps": (5.0, True, "peer-pull bandwidth, GB/s, of a rank that reports none"),
    "route_pull_fixed_ms": (5.0, False, "fixed cost of a peer pull, ms, of a rank that reports none"),
    # Loading held chunks into the engine: pinned CPU pages over PCIe; disk reads (NVMe) first.
    # GPU-resident tiers cost nothing.
    "route_cpu_load_gbps": (20.0, True, "load rate from a CPU tier into the engine, GB/s"),
    "route_disk_load_gbps": (2.0, True, "load rate from a disk tier into the engine, GB/s"),
    # Queueing: a running request shares every step with ours; a waiting one is served first.
    "route_running_ms": (10.0, False, "expected delay per running request, ms"),
    "route_waiting_ms": (100.0, False, "expected delay per waiting request, ms"),
    # KV nearly full: ours may wait for blocks or cause preemptions. Nothing below the knee, then
    # linear up to route_kv_full_ms at 100% in use.
    "route_kv_full_ms": (1000.0, False, "delay with every KV cache block in use, ms"),
    "route_kv_knee": (0.8, False, "KV usage fraction (below 1) where that delay starts"),
}


class SettingsError(ValueError):
    pass


@dataclass
class ControllerSettings:
    host: str = "localhost"
    port: int = 9000
    monitor_ports: dict[str, int] = field(default_factory=lambda: {"pull": 8300, "reply": 8400, "heartbeat": 8082})
    # ZMQ sockets' bind address; "" binds where the HTTP API does (--host). Workers on other
    # hosts need a routable address here (or 0.0.0.0, which must be asked for).
    monitor_host: str = ""
    health_check_interval: float = DEFAULT_HEALTH_CHECK_INTERVAL
    worker_timeout: float = DEFAULT_WORKER_TIMEOUT
    command_timeout: float = DEFAULT_COMMAND_TIMEOUT
    log_level: str = "info"
    # Security (issue 18). ``mesh_secret`` and ``api_token`` are the resolved values (load_settings
    # reads the files and the environment); the *_file fields only say where they came from.
    # Never in a repr, so never in a log line.
    mesh_secret_file: str | None = None
    mesh_secret: str | None = field(default=None, repr=False)  # None: ZMQ sockets stay plain
    api_token_file: str | None = None
    api_token: str | None = field(default=None, repr=False)  # None: the HTTP API is open
    protect_reads: bool = False  # read-only HTTP routes need the API token too
    # A JSON-lines file keeping the command event log across restarts; None: in memory only.
    events_file: str | None = None
    # HTTP connection bounds (DEFAULT_HTTP_* say why these numbers).
    http_max_connections: int = DEFAULT_HTTP_MAX_CONNECTIONS
    http_max_connections_per_address: int = DEFAULT_HTTP_MAX_CONNECTIONS_PER_ADDRESS
    http_header_timeout: float = DEFAULT_HTTP_HEADER_TIMEOUT
    http_keep_alive: float = DEFAULT_HTTP_KEEP_ALIVE
    # POST /route's weights (ROUTE_WEIGHTS says what each is).
    route_prefill_tokens_per_s: float = ROUTE_WEIGHTS["route_prefill_tokens_per_s"][0]
    route_prefill_min_steps: float = ROUTE_WEIGHTS["route_prefill_min_steps"][0]
    route_pull_gbps: float = ROUTE_WEIGHTS["route_pull_gbps"][0]
    route_pull_fixed_ms: float = ROUTE_WEIGHTS["route_pull_fixed_ms"][0]
    route_cpu_load_gbps: float = ROUTE_WEIGHTS["route_cpu_load_gbps"][0]
    route_disk_load_gbps: float = ROUTE_WEIGHTS["route_disk_load_gbps"][0]
    route_running_ms: float = ROUTE_WEIGHTS["route_running_ms"][0]
    route_waiting_ms: float = ROUTE_WEIGHTS["route_waiting_ms"][0]
    route_kv_full_ms: float = ROUTE_WEIGHTS["route_kv_full_ms"][0]
    route_kv_knee: float = ROUTE_WEIGHTS["route_kv_knee"][0]
    # GET /controller/workers and /controller/dashboard are computed at most once per this many
    # seconds and the same bytes served to every client meanwhile (header X-View-Age-S); 0: off.
    view_cache_s: float = 1.0

    @property
    def heartbeat_interval(self) -> float:
        """What the controller tells workers to use: the worker default (5 s), or faster when
        --worker-timeout is short, so a timeout always spans six beats."""
        return min(5.0, self.worker_timeout / 6)

    def __post_init__(self) -> None:
        self.monitor_host = self.monitor_host or self.host

    def validate(self) -> None:
        if not 0 < self.port < 65536:
            raise SettingsError(f"--port {self.port}: expected 1-65535")
        for key, port in self.monitor_ports.items():
            if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
                raise SettingsError(f"--monitor-ports: {key}={port!r}, expected a port number 1-65535")
        ports = [self.port, *self.monitor_ports.values()]
        if len(set(ports)) != len(ports):
            raise SettingsError(f"--port and --monitor-ports must all differ, got {ports}")
        for name in ("health_check_interval", "worker_timeout", "command_timeout", "http_header_timeout"):
            if getattr(self, name) <= 0:
                raise SettingsError(f"--{name.replace('_', '-')} {getattr(self, name)}: expected seconds > 0")
        if self.http_keep_alive < 1:
            raise SettingsError(f"--http-keep-alive {self.http_keep_alive}: expected seconds >= 1")
        for name in ("http_max_connections", "http_max_connections_per_address"):
            value = getattr(self, name)
            if isinstance(value, bool) or value < 1:
                raise SettingsError(f"--{name.replace('_', '-')} {value!r}: expected a number >= 1")
        if self.worker_timeout < self.health_check_interval:
            raise SettingsError(
                f"--worker-timeout {self.worker_timeout} is shorter than --health-check-interval "
                f"{self.health_check_interval}"
            )
        if self.log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
            raise SettingsError(f"--log-level {self.log_level!r}: expected debug, info, warning or error")
        for name, what in (("mesh_secret", "a mesh secret"), ("api_token", "an API token")):
            value = getattr(self, name)
            if value is None:
                continue
            try:
                setattr(self, name, check_secret(value, what))
            except MeshSecretError as e:
                raise SettingsError(f"{name} {e}") from None
        if not isinstance(self.protect_reads, bool):
            raise SettingsError(f"protect_reads {self.protect_reads!r}: expected true or false")
        for name, (_, positive, what) in ROUTE_WEIGHTS.items():
            value = getattr(self, name)
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise SettingsError(f"{flag} {value!r}: expected a number ({what})")
            if (value <= 0 if positive else value < 0) or (name == "route_kv_knee" and value >= 1):
                bound = "0 <= N < 1" if name == "route_kv_knee" else "N > 0" if positive else "N >= 0"
                raise SettingsError(f"{flag} {value!r}: expected {bound} ({what})")
        if self.protect_reads and self.api_token is None:
            raise SettingsError(
                f"--protect-reads needs an API token: --api-token-file PATH or the {API_TOKEN_ENV} environment variable"
            )


def parse_monitor_ports(raw: Any, source: str = "--monitor-ports") -> dict[str, int]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise SettingsError(
                f"{source}: not valid JSON ({e.msg} at char {e.pos}); expected e.g. "
                '\'{"pull": 8300, "reply": 8400, "heartbeat": 8082}\''
            ) from None
    if not isinstance(raw, dict):
        raise SettingsError(
            f'{source}: expected a JSON object such as {{"pull": 8300, "reply": 8400, "heartbeat": 8082}}'
        )
    unknown = set(raw) - set(MONITOR_PORT_KEYS)
    if unknown:
        raise SettingsError(f"{source}: unknown key(s) {sorted(unknown)}; expected {list(MONITOR_PORT_KEYS)}")
    for key in ("pull", "reply"):
        if key not in raw:
            raise SettingsError(f"{source}: missing key {key!r} (the port workers' {key} URL points at)")
    ports = dict(raw)
    ports.setdefault("heartbeat", DEFAULT_HEARTBEAT_PORT)
    return ports


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lmcache_controller",
        description="lmcache-p2p controller: chunk index, lookup/move/copy/clear/pin API, WebUI at /",
    )
    p.add_argument("--version", action="version", version=version_line("lmcache_controller"))
    p.add_argument("--config", help="YAML file with any of the settings below (flags win)")
    p.add_argument("--host", help="HTTP bind host (default localhost)")
    p.add_argument("--port", type=int, help="HTTP port (default 9000)")
    p.add_argument(
        "--monitor-ports", help='ZMQ ports as JSON, e.g. \'{"pull": 8300, "reply": 8400, "heartbeat": 8082}\''
    )
    p.add_argument("--monitor-host", help="ZMQ bind address (default: the --host value)")
    p.add_argument(
        "--health-check-interval",
        type=float,
        help=f"seconds between liveness sweeps (default {DEFAULT_HEALTH_CHECK_INTERVAL:g})",
    )
    p.add_argument(
        "--worker-timeout", type=float, help=f"reap a worker silent this long (default {DEFAULT_WORKER_TIMEOUT:g})"
    )
    p.add_argument(
        "--command-timeout",
        type=float,
        help=f"seconds a worker has to answer a command (default {DEFAULT_COMMAND_TIMEOUT:g})",
    )
    p.add_argument("--log-level", help="debug, info, warning, error (default info)")
    p.add_argument(
        "--mesh-secret-file",
        metavar="PATH",
        help=f"file holding the mesh secret (16+ characters) that authenticates every ZMQ socket (CurveZMQ); "
        f"or set {MESH_SECRET_ENV}. Instances need the same secret. Without one the ZMQ ports are open to anyone",
    )
    p.add_argument(
        "--api-token-file",
        metavar="PATH",
        help=f"file holding the token (16+ characters) the HTTP API asks for; or set {API_TOKEN_ENV}",
    )
    p.add_argument(
        "--events-file",
        metavar="PATH",
        help="keep the command event log (/check_finish, the WebUI's events) in this JSON-lines file, "
        "so it survives a restart (default: in memory only)",
    )
    p.add_argument(
        "--http-max-connections",
        type=int,
        metavar="N",
        help=f"open HTTP connections at most (default {DEFAULT_HTTP_MAX_CONNECTIONS}, lowered to half the free "
        "file descriptors); a newcomer past it closes the oldest connection that has sent no request, or is "
        "closed at once when every one has; both counted in /metrics",
    )
    p.add_argument(
        "--http-max-connections-per-address",
        type=int,
        metavar="N",
        help=f"open HTTP connections from one client address at most (default "
        f"{DEFAULT_HTTP_MAX_CONNECTIONS_PER_ADDRESS}); past it a newcomer closes that address's oldest connection "
        "that has sent no request, or is closed at once; raise it for a proxy in front of the API",
    )
    p.add_argument(
        "--http-header-timeout",
        type=float,
        metavar="S",
        help=f"close an HTTP connection that sends no complete request header within S seconds of connecting "
        f"or of its last response (default {DEFAULT_HTTP_HEADER_TIMEOUT:g})",
    )
    p.add_argument(
        "--http-keep-alive",
        type=float,
        metavar="S",
        help=f"close an idle keep-alive HTTP connection after S seconds (default {DEFAULT_HTTP_KEEP_ALIVE:g})",
    )
    p.add_argument(
        "--view-cache-s",
        type=float,
        metavar="S",
        help="build GET /controller/workers and /controller/dashboard at most once per S seconds, "
        "serving the same bytes meanwhile (default 1; 0: build per request); GET /metrics is kept to "
        "about a tenth of the loop, and at most this long between renders (0: a render per scrape)",
    )
    for name, (default, _, what) in ROUTE_WEIGHTS.items():
        p.add_argument(
            "--" + name.replace("_", "-"), type=float, metavar="N", help=f"POST /route: {what} (default {default:g})"
        )
    p.add_argument(
        "--protect-reads",
        action="store_true",
        default=None,
        help="read-only HTTP routes (lookups, queries, the dashboard's data) need the API token too",
    )
    return p


def load_settings(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> ControllerSettings:
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    if args.config:
        values.update(_read_yaml(args.config))
    for f in fields(ControllerSettings):
        flag = getattr(args, f.name, None)
        if flag is not None:
            values[f.name] = flag
    if "monitor_ports" in values:
        source = "--monitor-ports" if args.monitor_ports is not None else f"{args.config}: monitor_ports"
        values["monitor_ports"] = parse_monitor_ports(values["monitor_ports"], source)
    for name, variable, what in (
        ("mesh_secret", MESH_SECRET_ENV, "a mesh secret"),
        ("api_token", API_TOKEN_ENV, "an API token"),
    ):
        values[name] = _resolve_secret(values, args, env, name, variable, what)
    settings = ControllerSettings(**values)
    settings.validate()
    return settings


def _resolve_secret(
    values: dict[str, Any], args: argparse.Namespace, env: Mapping[str, str], name: str, variable: str, what: str
) -> str | None:
    """``name``'s value from its one source: a file (``--<name>-file`` or ``<name>_file`` in
    --config), the environment (``variable``) or ``<name>`` in --config; None from none."""
    file_key = f"{name}_file"
    flag = "--" + file_key.replace("_", "-")
    sources: list[tuple[str, str, bool]] = []  # (where, value or path, is a path)
    if values.get(file_key) is not None:
        where = flag if getattr(args, file_key, None) is not None else f"{args.config}: {file_key}"
        sources.append((where, str(values[file_key]), True))
    if values.get(name) is not None:
        sources.append((f"{args.config}: {name}", str(values[name]), False))
    if env.get(variable):
        sources.append((variable, env[variable], False))
    if not sources:
        return None
    if len(sources) > 1:
        raise SettingsError(
            f"{what} is given {len(sources)} times ({', '.join(s[0] for s in sources)}); give it in one place only"
        )
    where, raw, is_path = sources[0]
    try:
        return read_secret_file(raw, what) if is_path else check_secret(raw, what)
    except MeshSecretError as e:
        raise SettingsError(f"{where} {raw} {e}" if is_path else f"{where} {e}") from None


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
    except OSError as e:
        raise SettingsError(f"--config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise SettingsError(f"--config {path}: not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise SettingsError(f"--config {path}: expected a mapping of settings")
    known = {f.name for f in fields(ControllerSettings)}
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise SettingsError(f"--config {path}: unknown setting {key!r}; known: {sorted(known)}")
        expected = {
            "port": int,
            "health_check_interval": float,
            "worker_timeout": float,
            "command_timeout": float,
            "http_max_connections": int,
            "http_max_connections_per_address": int,
            "http_header_timeout": float,
            "http_keep_alive": float,
            **dict.fromkeys(ROUTE_WEIGHTS, float),
        }.get(name)
        if name == "protect_reads" and not isinstance(value, bool):
            raise SettingsError(f"--config {path}: {key}={value!r}, expected true or false")
        if name in ("mesh_secret", "api_token", "mesh_secret_file", "api_token_file", "events_file") and not isinstance(
            value, str
        ):
            raise SettingsError(f"--config {path}: {key}: expected a string")
        if expected is not None:
            try:
                value = expected(value)
            except (TypeError, ValueError):
                raise SettingsError(f"--config {path}: {key}={value!r}, expected a number") from None
        out[name] = value
    return out
