"""A test stand-in for one engine rank's worker, speaking the real protocol over real ZMQ sockets
to a real ``lmcache_controller`` process. It does only what a test tells it to, so tests can
create gaps, garbage, silence and restarts on purpose."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import httpx
import zmq

from lmcache_p2p.keys import KEY_FORMAT, KeyIdentity, LayoutFingerprint, MMPlacement, chunk_hashes
from lmcache_p2p.mesh_security import MeshSecurity, client_socket, server_socket
from lmcache_p2p.protocol import (
    PROTOCOL_VERSION,
    CommandDone,
    CommandReply,
    Deregister,
    EngineLoad,
    Heartbeat,
    KeyEvents,
    P2PLookup,
    Register,
    ResyncBatch,
    Traffic,
    command_decoder,
    controller_reply_decoder,
    encode,
    pack_hashes,
)
from lmcache_p2p.testing.ports import free_ports

# The installed console script, as a user runs it.
CONTROLLER_SCRIPT = os.path.join(os.path.dirname(sys.executable), "lmcache_controller")
CPU = "LocalCPUBackend"
DISK = "LocalDiskBackend"
CHUNK = 16


def layout(model: str = "tiny-llama", rank: int = 0, tp: int = 1, key_format: int = KEY_FORMAT) -> LayoutFingerprint:
    return LayoutFingerprint(
        model=model,
        dtype="float16",
        block_size=16,
        block_shape=(2, 16, 2, 8),
        block_stride=(256, 16, 8, 1),
        num_layers=2,
        tp_size=tp,
        tp_rank=rank,
        key_format=key_format,
    )


def register_message(
    instance_id: str = "inst", rank: int = 0, tp: int = 1, model: str = "tiny-llama", **fields
) -> Register:
    """A valid Register of one rank on 127.0.0.1; ``fields`` replace or add any of its fields."""
    return Register(
        **{
            "version": PROTOCOL_VERSION,
            "instance_id": instance_id,
            "rank": rank,
            "host": "127.0.0.1",
            "worker_port": 7000 + rank,
            "layout": layout(model, rank, tp),
            "chunk_size": CHUNK,
            "locations": [CPU],
            **fields,
        }
    )


def wait_for(predicate: Callable[[], object], timeout: float = 10.0, what: str = "condition", interval: float = 0.02):
    """``predicate()``'s first truthy value, asked every ``interval`` s (longer where each ask is
    heavy, e.g. an HTTP request to an engine starting on shared cores)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


# A worker timeout of 3 s makes the controller ask for 0.5 s heartbeats: registrations, totals,
# warm sets and restarts converge fast. The WebUI tests' controllers keep 6 s (one heartbeat a
# second) so that a page poll sees each.
FAST_CONTROLLER = ("--worker-timeout", "3", "--health-check-interval", "0.5")
WEBUI_CONTROLLER = ("--worker-timeout", "6", "--health-check-interval", "0.5")


