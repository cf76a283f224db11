"""Controller parts in-process: the chunk index against a reference model, the /lookup fast path
against the strict decoder, the dashboard's traffic rates, read event ids, the HTTP status of each
error, and what importing the controller loads."""

import asyncio
import json
import logging
import subprocess
import sys
import timeit

import msgspec
import numpy as np
import pytest
from protocol_client import layout, register_message

from lmcache_p2p.controller import api, errors
from lmcache_p2p.controller.admission import HostCheck, RegisterRefused, check_host_syntax
from lmcache_p2p.controller.api import HTTP_STATUS, LookupRequest, parse_token_array
from lmcache_p2p.controller.commands import (
    FD_MARGIN,
    FDS_PER_CHANNEL,
    FDS_PER_RANK,
    SPARE_SOCKETS,
    Capacity,
    fds_in_use,
)
from lmcache_p2p.controller.events import EventLog, ReadLog
from lmcache_p2p.controller.index import ChunkIndex
from lmcache_p2p.controller.metrics import Metrics
from lmcache_p2p.controller.orchestration import Orchestrator
from lmcache_p2p.controller.registry import Registry
from lmcache_p2p.controller.settings import ControllerSettings
from lmcache_p2p.controller.traffic import FleetTraffic
from lmcache_p2p.logs import RateLimitedLog
from lmcache_p2p.protocol import CommandDone, Traffic


def test_index_matches_a_reference_model_under_random_updates():
    rng = np.random.default_rng(0)
    index = ChunkIndex(capacity=16)  # small: forces many rebuilds
    ref: dict[int, set[int]] = {}
    for step in range(400):
        holder = int(rng.integers(1, 6))
        keys = rng.integers(0, 3000, size=int(rng.integers(1, 150))).astype(np.uint64)  # includes key 0
        if rng.random() < 0.65:
            index.add(holder, keys)
            for k in keys.tolist():
                ref.setdefault(k, set()).add(holder)
        else:
            index.remove(holder, keys)
            for k in keys.tolist():
                ref.get(k, set()).discard(holder)
        if step % 60 == 0:
            gone = int(rng.integers(1, 6))
            index.drop_holder(gone)
            for held in ref.values():
                held.discard(gone)
    everything = np.arange(3000, dtype=np.uint64)
    for key, set_id in zip(everything.tolist(), index.lookup(everything).tolist(), strict=True):
        assert index.sets.members(set_id) == frozenset(ref.get(key, set())), key
    assert index.live_keys == sum(1 for held in ref.values() if held)
    for holder in range(1, 6):
        expected = sorted(k for k, held in ref.items() if holder in held)
        assert index.holder_count(holder) == len(expected)
        assert sorted(index.holder_keys(holder).tolist()) == expected


def test_prefix_holders_stop_at_each_holders_first_gap():
    index = ChunkIndex()
    keys = np.arange(1, 11, dtype=np.uint64)
    index.add(1, keys)
    index.add(2, keys[:4])
    index.add(2, keys[5:])  # a gap at chunk 4
    index.add(3, keys[1:])  # never holds chunk 0: not a prefix holder
    assert index.prefix_holders(keys) == {1: 10, 2: 4}
    assert index.prefix_holders(np.array([99], dtype=np.uint64)) == {}


def test_replace_holder_is_exact():
    index = ChunkIndex()
    index.add(7, np.arange(1, 100, dtype=np.uint64))
    index.replace_holder(7, np.arange(50, 60, dtype=np.uint64))
    assert sorted(index.holder_keys(7).tolist()) == list(range(50, 60)) and index.live_keys == 10


@pytest.mark.parametrize("tokens", [[], [0], [1, 2, 3], list(range(0, 2**31, 2**24)), [2**31 - 1]])
def test_lookup_fast_path_agrees_with_the_strict_decoder(tokens):
    for text in (json.dumps(tokens), json.dumps(tokens, separators=(",", ":")), json.dumps(tokens, indent=1)):
        fast = parse_token_array(text.encode())
        strict = msgspec.json.decode(f'{{"tokens": {text}}}'.encode(), type=LookupRequest).tokens
        assert fast is not None and fast.tolist() == strict


@pytest.mark.parametrize(
    "text",
    ["[1,-2]", "[1.5]", '[1,"2"]', "[1e3]", "[2147483648]", "[1,,2]", "[1,2,]", "[true]", "{}", "[[1]]", "[1 2]"],
)
def test_lookup_fast_path_declines_whatever_the_strict_decoder_should_judge(text):
    assert parse_token_array(text.encode()) is None


# -- fleet traffic (the dashboard's rates) -----------------------------------------------------------


