"""The real ``lmcache_controller`` process over real ZMQ and HTTP, driven by protocol clients."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from protocol_client import (
    CHUNK,
    CONTROLLER_SCRIPT,
    CPU,
    DISK,
    ControllerProcess,
    FakeWorker,
    register_message,
    registered_workers,
    wait_for,
)

from lmcache_p2p.keys import chunk_hashes
from lmcache_p2p.protocol import Ack, CommandReply, Heartbeat, MoveCommand, Traffic, unpack_hashes
from lmcache_p2p.testing.ports import free_ports

# Commands time out after 1 s, and no rank is reaped while a test runs: fake workers speak only when
# a test makes them, and with a 1 s --worker-timeout a busy host reaped ranks between two of their
# messages (the 504 test and the TP lookup test each met it before getting controllers of their own).
FAST = ("--health-check-interval", "0.1", "--worker-timeout", "30", "--command-timeout", "1.0")
# The liveness test's: a rank silent for 3 s is reaped.
REAPING = ("--health-check-interval", "0.1", "--worker-timeout", "3", "--command-timeout", "1.0")
DOC = list(range(1000, 1000 + 10 * CHUNK))  # 10 chunks


@pytest.fixture
def controller(controllers):
    # As the seeds run it: the lmcache_controller console script under PYTHONHASHSEED=123.
    return controllers(*FAST, env={"PYTHONHASHSEED": "123"})


@pytest.fixture
def workers(controller):
    with registered_workers(controller) as make:
        yield make


def lookup(controller, tokens, **extra):
    return controller.api("/lookup", {"tokens": tokens, **extra})


def wait_lookup(controller, tokens, instance_id, tokens_expected, location=CPU):
    return wait_for(
        lambda: lookup(controller, tokens)["layout_info"].get(instance_id) == [location, tokens_expected],
        15,
        f"{instance_id} to hold {tokens_expected} tokens at {location}",
    )


# -- start-up --------------------------------------------------------------------------------------


def test_starts_as_the_seeds_start_it_without_torch(controller):
    assert controller.args[0] == CONTROLLER_SCRIPT and controller.env["PYTHONHASHSEED"] == "123"
    with open(f"/proc/{controller.proc.pid}/maps") as f:
        maps = f.read()
    assert "libtorch" not in maps and "vllm" not in maps, "the controller process must not load torch or vLLM"
    assert controller.http.get("/controller/workers").json()["workers"] == []


def test_seed_003_monitor_ports_without_heartbeat_default_to_8082_and_config_file(tmp_path):
    http, pull, reply, hb = free_ports(4)
    cfg = tmp_path / "controller.yaml"
    cfg.write_text(
        f"host: 127.0.0.1\nport: {http}\nmonitor_ports: {{pull: {pull}, reply: {reply}, heartbeat: {hb}}}\n"
        "worker_timeout: 12\nlog_level: debug\n"
    )
    c = ControllerProcess(ports=[http, pull, reply, hb], argv=[CONTROLLER_SCRIPT, "--config", str(cfg)]).start()
    try:
        assert c.http.get("/controller/workers").json()["thresholds"]["reaped_after_s"] == 12
    finally:
        c.stop()


@pytest.mark.parametrize(
    "monitor_ports,expected",
    [
        ('{"pull": 8300, "reply": ', "not valid JSON"),
        ('{"reply": 8400}', "missing key 'pull'"),
        ('{"pull": 8300, "reply": 8400, "hearbeat": 1}', "unknown key(s) ['hearbeat']"),
        ("[8300, 8400]", "expected a JSON object"),
    ],
)
def test_bad_monitor_ports_exit_with_one_line(monitor_ports, expected):
    out = subprocess.run(
        [CONTROLLER_SCRIPT, "--monitor-ports", monitor_ports], capture_output=True, text=True, timeout=30
    )
    assert out.returncode != 0 and expected in out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr


@pytest.mark.parametrize("which", ["http", "pull", "reply"])
def test_port_in_use_exits_with_one_line(controller, which):
    ports = free_ports(4)
    slot = ["http", "pull", "reply"].index(which)
    taken = ports[slot] = controller.ports[slot]
    other = ControllerProcess(*FAST, ports=ports)
    out = subprocess.run(other.args, capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and f"cannot bind {'HTTP' if which == 'http' else which}" in out.stderr
    assert str(taken) in out.stderr and "the port is already in use" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and out.stderr.strip().count("\n") == 0


# -- registration, events, lookup -------------------------------------------------------------------


def test_admitted_chunks_are_found_by_lookup_with_all_holders(controller, workers):
    a, b = workers("inst-a"), workers("inst-b", locations=(CPU, DISK))
    a.admit_tokens(DOC)
    b.admit_tokens(DOC[: 4 * CHUNK])
    b.admit_tokens(DOC[: 6 * CHUNK], location=DISK)
    wait_lookup(controller, DOC, "inst-b", 6 * CHUNK, DISK)
    result = lookup(controller, DOC + [1, 2, 3])  # a partial tail chunk is never a hit
    assert result["layout_info"] == {"inst-a": [CPU, 10 * CHUNK], "inst-b": [DISK, 6 * CHUNK]}
    assert [(h["instance_id"], h["location"], h["matched_tokens"]) for h in result["holders"]] == [
        ("inst-a", CPU, 160),
        ("inst-b", DISK, 96),
        ("inst-b", CPU, 64),
    ]
    assert result["event_id"]


def test_partial_prefix_empty_tokens_and_model_filter(controller, workers):
    a = workers("inst-a")
    a.admit_tokens(DOC)
    wait_lookup(controller, DOC, "inst-a", 160)
    diverged = DOC[: 3 * CHUNK + 5] + [7] * (7 * CHUNK - 5)
    assert lookup(controller, diverged)["layout_info"] == {"inst-a": [CPU, 3 * CHUNK]}
    empty = lookup(controller, [])
    assert (empty["layout_info"], empty["holders"]) == ({}, [])
    assert lookup(controller, DOC, model="another-model")["holders"] == []
    assert lookup(controller, DOC, model="tiny-llama")["layout_info"] == {"inst-a": [CPU, 160]}


def test_evictions_leave_lookups(controller, workers):
    a = workers("inst-a")
    hashes = a.admit_tokens(DOC)
    wait_lookup(controller, DOC, "inst-a", 160)
    a.events(evicted=hashes[5:6])
    wait_lookup(controller, DOC, "inst-a", 5 * CHUNK)


def test_instance_prefix_needs_every_tp_rank(controller, workers):
    r0, r1 = workers("inst-tp", rank=0, tp=2), workers("inst-tp", rank=1, tp=2)
    r0.admit_tokens(DOC)
    r1.admit_tokens(DOC[: 4 * CHUNK])
    wait_lookup(controller, DOC, "inst-tp", 4 * CHUNK)
    ranks = {h["worker_id"]: h["matched_tokens"] for h in lookup(controller, DOC)["holders"]}
    assert ranks == {0: 160, 1: 64}


def test_garbage_frames_are_counted_and_the_loops_go_on(controller, workers):
    a = workers("inst-a")
    a.send_raw("pull", b"\xff\x00garbage")
    a.send_raw("reply", b"not msgpack at all")
    a.send_raw("heartbeat", b"\x93\x01\x02")
    a.admit_tokens(DOC)
    wait_lookup(controller, DOC, "inst-a", 160)  # after the pull socket's garbage, on the same socket

    def bad_frames() -> dict[str, float]:
        return {
            s: controller.metric("lmcache_controller_bad_frames_total", socket=s)
            for s in ("pull", "reply", "heartbeat")
        }

    # The reply and heartbeat sockets are read by loops of their own: the admit's arrival says
    # nothing of theirs, so their counts are waited for (and must then be exactly one each).
    wait_for(lambda: all(bad_frames().values()), 15, "a bad frame counted on each socket")
    assert bad_frames() == {"pull": 1, "reply": 1, "heartbeat": 1}
    assert a.heartbeat().status == "ok"


def test_a_message_on_the_wrong_socket_is_answered_with_an_error_and_counted(controller, workers):
    a = workers("inst-a")
    reply = a._ask(a.req, Heartbeat(instance_id="inst-a", rank=0, controller_epoch=a.epoch))
    assert isinstance(reply, Ack) and not reply.ok and "undecodable" in reply.error
    assert controller.metric("lmcache_controller_bad_frames_total", socket="reply") == 1
    assert a.heartbeat().status == "ok"


def test_p2p_lookup_offers_peers_with_the_same_layout_never_itself(controller, workers):
    a, b = workers("inst-a"), workers("inst-b")
    other_model = workers("inst-c", model="other-model")
    hashes = a.admit_tokens(DOC)
    other_model.admit_tokens(DOC)
    b.admit_tokens(DOC[:CHUNK])
    wait_lookup(controller, DOC, "inst-c", 160)
    holders = b.p2p_lookup(hashes).holders
    assert [(h.instance_id, h.matched_chunks, h.p2p_lookup_port) for h in holders] == [("inst-a", 10, 9200)]


def test_p2p_lookup_offers_a_tp_peer_only_the_prefix_every_rank_of_it_holds(controller, workers):
    """The asker's ranks each pull from the same rank of the peer and load only what all of them
    got: a peer whose rank 1 evicted chunks 4+ (or left) offers rank 0's askers 4 chunks, not 10."""
    p0, p1 = workers("peer", rank=0, tp=2), workers("peer", rank=1, tp=2, locations=(CPU, DISK))
    a0, a1 = workers("asker", rank=0, tp=2), workers("asker", rank=1, tp=2)
    hashes = p0.admit_tokens(DOC)
    p1.admit_tokens(DOC)
    wait_lookup(controller, DOC, "peer", 160)
    assert [(h.rank, h.matched_chunks) for h in a0.p2p_lookup(hashes).holders] == [(0, 10)]
    p1.events(evicted=hashes[4:])
    wait_lookup(controller, DOC, "peer", 4 * CHUNK)
    assert [(h.rank, h.matched_chunks) for h in a0.p2p_lookup(hashes).holders] == [(0, 4)]
    assert [(h.rank, h.matched_chunks) for h in a1.p2p_lookup(hashes).holders] == [(1, 4)]
    # A rank serves a pull from whichever of its tiers holds each chunk: chunks 4+ on rank 1's
    # disk make the whole prefix pullable again, though no single tier of it holds all ten.
    p1.events(DISK, admitted=hashes[4:])
    wait_for(
        lambda: [(h.rank, h.matched_chunks, h.location) for h in a1.p2p_lookup(hashes).holders] == [(1, 10, CPU)],
        15,
        "rank 1's CPU and disk chunks to count together",
    )
    p1.deregister()  # pushed: the controller takes it in its own time
    wait_for(lambda: a0.p2p_lookup(hashes).holders == [], 15, "a rank gone to leave nothing to pull from its instance")


