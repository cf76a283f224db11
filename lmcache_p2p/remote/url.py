"""``remote_url`` as the user wrote it, parsed into what a backend needs to connect.

Accepted forms (LMCache's spellings, plus the seed's bare ``remote_server_addr``):

* ``lm://host:port`` — our ``lmcache_server`` (``host:port`` alone means the same);
* ``redis://[user:password@]host:port[/db]`` and ``rediss://...`` (TLS);
* ``redis-sentinel://host:port[,host:port...]/master_name``;
* ``redis-cluster://host:port[,host:port...]``.

A bad URL raises :class:`ValueError` saying which part is wrong; the config layer wraps it in a
``ConfigError`` naming the key and the value.
"""

from __future__ import annotations

import dataclasses
import urllib.parse
from dataclasses import dataclass

SCHEMES = ("lm", "redis", "rediss", "redis-sentinel", "redis-cluster")
DEFAULT_PORTS = {"lm": 65432, "redis": 6379, "rediss": 6379, "redis-sentinel": 26379, "redis-cluster": 6379}


@dataclass(frozen=True)
class RemoteUrl:
    scheme: str  # one of SCHEMES
    hosts: tuple[tuple[str, int], ...]  # one for lm/redis/rediss; seeds for sentinel/cluster
    username: str | None = None
    password: str | None = None
    db: int = 0
    master_name: str | None = None  # redis-sentinel only
    # Not part of the URL: the engine's mesh secret (config mesh_secret_file / mesh_secret), which
    # the tier keys its value MACs from and an lm:// client authenticates with. None: neither.
    mesh_secret: str | None = dataclasses.field(default=None, repr=False, compare=False)

    def with_mesh_secret(self, secret: str | None) -> RemoteUrl:
        """This URL with ``secret`` as the mesh secret its store and tier use (None: none)."""
        return dataclasses.replace(self, mesh_secret=secret)

    @property
    def tls(self) -> bool:
        return self.scheme == "rediss"

    @property
    def host(self) -> str:
        return self.hosts[0][0]

    @property
    def port(self) -> int:
        return self.hosts[0][1]

    def describe(self) -> str:
        """The URL for logs: never the password."""
        auth = f"{self.username or ''}:***@" if self.password else (f"{self.username}@" if self.username else "")
        hosts = ",".join(f"{h}:{p}" for h, p in self.hosts)
        tail = f"/{self.master_name}" if self.master_name else (f"/{self.db}" if self.db else "")
        return f"{self.scheme}://{auth}{hosts}{tail}"


def _host_port(text: str, scheme: str) -> tuple[str, int]:
    text = text.strip()
    if not text:
        raise ValueError("an empty host")
    if text.startswith("["):  # [::1]:6379
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            host, port_text = text, ""
    if not host:
        raise ValueError(f"no host in {text!r}")
    if not port_text:
        return host, DEFAULT_PORTS[scheme]
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"port {port_text!r} in {text!r} is not a number") from None
    if not 0 < port < 65536:
        raise ValueError(f"port {port} in {text!r} is outside 1-65535")
    return host, port


FORMS = (
    "host:port (lmcache_server), lm://host:port, redis://host:port[/db], rediss://host:port[/db], "
    "redis-sentinel://host:port,host:port/master or redis-cluster://host:port,host:port"
)


def _refuse_mistyped_scheme(text: str) -> None:
    """A bare address is ``host:port``; one with a "/" ("redis//h:6379", "redis:/h:6379") or a
    scheme's name before a host:port ("redis:h:6379") is a URL whose "://" was mistyped, and
    read as an lm:// address it would name a server that never answers. ("redis:6379", a host
    named redis, stays an address.)"""
    head, colon, rest = text.partition(":")
    if "/" not in text and not (colon and head.lower() in SCHEMES and ":" in rest):
        return
    # The value, but never a password: whatever precedes an "@" is masked.
    shown = text
    if "@" in text:
        start = text.find("//") + 2 if "//" in text else 0
        shown = f"{text[:start]}***@{text.rpartition('@')[2]}"
    raise ValueError(f"{shown!r} looks like a URL with its :// mistyped; expected {FORMS}")


def parse_remote_url(text: str) -> RemoteUrl:
    """``text`` parsed; :class:`ValueError` naming the wrong part otherwise."""
    text = text.strip()
    if "://" not in text:  # the seed's remote_server_addr: "localhost:65432"
        _refuse_mistyped_scheme(text)
        return RemoteUrl("lm", (_host_port(text, "lm"),))
    scheme, _, rest = text.partition("://")
    scheme = scheme.lower()
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; expected one of {', '.join(s + '://' for s in SCHEMES)}")
    # The user part goes first, up to the last "@": a password may hold "/" (base64 does), and
    # splitting the path off first would put part of it in an error message.
    userinfo, at, after_user = rest.rpartition("@")
    if not at:
        userinfo, after_user = "", rest
    hostlist, _, path = after_user.partition("/")
    if "?" in path or "?" in hostlist:
        raise ValueError("query parameters are not supported; put options in the instance config")
    username = password = None
    if userinfo:
        if scheme == "lm":
            raise ValueError("lm:// takes no user or password")
        user, colon, pw = userinfo.partition(":")
        username = urllib.parse.unquote(user) or None
        password = urllib.parse.unquote(pw) if colon else None
    hosts = tuple(_host_port(h, scheme) for h in hostlist.split(","))
    path = path.strip("/")
    if scheme in ("lm", "redis", "rediss"):
        if len(hosts) != 1:
            raise ValueError(f"{scheme}:// takes one host:port (got {len(hosts)}); use redis-cluster:// for several")
        db = 0
        if path:
            if scheme == "lm":
                raise ValueError(f"lm:// takes no path (got /{path})")
            try:
                db = int(path)
            except ValueError:
                raise ValueError(f"database {path!r} is not a number (redis://host:port/0)") from None
            if db < 0:
                raise ValueError(f"database {db} is negative")
        return RemoteUrl(scheme, hosts, username, password, db)
    if scheme == "redis-sentinel":
        if not path:
            raise ValueError("redis-sentinel:// needs the master's name: redis-sentinel://host:port,host:port/mymaster")
        return RemoteUrl(scheme, hosts, username, password, master_name=path)
    if path:
        raise ValueError(f"redis-cluster:// takes no path or database (got /{path}): a cluster has only db 0")
    return RemoteUrl(scheme, hosts, username, password)
