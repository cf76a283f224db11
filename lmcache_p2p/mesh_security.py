"""Who may talk to the mesh's ZMQ sockets: CurveZMQ keys derived from one shared mesh secret.

Every member (the controller and each instance's workers) is configured with the same *mesh
secret*, a string of at least :data:`MIN_SECRET_CHARS` characters. From it each derives the same
CurveZMQ keypair (:func:`derive_keys`). A socket that binds is a CURVE server with that keypair;
a socket that connects is a CURVE client that expects the mesh's public key as the server's and
presents the mesh keypair as its own. A ZAP handler (pyzmq's ``zmq.auth``, one per libzmq
context) admits only clients that proved they hold the mesh key. So a process without the secret
cannot complete a handshake with any member, in either direction, and everything on the sockets
is encrypted.

What a refused stranger looks like from here:

* a plain socket, or one with another secret (so another server key), fails the CURVE handshake
  before ZAP is asked; libzmq does not say which address it came from, so these are counted per
  socket (from the socket's monitor events);
* a client that knows the mesh's public key but not its secret key passes the handshake's
  cryptography with its own keypair and is refused by ZAP, which knows its address.

Each is counted (:attr:`MeshSecurity.refused`) and logged at most once per minute per peer
address (or per socket, when the address is unknown), with the count since the last line.

Without a secret, sockets stay plain and each process says once, at WARNING, that the mesh is
unauthenticated (:func:`warn_unauthenticated`).

The secret derives keys, it is not a password: use a random one (``python -c "import secrets;
print(secrets.token_urlsafe(32))"``). The mesh public key never travels in the clear (CurveZMQ
sends the client's long-term key inside an encrypted box), and the derivation is one-way.

Torch-free: the controller imports it.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

logger = logging.getLogger(__name__)

MESH_SECRET_ENV = "LMCACHE_MESH_SECRET"
MIN_SECRET_CHARS = 16
# blake2b's personalisation (16 bytes at most): keys derived for this purpose differ from any
# other digest of the same secret (say, an API token that happens to be the same string).
_KEY_PERSON = b"lmcache-p2p-mesh"
# At most one WARNING per peer address (or per socket) per this many seconds.
REFUSAL_LOG_PERIOD_S = 60.0

# The handshake failures a server socket's monitor reports for strangers: a plain client
# (mechanism mismatch), another secret (the HELLO box does not open), garbage. Not counted: a
# connection closed mid-handshake (EVENT_HANDSHAKE_FAILED_NO_DETAIL: a TCP probe such as the
# controller's check that a command port accepts, a load balancer's health check, a restart),
# and ZAP refusals (EVENT_HANDSHAKE_FAILED_AUTH), which the ZAP handler counts with the address.
_HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
# A client of a server with another secret sees its HELLO go unanswered: the server hangs up
# (NO_DETAIL, EPIPE or ECONNRESET). A server going away mid-handshake looks the same, once.
_CLIENT_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class MeshSecretError(ValueError):
    """A mesh secret (or API token) that cannot be used; the message says why, without the value."""


def normalize_secret(raw: str) -> str:
    """The secret as every member compares it: surrounding whitespace (a file's trailing newline,
    an env value's stray space) is not part of it, on the controller and on workers alike."""
    return raw.strip()


def check_secret(secret: str, what: str = "a mesh secret") -> str:
    """``secret`` normalised; :class:`MeshSecretError` when it is too short to be one."""
    secret = normalize_secret(secret)
    if len(secret) < MIN_SECRET_CHARS:
        raise MeshSecretError(
            f"is {len(secret)} character(s) long; {what} needs at least {MIN_SECRET_CHARS} "
            '(make one with: python -c "import secrets; print(secrets.token_urlsafe(32))")'
        )
    return secret


def read_secret_file(path: str, what: str = "a mesh secret") -> str:
    """The secret held in the file at ``path``, normalised and checked; :class:`MeshSecretError`
    saying what is wrong (missing, unreadable, empty, too short) otherwise."""
    try:
        with open(path, encoding="utf-8") as fh:
            raw = fh.read()
    except FileNotFoundError:
        raise MeshSecretError("file not found") from None
    except IsADirectoryError:
        raise MeshSecretError("is a directory, expected a file holding the secret") from None
    except PermissionError:
        raise MeshSecretError("cannot be read (permission denied)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise MeshSecretError(f"cannot be read ({e})") from None
    if not normalize_secret(raw):
        raise MeshSecretError("is empty")
    return check_secret(raw, what)


@dataclass(frozen=True)
class MeshKeys:
    """The mesh's CurveZMQ keypair, z85-encoded (40 bytes each)."""

    public: bytes
    secret: bytes = field(repr=False)


def derive_keys(secret: str) -> MeshKeys:
    """The keypair every member derives from ``secret``: the secret key is a 32-byte blake2b
    digest of it (personalised for this use), the public key follows from it (Curve25519)."""
    digest = hashlib.blake2b(normalize_secret(secret).encode("utf-8"), digest_size=32, person=_KEY_PERSON).digest()
    secret_key = z85.encode(digest)
    return MeshKeys(public=zmq.curve_public(secret_key), secret=secret_key)


# HKDF's salt for every key derive_key makes (RFC 5869: a fixed, public, per-application value).
_HKDF_SALT = b"lmcache-p2p/mesh-secret/hkdf/v1"


def derive_key(secret: str, label: bytes) -> bytes:
    """A 32-byte key for one use of the mesh secret other than CurveZMQ, named by ``label``
    (e.g. the remote store's value MACs, ``lmcache_server``'s handshake): HKDF-SHA256 (RFC 5869)
    of the normalised secret, ``label`` as its info. Keys for two labels are unrelated, so a key
    leaked from one use (or a protocol bug in it) gives nothing for another."""
    if not label:
        raise ValueError("derive_key needs a label naming the key's use")
    prk = hmac.digest(_HKDF_SALT, normalize_secret(secret).encode("utf-8"), "sha256")  # extract
    return hmac.digest(prk, label + b"\x01", "sha256")  # expand: one block is the 32 bytes asked for


class _RefusalLog:
    """Counts refusals and logs them rate-limited: at most one WARNING per key per period."""

    def __init__(self, period_s: float = REFUSAL_LOG_PERIOD_S):
        self.period_s = period_s
        self.total = 0
        self._lock = threading.Lock()  # the ZAP thread and the sockets' loops both count
        self._by_key: dict[str, int] = {}  # refusals per key, all time
        self._unlogged: dict[str, int] = {}  # since the key's last WARNING
        self._logged_at: dict[str, float] = {}

    def note(self, key: str, line: Callable[[int, int], str]) -> None:
        """Count one refusal under ``key``; ``line(since_last, all_time)`` is the WARNING's text."""
        now = time.monotonic()
        with self._lock:
            self.total += 1
            self._by_key[key] = self._by_key.get(key, 0) + 1
            self._unlogged[key] = self._unlogged.get(key, 0) + 1
            last = self._logged_at.get(key)
            if last is not None and now - last < self.period_s:
                return
            self._logged_at[key] = now
            since, total = self._unlogged.pop(key), self._by_key[key]
        logger.warning(line(since, total))

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._by_key)


# Asked by a context's ZAP handler before anything else about each new connection to one of its
# server sockets: (the socket's ZAP domain, the peer's address) -> why it is refused now (ZAP
# status 400: libzmq closes it), or None to go on to the key check. Called on the ZAP thread, once
# per handshake: it must not block.
ConnectionGate = Callable[[str, str], "str | None"]


class _MeshAuthenticator(ThreadAuthenticator):
    """pyzmq's ZAP handler in a thread, remembering the address of the request it is answering
    (pyzmq hands a curve callback only the domain and the key; the refusal log wants the peer),
    and asking its :data:`ConnectionGate` first when it has one."""

    peer_address = ""
    gate: ConnectionGate | None = None

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # Frames: version, request id, domain, address, identity, mechanism, credentials. The
        # thread answers one request at a time, so the attribute is this request's.
        self.peer_address = msg[3].decode("utf-8", "replace") if len(msg) > 3 else "?"
        gate = self.gate
        if gate is not None and len(msg) >= 6:
            try:
                why = gate(msg[2].decode("utf-8", "replace"), self.peer_address)
            except Exception:  # a failing gate must not take the ZAP thread (every handshake) down
                logger.exception("the connection gate failed; admitting the connection")
                why = None
            if why is not None:
                self._send_zap_reply(msg[1], b"400", why.encode("utf-8", "replace"))
                return
        if len(msg) >= 6:
            # A domain names the socket for the gate; the mesh's key is checked alike on every
            # socket (its curve callback serves the default domain, which pyzmq gives an empty one).
            msg = [msg[0], msg[1], b"", *msg[3:]]
        await super().handle_zap_message(msg)


class _MeshKeyCheck:
    """The curve callback: a client is admitted when its long-term key is the mesh's."""

    def __init__(self, security: MeshSecurity, auth: _MeshAuthenticator):
        self.security = security
        self.auth = auth

    def callback(self, domain: str, client_key: bytes) -> bool:
        if hmac.compare_digest(client_key, self.security.keys.public):
            return True
        address = self.auth.peer_address or "an unknown address"
        try:
            self.security._note_refusal(
                address,
                f"from {address}",
                "ZAP refused its client key, which is not the mesh's (it knows the mesh's public key, not its secret)",
            )
        except Exception:  # counting must never take the ZAP thread down with it
            logger.exception("counting a refused client failed")
        return False


@dataclass
class _Served:
    """One libzmq context's ZAP handler: of a mesh (``security``), or a plain one serving only a
    gate (None: every plain client it lets through is admitted)."""

    security: MeshSecurity | None
    auth: _MeshAuthenticator


def _start_authenticator(key: int) -> _MeshAuthenticator:
    auth = _MeshAuthenticator(zmq.Context.shadow(key), log=logging.getLogger(__name__ + ".zap"))
    auth.start()
    return auth


# One ZAP handler per libzmq context (ZMQ has one ZAP endpoint per context), keyed by the
# context's address, which a shadow context shares with the context it shadows.
_served: dict[int, _Served] = {}
_served_lock = threading.Lock()
# Monitor watchers run as tasks; kept here so they are not collected while they run.
_watchers: set[asyncio.Task] = set()


class MeshSecurity:
    """The mesh's keys and what applies them to sockets.

    * :meth:`attach` starts the ZAP handler for a context and makes these keys the ones every
      :class:`~lmcache_p2p.rpc.RpcServer`/``RpcClient`` built on that context uses when it is not
      handed any (:func:`for_context`): no socket of a secured context comes out plain, whoever
      builds it. :meth:`detach` stops the handler (before the context is destroyed).
    * :meth:`server` makes a socket that binds a CURVE server (and attaches its context);
      :meth:`client` makes a socket that connects a CURVE client of the mesh.

    ``refused`` counts strangers turned away, by peer address (or socket, when the address is
    unknown); ``fingerprint`` names the mesh key in logs without revealing anything."""

    def __init__(self, secret: str):
        self.keys = derive_keys(check_secret(secret))
        self.fingerprint = hashlib.blake2b(self.keys.public, digest_size=4).hexdigest()
        self._refusals = _RefusalLog()

    def __repr__(self) -> str:
        return f"MeshSecurity(key {self.fingerprint})"

    # -- the ZAP handler ----------------------------------------------------------------------------

    def attach(self, ctx: zmq.Context) -> None:
        """Serve ZAP for ``ctx`` (idempotent). A ThreadAuthenticator on a shadow of the context,
        not pyzmq's AsyncioAuthenticator: the handler then runs on its own thread, so handshakes
        are admitted while the owner's loop is busy (a worker's loop serving a pull, the
        controller's loop answering a big lookup), and the same code serves asyncio and plain
        contexts (test clients, the controller under uvloop)."""
        key = ctx.underlying
        with _served_lock:
            served = _served.get(key)
            if served is not None and served.auth.is_alive():
                if served.security is None:  # a plain handler serving a gate: it checks keys from now on
                    served.auth.configure_curve_callback("*", credentials_provider=_MeshKeyCheck(self, served.auth))
                    served.security = self
                elif served.security.keys.public != self.keys.public:
                    theirs = served.security.fingerprint
                    raise ValueError(f"this ZMQ context already serves mesh key {theirs}, not {self.fingerprint}")
                return
            gate = served.auth.gate if served is not None else None
            if served is not None:  # its thread ended: close its sockets, which hold the ZAP endpoint
                served.auth.stop()
            auth = _start_authenticator(key)
            auth.gate = gate
            auth.configure_curve_callback("*", credentials_provider=_MeshKeyCheck(self, auth))
            _served[key] = _Served(self, auth)

    def detach(self, ctx: zmq.Context) -> None:
        """Stop ``ctx``'s ZAP handler. Call it before ``ctx.destroy()``/``term()``: the handler's
        sockets belong to a shadow context, so the owner's destroy() does not close them and
        term() would wait for them for ever."""
        stop_zap(ctx)

    # -- sockets ------------------------------------------------------------------------------------

    def server(self, sock: zmq.Socket, name: str) -> None:
        """Make ``sock`` (before it binds) a CURVE server of the mesh, with ZAP on its context and
        its handshake failures counted (when it is an asyncio socket on a running loop)."""
        self.attach(sock.context)
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        sock.curve_server = True
        _start_watch(sock, name, _HANDSHAKE_FAILED, self._stranger)

    def client(
        self, sock: zmq.Socket, name: str = "", watch: bool = False, on_refused: Callable[[], None] | None = None
    ) -> None:
        """Make ``sock`` (before it connects) a CURVE client of the mesh. With ``watch`` its
        failed handshakes are logged: the server runs with another secret, or none, or refused
        us (:func:`client_socket` says what ``on_refused`` is for)."""
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        sock.curve_serverkey = self.keys.public
        if watch:
            _watch_client(sock, name, secured=True, on_refused=on_refused)

    @property
    def refused(self) -> int:
        """Strangers turned away so far (handshakes failed or refused by ZAP), on every socket."""
        return self._refusals.total

    def refused_by(self) -> dict[str, int]:
        """Refusals per peer address (ZAP's), or per socket name (failed handshakes, whose address
        ZMQ does not report)."""
        return self._refusals.counts()

    def _stranger(self, name: str, endpoint: str, why: str, event: int) -> None:
        self._note_refusal(
            name,
            f"on {name} ({endpoint}; ZMQ does not say from where)",
            f"the CURVE handshake failed ({why}): a peer without the mesh secret, or with another one",
        )

    def _note_refusal(self, key: str, where: str, why: str) -> None:
        """Count one stranger under ``key`` (its address, or the socket when that is unknown)."""
        self._refusals.note(
            key,
            lambda since, total: (
                f"mesh {self.fingerprint}: refused {since} connection(s) {where} in the last "
                f"{REFUSAL_LOG_PERIOD_S:.0f} s or less ({total} in all): {why}. If it belongs to the mesh, "
                f"give it the mesh secret (instances: mesh_secret_file or {MESH_SECRET_ENV}; "
                f"controller: --mesh-secret-file or {MESH_SECRET_ENV})"
            ),
        )


def gate_connections(ctx: zmq.Context, gate: ConnectionGate) -> None:
    """Ask ``gate`` about every new connection to a server socket of ``ctx`` before admitting it
    (a refused one is closed by libzmq at once, freeing its descriptor). Without a mesh attached,
    a plain ZAP handler is started for it, admitting every client the gate lets through; a mesh
    attached later checks keys on the same handler. libzmq asks ZAP about a plain (NULL) client
    only on a socket with a ZAP domain: give each server socket one (``zmq.ZAP_DOMAIN``, before it
    binds), which is also the name the gate is told. Stop it with :func:`stop_zap`."""
    key = ctx.underlying
    with _served_lock:
        served = _served.get(key)
        if served is None or not served.auth.is_alive():
            security = served.security if served is not None else None
            if served is not None:
                served.auth.stop()
            auth = _start_authenticator(key)
            if security is not None:
                auth.configure_curve_callback("*", credentials_provider=_MeshKeyCheck(security, auth))
            served = _served[key] = _Served(security, auth)
        served.auth.gate = gate


def stop_zap(ctx: zmq.Context) -> None:
    """Stop ``ctx``'s ZAP handler (a mesh's or a gate's), if it has one; before ``ctx`` ends."""
    with _served_lock:
        served = _served.pop(ctx.underlying, None)
    if served is not None:
        served.auth.stop()


def for_context(ctx: zmq.Context) -> MeshSecurity | None:
    """The security attached to ``ctx``'s libzmq context, if any (see :meth:`MeshSecurity.attach`)."""
    with _served_lock:
        served = _served.get(ctx.underlying)
    return served.security if served is not None else None


def resolve(ctx: zmq.Context, security: MeshSecurity | None) -> MeshSecurity | None:
    """The security a socket on ``ctx`` gets: the one named, else the context's."""
    return security if security is not None else for_context(ctx)


def server_socket(sock: zmq.Socket, security: MeshSecurity | None, name: str, max_message_bytes: int) -> None:
    """Set up a socket that binds, before it binds: ZMQ drops a connection that sends a frame over
    ``max_message_bytes`` (before anything is allocated for it), and with ``security`` it is a
    CURVE server of the mesh."""
    if max_message_bytes <= 0:
        raise ValueError(f"{name}: max_message_bytes {max_message_bytes}, expected bytes > 0")
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    if security is not None:
        security.server(sock, name)


def client_socket(
    sock: zmq.Socket,
    security: MeshSecurity | None,
    name: str = "",
    watch: bool = False,
    on_refused: Callable[[], None] | None = None,
) -> None:
    """Set up a socket that connects, before it connects: a CURVE client of the mesh with
    ``security``, plain without. With ``watch``, handshakes the server refuses are logged
    (rate-limited): the one place a member with the wrong secret, or none, hears of it. And
    ``on_refused`` is called on the loop each time the server's ZAP handler refuses the socket's
    connection (another mesh's key, or a controller at its descriptor limit): libzmq does not
    connect such a socket again, so its owner may want to open a new one."""
    if security is not None:
        security.client(sock, name, watch=watch, on_refused=on_refused)
    elif watch:
        _watch_client(sock, name, secured=False, on_refused=on_refused)


# -- monitors ---------------------------------------------------------------------------------------

_client_refusals = _RefusalLog()


def _watch_client(sock: zmq.Socket, name: str, secured: bool, on_refused: Callable[[], None] | None = None) -> None:
    def on_event(name: str, endpoint: str, why: str, event: int) -> None:
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            if on_refused is not None:
                on_refused()
            hint = "it refused this process: it is at its connection capacity" + (
                ", or it runs with another mesh secret" if secured else ""
            )
        elif not secured:
            hint = f"it requires a mesh secret and this process has none (set mesh_secret_file or {MESH_SECRET_ENV})"
        elif "mechanism mismatch" in why:
            hint = "it runs without a mesh secret and this process has one: give both the same, or neither"
        else:
            hint = "it runs with another mesh secret than this process: give both the same one"
            if "hung up" in why:
                hint += " (or it went away during the handshake)"
        _client_refusals.note(
            name,
            lambda since, total: (
                f"{name}: {since} handshake(s) with {endpoint} failed in the last {REFUSAL_LOG_PERIOD_S:.0f} s "
                f"or less ({total} in all; {why}): {hint}"
            ),
        )

    # A plain client is told apart by the mechanism mismatch (or a refusal) alone; a hang-up means
    # nothing for it.
    plain_events = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    _start_watch(sock, name, _CLIENT_HANDSHAKE_FAILED if secured else plain_events, on_event)


def _describe(event: int, value: int) -> str:
    """A handshake failure's reason in words: the protocol error ("zmtp mechanism mismatch": a
    plain peer; "zmtp cryptographic": another key) or the ZAP status (400: refused)."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"ZAP status {value}"
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # the value is an errno
        return f"the other side hung up: {os.strerror(value)}" if value else "no detail"
    try:
        name = zmq.Event(value).name
    except ValueError:
        name = None
    return name.lower().removeprefix("protocol_error_").replace("_", " ") if name else f"protocol error {value:#x}"


def _start_watch(sock: zmq.Socket, name: str, events: int, on_event: Callable[[str, str, str, int], None]) -> None:
    """Read ``sock``'s monitor events (``events``) on the running loop until the socket closes.
    Only asyncio sockets on a running loop are watched (every socket of the mesh is one); a
    plain socket's refusals are still refused, only not counted."""
    if not isinstance(sock, zmq.asyncio.Socket):
        return
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        logger.debug("%s: no running loop; its handshake failures are not counted", name)
        return
    monitor = sock.get_monitor_socket(events | zmq.EVENT_MONITOR_STOPPED)
    task = asyncio.ensure_future(_read_monitor(monitor, name, on_event))
    _watchers.add(task)
    task.add_done_callback(_watchers.discard)


async def _read_monitor(monitor: zmq.asyncio.Socket, name: str, on_event: Callable[[str, str, str, int], None]) -> None:
    try:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_MONITOR_STOPPED:  # the socket closed
                return
            endpoint = event["endpoint"].decode("utf-8", "replace")
            try:
                on_event(name, endpoint, _describe(event["event"], event["value"]), event["event"])
            except Exception:
                logger.exception("%s: counting a monitor event failed", name)
    except (asyncio.CancelledError, zmq.ZMQError):  # the context is gone
        return
    finally:
        monitor.close(linger=0)


# -- without a secret -------------------------------------------------------------------------------

_warned_plain = False
_warned_lock = threading.Lock()


def warn_unauthenticated(role: str, how: str) -> None:
    """Say once per process, at WARNING, that its sockets are plain and how to change that."""
    global _warned_plain
    with _warned_lock:
        if _warned_plain:
            return
        _warned_plain = True
    logger.warning(
        "the mesh is unauthenticated: anyone who can reach this %s's ZMQ ports can register workers, "
        "send commands (clear, move, pin) and pull or push KV. Give the controller and every instance the "
        "same mesh secret (%d+ characters): %s",
        role,
        MIN_SECRET_CHARS,
        how,
    )


HOW_TO_SET_WORKER = f"mesh_secret_file: PATH (a file holding it) or the {MESH_SECRET_ENV} environment variable"
HOW_TO_SET_CONTROLLER = (
    f"--mesh-secret-file PATH, mesh_secret_file in --config, or the {MESH_SECRET_ENV} environment variable"
)