# -- sequence gaps, re-sync, re-registration --------------------------------------------------------


def test_a_sequence_gap_asks_for_a_full_resync_that_replaces_the_keys(controller, workers):
    a = workers("inst-a")
    a.resync(CPU, [])  # the re-sync every registration asks for
    assert a.heartbeat().resync == []
    a.admit_tokens(DOC[: 2 * CHUNK])
    a.events(admitted=chunk_hashes(DOC, CHUNK)[2:4], seq=a.seq[CPU] + 2)  # batch 2 lost on the way
    reply = wait_for(lambda: (r := a.heartbeat()).resync and r, 15, "a re-sync request in the heartbeat reply")
    assert reply.resync == [CPU]
    assert controller.metric("lmcache_controller_seq_gaps_total") == 1
    full = chunk_hashes(DOC, CHUNK)[:6]  # what the worker really holds
    a.resync(CPU, full, batch_size=4)
    assert a.heartbeat().resync == []
    wait_lookup(controller, DOC, "inst-a", 6 * CHUNK)


def test_a_lost_last_batch_is_caught_by_the_heartbeat_and_re_synced(controller, workers):
    """No later batch reveals a lost tail: the heartbeat says what was sent a beat ago."""
    a = workers("inst-a")
    a.resync(CPU, [])
    a.admit_tokens(DOC[: 2 * CHUNK])
    wait_lookup(controller, DOC, "inst-a", 2 * CHUNK)
    assert a.heartbeat(event_seqs={CPU: a.seq[CPU]}).resync == []  # all arrived: nothing asked
    a.seq[CPU] += 1  # batch 2 was sent and lost (the pull socket was reconnecting), and it was the last
    assert a.heartbeat(event_seqs={CPU: a.seq[CPU]}).resync == [CPU]
    assert controller.metric("lmcache_controller_seq_gaps_total") == 1
    a.resync(CPU, chunk_hashes(DOC, CHUNK)[:4])
    assert a.heartbeat(event_seqs={CPU: a.seq[CPU]}).resync == []  # the snapshot covers batch 2
    wait_lookup(controller, DOC, "inst-a", 4 * CHUNK)


