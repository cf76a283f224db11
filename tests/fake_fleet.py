"""Many fake worker ranks in one process, for scale tests and ``benchmarks/bench_controller_scale.py``.

Every rank gets a command port of its own, all bound by one ROUTER (one socket, one listening
descriptor per port) that answers every command with ``ok``; registrations and heartbeats go out
on one DEALER each, pipelined, so ten thousand ranks cost the controller ten thousand command
ports to reach but only a few connections in. Ranks are grouped into instances of ``tp`` ranks.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable

import zmq
from protocol_client import CPU, ControllerProcess, layout

from lmcache_p2p.protocol import (
    PROTOCOL_VERSION,
    CommandReply,
    Heartbeat,
    HeartbeatReply,
    Register,
    RegisterReply,
    command_decoder,
    controller_reply_decoder,
    encode,
)

WINDOW = 256  # requests in flight on a DEALER: the controller answers in order, one at a time


class FakeFleet:
    def __init__(self, controller: ControllerProcess, ranks: int, tp: int = 1, prefix: str = "fleet"):
        self.controller = controller
        self.tp = tp
        self.ctx = zmq.Context()
        self.ctx.set(zmq.MAX_SOCKETS, ranks + 256)  # register_each_connected opens one per rank
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.ranks: list[tuple[str, int]] = [(f"{prefix}-{n // tp}", n % tp) for n in range(ranks)]
        self.ports: list[int] = []
        for _ in range(ranks):
            self.router.bind("tcp://127.0.0.1:*")
            self.ports.append(int(self.router.last_endpoint.rsplit(b":", 1)[1]))
        self.commands: Counter[str] = Counter()
        self.command_reply: Callable[[object], CommandReply] = lambda c: CommandReply(
            event_id=c.event_id, ok=True, num_tokens=0
        )
        self.epoch = ""
        self.heartbeat_interval = 5.0
        self.heartbeat_port = 0
        self.heartbeats_sent = 0
        self.heartbeats_unknown = 0
        self._own: list[zmq.Socket] = []  # register_each_connected's connections
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._serve_commands, daemon=True)]
        self._threads[0].start()

    # -- commands --------------------------------------------------------------------------------

    def _serve_commands(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            identity, request_id, payload = self.router.recv_multipart()
            command = command_decoder.decode(payload)
            self.commands[type(command).__name__] += 1
            self.router.send_multipart([identity, request_id, encode(self.command_reply(command))])

    # -- registration ----------------------------------------------------------------------------

    def register_message(self, n: int) -> Register:
        instance_id, rank = self.ranks[n]
        return Register(
            version=PROTOCOL_VERSION,
            instance_id=instance_id,
            rank=rank,
            host="127.0.0.1",
            worker_port=self.ports[n],
            layout=layout("fleet-model", rank, self.tp),
            chunk_size=256,
            locations=[CPU],
            session=f"{instance_id}-r{rank}",
        )

    def register_all(self, ranks: list[int] | None = None, timeout: float = 600.0) -> dict[int, RegisterReply]:
        """Register ``ranks`` (default: every rank), ``WINDOW`` at a time; the replies by rank index."""
        chosen = list(range(len(self.ranks))) if ranks is None else ranks
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{self.controller.reply}")
        replies: dict[int, RegisterReply] = {}
        deadline = time.monotonic() + timeout
        sent = 0
        try:
            while len(replies) < len(chosen):
                while sent < len(chosen) and sent - len(replies) < WINDOW:
                    n = chosen[sent]
                    sock.send_multipart([n.to_bytes(8, "little"), encode(self.register_message(n))])
                    sent += 1
                if not sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                    raise AssertionError(f"controller answered {len(replies)} of {len(chosen)} Registers")
                request_id, payload = sock.recv_multipart()
                reply = controller_reply_decoder.decode(payload)
                assert isinstance(reply, RegisterReply), reply
                replies[int.from_bytes(request_id, "little")] = reply
        finally:
            sock.close(0)
        ok = [r for r in replies.values() if r.ok]
        if ok:
            self.epoch = ok[0].controller_epoch
            self.heartbeat_interval = ok[0].heartbeat_interval
            self.heartbeat_port = ok[0].heartbeat_port
        return replies

    def register_each_connected(self, ranks: list[int] | None = None) -> dict[int, RegisterReply]:
        """Register ``ranks`` one at a time, each over a connection of its own that stays open, as
        real ranks hold theirs: the controller then spends a descriptor per rank, as it would. A
        refused rank closes its connection (a real one would keep it and retry)."""
        chosen = list(range(len(self.ranks))) if ranks is None else ranks
        replies: dict[int, RegisterReply] = {}
        for n in chosen:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{self.controller.reply}")
            sock.send_multipart([n.to_bytes(8, "little"), encode(self.register_message(n))])
            if not sock.poll(10_000):
                raise AssertionError(f"no answer to rank {n}'s Register")
            reply = controller_reply_decoder.decode(sock.recv_multipart()[1])
            assert isinstance(reply, RegisterReply), reply
            replies[n] = reply
            if reply.ok:
                self._own.append(sock)
            else:
                sock.close(0)
        return replies

    # -- heartbeats ------------------------------------------------------------------------------

    def start_heartbeats(self, ranks: list[int] | None = None) -> None:
        """Heartbeat ``ranks`` (default: all) at the interval the controller asked for, spread evenly."""
        chosen = list(range(len(self.ranks))) if ranks is None else ranks
        thread = threading.Thread(target=self._heartbeat_loop, args=(chosen,), daemon=True)
        self._threads.append(thread)
        thread.start()

    def _heartbeat_loop(self, chosen: list[int]) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{self.heartbeat_port or self.controller.heartbeat}")
        messages = [
            encode(Heartbeat(instance_id=self.ranks[n][0], rank=self.ranks[n][1], controller_epoch=self.epoch))
            for n in chosen
        ]
        step = self.heartbeat_interval / max(1, len(messages))
        start = time.monotonic()
        i = 0
        try:
            while not self._stop.is_set():
                due = start + i * step
                while time.monotonic() < due:
                    self._drain(sock)
                    if sock.poll(max(1, int((due - time.monotonic()) * 1000)), zmq.POLLIN):
                        continue
                sock.send_multipart([i.to_bytes(8, "little"), messages[i % len(messages)]])
                self.heartbeats_sent += 1
                i += 1
                self._drain(sock)
        finally:
            sock.close(0)

    def _drain(self, sock: zmq.Socket) -> None:
        while sock.poll(0):
            _, payload = sock.recv_multipart()
            reply = controller_reply_decoder.decode(payload)
            if isinstance(reply, HeartbeatReply) and reply.status != "ok":
                self.heartbeats_unknown += 1

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5)
        for sock in self._own:
            sock.close(0)
        self.router.close(0)
        self.ctx.term()
