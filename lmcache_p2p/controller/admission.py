"""What a ``Register`` must be before the registry takes it: every field checked, and the host
checked to resolve.

One bad Register used to break ``/lookup`` for everyone (``chunk_size`` 0 made every lookup a
500; ``tp_size`` 0 made lookups of its prompts one until the worker was reaped). Now each field
is checked against the bounds below and a bad one is refused with :class:`RegisterRefused`,
naming the field and the value; the worker gets ``RegisterReply(ok=False, error=...)`` and never
enters the registry. The bounds are generous (far beyond any engine), so they only stop
nonsense: values that break arithmetic, or sizes that would let one sender grow the
controller's memory or the dashboard without limit.

A heartbeat's engine load (``Heartbeat.load``, what POST /route weighs) is checked here too
(:func:`validate_load`): a bad one is dropped with :class:`LoadRefused` naming the field and
value, and the heartbeat still counts for liveness.

Reachability is checked in two steps: a host that is not a hostname or IPv4 address, or that
does not resolve, is refused here; one that resolves but whose command port completes no ZMQ
handshake is found by the orchestration's probe right after registering, removed, and refused
for ``worker_timeout`` (see orchestration.py).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import math
import re
import socket
import time
import urllib.parse
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from lmcache_p2p.controller.errors import ControllerError
from lmcache_p2p.protocol import PROTOCOL_VERSION, EngineLoad, Register
from lmcache_p2p.vocab import TRANSFER_CHANNELS

# -- bounds -----------------------------------------------------------------------------------------

MAX_ID_CHARS = 128  # instance ids are identifiers: they go into event ids, logs and metric labels
MAX_TEXT_CHARS = 256  # sessions
MAX_MODEL_CHARS = 1024  # a model is named by its path when loaded from disk
MAX_ERROR_CHARS = 4096  # channel_error: a reason shown on the dashboard
MAX_TP_SIZE = 1024  # tensor parallelism beyond any host or pod today
MAX_CHUNK_SIZE = 65536  # tokens; a chunk that size of even a small model's KV is gigabytes
MAX_LOCATIONS = 8  # LMCache has two local backends
MAX_WARM_PEERS = 1024  # each is a connection the worker keeps open
MAX_BLOCK_SIZE = 65536  # tokens per KV block (vLLM uses 16..128)
MAX_LAYERS = 4096
MAX_BLOCK_DIMS = 8
MAX_DIM = 2**31 - 1
MAX_STRIDE = 2**62
MAX_URL_CHARS = 2048  # serve_url: shown on the dashboard, handed to routers
# A heartbeat's EngineLoad: far beyond any engine, so only nonsense is refused.
MAX_REQUESTS = 10**6  # running or waiting requests in one engine
MAX_PREFILL_TOKENS_PER_S = 1e9
MAX_PULL_BYTES_PER_S = 100e9  # two 400 Gb/s links, as traffic.py bounds a rank's bytes
MAX_PULL_FIXED_MS = 60_000.0
# A location is named as the controller API names it: LocalCPUBackend, LocalDiskBackend; a
# future backend will look the same. Anything else is refused rather than becoming a holder id.
LOCATION_NAME = re.compile(r"[A-Z][A-Za-z0-9]{0,62}Backend")
# RFC 1123 labels, with "_" allowed (container names); checked again by resolving.
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")
MAX_HOST_CHARS = 253
_SHOWN_CHARS = 80  # of a refused value, in the error and the log


class RegisterRefused(ControllerError):
    """A Register the controller will not take. ``field`` is the Register field at fault (None
    when it is not one field, like capacity) and ``value`` the value refused."""

    def __init__(self, message: str, field: str | None = None, value: Any = None):
        super().__init__(message, field)
        self.value = value


def shown(value: Any) -> str:
    """``repr(value)``, cut to a length a log line can carry (a sender chooses it)."""
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else f"{text[: _SHOWN_CHARS - 3]}... ({len(text)} chars)"


def _refuse(field: str, value: Any, expected: str) -> RegisterRefused:
    return RegisterRefused(f"Register field {field}={shown(value)} refused: expected {expected}", field, value)


def _check_int(field: str, value: int, low: int, high: int, what: str = "") -> None:
    # bool is an int to Python, and msgspec decodes a msgpack bool into an int field as one.
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _refuse(field, value, f"an integer {low}..{high}{what}")


def _check_text(field: str, value: str, max_chars: int, spaces: bool = True) -> None:
    if not isinstance(value, str) or not 0 < len(value) <= max_chars or not value.isprintable():
        raise _refuse(field, value, f"1..{max_chars} printable characters")
    if not spaces and any(c.isspace() for c in value):
        raise _refuse(field, value, "no whitespace")


def _check_port(field: str, value: int | None, optional: bool = False) -> None:
    if value is None and optional:
        return
    _check_int(field, value if value is not None else -1, 1, 65535, " (a TCP port)")


def check_host_syntax(host: str) -> None:
    """A hostname or an IPv4 address the controller can connect to."""
    if not isinstance(host, str) or not 0 < len(host) <= MAX_HOST_CHARS:
        raise _refuse("host", host, f"a hostname or IPv4 address of 1..{MAX_HOST_CHARS} characters")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is not None:
        if ip.version == 6:
            # The command channel (tcp://host:port, ZMQ without IPv6 on) cannot reach one.
            raise _refuse("host", host, "a hostname or an IPv4 address (IPv6 is not supported yet)")
        if ip.is_unspecified or ip.is_multicast:
            raise _refuse("host", host, "an address the controller can connect to, not a wildcard or multicast one")
        return
    labels = host.split(".")
    if not all(_HOST_LABEL.fullmatch(label) for label in labels):
        raise _refuse("host", host, "a hostname (labels of letters, digits, '-' and '_') or an IPv4 address")
    if labels[-1].isdigit():  # 10.0.0.256 or 1.2.3: a mistyped address, not a name
        raise _refuse("host", host, "a valid IPv4 address (this looks like a mistyped one)")


def validate_register(msg: Register) -> None:
    """Raise :class:`RegisterRefused` naming the first field of ``msg`` that is out of bounds."""
    if msg.version != PROTOCOL_VERSION:
        raise RegisterRefused(
            f"Register field version={shown(msg.version)} refused: protocol version {msg.version} not "
            f"supported; this controller speaks {PROTOCOL_VERSION}",
            "version",
            msg.version,
        )
    _check_text("instance_id", msg.instance_id, MAX_ID_CHARS, spaces=False)
    layout = msg.layout
    _check_int("layout.tp_size", layout.tp_size, 1, MAX_TP_SIZE)
    _check_int("rank", msg.rank, 0, layout.tp_size - 1, f" (a rank below layout.tp_size={layout.tp_size})")
    if layout.tp_rank != msg.rank:
        raise _refuse("layout.tp_rank", layout.tp_rank, f"the worker's rank ({msg.rank})")
    _check_int("chunk_size", msg.chunk_size, 1, MAX_CHUNK_SIZE, " tokens")
    check_host_syntax(msg.host)
    _check_port("worker_port", msg.worker_port)
    _check_port("p2p_init_port", msg.p2p_init_port, optional=True)
    _check_port("p2p_lookup_port", msg.p2p_lookup_port, optional=True)
    if (msg.p2p_init_port is None) != (msg.p2p_lookup_port is None):
        missing = "p2p_lookup_port" if msg.p2p_lookup_port is None else "p2p_init_port"
        raise _refuse(missing, None, "both p2p ports or neither (a peer needs both to pull)")
    _check_locations(msg.locations)
    _check_layout(msg)
    for field in ("transfer_channel", "effective_channel"):
        channel = getattr(msg, field)
        if channel is not None and channel not in TRANSFER_CHANNELS:
            raise _refuse(field, channel, f"one of {', '.join(TRANSFER_CHANNELS)}, or none")
    if msg.channel_error is not None and len(msg.channel_error) > MAX_ERROR_CHARS:
        raise _refuse("channel_error", msg.channel_error, f"at most {MAX_ERROR_CHARS} characters")
    if msg.session:
        _check_text("session", msg.session, MAX_TEXT_CHARS, spaces=False)
    if msg.max_warm_peers is not None:
        _check_int("max_warm_peers", msg.max_warm_peers, 0, MAX_WARM_PEERS)
    if msg.serve_url is not None:
        check_serve_url(msg.serve_url)
    if msg.adapters is not None:
        try:
            validate_adapters(msg.adapters, "Register")
        except AdaptersRefused as e:
            raise RegisterRefused(e.message, "adapters", msg.adapters) from None


# -- the adapters an engine served (Register/Heartbeat.adapters) ----------------------------------

MAX_ADAPTERS = 64  # the worker keeps as many (worker/adapters.py)
MAX_ADAPTER_NAME_CHARS = 1024  # an OpenAI model name
_LORA_ID = re.compile(r"[0-9a-f]{32}")


class AdaptersRefused(ControllerError):
    """An adapters map out of bounds: too many, a name not printable text, an id not 32 hex."""


def validate_adapters(adapters: dict[str, str], message: str) -> None:
    """Raise :class:`AdaptersRefused` unless ``adapters`` (name -> lora_id) is in bounds."""
    if not isinstance(adapters, dict) or len(adapters) > MAX_ADAPTERS:
        raise AdaptersRefused(f"{message} field adapters refused: expected at most {MAX_ADAPTERS} adapters", "adapters")
    for name, lora_id in adapters.items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_ADAPTER_NAME_CHARS or not name.isprintable():
            raise AdaptersRefused(
                f"{message} field adapters refused: name {shown(name)} is not 1..{MAX_ADAPTER_NAME_CHARS} printable "
                "characters",
                "adapters",
            )
        if not isinstance(lora_id, str) or not _LORA_ID.fullmatch(lora_id):
            raise AdaptersRefused(
                f"{message} field adapters refused: id {shown(lora_id)} of {shown(name)} is not 32 lowercase hex "
                "characters",
                "adapters",
            )


def check_serve_url(url: str) -> None:
    """An http(s) URL with a host, as a router would forward to: ``http://10.0.0.7:8000``."""
    expected = f"an http:// or https:// URL with a host, at most {MAX_URL_CHARS} printable characters, no spaces"
    if not isinstance(url, str) or not 0 < len(url) <= MAX_URL_CHARS or not url.isprintable() or " " in url:
        raise _refuse("serve_url", url, expected)
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018  (raises ValueError on a port out of range or not a number)
    except ValueError:
        raise _refuse("serve_url", url, expected) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _refuse("serve_url", url, expected)