def test_re_registering_keeps_keys_until_the_resync_replaces_them(controller, workers):
    a = workers("inst-a")
    a.admit_tokens(DOC)
    wait_lookup(controller, DOC, "inst-a", 160)
    assert a.register().resync == [CPU]
    assert lookup(controller, DOC)["layout_info"] == {"inst-a": [CPU, 160]}, "keys survive re-registration"
    a.resync(CPU, chunk_hashes(DOC, CHUNK)[:3])
    wait_lookup(controller, DOC, "inst-a", 3 * CHUNK)


def test_events_newer_than_the_snapshot_survive_the_resync(controller, workers):
    a = workers("inst-a")
    hashes = chunk_hashes(DOC, CHUNK)
    snapshot_seq = a.seq[CPU]
    a.events(admitted=hashes[5:6])  # produced after the snapshot below was taken
    wait_for(lambda: controller.http.get("/controller/key-stats").json()["total_keys"] == 1, 15, "the admit to land")
    a.seq[CPU] = snapshot_seq
    a.resync(CPU, hashes[:5])  # the snapshot does not include chunk 5
    wait_lookup(controller, DOC, "inst-a", 6 * CHUNK)


# -- liveness ---------------------------------------------------------------------------------------


def test_a_silent_worker_is_reaped_and_its_keys_vanish(controllers):
    controller = controllers(*REAPING, env={"PYTHONHASHSEED": "123"})
    with registered_workers(controller) as workers:
        a, b = workers("inst-a"), workers("inst-b")
        a.admit_tokens(DOC)
        b.admit_tokens(DOC)
        wait_lookup(controller, DOC, "inst-b", 160)
        deadline = time.monotonic() + 15
        while "inst-a" in lookup(controller, DOC)["layout_info"]:
            b.heartbeat()  # b stays alive; a says nothing
            assert time.monotonic() < deadline, "inst-a was never reaped"
            time.sleep(0.1)
        assert lookup(controller, DOC)["layout_info"] == {"inst-b": [CPU, 160]}
        assert a.heartbeat().status == "unknown", "a reaped worker is told to register again"
        assert controller.metric("lmcache_controller_workers_reaped_total") == 1


def test_a_second_live_engine_under_one_id_is_a_warning_naming_both_and_a_restart_is_not():
    """A restarted engine registers again under its id and takes its place; a second engine
    registering a live one's id from elsewhere takes it too, but that is a misconfiguration the
    log must name (both addresses, and what becomes of the old one)."""
    # Heartbeats every 1 s: a rank heard from within 2 s is live.
    controller = ControllerProcess("--worker-timeout", "6", "--health-check-interval", "0.5").start()
    made = []
    try:
        first, second = (FakeWorker(controller, "inst-a") for _ in range(2))
        made += [first, second]
        assert first.register().ok and first.heartbeat().status == "ok"
        assert second.register().ok  # first is live, at another port
        assert controller.metric("lmcache_controller_duplicate_registrations_total") == 1
        (worker,) = controller.http.get("/controller/workers").json()["workers"]
        assert worker["worker_port"] == second.worker_port  # the new one took the id

        # A restart at the same address (the old process gave its port up): no warning.
        restarted = FakeWorker(controller, "inst-a")
        made.append(restarted)
        restarted.worker_port = second.worker_port
        assert restarted.register().ok
        # A restart elsewhere, after the old one went silent: no warning either.
        time.sleep(2.5)
        elsewhere = FakeWorker(controller, "inst-a")
        made.append(elsewhere)
        assert elsewhere.register().ok
        assert controller.metric("lmcache_controller_worker_restarts_total") == 2
        assert controller.metric("lmcache_controller_duplicate_registrations_total") == 1
    finally:
        for worker in made:
            worker.close()
        log = controller.stop()
    (warning,) = [line for line in log.splitlines() if "WARNING" in line and "registered from" in line]
    assert f"127.0.0.1:{second.worker_port}" in warning and f"127.0.0.1:{first.worker_port}" in warning, warning
    assert "is live" in warning and "The new one replaces it" in warning and "lmcache_instance_id" in warning
    assert f"at 127.0.0.1:{elsewhere.worker_port} replaces the one at 127.0.0.1:{second.worker_port}" in log
    assert "a restart (that one silent for" in log and "a restart (the same address)" in log


