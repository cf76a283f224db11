"""The controller past a thousand ranks (a real ``lmcache_controller``, fake ranks of one process):
every rank registers and every rank's command channel opens and answers; under a small
open-file limit, registrations past capacity are refused with a clear error, never half-made."""

from __future__ import annotations

import resource
import time

import pytest
from fake_fleet import FakeFleet
from protocol_client import ControllerProcess

# Past the 1,024 sockets of a default ZMQ context, where registrations and commands used to fail.
RANKS = 1100


@pytest.fixture
def quiet_controller():
    # warning: 1,100 registrations at info would fill the pipe the test reads the log from.
    controller = ControllerProcess("--log-level", "warning").start()
    yield controller
    controller.stop()


def health_failures(controller: ControllerProcess, instance_ids) -> list[tuple[str, int, str]]:
    failures = []
    for instance_id in instance_ids:
        r = controller.post("/health", {"instance_id": instance_id})
        if r.status_code != 200:
            failures.append((instance_id, r.status_code, r.text[:200]))
    return failures


def test_more_than_1100_ranks_register_and_each_answers_a_command(quiet_controller):
    fleet = FakeFleet(quiet_controller, RANKS, tp=1)
    try:
        replies = fleet.register_all()
        refused = [r.error for r in replies.values() if not r.ok]
        assert not refused, refused[:3]
        assert len(quiet_controller.http.get("/controller/workers").json()["workers"]) == RANKS
        # Each /health opens one more command channel: 1,100 of them stay open at once.
        failures = health_failures(quiet_controller, sorted({i for i, _ in fleet.ranks}))
        assert not failures, f"{len(failures)} failed, first: {failures[:3]}"
        assert fleet.commands["HealthCommand"] == RANKS
    finally:
        fleet.close()


SMALL_FD_LIMIT = 2048
SMALL_LIMIT_CHANNELS = int(SMALL_FD_LIMIT * 0.4) // 2  # the bus's channel share: 409


def _small_fd_limit() -> None:
    # In the controller's process only, hard limit included, so the controller cannot raise it
    # and its capacity is small enough to reach quickly.
    resource.setrlimit(resource.RLIMIT_NOFILE, (SMALL_FD_LIMIT, SMALL_FD_LIMIT))


def test_past_capacity_registrations_are_refused_and_every_registered_rank_answers():
    controller = ControllerProcess("--log-level", "warning", preexec_fn=_small_fd_limit).start()
    fleet = FakeFleet(controller, 900, tp=1, prefix="capped")
    try:
        # Each rank over its own connection, as real ranks: the controller's descriptors run out.
        replies = fleet.register_each_connected()
        refused = {n: r.error for n, r in replies.items() if not r.ok}
        assert refused, "900 ranks under a 2,048-descriptor limit: some must be refused"
        error = next(iter(refused.values()))
        assert "controller at capacity" in error and "file descriptors" in error and "ulimit -n" in error, error
        # Between counts of its descriptors the controller assumes each registration brought
        # three connections; a later count shows the room those refused in the burst can take.
        time.sleep(1.1)
        replies.update(fleet.register_each_connected(sorted(refused)))
        assert any(not r.ok for r in replies.values()), "the room ran out for good"
        accepted = {fleet.ranks[n][0] for n, r in replies.items() if r.ok}
        registered = {w["instance_id"] for w in controller.http.get("/controller/workers").json()["workers"]}
        assert registered == accepted
        # Nothing half-registered: every listed rank answers a command, more of them than the
        # channels that may be open at once under this limit (the least recently used close).
        assert len(registered) > SMALL_LIMIT_CHANNELS, len(registered)
        failures = health_failures(controller, sorted(registered))
        assert not failures, f"{len(failures)} of {len(registered)} failed, first: {failures[:3]}"
    finally:
        fleet.close()
        log = controller.stop()
    assert "refused Register of" in log and "controller at capacity" in log, log[-2000:]


def test_a_socket_table_sized_too_early_lowers_the_channel_limit_instead_of_failing(caplog):
    """MAX_SOCKETS counts only when set before a context's first socket; when something opened
    one first, the bus learns the real limit at the first refusal and closes idle channels."""
    import asyncio

    import zmq.asyncio

    from lmcache_p2p.controller.commands import CommandBus
    from lmcache_p2p.protocol import HealthCommand

    async def main() -> int:
        ctx = zmq.asyncio.Context()
        ctx.set(zmq.MAX_SOCKETS, 40)
        early = ctx.socket(zmq.ROUTER)  # the table is sized now, at 40
        bus = CommandBus(ctx)  # asks for thousands: too late
        server_ctx = zmq.Context()
        router = server_ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        workers = []
        for n in range(60):
            router.bind("tcp://127.0.0.1:*")
            port = int(router.last_endpoint.rsplit(b":", 1)[1])
            bus.connect((f"i{n}", 0), "127.0.0.1", port)
            workers.append((f"i{n}", 0))

        def answer() -> None:
            from lmcache_p2p.protocol import CommandReply, command_decoder, encode

            while True:
                try:
                    identity, request_id, payload = router.recv_multipart()
                except zmq.ZMQError:  # ETERM from server_ctx.term(): this thread owns the socket
                    router.close(0)
                    return
                command = command_decoder.decode(payload)
                router.send_multipart([identity, request_id, encode(CommandReply(event_id=command.event_id, ok=True))])

        import threading

        answerer = threading.Thread(target=answer, daemon=True)
        answerer.start()
        try:
            answered = 0
            for worker in workers:
                reply = await bus.request(worker, HealthCommand(event_id=worker[0]), 5)
                answered += reply.ok
            assert bus.capacity.max_channels < 40 and bus.stats["channels_closed_idle"] > 0
            return answered
        finally:
            bus.close()
            early.close(0)
            ctx.destroy(0)
            # Not destroy(): that closes the router from this thread while the answerer blocks
            # in recv on it (zmq sockets are not thread-safe; it hung CI for 300 s). term()
            # wakes the recv with ETERM and the answerer closes its own socket.
            server_ctx.term()
            answerer.join(10)

    assert asyncio.run(asyncio.wait_for(main(), 60)) == 60
    assert any("no socket for a new command channel" in r.getMessage() for r in caplog.records)