def test_traffic_rates_from_heartbeat_totals():
    fleet = FleetTraffic(started_at=100.0, sample_every_s=2.0, rate_window_s=4.0)
    assert fleet.current()["hit_ratio"] is None  # nothing asked yet: no ratio, not 0%
    fleet.sample({}, now=100.0)
    fleet.report(
        ("a", 0),
        Traffic(
            started_at=101.0,
            lookups=4,
            lookup_tokens=1000,
            hit_tokens=800,
            peer_hit_tokens=200,
            pulls=2,
            pulled_bytes=8_000_000,
        ),
    )
    fleet.sample({}, now=102.0)
    fleet.sample({}, now=104.0)  # no heartbeat in between: the window still spans the traffic
    now = fleet.current()
    assert now["lookups_per_s"] == 1.0 and now["hit_ratio"] == 0.8
    assert now["p2p_bytes_per_s"] == 2_000_000 and now["p2p_transfers_per_s"] == 0.5
    fleet.sample({}, now=108.0)  # the window has moved past it
    assert fleet.current()["lookups_per_s"] == 0 and fleet.current()["hit_ratio"] is None
    assert len(fleet.series()) == 3


def test_traffic_baseline_for_older_workers_and_restarts():
    fleet = FleetTraffic(started_at=100.0)
    # Running since before the controller: its first totals are history, not traffic now.
    fleet.report(("old", 0), Traffic(started_at=50.0, lookups=1_000_000, pulled_bytes=10**12))
    assert fleet.totals["lookups"] == 0
    fleet.report(("old", 0), Traffic(started_at=50.0, lookups=1_000_010, pulled_bytes=10**12 + 5))
    assert fleet.totals["lookups"] == 10 and fleet.totals["pulled_bytes"] == 5
    # The same worker restarted: its totals began again, all of them are new.
    fleet.report(("old", 0), Traffic(started_at=150.0, lookups=3))
    assert fleet.totals["lookups"] == 13 and fleet.totals["pulled_bytes"] == 5
    # A worker that started after the controller: everything it reports counts.
    fleet.report(("new", 0), Traffic(started_at=120.0, lookups=7))
    assert fleet.totals["lookups"] == 20


# -- read event ids ----------------------------------------------------------------------------------


def test_read_ids_are_known_while_kept_and_only_to_the_run_that_issued_them():
    reads, other_run = ReadLog(capacity=4), ReadLog(capacity=4)
    first = reads.record("lookup", 512)
    event = reads.get(first)
    assert event is not None and (event.kind, event.num_tokens) == ("lookup", 512)
    assert other_run.get(first) is None and other_run.get(other_run.record("lookup")) is not None
    info = reads.record("query_worker_info")
    assert reads.get(info).kind == "query_worker_info"
    assert reads.get(info.replace("query_worker_info", "lookup")) is None  # the serial is not a lookup's
    for bad in ("", "lookup", "lookup-x-", "lookup-x-1", first + "0", first.replace("-1", "-¹")):
        assert reads.get(bad) is None, bad
    for _ in range(3):
        reads.record("query_instance")
    assert reads.get(first) is None and reads.get(info) is not None  # the oldest is overwritten


def test_reads_leave_the_command_log_alone_and_cost_under_a_few_microseconds():
    commands, reads = EventLog(capacity=10), ReadLog()
    clear = commands.create("clear", "inst-a", {0})
    per_read_s = min(timeit.repeat(lambda: reads.record("lookup", 256), number=10_000, repeat=3)) / 10_000
    assert commands.get(clear.event_id) is clear and commands.newest() == [clear]
    assert per_read_s < 5e-6, f"{per_read_s * 1e6:.2f} us per read id"


# -- command outcomes ---------------------------------------------------------------------------------


class _LeavingBus:
    """A command bus whose worker leaves while a command is in flight: the command then fails as
    unreachable, as a closed channel makes it, after the departure already failed its event."""

    def __init__(self):
        from lmcache_p2p.controller.commands import Capacity

        self.orchestrator = None
        self.capacity = Capacity(fd_limit=65536, socket_limit=65536)  # room for everything here

    async def request(self, worker, command, timeout):
        record = self.orchestrator.registry.remove_worker(worker, "deregistered")
        self.orchestrator.worker_gone(record, "deregistered")
        raise errors.WorkerUnreachable(f"{worker[0]} rank {worker[1]}: closed")

    def connect(self, worker, host, port):
        pass

    def disconnect(self, worker):
        pass


