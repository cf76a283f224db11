"""Commands expire: a command the controller reported as failed (504) never runs later, on a
worker that was stopped and resumed; and a move that finished only in part says why."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import torch
from command_harness import served_commands
from instances import instance_config, tokens
from protocol_client import CHUNK, CPU, ControllerProcess, FakeWorker, layout, wait_for

from lmcache_p2p.config import LMCacheConfig
from lmcache_p2p.protocol import (
    COMMAND_CLOCK_MARGIN_S,
    ClearCommand,
    CommandReply,
    HealthCommand,
    MoveCommand,
)
from lmcache_p2p.rpc import RemoteError
from lmcache_p2p.storage.manager import StorageManager


def test_the_worker_refuses_an_expired_command_unrun_and_runs_a_fresh_one(caplog):
    config = LMCacheConfig.from_dict({"chunk_size": 16, "max_local_cpu_size": 0.001})
    storage = StorageManager(config, layout(), pin_memory=False)
    for h in (1, 2, 3):
        assert storage.put(h, torch.zeros(storage.page_bytes, dtype=torch.uint8))

    async def main():
        async with served_commands(storage) as (commands, client):
            # Read 3 s after the controller stopped waiting: refused, nothing cleared.
            stale = ClearCommand(event_id="clear-stale", location=CPU, deadline_unix=time.time() - 3.0)
            with pytest.raises(RemoteError) as refused:
                await client.request(stale, CommandReply, 5)
            assert refused.value.reply.event_id == "clear-stale"
            assert "expired: inst rank 0 read ClearCommand 3." in str(refused.value)
            assert len(storage.cpu) == 3 and commands.expired == 1
            # Inside the margin of its deadline: refused too (the controller may be giving up now).
            edge = ClearCommand(
                event_id="clear-edge", location=CPU, deadline_unix=time.time() + 0.5 * COMMAND_CLOCK_MARGIN_S
            )
            with pytest.raises(RemoteError):
                await client.request(edge, CommandReply, 5)
            assert len(storage.cpu) == 3 and commands.expired == 2
            # Fresh, and with no deadline at all (an older controller): both run.
            fresh = ClearCommand(event_id="clear-fresh", location=CPU, deadline_unix=time.time() + 5.0)
            assert (await client.request(fresh, CommandReply, 5)).num_tokens == 3 * 16
            assert len(storage.cpu) == 0
            assert (await client.request(HealthCommand(event_id="h"), CommandReply, 5)).ok

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        storage.close()
    (line,) = [r.getMessage() for r in caplog.records if "clear-stale" in r.getMessage()]
    assert "read 3." in line and "s past its deadline" in line and "not run" in line


def test_the_controller_sends_each_command_with_its_deadline():
    controller = ControllerProcess("--command-timeout", "2").start()
    worker = FakeWorker(controller, "inst-a")
    try:
        assert worker.register().ok
        before = time.time()
        assert controller.post("/health", {"instance_id": "inst-a"}).status_code == 200
        after = time.time()
        (command,) = worker.commands
        assert before + 2.0 <= command.deadline_unix <= after + 2.0
    finally:
        worker.close()
        controller.stop()


def test_a_clear_that_timed_out_never_runs_when_its_stopped_worker_resumes(spawn):
    # Heartbeats every 5 s and reaping after 30 s: the stopped worker stays registered.
    controller = ControllerProcess("--command-timeout", "2", "--worker-timeout", "30").start()
    try:
        a = spawn(instance_config("inst-stopped", controller, chunk_size=32))
        prompt = tokens(8 * 32, seed=31)
        assert a.prefill(prompt) == 8 * 32
        wait_for(lambda: controller.holders(prompt).get("inst-stopped") == [CPU, 8 * 32], 15, "A's keys")
        # A command first, so the channel is connected: the clear then reaches the stopped
        # worker's socket buffers and waits there, as it did in the campaign.
        assert controller.post("/health", {"instance_id": "inst-stopped"}).status_code == 200

        a.signal(signal.SIGSTOP)
        try:
            r = controller.post("/clear", {"instance_id": "inst-stopped", "location": CPU})
            assert r.status_code == 504, r.text
            time.sleep(1.0)  # well past the deadline
        finally:
            a.signal(signal.SIGCONT)
        a.status()  # it runs again; its loop reads the command socket's backlog now
        # Once the worker has read the clear and said it refused it, the clear can never run: what
        # it holds then is the answer (a fixed sleep could look before the backlog was read).
        wait_for(lambda: "expired, not run" in a.log(), 30, "the worker to read and refuse the clear")
        assert a.lookup(prompt, peers=False) == 8 * 32, "the clear that answered 504 ran after all"
        assert a.status()["storage"]["cpu"]["chunks"] == 8
        time.sleep(0.5)  # and the controller's index was never told of evictions
        assert controller.holders(prompt).get("inst-stopped") == [CPU, 8 * 32]
        # A clear sent now runs.
        r = controller.post("/clear", {"instance_id": "inst-stopped", "location": CPU})
        assert r.status_code == 200 and r.json()["num_tokens"] == 8 * 32, r.text
    finally:
        controller.stop()


def test_check_finish_of_a_partial_move_keeps_its_reason():
    controller = ControllerProcess().start()
    src, dst = FakeWorker(controller, "inst-src"), FakeWorker(controller, "inst-dst")
    try:
        assert src.register().ok and dst.register().ok
        src.command_reply = lambda c: CommandReply(event_id=c.event_id, ok=True, pending=isinstance(c, MoveCommand))
        doc = list(range(100, 100 + 4 * CHUNK))
        src.admit_tokens(doc)
        wait_for(lambda: controller.holders(doc).get("inst-src") == [CPU, 4 * CHUNK], 15, "src keys")
        r = controller.post("/move", {"old_position": ["inst-src", CPU], "new_position": ["inst-dst", CPU]})
        assert r.status_code == 200, r.text
        event_id = r.json()["event_id"]
        reason = "CPU pool full: reserved 3 of 4 pages (every other page of 3 is pinned or in a transfer)"
        src.done(event_id, ok=True, num_tokens=3 * CHUNK, error=reason)
        status = controller.finish(event_id, 15)
        assert status["status"] == "done" and status["num_tokens"] == 3 * CHUNK
        assert status["error"] == f"rank 0: {reason}"
    finally:
        src.close()
        dst.close()
        controller.stop()