def _check_locations(locations: list[str]) -> None:
    if not 0 < len(locations) <= MAX_LOCATIONS:
        raise _refuse("locations", locations, f"1..{MAX_LOCATIONS} location names")
    for name in locations:
        if not isinstance(name, str) or not LOCATION_NAME.fullmatch(name):
            raise _refuse("locations", name, "location names like LocalCPUBackend, LocalDiskBackend")
    if len(set(locations)) != len(locations):
        raise _refuse("locations", locations, "each location once")


def _check_layout(msg: Register) -> None:
    layout = msg.layout
    _check_text("layout.model", layout.model, MAX_MODEL_CHARS)
    _check_int("layout.block_size", layout.block_size, 1, MAX_BLOCK_SIZE)
    _check_int("layout.num_layers", layout.num_layers, 1, MAX_LAYERS)
    if not 0 < len(layout.block_shape) <= MAX_BLOCK_DIMS:
        raise _refuse("layout.block_shape", layout.block_shape, f"1..{MAX_BLOCK_DIMS} dimensions")
    for dim in layout.block_shape:
        _check_int("layout.block_shape", dim, 1, MAX_DIM, " per dimension")
    if len(layout.block_stride) != len(layout.block_shape):
        raise _refuse(
            "layout.block_stride", layout.block_stride, f"{len(layout.block_shape)} strides, one per dimension"
        )
    for stride in layout.block_stride:
        _check_int("layout.block_stride", stride, 0, MAX_STRIDE, " per dimension")
    try:
        bytes_per_token = layout.bytes_per_token  # raises on a dtype it does not know
    except ValueError as e:
        raise _refuse("layout.dtype", layout.dtype, str(e).split("; ", 1)[-1]) from None
    if bytes_per_token <= 0:
        raise _refuse("layout.block_shape", layout.block_shape, "a block of at least one byte per token")