def test_an_event_that_finishes_several_ways_is_counted_once():
    registry, events, metrics, bus = Registry(), EventLog(), Metrics(), _LeavingBus()
    orchestrator = bus.orchestrator = Orchestrator(ControllerSettings(), registry, events, bus, metrics)
    for rank in (0, 1):
        orchestrator.worker_registered(registry.register(register_message("inst-a", rank, tp=2, worker_port=1)))
    with pytest.raises(errors.WorkerUnreachable):
        asyncio.run(orchestrator.health("inst-a"))
    (event,) = events.newest()
    assert event.status == "failed" and "deregistered" in event.error
    orchestrator.command_done(CommandDone(event_id=event.event_id, instance_id="inst-a", rank=1, ok=True))
    assert metrics.total("lmcache_controller_commands_total") == 1

    done = events.create("move", "inst-b", {0, 1})
    for rank in (0, 1, 1):  # the last one a duplicate
        orchestrator.command_done(CommandDone(event_id=done.event_id, instance_id="inst-b", rank=rank, ok=True))
    assert done.status == "done" and metrics.total("lmcache_controller_commands_total") == 2


# -- errors and their HTTP status -------------------------------------------------------------------


def test_every_controller_error_has_its_http_status_in_the_api():
    # The core's errors (errors.py) and HTTP's own (api.py: token, content type, body size).
    kinds = {
        e
        for module in (errors, api)
        for e in vars(module).values()
        if isinstance(e, type) and issubclass(e, errors.ControllerError) and e is not errors.ControllerError
    }
    assert set(HTTP_STATUS) == kinds
    assert HTTP_STATUS[errors.WorkerUnreachable] == 504 and HTTP_STATUS[errors.InvalidRequest] == 422


# -- what importing the controller loads --------------------------------------------------------------