def test_deregister_removes_at_once(controller, workers):
    a = workers("inst-a")
    a.admit_tokens(DOC)
    wait_lookup(controller, DOC, "inst-a", 160)
    a.deregister()
    wait_for(lambda: lookup(controller, DOC)["holders"] == [], 15, "deregistered keys to vanish")


def test_after_a_controller_restart_the_index_is_rebuilt_from_resyncs(controller):
    a = FakeWorker(controller, "inst-a")
    try:
        a.register()
        hashes = a.admit_tokens(DOC)
        wait_lookup(controller, DOC, "inst-a", 160)
        controller.kill()
        controller.start()  # same ports, empty index, new epoch
        assert lookup(controller, DOC)["holders"] == []
        hb = wait_for(lambda: a.heartbeat(), 5, "heartbeat answer")
        assert hb.status == "unknown"
        reply = a.register()
        assert reply.ok and reply.resync == [CPU] and reply.controller_epoch == hb.controller_epoch
        a.resync(CPU, hashes)
        wait_lookup(controller, DOC, "inst-a", 160)
        assert a.heartbeat().status == "ok"
    finally:
        a.close()


def test_with_an_events_file_the_event_history_survives_a_restart(tmp_path):
    """Before, every event id answered 404 after a restart. A finished move keeps its outcome; one
    still pending when the controller died comes back failed, saying why."""
    journal = tmp_path / "events.jsonl"
    controller = ControllerProcess(*FAST, "--events-file", str(journal)).start()
    src = dst = None
    try:
        src, dst = FakeWorker(controller, "lmcache_instance_1"), FakeWorker(controller, "lmcache_instance_2")
        assert src.register().ok and dst.register().ok
        src.command_reply = lambda c: CommandReply(event_id=c.event_id, ok=True, pending=isinstance(c, MoveCommand))
        src.admit_tokens(DOC[: 4 * CHUNK])
        wait_lookup(controller, DOC, "lmcache_instance_1", 4 * CHUNK)
        body = {"old_position": ["lmcache_instance_1", CPU], "new_position": ["lmcache_instance_2", CPU], "tokens": DOC}
        finished = controller.post("/move", body).json()["event_id"]
        src.done(finished, ok=True, num_tokens=4 * CHUNK)
        assert controller.finish(finished, 15)["status"] == "done"
        interrupted = controller.post("/move", body).json()["event_id"]  # never finished
        controller.kill()
        controller.start()
        assert controller.post("/check_finish", {"event_id": finished}).json() == {
            "event_id": finished,
            "status": "done",
            "num_tokens": 4 * CHUNK,
            "error": None,
        }
        again = controller.post("/check_finish", {"event_id": interrupted}).json()
        assert again["status"] == "failed" and "restarted before this command finished" in again["error"]
        shown = [e["event_id"] for e in controller.http.get("/controller/events").json()["events"]]
        assert finished in shown and interrupted in shown
    finally:
        for w in (src, dst):
            if w is not None:
                w.close()
        controller.stop()


def test_a_damaged_events_file_is_survived_line_by_line(tmp_path):
    """Issue 47 item 6: a non-UTF-8 line, a 100,000-deep one or ``num_tokens: 1e400`` stopped start-up
    with a traceback; a string ``finished_at`` started, then /controller/events and the dashboard
    reset the connection. Now each bad line is skipped with a WARNING naming its number and why,
    and the good records are served."""
    base = {"kind": "move", "instance_id": "inst-a", "detail": "inst-a/LocalCPUBackend -> inst-b/LocalCPUBackend"}
    base |= {"status": "done", "num_tokens": 64, "error": None, "created_at": 1.7e9, "finished_at": 1.7e9 + 1.5}
    good = [
        {**base, "event_id": "move-00000000000000a1"},
        {**base, "event_id": "clear-00000000000000a2", "kind": "clear", "detail": "LocalCPUBackend"},
        {**base, "event_id": "pin-00000000000000a3", "kind": "pin", "status": "failed", "error": "rank 0: no pool"},
    ]

    def line(record: dict) -> bytes:
        return json.dumps(record).encode() + b"\n"

    # What each WARNING says in our words (events.py); the decoder's own detail after them
    # ("Number out of range", "- at `$.finished_at`", "Input data was truncated") is msgspec's.
    damaged = {  # line number -> (the line, what its WARNING says)
        2: (line({**base, "event_id": "move-X"}).replace(b"move-X", b"move-\xff\xfe"), "not valid UTF-8"),
        3: (b"[" * 100_000 + b"]" * 100_000 + b"\n", "200000 bytes long"),
        5: (
            line({**base, "event_id": "move-b3"}).replace(b'"num_tokens": 64', b'"num_tokens": 1e400'),
            "not an event record",
        ),
        6: (line({**base, "event_id": "move-b4", "finished_at": "yesterday"}), "not an event record"),
        7: (line({k: v for k, v in base.items() if k != "status"} | {"event_id": "move-b5"}), "not an event record"),
        9: (line({**base, "event_id": "move-b6"})[:60] + b"\n", "not valid JSON"),
    }
    lines = [line(good[0]), damaged[2][0], damaged[3][0], line(good[1]), damaged[5][0], damaged[6][0]]
    lines += [damaged[7][0], line(good[2]), damaged[9][0]]
    journal = tmp_path / "events.jsonl"
    journal.write_bytes(b"".join(lines))
    controller = ControllerProcess(*FAST, "--events-file", str(journal)).start()
    try:
        events = controller.http.get("/controller/events").json()["events"]
        assert sorted(e["event_id"] for e in events) == sorted(r["event_id"] for r in good)
        by_id = {e["event_id"]: e for e in events}
        assert by_id["pin-00000000000000a3"]["error"] == "rank 0: no pool"
        assert by_id["move-00000000000000a1"]["duration_ms"] == 1500.0
        dashboard = controller.http.get("/controller/dashboard")
        assert dashboard.status_code == 200
        assert {e["event_id"] for e in dashboard.json()["events"]} == set(by_id)
        assert controller.post("/check_finish", {"event_id": "move-00000000000000a1"}).json()["num_tokens"] == 64
    finally:
        out = controller.stop()
    warnings = [text for text in out.splitlines() if "WARNING" in text and "events journal" in text]
    assert len(warnings) == len(damaged), out
    for (number, (_, why)), warning in zip(sorted(damaged.items()), warnings, strict=True):
        assert f"line {number} skipped" in warning and why in warning, warning
    assert "Traceback" not in out, out
    # Rewritten with the good records only: the next start reads them without a warning.
    assert [json.loads(text)["event_id"] for text in journal.read_text().splitlines()] == [r["event_id"] for r in good]