class ControllerProcess:
    """``lmcache_controller`` as a user starts it, on free loopback ports.

    ``preexec_fn`` runs in the child before the controller starts (e.g. to lower its open-file
    limit). ``read_log``: a thread reads the controller's output as it comes, into ``lines``, so a
    flood of log lines never fills the pipe and stalls it; :meth:`stop` returns them all the same.
    """

    def __init__(
        self,
        *extra: str,
        ports: list[int] | None = None,
        env: dict | None = None,
        argv: list[str] | None = None,
        reads_protected: bool = False,
        preexec_fn: Callable[[], None] | None = None,
        read_log: bool = False,
    ):
        self.preexec_fn = preexec_fn
        self.read_log = read_log
        self.lines: list[str] = []
        self._reader: threading.Thread | None = None
        # With --protect-reads the readiness GET answers 401: up all the same.
        self.ready_statuses = (200, 401) if reads_protected else (200,)
        self.http_port, self.pull, self.reply, self.heartbeat = ports or free_ports(4)
        self.args = argv or [
            CONTROLLER_SCRIPT,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.http_port),
            "--monitor-ports",
            f'{{"pull": {self.pull}, "reply": {self.reply}, "heartbeat": {self.heartbeat}}}',
            *extra,
        ]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.http = httpx.Client(base_url=self.url, timeout=10)

    @property
    def ports(self) -> list[int]:
        return [self.http_port, self.pull, self.reply, self.heartbeat]

    def start(self) -> ControllerProcess:
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env,
            preexec_fn=self.preexec_fn,
        )
        if self.read_log:
            self.lines = []
            self._reader = threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True)
            self._reader.start()
        wait_for(self._up, 15, "controller HTTP")
        self.ready_after = time.monotonic() - self.started_at
        return self

    def _read(self, stdout) -> None:
        for line in stdout:
            self.lines.append(line)

    def _log(self) -> str:
        """The output of the process that has exited."""
        if self._reader is None:
            return self.proc.stdout.read()
        self._reader.join(5)  # to the end of the pipe
        return "".join(self.lines)

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"controller exited {self.proc.returncode}: {self._log()}")
        try:
            return self.http.get("/controller/workers").status_code in self.ready_statuses
        except httpx.TransportError:
            return False

    def stop(self) -> str:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self._log() if self.proc else ""

    def open_fds(self) -> int:
        """How many descriptors the controller's process holds now."""
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def post(self, path: str, body) -> httpx.Response:
        return self.http.post(path, json=body)

    def api(self, path: str, body) -> dict:
        """POST and return the JSON answer, which must be a 200."""
        response = self.post(path, body)
        assert response.status_code == 200, f"{path}: {response.status_code} {response.text}"
        return response.json()

    def holders(self, tokens) -> dict:
        """``/lookup``'s layout_info: {instance: [location, tokens held]}."""
        return self.api("/lookup", {"tokens": list(tokens)})["layout_info"]

    def finish(self, event_id: str, timeout: float = 30.0) -> dict:
        """The command event once it is no longer pending."""

        def done():
            state = self.api("/check_finish", {"event_id": event_id})
            return state if state["status"] != "pending" else None

        return wait_for(done, timeout, f"event {event_id}")

    def metrics(self) -> dict[str, tuple[str, list[tuple[dict[str, str], float]]]]:
        """/metrics as Prometheus' parser reads it: family name -> (type, [(labels, value)]),
        sample names as written (``..._total``)."""
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, tuple[str, list[tuple[dict[str, str], float]]]] = {}
        # no-cache: the counters of what the test just did (a scrape may otherwise get a render
        # from a few milliseconds ago: the controller bounds the loop time /metrics takes)
        text = self.http.get("/metrics", headers={"Cache-Control": "no-cache"}).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out.setdefault(sample.name, (family.type, []))[1].append((sample.labels, sample.value))
        return out

    def metric(self, name: str, **labels: str) -> float:
        """One series' value (0 when it is not exported)."""
        _, series = self.metrics().get(name, ("", []))
        return next((value for have, value in series if have == labels), 0.0)


