"""Real Redis servers for tests: Debian's ``redis-server`` on free loopback ports, in a temp dir.

* :class:`RedisServer` — one standalone server (optionally with ``--requirepass``);
* :class:`RedisCluster` — three masters, no replicas, joined by ``redis-cli --cluster create``;
* :class:`RedisSentinel` — a master plus one ``redis-server --sentinel`` watching it.

Each is a context manager, and :func:`redis_server`, :func:`redis_cluster` and
:func:`redis_sentinel` are fixtures over them (import them into a test module to use them).
Every process can be killed (SIGKILL), paused (SIGSTOP: a server that hangs) and restarted on
the same port, for reconnect tests. Nothing here ever talks to a system Redis on 6379.

``make test`` installs the Debian package; without ``redis-server`` on PATH the tests that
need one fail (not skip), so a missing package never passes silently.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import redis

from lmcache_p2p.testing.ports import free_ports
from lmcache_p2p.testing.processes import freeze

START_TIMEOUT_S = 15.0
# Peers flag a silent node as failing after this long, and a restarted master waits about as long
# (Redis clamps it to 0.5-5 s; a fresh start also waits a fixed 2 s) before it says ok again. Short
# keeps the restart tests quick.
CLUSTER_NODE_TIMEOUT_MS = 1000


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"{name} is not on PATH: run `make test`, which installs Debian's redis-server package "
            "(apt-get install -y redis-server; it brings redis-cli too)",
            pytrace=False,
        )
    return path


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class _Process:
    """One redis-server process on a fixed port; start/kill/restart keep the port and the dir."""

    def __init__(
        self,
        name: str,
        args: list[str],
        port: int,
        workdir: Path,
        password: str | None = None,
        client_kw: dict | None = None,
    ) -> None:
        self.name = name
        self.client_kw = client_kw or {}
        self.args = args
        self.port = port
        self.workdir = workdir
        self.password = password
        self.log_path = workdir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, f"{self.name} is already running"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [_binary("redis-server"), *self.args],
                cwd=self.workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # Its own process group, so a Ctrl-C of pytest does not race our own shutdown.
                start_new_session=True,
            )
        self._wait_ready()

    def client(self, **kw) -> redis.Redis:
        kw = {**self.client_kw, **kw}
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5, **kw)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        last: Exception | None = None
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{_tail(self.log_path)}")
            try:
                with self.client(socket_connect_timeout=1) as c:
                    c.ping()
                return
            except redis.RedisError as err:
                last = err
                time.sleep(0.02)
        raise RuntimeError(f"{self.name} did not answer PING on port {self.port} ({last}):\n{_tail(self.log_path)}")

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: the server vanishes, the kernel refuses the port until a restart."""
        if self.running:
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: connections are accepted by the kernel but nothing answers."""
        assert self.proc is not None and self.running
        freeze(self.proc.pid)

    def resume(self) -> None:
        assert self.proc is not None and self.running
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGCONT)  # a paused server cannot act on SIGTERM
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self) -> None:
        self.stop()
        self.start()


def _common_args(port: int, workdir: Path) -> list[str]:
    return [
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--dir",
        str(workdir),
        "--save",
        "",
        "--appendonly",
        "no",
        "--daemonize",
        "no",
    ]


def _make_certs(workdir: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate it signed, valid for IP 127.0.0.1: (ca.crt, server.crt, server.key)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail("openssl is not on PATH (Debian's openssl package): the TLS tests make their certificates with it")
    tls = workdir / "tls"
    tls.mkdir(exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    (tls / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    steps = [
        ["req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=lmcache-p2p test CA"],
        ["req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial"]
        + ["-out", "server.crt", "-days", "2", "-extfile", "san.ext"],
    ]
    for step in steps:
        done = subprocess.run([openssl, *step], cwd=tls, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"openssl {' '.join(step)} failed:\n{done.stderr}")
    return tls / "ca.crt", tls / "server.crt", tls / "server.key"


class _Workdir:
    """A temp dir of our own unless the caller gives one (then it is left in place)."""

    def __init__(self, workdir: str | Path | None, prefix: str) -> None:
        self._owned = workdir is None
        self.path = Path(tempfile.mkdtemp(prefix=prefix)) if workdir is None else Path(workdir)
        self.path.mkdir(parents=True, exist_ok=True)

    def cleanup(self) -> None:
        if self._owned:
            shutil.rmtree(self.path, ignore_errors=True)


_S = TypeVar("_S", bound="_Started")


class _Started:
    """``with``: started on entry (closed again if the start fails), closed on exit."""

    def start(self: _S) -> _S:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _S) -> _S:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


class RedisServer(_Started):
    """A standalone redis-server on 127.0.0.1 (``with RedisServer() as s: s.url``)."""

    def __init__(self, workdir: str | Path | None = None, password: str | None = None, tls: bool = False) -> None:
        """``tls``: TLS only (no plain port), with a throwaway CA in the work dir (:attr:`ca_file`)
        and a server certificate for IP 127.0.0.1."""
        self._dir = _Workdir(workdir, "redis-")
        self.host = "127.0.0.1"
        self.port = free_ports(1)[0]
        self.password = password
        self.tls = tls
        self.ca_file: Path | None = None
        args = _common_args(self.port, self._dir.path)
        if password is not None:
            args += ["--requirepass", password]
        client_kw: dict = {}
        if tls:
            self.ca_file, cert, key = _make_certs(self._dir.path)
            # The port given as --port becomes the TLS port; no plain-text port at all.
            args[args.index("--port")] = "--tls-port"
            args += ["--port", "0", "--tls-cert-file", str(cert), "--tls-key-file", str(key)]
            args += ["--tls-ca-cert-file", str(self.ca_file), "--tls-auth-clients", "no"]
            client_kw = {"ssl": True, "ssl_ca_certs": str(self.ca_file)}
        self.process = _Process(f"redis-{self.port}", args, self.port, self._dir.path, password, client_kw)

    def url(self, db: int = 0, password: str | None = None, scheme: str | None = None) -> str:
        """``redis[s]://[:password@]127.0.0.1:port[/db]``; the server's own password unless given."""
        pw = self.password if password is None else password
        auth = f":{pw}@" if pw else ""
        scheme = scheme or ("rediss" if self.tls else "redis")
        return f"{scheme}://{auth}{self.host}:{self.port}" + (f"/{db}" if db else "")

    def client(self, db: int = 0) -> redis.Redis:
        return self.process.client(db=db)

    def start(self) -> RedisServer:
        self.process.start()
        return self

    def stop(self) -> None:
        self.process.stop()

    def kill(self) -> None:
        self.process.kill()

    def pause(self) -> None:
        self.process.pause()

    def resume(self) -> None:
        self.process.resume()

    def restart(self) -> None:
        """The same port again, empty (no persistence)."""
        self.process.kill()
        self.process.start()

    def close(self) -> None:
        self.process.stop()
        self._dir.cleanup()