# -- a heartbeat's engine load ----------------------------------------------------------------------


class LoadRefused(ControllerError):
    """A heartbeat's ``load`` out of bounds. The heartbeat still counts (liveness is not the load's
    to take away); the load is dropped. ``field`` is the EngineLoad field at fault."""

    def __init__(self, message: str, field: str, value: Any):
        super().__init__(message, field)
        self.value = value


def _refuse_load(field: str, value: Any, expected: str) -> LoadRefused:
    return LoadRefused(
        f"Heartbeat field load.{field}={shown(value)} refused: expected {expected}", f"load.{field}", value
    )


def _check_gauge(field: str, value: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _refuse_load(field, value, "a finite number")
    if not 0 <= value <= high:
        raise _refuse_load(field, value, f"0..{high:g}")


def validate_load(load: EngineLoad) -> None:
    """Raise :class:`LoadRefused` naming the first field of ``load`` that is out of bounds."""
    for field in ("running", "waiting"):
        value = getattr(load, field)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_REQUESTS:
            raise _refuse_load(field, value, f"an integer 0..{MAX_REQUESTS}")
    steps = load.prefill_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps < 2**53:
        raise _refuse_load("prefill_steps", steps, "an integer >= 0")
    _check_gauge("kv_usage", load.kv_usage, 1.0)
    _check_gauge("prefill_tokens_per_s", load.prefill_tokens_per_s, MAX_PREFILL_TOKENS_PER_S)
    _check_gauge("pull_bytes_per_s", load.pull_bytes_per_s, MAX_PULL_BYTES_PER_S)
    _check_gauge("pull_fixed_ms", load.pull_fixed_ms, MAX_PULL_FIXED_MS)


# -- does the host resolve? -----------------------------------------------------------------------


class Resolver(Protocol):
    """Names to IPv4 addresses: :class:`ThreadedResolver` in the controller, another in a test."""

    async def ipv4_addresses(self, host: str) -> list[str]:
        """``host``'s IPv4 addresses; OSError (socket.gaierror) when it has none."""
        ...

    def close(self) -> None: ...


class ThreadedResolver:
    """The system resolver (``getaddrinfo``: /etc/hosts, DNS, nsswitch) on threads of its own.

    Not the loop's default executor: a lookup that never answers holds its thread until the
    resolver library gives up (or forever), and hung lookups there once queued every other
    ``run_in_executor`` behind them, so a legitimate ``localhost`` timed out too (issue 47)."""

    def __init__(self, max_threads: int):
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="lmcache-controller-resolver")

    async def ipv4_addresses(self, host: str) -> list[str]:
        lookup = functools.partial(socket.getaddrinfo, host, None, family=socket.AF_INET, type=socket.SOCK_STREAM)
        found = await asyncio.get_running_loop().run_in_executor(self._pool, lookup)
        return [str(info[4][0]) for info in found]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class HostCheck:
    """Refuses a Register whose host does not resolve to an IPv4 address (the command channel and
    every peer would fail on it). IPv4 literals need no lookup.

    One slow name delays only the registrations that carry it (issue 47: eight Registers whose DNS
    never answered held the reply socket 16 s, and got ``localhost`` refused):

    * each registration waits at most ``timeout_s`` for its host, and the caller (the reply socket,
      now concurrent) goes on meanwhile;
    * registrations of one host share one lookup (ranks of a host register together; a sender
      repeating a hung name must not take a thread each), and at most ``max_lookups`` hosts are
      looked up at once (a new one past that is refused at once, not queued behind hung ones);
    * answers are cached per host (``ttl_s``; a failure ``failed_ttl_s``), and only the resolver's
      own answer: a registration that gave up waiting caches nothing, so it can never refuse
      another host, nor the same host once its lookup does answer.
    """

    def __init__(
        self,
        resolver: Resolver | None = None,
        timeout_s: float = 2.0,
        ttl_s: float = 60.0,
        failed_ttl_s: float = 10.0,
        max_hosts: int = 4096,
        max_lookups: int = 16,
    ):
        self.resolver = resolver if resolver is not None else ThreadedResolver(max_lookups)
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self.failed_ttl_s = failed_ttl_s
        self.max_hosts = max_hosts
        self.max_lookups = max_lookups
        self._cache: OrderedDict[str, tuple[float, str | None]] = OrderedDict()  # host -> (expires, why not)
        self._lookups: dict[str, asyncio.Task[str | None]] = {}  # host -> its lookup in flight

    def close(self) -> None:
        for task in self._lookups.values():
            task.cancel()
        self.resolver.close()

    async def check(self, host: str) -> None:
        try:
            ipaddress.IPv4Address(host)
            return
        except ValueError:
            pass
        cached = self._cache.get(host)
        if cached is not None and cached[0] > time.monotonic():
            why = cached[1]
        else:
            why = await self._wait_for_lookup(host)
        if why is not None:
            raise RegisterRefused(f"Register field host={shown(host)} refused: {why}", "host", host)

    async def _wait_for_lookup(self, host: str) -> str | None:
        lookup = self._lookups.get(host)
        if lookup is None:
            if len(self._lookups) >= self.max_lookups:
                return (
                    f"{len(self._lookups)} other host names are being looked up (at most {self.max_lookups} at "
                    "once); register again shortly, or advertise an IPv4 address"
                )
            lookup = asyncio.ensure_future(self._lookup(host))
            self._lookups[host] = lookup
            lookup.add_done_callback(lambda _: self._lookups.pop(host, None))
        try:
            # shield: this registration giving up must not cancel the lookup others share.
            return await asyncio.wait_for(asyncio.shield(lookup), self.timeout_s)
        except asyncio.TimeoutError:
            return f"it did not resolve within {self.timeout_s:g} s"

    async def _lookup(self, host: str) -> str | None:
        try:
            found = await self.resolver.ipv4_addresses(host)
        except OSError as e:  # socket.gaierror
            why: str | None = f"it does not resolve to an IPv4 address ({e.strerror or e})"
        else:
            why = None if found else "it resolves to no IPv4 address"
        self._cache[host] = (time.monotonic() + (self.failed_ttl_s if why else self.ttl_s), why)
        self._cache.move_to_end(host)
        while len(self._cache) > self.max_hosts:
            self._cache.popitem(last=False)
        return why