def test_the_controller_imports_no_engine_side_module():
    """Every module of the controller package, imported in a fresh interpreter, loads neither torch,
    vLLM, nor the engine side of this project (worker, cache engine, storage tiers)."""
    code = """
import json, pkgutil, sys
import lmcache_p2p.controller as package
for module in pkgutil.iter_modules(package.__path__):
    __import__(f"lmcache_p2p.controller.{module.name}")
forbidden = ("torch", "vllm", "lmcache_p2p.worker", "lmcache_p2p.cache_engine", "lmcache_p2p.storage")
print(json.dumps({"imported": sorted(m for m in sys.modules if m.startswith("lmcache_p2p.controller.")),
                  "forbidden": sorted(m for m in sys.modules if m.startswith(forbidden))}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = json.loads(out.stdout)
    assert {"lmcache_p2p.controller.api", "lmcache_p2p.controller.service", "lmcache_p2p.controller.cli"} <= set(
        loaded["imported"]
    )
    assert loaded["forbidden"] == []


# -- admission: every Register field checked ----------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "changes"),
    [
        ("chunk_size", {"chunk_size": 0}),
        ("layout.tp_size", {"layout": msgspec.structs.replace(layout(), tp_size=0)}),
        ("rank", {"rank": 3}),
        ("host", {"host": "a..b"}),
        ("worker_port", {"worker_port": 65536}),
        ("locations", {"locations": ["LocalCPUBackend; DROP"]}),
        ("max_warm_peers", {"max_warm_peers": -3}),
    ],
)
def test_the_registry_refuses_an_out_of_bounds_register_and_stays_unchanged(field, changes):
    registry = Registry()
    with pytest.raises(RegisterRefused) as refused:
        registry.register(register_message(**changes))
    assert refused.value.field == field and f"Register field {field}=" in refused.value.message
    assert registry.workers == {} and registry.holders == []
    assert registry.register(register_message()).key == ("inst", 0)


def test_host_syntax_accepts_names_and_ipv4_and_refuses_the_rest():
    for host in ("127.0.0.1", "10.1.2.3", "localhost", "node-7.cluster.local", "gpu_box_3"):
        check_host_syntax(host)
    for host in ("", "-lead.example", "a" * 64 + ".x", "1.2.3", "300.1.1.1", "::1", "0.0.0.0", "224.0.0.1", "a b"):
        with pytest.raises(RegisterRefused):
            check_host_syntax(host)


def test_an_unresolvable_host_is_refused_and_the_answer_cached():
    hosts = HostCheck(timeout_s=5.0)

    async def main():
        await hosts.check("localhost")
        await hosts.check("192.0.2.7")  # an IPv4 literal needs no lookup
        for _ in range(2):  # the second from the cache
            with pytest.raises(RegisterRefused, match="does not resolve"):
                await hosts.check("no-such-host.invalid")

    asyncio.run(main())


def test_capacity_refuses_past_the_descriptor_budget_with_what_to_set():
    capacity = Capacity(fd_limit=4000, socket_limit=65535)
    assert capacity.max_channels == 800 and capacity.max_sockets == 800 + SPARE_SOCKETS
    in_use = fds_in_use()
    registered = 0
    with pytest.raises(RegisterRefused) as refused:
        for registered in range(4000):  # noqa: B007  (how far it got is the point)
            capacity.check_room(registered, open_channels=0)
    # Counted once, then each registration counts three descriptors (a rank's connections),
    # with every channel's two kept in reserve and the margin spare.
    expected = (4000 - 2 * 800 - FD_MARGIN - FDS_PER_RANK - in_use) // FDS_PER_RANK
    assert abs(registered - expected) <= 3, (registered, expected)
    assert "controller at capacity" in refused.value.message and "ulimit -n" in refused.value.message
    assert capacity.needed_for(10_000) >= 10_000 * (FDS_PER_RANK + FDS_PER_CHANNEL)


# -- traffic totals checked -----------------------------------------------------------------------------


def test_impossible_traffic_totals_are_refused_and_a_backwards_total_adds_nothing():
    fleet = FleetTraffic(started_at=100.0)
    worker, t0 = ("w", 0), 1000.0
    fleet.report(worker, Traffic(started_at=50.0, lookups=10, pulled_bytes=10**9), now=t0)  # baseline
    fleet.report(worker, Traffic(started_at=50.0, lookups=12, pulled_bytes=2**64 - 1), now=t0 + 5)
    assert fleet.totals["lookups"] == 2 and fleet.totals["pulled_bytes"] == 0 and fleet.refused == 1
    # 10^15 bytes in 5 s: more than any link moves (100 GB/s over 5 s plus 10 s of slack).
    fleet.report(worker, Traffic(started_at=50.0, lookups=12, pulled_bytes=10**15), now=t0 + 10)
    assert fleet.totals["pulled_bytes"] == 0 and fleet.refused == 2
    # The baseline stayed at the last good value: a sane total counts against it.
    fleet.report(worker, Traffic(started_at=50.0, lookups=12, pulled_bytes=10**9 + 4096), now=t0 + 15)
    assert fleet.totals["pulled_bytes"] == 4096
    # Backwards without a new started_at: an unannounced restart, a new baseline, never negative.
    fleet.report(worker, Traffic(started_at=50.0, lookups=3, pulled_bytes=100), now=t0 + 20)
    assert fleet.totals["lookups"] == 2 and fleet.totals["pulled_bytes"] == 4096
    fleet.report(worker, Traffic(started_at=50.0, lookups=4, pulled_bytes=150), now=t0 + 25)
    assert fleet.totals["lookups"] == 3 and fleet.totals["pulled_bytes"] == 4146
    # A negative total and a non-finite start are refused or ignored, not summed.
    fleet.report(("x", 0), Traffic(started_at=float("nan"), lookups=-5), now=t0)
    assert fleet.totals["lookups"] == 3


# -- partial results keep their reason --------------------------------------------------------------------


def test_a_partial_success_keeps_its_reason_and_a_failure_leads():
    events = EventLog()
    move = events.create("move", "inst", {0, 1})
    events.rank_done(move, 0, True, 48, "CPU pool full: reserved 3 of 4 pages")
    events.rank_done(move, 1, True, 64, None)
    assert move.status == "done" and move.num_tokens == 48
    assert move.error == "rank 0: CPU pool full: reserved 3 of 4 pages"
    failed = events.create("move", "inst", {0, 1})
    events.rank_done(failed, 0, True, 16, "destination holds 1 of 4")
    events.rank_done(failed, 1, False, 0, "peer refused")
    assert failed.status == "failed" and failed.error == "rank 1: peer refused; rank 0: destination holds 1 of 4"


# -- rate-limited logging -------------------------------------------------------------------------------


def test_rate_limited_log_writes_one_line_per_key_per_interval_and_counts_the_rest(caplog):
    now = [0.0]
    log = RateLimitedLog(logging.getLogger("lmcache_p2p.test_rate"), every_s=10.0, max_keys=2, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="lmcache_p2p.test_rate"):
        for n in range(1000):
            log.warning("pull", "bad frame %d", n)
        log.warning("reply", "bad frame on reply")
        for key in range(50):  # keys past max_keys share one: still bounded
            log.warning(("other", key), "odd %d", key)
        now[0] = 12.0
        log.warning("pull", "bad frame %d", 1000)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "bad frame 0",
        "bad frame on reply",
        "odd 0",
        "bad frame 1000 (... and 999 more in the last 12 s)",
    ]
    assert log.held_back == 999 + 49
    assert caplog.records[0].filename == "test_controller_units.py"  # the caller's line, not the helper's