# -- commands -------------------------------------------------------------------------------------


def test_move_sends_the_held_prefix_and_check_finish_follows_completion(controller, workers):
    src, _ = workers("lmcache_instance_1"), workers("lmcache_instance_2")  # the destination must be registered
    src.command_reply = lambda c: CommandReply(event_id=c.event_id, ok=True, pending=isinstance(c, MoveCommand))
    hashes = src.admit_tokens(DOC[: 4 * CHUNK])
    wait_lookup(controller, DOC, "lmcache_instance_1", 4 * CHUNK)
    r = controller.post(
        "/move",
        {"old_position": ["lmcache_instance_1", CPU], "new_position": ["lmcache_instance_2", CPU], "tokens": DOC},
    )
    assert r.status_code == 200, r.text
    assert r.json()["num_tokens"] == 4 * CHUNK
    event_id = r.json()["event_id"]
    (cmd,) = src.commands
    assert isinstance(cmd, MoveCommand) and not cmd.copy and cmd.location == CPU
    assert unpack_hashes(cmd.hashes).tolist() == hashes
    assert (cmd.destination.instance_id, cmd.destination.location, cmd.destination.p2p_lookup_port) == (
        "lmcache_instance_2",
        CPU,
        9200,
    )
    assert controller.post("/check_finish", {"event_id": event_id}).json()["status"] == "pending"
    src.done(event_id, ok=True, num_tokens=3 * CHUNK)  # one chunk could not be moved
    status = controller.finish(event_id, 15)
    assert status == {"event_id": event_id, "status": "done", "num_tokens": 3 * CHUNK, "error": None}
    assert controller.metric("lmcache_controller_commands_total", kind="move", outcome="done") == 1


def test_copy_without_tokens_sends_everything_and_reports_failure(controller, workers):
    src, _ = workers("inst-a"), workers("inst-b")
    src.command_reply = lambda c: CommandReply(event_id=c.event_id, ok=True, pending=True)
    hashes = src.admit_tokens(DOC)
    wait_lookup(controller, DOC, "inst-a", 160)
    r = controller.post("/copy", {"old_position": ["inst-a", CPU], "new_position": ["inst-b", CPU]})
    assert r.json()["num_tokens"] == 160
    (cmd,) = src.commands
    assert cmd.copy and sorted(unpack_hashes(cmd.hashes).tolist()) == sorted(hashes)
    src.done(r.json()["event_id"], ok=False, error="peer inst-b refused the transfer")
    status = controller.finish(r.json()["event_id"], 15)
    assert status["status"] == "failed"
    assert "refused" in status["error"]


def test_clear_pin_and_health_fan_out_to_every_rank(controller, workers):
    r0, r1 = workers("inst-tp", rank=0, tp=2), workers("inst-tp", rank=1, tp=2)
    for w in (r0, r1):
        w.command_reply = lambda c: CommandReply(event_id=c.event_id, ok=True, num_tokens=32)
    r = controller.post("/clear", {"instance_id": "inst-tp", "location": CPU})
    assert r.status_code == 200 and r.json()["num_tokens"] == 32
    assert controller.post("/check_finish", {"event_id": r.json()["event_id"]}).json()["status"] == "done"
    r = controller.post("/pin", {"instance_id": "inst-tp", "location": CPU, "tokens": DOC})
    assert r.status_code == 200
    assert unpack_hashes(r0.commands[-1].hashes).tolist() == chunk_hashes(DOC, CHUNK)
    r = controller.post("/health", {"instance_id": "inst-tp"})
    assert r.json()["error_codes"] == {"0": 0, "1": 0}
    assert [type(c).__name__ for c in r1.commands] == ["ClearCommand", "PinCommand", "HealthCommand"]


def test_a_refusal_is_a_409_with_the_workers_error_and_health_reports_it(controller, workers):
    a = workers("inst-a")
    a.command_reply = lambda c: CommandReply(event_id=c.event_id, ok=False, error="tier offline")
    r = controller.post("/clear", {"instance_id": "inst-a", "location": CPU})
    assert r.status_code == 409 and "tier offline" in r.json()["error"], r.text
    assert controller.http.get("/controller/events").json()["events"][0]["status"] == "failed"
    r = controller.post("/health", {"instance_id": "inst-a"})
    assert r.status_code == 200 and r.json()["error_codes"] == {"0": 1} and "tier offline" in r.json()["errors"]["0"]
    # A worker whose server failed before it could build a CommandReply answers with an Ack:
    # still a refusal with its reason, not an undecodable answer (or a 504).
    a.command_reply = lambda c: Ack(ok=False, error="command server error: boom")
    r = controller.post("/clear", {"instance_id": "inst-a", "location": CPU})
    assert r.status_code == 409 and "boom" in r.json()["error"], r.text
    assert controller.metric("lmcache_controller_commands_total", kind="clear", outcome="failed") == 2


