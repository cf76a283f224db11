"""The remote tier's stores for tests: ``lmcache_server`` as users start it (its console script);
Redis and Redis Cluster are in :mod:`redis_servers`. :func:`store_url` is any of them's URL."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from protocol_client import wait_for

from lmcache_p2p.remote.lm_store import LmServerStore
from lmcache_p2p.remote.url import parse_remote_url
from lmcache_p2p.testing.ports import free_ports

SCRIPT = str(Path(sys.executable).with_name("lmcache_server"))


class LmServer:
    """``lmcache_server HOST PORT`` as users start it (the console script), on loopback, its log
    in a file (a pipe nobody reads would stall the server once full). ``argv`` replaces the whole
    command (bad-argument tests); ``extra`` arguments follow the defaults. With ``mesh_secret`` it
    is started with ``--mesh-secret-file`` (a file beside its log) and :meth:`client` authenticates."""

    def __init__(
        self,
        *extra: str,
        port: int | None = None,
        max_size_gb: float | None = 0.5,
        argv: list[str] | None = None,
        log_dir: Path | None = None,
        mesh_secret: str | None = None,
    ):
        self.port = port or free_ports(1)[0]
        self.max_size_gb = max_size_gb
        self.mesh_secret = mesh_secret
        size = ["--max-size-gb", str(max_size_gb)] if max_size_gb is not None else []
        self.log_path = Path(log_dir or tempfile.gettempdir()) / f"lmcache_server-{self.port}-{time.monotonic_ns()}.log"
        secret: list[str] = []
        if mesh_secret is not None:
            secret_file = self.log_path.with_suffix(".secret")
            secret_file.write_text(mesh_secret + "\n")
            secret = ["--mesh-secret-file", str(secret_file)]
        self.argv = argv or [SCRIPT, "127.0.0.1", str(self.port), "--log-level", "debug", *size, *secret, *extra]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"lm://127.0.0.1:{self.port}"

    def client(self, timeout_s: float = 5.0, mesh_secret: str | None = None) -> LmServerStore:
        """A client with the server's own secret unless ``mesh_secret`` names another ("" for none)."""
        secret = self.mesh_secret if mesh_secret is None else (mesh_secret or None)
        return LmServerStore(parse_remote_url(self.url), timeout_s, mesh_secret=secret)

    def start(self, wait: bool = True) -> LmServer:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        if wait:
            wait_for(lambda: "listening on" in self.log() or self.proc.poll() is not None, what="lmcache_server")
            assert self.proc.poll() is None, self.log()
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        """SIGTERM (a stopped server is continued first); its exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
        return self.proc.wait(10)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> LmServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()


def restarted(server: LmServer) -> LmServer:
    """A fresh (empty) server on ``server``'s port."""
    return LmServer(port=server.port, max_size_gb=server.max_size_gb, mesh_secret=server.mesh_secret).start()


def store_url(store) -> str:
    """The remote_url of an LmServer, a RedisServer (whose url is a method) or a RedisCluster."""
    return store.url() if callable(store.url) else store.url


def raw_frame(frame: bytes, port: int) -> tuple[bytes, bool]:
    """Send ``frame`` to an ``lmcache_server`` on a fresh plain connection; (what came back,
    whether the server then closed it)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(frame)
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except TimeoutError:
            return data, False
        except ConnectionResetError:
            pass
        return data, True