class FakeWorker:
    """One rank: PUSH to pull, DEALER to reply and heartbeat, ROUTER for commands."""

    def __init__(
        self,
        controller: ControllerProcess,
        instance_id: str,
        rank: int = 0,
        tp: int = 1,
        locations=(CPU,),
        model: str = "tiny-llama",
        answer_commands: bool = True,
        security: MeshSecurity | None = None,  # a member of a mesh with a secret (CurveZMQ)
        p2p: bool = True,  # registers p2p ports (a peer others can pull from)
        serve_url: str | None = None,  # Register.serve_url: where its engine serves OpenAI requests
        key_format: int = KEY_FORMAT,  # 1: an engine from before tenant-safe keys
        adapters: dict[str, str] | None = None,  # Register.adapters: name -> lora_id
        max_warm_peers: int | None = None,
    ):
        self.controller = controller
        self.p2p, self.serve_url = p2p, serve_url
        self.adapters, self.max_warm_peers = adapters, max_warm_peers
        self.security = security
        self.instance_id, self.rank = instance_id, rank
        self.layout = layout(model, rank, tp, key_format)
        self.locations = list(locations)
        self.ctx = zmq.Context()
        self.seq = {loc: 0 for loc in self.locations}
        self.epoch = ""
        self.commands: list = []
        self._request_id = 0
        self.command_reply: Callable[[object], CommandReply] = lambda c: CommandReply(event_id=c.event_id, ok=True)
        self.worker_port = free_ports(1)[0]
        self.router = self.ctx.socket(zmq.ROUTER)
        server_socket(self.router, security, f"{instance_id} commands", 4 * 2**20)
        self.router.bind(f"tcp://127.0.0.1:{self.worker_port}")
        self._connect()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_commands, daemon=True)
        if answer_commands:
            self._thread.start()

    def _connect(self) -> None:
        c = self.controller
        self.push = self.ctx.socket(zmq.PUSH)
        client_socket(self.push, self.security)
        self.push.connect(f"tcp://127.0.0.1:{c.pull}")
        self.req = self.ctx.socket(zmq.DEALER)
        client_socket(self.req, self.security)
        self.req.connect(f"tcp://127.0.0.1:{c.reply}")
        self.hb = self.ctx.socket(zmq.DEALER)
        client_socket(self.hb, self.security)
        self.hb.connect(f"tcp://127.0.0.1:{c.heartbeat}")
        for s in (self.push, self.req, self.hb):
            s.setsockopt(zmq.LINGER, 0)

    def _ask(self, sock, msg, timeout: float = 5.0):
        """Send a request and return the reply with the same request id (stale ones are skipped)."""
        self._request_id += 1
        rid = self._request_id.to_bytes(8, "little")
        sock.send_multipart([rid, encode(msg)])
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000)):
                raise AssertionError(f"no reply to {type(msg).__name__} within {timeout}s")
            got_rid, payload = sock.recv_multipart()
            if got_rid == rid:
                return controller_reply_decoder.decode(payload)

    def _serve_commands(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            identity, request_id, payload = self.router.recv_multipart()
            command = command_decoder.decode(payload)
            self.commands.append(command)
            self.router.send_multipart([identity, request_id, encode(self.command_reply(command))])

    # -- protocol actions --------------------------------------------------------------------------

    def register(self, timeout: float = 5.0):
        message = register_message(
            self.instance_id,
            self.rank,
            layout=self.layout,
            worker_port=self.worker_port,
            locations=self.locations,
            p2p_init_port=9100 + self.rank if self.p2p else None,
            p2p_lookup_port=9200 + self.rank if self.p2p else None,
            transfer_channel="tcp",
            serve_url=self.serve_url,
            adapters=self.adapters,
            max_warm_peers=self.max_warm_peers,
        )
        reply = self._ask(self.req, message, timeout)
        self.epoch = reply.controller_epoch
        return reply

    def heartbeat(
        self,
        traffic: Traffic | None = None,
        event_seqs: dict[str, int] | None = None,
        load: EngineLoad | None = None,
        timeout: float = 5.0,
        adapters: dict[str, str] | None = None,
    ):
        return self._ask(
            self.hb,
            Heartbeat(
                instance_id=self.instance_id,
                rank=self.rank,
                controller_epoch=self.epoch,
                traffic=traffic,
                event_seqs=event_seqs,
                load=load,
                adapters=adapters,
            ),
            timeout,
        )

    def events(self, location: str = CPU, admitted=(), evicted=(), seq: int | None = None) -> int:
        self.seq[location] = seq if seq is not None else self.seq[location] + 1
        self.push.send(
            encode(
                KeyEvents(
                    instance_id=self.instance_id,
                    rank=self.rank,
                    location=location,
                    seq=self.seq[location],
                    admitted=pack_hashes(list(admitted)),
                    evicted=pack_hashes(list(evicted)),
                )
            )
        )
        return self.seq[location]

    def admit_tokens(
        self, tokens, location: str = CPU, identity: KeyIdentity | None = None, mm: tuple[MMPlacement, ...] = ()
    ) -> list[int]:
        """Admit ``tokens``' chunk keys, made as an engine makes them for a request with
        ``identity`` (salt, adapter) and multimodal items ``mm``."""
        hashes = chunk_hashes(tokens, CHUNK, identity=identity, mm=mm)
        self.events(location, admitted=hashes)
        return hashes

    def resync(self, location: str, keys, batch_size: int = 1000):
        keys = list(keys)
        batches = [keys[i : i + batch_size] for i in range(0, len(keys), batch_size)] or [[]]
        reply = None
        for i, batch in enumerate(batches):
            reply = self._ask(
                self.req,
                ResyncBatch(
                    instance_id=self.instance_id,
                    rank=self.rank,
                    location=location,
                    snapshot_seq=self.seq[location],
                    batch=i,
                    last=i == len(batches) - 1,
                    keys=pack_hashes(batch),
                ),
            )
            assert reply.ok, reply.error
        return reply

    def p2p_lookup(self, hashes):
        return self._ask(self.req, P2PLookup(instance_id=self.instance_id, rank=self.rank, hashes=pack_hashes(hashes)))

    def done(self, event_id: str, ok: bool = True, num_tokens: int = 0, error: str | None = None) -> None:
        self.push.send(
            encode(
                CommandDone(
                    event_id=event_id,
                    instance_id=self.instance_id,
                    rank=self.rank,
                    ok=ok,
                    num_tokens=num_tokens,
                    error=error,
                )
            )
        )

    def deregister(self) -> None:
        self.push.send(encode(Deregister(instance_id=self.instance_id, rank=self.rank)))

    def send_raw(self, socket_name: str, payload: bytes) -> None:
        {"pull": self.push, "reply": self.req, "heartbeat": self.hb}[socket_name].send_multipart(
            [payload] if socket_name == "pull" else [b"garbage", payload]
        )

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2)
        if self.security is not None:
            self.security.detach(self.ctx)  # its ZAP thread's sockets would keep destroy() waiting
        self.ctx.destroy(linger=0)


@contextlib.contextmanager
def registered_workers(controller: ControllerProcess, worker_class: type[FakeWorker] = FakeWorker):
    """``make(instance_id, **kw)``: a registered ``worker_class`` rank; all closed on exit."""
    made: list[FakeWorker] = []

    def make(instance_id: str, **kw) -> FakeWorker:
        worker = worker_class(controller, instance_id, **kw)
        assert worker.register().ok
        made.append(worker)
        return worker

    try:
        yield make
    finally:
        for worker in made:
            worker.close()