def test_error_codes_name_what_is_wrong(controller, workers):
    workers("inst-a")
    r = controller.post("/clear", {"instance_id": "nope", "location": CPU})
    assert r.status_code == 404 and "'nope'" in r.json()["error"] and "inst-a" not in r.json()["error"]
    r = controller.post("/move", {"old_position": ["inst-a", CPU], "new_position": ["nope", CPU]})
    assert r.status_code == 404 and r.json()["field"] == "new_position"
    r = controller.post("/move", {"new_position": ["inst-a", CPU]})
    assert r.status_code == 422 and r.json()["field"] == "old_position"
    r = controller.post("/lookup", {"tokens": [1, "two"]})
    assert r.status_code == 422 and r.json()["field"] == "tokens"
    r = controller.http.post("/pin", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and "not valid JSON" in r.json()["error"]
    r = controller.post("/clear", {"instance_id": "inst-a", "location": "RedisBackend"})
    assert r.status_code == 422 and r.json()["field"] == "location" and "RedisBackend" in r.json()["error"]
    r = controller.post("/check_finish", {"event_id": "move-unknown"})
    assert r.status_code == 404 and "move-unknown" in r.json()["error"]
    r = controller.post("/query_instance", {"ip": "10.9.9.9"})
    assert r.status_code == 404


def test_a_worker_that_does_not_answer_is_a_504_within_the_timeout():
    # A live worker (not reaped: a long --worker-timeout) that ignores commands. With a 1 s worker
    # timeout (FAST's, then) the silent fake was sometimes reaped first, and the answer was not a 504.
    controller = ControllerProcess(
        "--health-check-interval", "0.1", "--worker-timeout", "30", "--command-timeout", "1.0"
    ).start()
    mute = FakeWorker(controller, "inst-mute", answer_commands=False)
    try:
        assert mute.register().ok
        t0 = time.monotonic()
        r = controller.post("/health", {"instance_id": "inst-mute"})
        assert r.status_code == 504 and "inst-mute" in r.json()["error"], (r.status_code, r.text)
        assert time.monotonic() - t0 < 5, "bounded by --command-timeout (1s here)"
        events = controller.http.get("/controller/events").json()["events"]
        assert events[0]["status"] == "failed" and events[0]["kind"] == "health"
    finally:
        mute.close()
        controller.stop()


def test_worker_views_and_key_stats(controller, workers):
    a = workers("inst-a", locations=(CPU, DISK))
    a.admit_tokens(DOC)
    wait_lookup(controller, DOC, "inst-a", 160)
    (info,) = controller.post("/query_worker_info", {"instance_id": "inst-a"}).json()["worker_infos"]
    assert info["status"] == "live" and info["keys"] == {CPU: 10, DISK: 0} and info["model"] == "tiny-llama"
    assert controller.post("/query_instance", {"ip": "127.0.0.1"}).json()["res"] == "inst-a"
    stats = controller.http.get("/controller/key-stats").json()
    assert stats["total_keys"] == 10 and stats["instances"] == {"inst-a": {CPU: 10, DISK: 0}}
    assert controller.metric("lmcache_controller_key_holders", instance_id="inst-a", location=CPU) == 10
    assert controller.metric("lmcache_controller_workers") == 1


def test_openapi_describes_every_route(controller):
    paths = controller.http.get("/openapi.json").json()["paths"]
    for route in (
        "/lookup",
        "/move",
        "/copy",
        "/clear",
        "/pin",
        "/health",
        "/check_finish",
        "/query_worker_info",
        "/query_instance",
        "/controller/workers",
        "/controller/key-stats",
        "/metrics",
    ):
        assert route in paths, route
    move_schema = paths["/move"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"old_position", "new_position", "tokens", "copy"} <= set(move_schema["properties"])


def test_metrics_count_lookups_and_messages(controller, workers):
    a = workers("inst-a")
    a.admit_tokens(DOC)
    wait_lookup(controller, DOC, "inst-a", 160)
    before = controller.metric("lmcache_controller_lookups_total")
    lookup(controller, DOC)
    assert controller.metric("lmcache_controller_lookups_total") == before + 1
    assert controller.metric("lmcache_controller_messages_total", type="KeyEvents") >= 1
    assert controller.metric("lmcache_controller_messages_total", type="Register") == 1
    a.heartbeat()
    assert controller.metric("lmcache_controller_messages_total", type="Heartbeat") == 1
    assert controller.metric("lmcache_controller_lookup_hit_tokens_total") >= 160


def test_counters_are_counters_and_the_fleets_traffic_is_on_metrics(controller, workers):
    """Every ``*_total`` is typed counter (Prometheus' rate() needs it), and what the WebUI charts
    from the workers' heartbeats (lookups, hits, pulls, bytes) is there as counters too."""
    from lmcache_p2p.controller.traffic import FIELDS
    from lmcache_p2p.controller.views import FLEET_COUNTERS

    assert set(FLEET_COUNTERS) == set(FIELDS)  # every heartbeat total is exported
    a, b = workers("inst-a"), workers("inst-b")
    started = time.time()  # after the controller: each rank's totals count from its first report
    a.heartbeat(traffic=Traffic(started_at=started, lookups=4, lookup_tokens=4000, hit_tokens=3000))
    b.heartbeat(
        traffic=Traffic(started_at=started, lookups=2, lookup_tokens=1000, hit_tokens=512, pulled_bytes=7 << 20)
    )
    a.heartbeat(traffic=Traffic(started_at=started, lookups=6, lookup_tokens=6000, hit_tokens=4500, pulls=1))
    metrics = controller.metrics()
    for name, (kind, _) in metrics.items():
        if name.endswith("_total"):
            assert kind == "counter", (name, kind)
    for name in ("lmcache_controller_workers", "lmcache_controller_keys", "lmcache_controller_commands_in_flight"):
        assert metrics[name][0] == "gauge", name
    assert metrics["lmcache_controller_seq_gaps_total"][0] == "counter"
    fleet = {
        name: series[0][1] for name, (_, series) in metrics.items() if name.startswith("lmcache_controller_fleet_")
    }
    assert fleet["lmcache_controller_fleet_lookups_total"] == 6 + 2
    assert fleet["lmcache_controller_fleet_lookup_tokens_total"] == 6000 + 1000
    assert fleet["lmcache_controller_fleet_hit_tokens_total"] == 4500 + 512
    assert fleet["lmcache_controller_fleet_pulls_total"] == 1
    assert fleet["lmcache_controller_fleet_pulled_bytes_total"] == 7 << 20


def test_an_instance_that_can_never_share_with_another_of_its_model_is_flagged_on_arrival(controller):
    """Engines meant to share that differ in one layout field register silently and never hit
    each other: the controller names the pair and the field when the second arrives (one WARNING),
    /controller/workers shows it on both, and it goes when one of them leaves."""
    import msgspec

    made = []

    def arrive(instance_id: str, model: str, chunk_size: int = CHUNK, **layout_fields) -> FakeWorker:
        worker = FakeWorker(controller, instance_id, model=model)
        worker.layout = msgspec.structs.replace(worker.layout, **layout_fields)
        message = register_message(instance_id, layout=worker.layout, worker_port=worker.worker_port)
        message.chunk_size = chunk_size
        assert worker._ask(worker.req, message).ok
        made.append(worker)
        return worker

    def cannot_share() -> dict:
        workers = controller.http.get("/controller/workers").json()["workers"]
        return {w["instance_id"]: w["cannot_share_with"] for w in workers}

    try:
        arrive("a", "meta-llama/Llama-3.1-8B")
        arrive("same", "/models/llama-3.1-8b")  # a path on one host, a hub id on another: one model
        arrive("dtype", "meta-llama/Llama-3.1-8B", dtype="bfloat16")
        arrive("chunks", "meta-llama/Llama-3.1-8B", chunk_size=2 * CHUNK)
        arrive("other-model", "Qwen/Qwen3-8B", dtype="bfloat16")  # another model: not meant to share
        seen = cannot_share()
        assert seen["a"] == {
            "same": ["model meta-llama/Llama-3.1-8B vs /models/llama-3.1-8b"],
            "dtype": ["dtype float16 vs bfloat16"],
            "chunks": [f"chunk_size {CHUNK} vs {2 * CHUNK}"],
        }
        assert seen["dtype"]["a"] == ["dtype bfloat16 vs float16"]
        assert seen["same"]["dtype"] == [
            "model /models/llama-3.1-8b vs meta-llama/Llama-3.1-8B",
            "dtype float16 vs bfloat16",
        ]
        assert seen["other-model"] == {}
        made[2].deregister()  # "dtype" leaves: nobody lists it any more
        wait_for(lambda: "dtype" not in cannot_share()["a"], what="the pair forgotten")
    finally:
        for worker in made:
            worker.close()
        log = controller.stop()
    warnings = [line for line in log.splitlines() if "cannot share KV with" in line]
    assert any(
        "instance dtype cannot share KV with instance a" in line and "dtype differs (dtype bfloat16 vs float16)" in line
        for line in warnings
    ), warnings
    assert any(
        "instance chunks cannot share KV with instance a" in line and "chunk_size differs" in line for line in warnings
    )
    assert not [line for line in warnings if "other-model" in line]
    assert len([line for line in warnings if "instance dtype cannot share KV with instance a" in line]) == 1


def test_explain_says_chunk_by_chunk_who_holds_a_prompt_and_why_an_instance_would_miss_it(controller, workers):
    """POST /explain (and lmcache-p2p explain): the target's own chunks, then a compatible peer's,
    then chunks only an engine of another layout holds (the field named), then nobody's."""
    import msgspec

    prompt = list(range(5000, 5000 + 7 * CHUNK))  # 7 chunks
    a, b = workers("a"), workers("b")
    c = FakeWorker(controller, "c")
    c.layout = msgspec.structs.replace(c.layout, dtype="bfloat16")
    assert c.register().ok
    try:
        a.admit_tokens(prompt[: 2 * CHUNK])
        b.admit_tokens(prompt[: 4 * CHUNK])
        c.admit_tokens(prompt[: 6 * CHUNK])
        wait_lookup(controller, prompt, "c", 6 * CHUNK)
        wait_lookup(controller, prompt, "a", 2 * CHUNK)
        wait_lookup(controller, prompt, "b", 4 * CHUNK)
        answer = controller.api("/explain", {"tokens": prompt, "instance_id": "a"})
        assert answer["usable_tokens"] == 4 * CHUNK and answer["chunk_size"] == CHUNK
        assert [(r["start_token"], r["end_token"], r["status"], r["detail"]) for r in answer["runs"]] == [
            (0, 2 * CHUNK, "own", CPU),
            (2 * CHUNK, 4 * CHUNK, "peer", "b"),
            (4 * CHUNK, 6 * CHUNK, "layout_mismatch", "c: dtype float16 vs bfloat16"),
            (6 * CHUNK, 7 * CHUNK, "not_held", "nobody holds it now: never stored, or evicted by every holder"),
        ]
        assert answer["runs"][1]["holders"] == [
            {"instance_id": "b", "ranks": [0], "locations": [CPU]},
            {"instance_id": "c", "ranks": [0], "locations": [CPU]},
        ]
        assert answer["cannot_share_with"] == {"c": ["dtype float16 vs bfloat16"]}
        assert controller.api("/check_finish", {"event_id": answer["event_id"]})["num_tokens"] == 4 * CHUNK
        # Without a target: who holds what, at the chunk size asked.
        plain = controller.api("/explain", {"tokens": prompt, "chunk_size": CHUNK})
        assert [(r["status"], r["chunks"]) for r in plain["runs"]] == [
            ("held", 2),
            ("held", 2),
            ("held", 2),
            ("not_held", 1),
        ]
        # Bad input is named.
        unknown = controller.post("/explain", {"tokens": prompt, "instance_id": "nobody"})
        assert unknown.status_code == 404 and "nobody" in unknown.json()["error"]
        wrong = controller.post("/explain", {"tokens": prompt, "instance_id": "a", "chunk_size": 2 * CHUNK})
        assert wrong.status_code == 422 and wrong.json()["field"] == "chunk_size"
        # The CLI prints the same as a table.
        out = subprocess.run(
            [
                str(Path(sys.executable).parent / "lmcache-p2p"),
                "explain",
                "--controller-url",
                controller.url,
                "--instance",
                "a",
                json.dumps(prompt),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        reused = f"{4 * CHUNK} of {7 * CHUNK} prompt tokens would be reused (7 whole chunks)"
        assert lines[0] == f"instance a, chunk size {CHUNK}: {reused}"
        assert any(line.startswith(f"{2 * CHUNK}-{4 * CHUNK}") and "peer: b" in line for line in lines), lines
        assert "a can never share KV with c: dtype float16 vs bfloat16" in lines
    finally:
        c.close()


def test_explain_tokenizes_text_with_the_instances_own_engine(controller, workers):
    """`lmcache-p2p explain --text` asks the instance's engine (its registered serve_url) for the
    token ids, so the chunks explained are the ones that engine hashes."""
    from openai_standin import StandinEngine, standin_tokens

    engine = StandinEngine("b").start()
    try:
        text = " ".join(f"w{i}" for i in range(3 * CHUNK))
        holder = workers("a")
        holder.admit_tokens(standin_tokens(text))
        workers("b", serve_url=engine.url)
        wait_lookup(controller, standin_tokens(text), "a", 3 * CHUNK)
        script = str(Path(sys.executable).parent / "lmcache-p2p")
        argv = [script, "explain", "--controller-url", controller.url, "--instance", "b", "--text", text, "--json"]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        answer = json.loads(out.stdout)
        assert answer["usable_tokens"] == 3 * CHUNK and answer["runs"][0]["detail"] == "a"
        assert engine.paths("/tokenize") == [{"model": "tiny-llama", "prompt": text}]
        # an instance that registered no serve_url cannot tokenize: said in one line
        argv[argv.index("b")] = "a"
        refused = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1 and "registered no serve_url" in refused.stderr
    finally:
        engine.stop()


# -- event ids of reads, disk pins ------------------------------------------------------------------


def test_every_event_id_the_api_hands_out_is_known_to_check_finish(controller, workers):
    a = workers("inst-a")
    a.admit_tokens(DOC)
    wait_lookup(controller, DOC, "inst-a", 160)
    answers = {
        "lookup": lookup(controller, DOC),
        "lookup (nothing held)": lookup(controller, [5] * CHUNK),
        "query_worker_info": controller.api("/query_worker_info", {"instance_id": "all"}),
        "query_instance": controller.api("/query_instance", {"ip": "127.0.0.1"}),
        "health": controller.api("/health", {"instance_id": "inst-a"}),
    }
    ids = {what: answer["event_id"] for what, answer in answers.items()}
    assert len(set(ids.values())) == len(ids), ids
    for what, event_id in ids.items():
        r = controller.post("/check_finish", {"event_id": event_id})
        assert r.status_code == 200, f"{what}: {event_id} -> {r.status_code} {r.text}"
        assert r.json()["status"] == "done" and r.json()["event_id"] == event_id
    assert controller.api("/check_finish", {"event_id": ids["lookup"]})["num_tokens"] == 160
    # Reads are not commands: the event log (and the WebUI) shows the health check alone.
    assert [e["kind"] for e in controller.http.get("/controller/events").json()["events"]] == ["health"]
    # A read id of the same shape that was never handed out is unknown.
    serial = int(ids["lookup"].rsplit("-", 1)[1])
    r = controller.post("/check_finish", {"event_id": ids["lookup"].rsplit("-", 1)[0] + f"-{serial + 100}"})
    assert r.status_code == 404


@pytest.mark.parametrize("unpin", [False, True])
def test_pinning_on_disk_is_refused_before_any_worker_is_asked(controller, workers, unpin):
    a = workers("inst-a", locations=(CPU, DISK))
    r = controller.post("/pin", {"instance_id": "inst-a", "location": DISK, "tokens": DOC, "unpin": unpin})
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "location"
    assert "LocalCPUBackend only" in r.json()["error"] and DISK in r.json()["error"]
    assert a.commands == [] and controller.http.get("/controller/events").json()["events"] == []
    assert controller.api("/pin", {"instance_id": "inst-a", "location": CPU, "tokens": DOC, "unpin": unpin})
    assert [type(c).__name__ for c in a.commands] == ["PinCommand"]
