"""Controller settings: the seeds' flags, the same keys in a YAML ``--config``, and their checks."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, fields
from typing import Any

import yaml

# Consistent with the worker (DESIGN.md §7): a worker heartbeats every 5 s by default
# (lmcache_worker_heartbeat_time) and is reaped after 30 s of silence, six missed beats.
DEFAULT_HEALTH_CHECK_INTERVAL = 5.0
DEFAULT_WORKER_TIMEOUT = 30.0
DEFAULT_COMMAND_TIMEOUT = 5.0
MONITOR_PORT_KEYS = ("pull", "reply", "heartbeat")
DEFAULT_HEARTBEAT_PORT = 8082  # seed 003 starts the controller without one


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
        for name in ("health_check_interval", "worker_timeout", "command_timeout"):
            if getattr(self, name) <= 0:
                raise SettingsError(f"--{name.replace('_', '-')} {getattr(self, name)}: expected seconds > 0")
        if self.worker_timeout < self.health_check_interval:
            raise SettingsError(
                f"--worker-timeout {self.worker_timeout} is shorter than --health-check-interval "
                f"{self.health_check_interval}"
            )
        if self.log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
            raise SettingsError(f"--log-level {self.log_level!r}: expected debug, info, warning or error")


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
    return p


def load_settings(args: argparse.Namespace) -> ControllerSettings:
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
    settings = ControllerSettings(**values)
    settings.validate()
    return settings


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
        expected = {"port": int, "health_check_interval": float, "worker_timeout": float, "command_timeout": float}.get(
            name
        )
        if expected is not None:
            try:
                value = expected(value)
            except (TypeError, ValueError):
                raise SettingsError(f"--config {path}: {key}={value!r}, expected a number") from None
        out[name] = value
    return out