def _cluster_info(client: redis.Redis) -> dict[str, str]:
    # redis-py parses CLUSTER INFO's "field:value" lines into a dict of strings.
    return dict(client.execute_command("CLUSTER INFO"))


class RedisCluster(_Started):
    """Three cluster-enabled masters on 127.0.0.1, all 16384 slots assigned, no replicas."""

    def __init__(self, workdir: str | Path | None = None, masters: int = 3) -> None:
        self._dir = _Workdir(workdir, "redis-cluster-")
        self.host = "127.0.0.1"
        ports = free_ports(2 * masters)
        self.ports = ports[:masters]
        self.nodes: list[_Process] = []
        for port, bus_port in zip(ports[:masters], ports[masters:], strict=True):
            node_dir = self._dir.path / str(port)
            node_dir.mkdir()
            args = _common_args(port, node_dir) + [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(node_dir / "nodes.conf"),
                # The bus port defaults to port+10000, which nobody checked was free.
                "--cluster-port",
                str(bus_port),
                "--cluster-node-timeout",
                str(CLUSTER_NODE_TIMEOUT_MS),
            ]
            self.nodes.append(_Process(f"cluster-{port}", args, port, node_dir))

    @property
    def url(self) -> str:
        return "redis-cluster://" + ",".join(f"{self.host}:{p}" for p in self.ports)

    def node_client(self, index: int) -> redis.Redis:
        """A plain client on one node (CLUSTER KEYSLOT, DBSIZE, CLUSTER INFO)."""
        return self.nodes[index].client()

    def start(self) -> RedisCluster:
        for node in self.nodes:
            node.start()
        if not self._slots_assigned():
            created = subprocess.run(
                [
                    _binary("redis-cli"),
                    "--cluster",
                    "create",
                    *(f"{self.host}:{p}" for p in self.ports),
                    "--cluster-replicas",
                    "0",
                    "--cluster-yes",
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            if created.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed:\n{created.stdout}\n{created.stderr}")
        self.wait_ok()
        return self

    def _slots_assigned(self) -> bool:
        # A node restarted from its nodes.conf still owns its slots; creating again would fail.
        with self.node_client(0) as c:
            return str(_cluster_info(c).get("cluster_slots_assigned")) == "16384"

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every node says cluster_state:ok (gossip settled, every slot served)."""
        deadline = time.monotonic() + timeout_s
        states: list[str] = []
        while time.monotonic() < deadline:
            states = []
            for node in self.nodes:
                try:
                    with node.client(socket_connect_timeout=1) as c:
                        state = str(_cluster_info(c).get("cluster_state"))
                except redis.RedisError as err:
                    state = f"error {err}"
                states.append(state)
            if all(s == "ok" for s in states):
                return
            time.sleep(0.05)
        logs = "\n".join(f"--- {n.name}\n{_tail(n.log_path, 8)}" for n in self.nodes)
        raise RuntimeError(f"cluster not ok after {timeout_s}s: {states}\n{logs}")

    def kill(self, index: int | None = None) -> None:
        """SIGKILL one node, or all of them."""
        for node in self.nodes if index is None else [self.nodes[index]]:
            node.kill()

    def restart(self, index: int | None = None) -> None:
        """Start the killed node(s) again on the same ports; they rejoin from nodes.conf, empty."""
        for node in self.nodes if index is None else [self.nodes[index]]:
            node.kill()
            node.start()
        self.wait_ok()

    def pause(self, index: int) -> None:
        self.nodes[index].pause()

    def resume(self, index: int) -> None:
        self.nodes[index].resume()

    def close(self) -> None:
        for node in self.nodes:
            node.stop()
        self._dir.cleanup()


class RedisSentinel(_Started):
    """A master and one sentinel monitoring it as ``master_name`` (quorum 1)."""

    def __init__(self, workdir: str | Path | None = None, master_name: str = "mymaster") -> None:
        self._dir = _Workdir(workdir, "redis-sentinel-")
        self.master_name = master_name
        self.master = RedisServer(self._dir.path / "master")
        self.host = "127.0.0.1"
        self.port = free_ports(1)[0]
        sentinel_dir = self._dir.path / "sentinel"
        sentinel_dir.mkdir()
        # A sentinel rewrites its config file as it learns, so it gets one of its own.
        conf = sentinel_dir / "sentinel.conf"
        conf.write_text(
            f"port {self.port}\n"
            "bind 127.0.0.1\n"
            f"dir {sentinel_dir}\n"
            f"sentinel monitor {master_name} 127.0.0.1 {self.master.port} 1\n"
            f"sentinel down-after-milliseconds {master_name} 5000\n"
        )
        self.sentinel = _Process(f"sentinel-{self.port}", [str(conf), "--sentinel"], self.port, sentinel_dir)

    @property
    def url(self) -> str:
        return f"redis-sentinel://{self.host}:{self.port}/{self.master_name}"

    def start(self) -> RedisSentinel:
        self.master.start()
        self.sentinel.start()
        self._wait_master_known()
        return self

    def _wait_master_known(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        state = None
        while time.monotonic() < deadline:
            with self.sentinel.client() as c:
                state = c.sentinel_masters().get(self.master_name)
            if state and state["is_master"] and not (state["is_sdown"] or state["is_odown"]):
                return
            time.sleep(0.05)
        raise RuntimeError(f"sentinel does not see {self.master_name} as an up master: {state}")

    def close(self) -> None:
        self.sentinel.stop()
        self.master.close()
        self._dir.cleanup()


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path / "redis") as server:
        yield server


@pytest.fixture
def redis_cluster(tmp_path) -> Iterator[RedisCluster]:
    with RedisCluster(tmp_path / "redis-cluster") as cluster:
        yield cluster


@pytest.fixture
def redis_sentinel(tmp_path) -> Iterator[RedisSentinel]:
    with RedisSentinel(tmp_path / "redis-sentinel") as sentinel:
        yield sentinel
