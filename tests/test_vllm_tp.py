"""Tensor parallelism end to end: two real vLLM CPU engines at --tensor-parallel-size 2, seed
004's configuration with a port per rank in every port list, one controller, P2P over tcp (over
NIXL, two of three ``bench_tp.py --channel nixl`` runs on this host had a rank silent for minutes:
docs/tensor-parallelism.md, "Small CPU hosts").

Each engine is four processes (API server, EngineCore, two worker ranks) on this host's cores;
the ranks are pinned and torch.compile is off (``served_fleet.tp_engine_env``:
docs/tensor-parallelism.md, "Small CPU hosts", says why). The oracle is engine 1's own greedy output: whatever a
rank loaded, pulled or recomputed, engine 2 must answer the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml
import zmq.asyncio
from protocol_client import wait_for

from lmcache_p2p.protocol import ClearCommand, CommandReply, command_reply_decoder
from lmcache_p2p.rpc import RpcClient
from lmcache_p2p.testing.processes import peer_pulls, stream_completion, wait_peer_pulls
from lmcache_p2p.testing.served_fleet import ServedFleet
from lmcache_p2p.testing.tiny_model import sample_text

# One TP fleet at a time: with test_blend_tp's beside it, eight pinned ranks on two cores
# starved a holder past its pull timeout (make test-floor, once).
pytestmark = [pytest.mark.engine, pytest.mark.xdist_group("tensor_parallel")]

CHUNK = 256
CPU = "LocalCPUBackend"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_model):
    fleet = ServedFleet(
        tmp_path_factory.mktemp("tp2"),
        tiny_model,
        tp=2,
        ports_per_rank=True,
        engine_extra={
            "transfer_channel": "tcp",
            # Which chunks each rank is offered and pulls, not whether a pull beats recomputing:
            # under "auto" a rank whose first pull measured its link slow (start-up, two busy
            # cores) recomputed instead, once in make test (test_pull_policy*.py test that choice).
            "p2p_pull_policy": "always",
            # Whether each rank pulls, not how fast: eight pinned ranks and the other pytest
            # worker's engines on two cores kept a holder from answering within the default 2 s
            # (make test-floor, twice).
            "p2p_pull_timeout_s": 15,
            "enable_async_loading": True,
            "extra_config": {"lookup_backoff_time": 0.001},
        },
        engine_args=("--max-num-seqs", "4"),
        controller_args=("--worker-timeout", "6"),
    )
    try:
        fleet.start(timeout=400)
        fleet.first_forward(1200)
        yield fleet
    finally:
        fleet.stop()


def token_ids(fleet: ServedFleet, text: str) -> list[int]:
    body = {"model": fleet.model, "prompt": text}
    return httpx.post(f"{fleet.engine_urls[0]}/tokenize", json=body, timeout=30).json()["tokens"]


def controller(fleet: ServedFleet, path: str, body: dict) -> dict:
    response = httpx.post(f"{fleet.controller_url}{path}", json=body, timeout=30)
    response.raise_for_status()
    return response.json()


def held(fleet: ServedFleet, tokens: list[int]) -> tuple[dict, dict]:
    """/lookup's layout_info, and {(instance, rank): tokens} of its holders."""
    answer = controller(fleet, "/lookup", {"tokens": tokens})
    ranks = {(h["instance_id"], h["worker_id"]): h["matched_tokens"] for h in answer["holders"]}
    return answer["layout_info"], ranks


def pulls(log: str) -> list[tuple[int, int, str, int]]:
    """(rank, tokens, peer instance, peer rank) of every pull in an engine's log."""
    return [(p["rank"], int(p["tokens"]), p["peer_instance"], p["peer_rank"]) for p in peer_pulls(log)]


def hit_tokens(log: str, total: int) -> list[int]:
    """'LMCache hit tokens' of every request of ``total`` prompt tokens the scheduler logged."""
    return [int(n) for n in re.findall(rf"Total tokens {total}, LMCache hit tokens: (\d+)", log)]


def full_chunks(tokens: list[int]) -> int:
    return len(tokens) // CHUNK * CHUNK


def test_engine_2_pulls_rank_by_rank_and_answers_like_engine_1(fleet):
    e1, e2 = fleet.engine_urls
    prompt = sample_text(1200, seed=1)
    tokens = token_ids(fleet, prompt)
    cold = stream_completion(e1, fleet.model, prompt)
    wait_for(lambda: held(fleet, tokens)[0] == {"engine1": [CPU, full_chunks(tokens)]}, 15, "both ranks indexed")

    warm = stream_completion(e2, fleet.model, prompt)
    assert warm["text"] == cold["text"]
    engine2 = fleet.processes["engine2"]
    wait_peer_pulls(engine2.log, 2, holder_log=fleet.processes["engine1"].log)  # each rank logs its own
    log = engine2.log()
    assert sorted(pulls(log)) == [(0, full_chunks(tokens), "engine1", 0), (1, full_chunks(tokens), "engine1", 1)]
    assert hit_tokens(log, len(tokens))[-1] == full_chunks(tokens)


async def _clear_rank(port: int) -> CommandReply:
    """What the controller's /clear sends each rank, sent to one rank only: its tier then differs
    from the other rank's, as after an eviction on one rank."""
    ctx = zmq.asyncio.Context()
    client = RpcClient(ctx, f"tcp://127.0.0.1:{port}", command_reply_decoder, "test")
    try:
        return await client.request(ClearCommand(event_id="clear-rank-1", location=CPU), CommandReply, 10)
    finally:
        client.close()
        ctx.destroy(0)


def test_when_the_ranks_hold_different_prefixes_only_what_both_hold_is_offered_and_loaded(fleet):
    e1, e2 = fleet.engine_urls
    tokens = token_ids(fleet, sample_text(1200, seed=2))
    chunks = full_chunks(tokens) // CHUNK
    assert chunks >= 4
    cold = stream_completion(e1, fleet.model, tokens)
    wait_for(lambda: held(fleet, tokens)[0] == {"engine1": [CPU, chunks * CHUNK]}, 15, "both ranks indexed")

    rank_1_port = yaml.safe_load((fleet.workdir / "engine1.yaml").read_text())["lmcache_worker_ports"][1]
    assert asyncio.run(_clear_rank(rank_1_port)).ok
    wait_for(lambda: held(fleet, tokens)[0] == {}, 15, "engine 1 to stop offering the prompt: rank 1 holds none")
    # The first two chunks again, with another tail: rank 1 stores them, rank 0 has them already.
    stream_completion(e1, fleet.model, tokens[: 2 * CHUNK] + token_ids(fleet, sample_text(200, seed=3)))
    wait_for(
        lambda: (
            held(fleet, tokens)
            == ({"engine1": [CPU, 2 * CHUNK]}, {("engine1", 0): chunks * CHUNK, ("engine1", 1): 2 * CHUNK})
        ),
        15,
        "rank 0 to hold every chunk and rank 1 the first two",
    )

    before = len(pulls(fleet.processes["engine2"].log()))
    warm = stream_completion(e2, fleet.model, tokens)
    assert warm["text"] == cold["text"]
    # Rank 0 of engine 2 could pull every chunk from engine 1's rank 0; it is offered, and pulls,
    # only the two its rank 1 can get too.
    engine2 = fleet.processes["engine2"]
    wait_peer_pulls(engine2.log, before + 2, holder_log=fleet.processes["engine1"].log)
    log = engine2.log()
    assert sorted(pulls(log)[before:]) == [(0, 2 * CHUNK, "engine1", 0), (1, 2 * CHUNK, "engine1", 1)]
    assert hit_tokens(log, len(tokens))[-1] == 2 * CHUNK


def test_move_moves_both_ranks_chunks(fleet):
    e1, e2 = fleet.engine_urls
    tokens = token_ids(fleet, sample_text(1000, seed=4))
    cold = stream_completion(e1, fleet.model, tokens)
    wait_for(lambda: held(fleet, tokens)[0] == {"engine1": [CPU, full_chunks(tokens)]}, 15, "both ranks indexed")

    moved = controller(
        fleet, "/move", {"old_position": ["engine1", CPU], "new_position": ["engine2", CPU], "tokens": tokens}
    )
    wait_for(
        lambda: controller(fleet, "/check_finish", {"event_id": moved["event_id"]})["status"] == "done",
        30,
        "the move to finish",
    )
    everything = full_chunks(tokens)
    wait_for(
        lambda: (
            held(fleet, tokens)
            == ({"engine2": [CPU, everything]}, {("engine2", 0): everything, ("engine2", 1): everything})
        ),
        15,
        "both ranks of engine 2, and no rank of engine 1, to hold the prompt",
    )

    before = len(pulls(fleet.processes["engine2"].log()))
    assert stream_completion(e2, fleet.model, tokens)["text"] == cold["text"]
    log = fleet.processes["engine2"].log()
    assert len(pulls(log)) == before, "engine 2 pulled instead of loading what was moved to it"
    assert hit_tokens(log, len(tokens))[-1] == full_chunks(tokens)


def _cores(pid: int, tid: int) -> str | None:
    """A thread's Cpus_allowed_list; None once it has exited."""
    try:
        status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    except OSError:
        return None
    return next(line.split()[-1] for line in status.splitlines() if line.startswith("Cpus_allowed_list"))


def _rank_processes(fleet: ServedFleet, engine: str) -> list[psutil.Process]:
    parent = psutil.Process(fleet.processes[engine].process.pid)
    ranks = []
    for child in parent.children(recursive=True):
        with contextlib.suppress(psutil.Error):  # a child gone meanwhile
            # The ranks, not a helper a rank started that took its title
            if "Worker_TP" in child.name() and "Worker_TP" not in psutil.Process(child.ppid()).name():
                ranks.append(child)
    return ranks


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores: each rank is bound to one")
def test_each_rank_serves_peers_from_every_core_its_engine_may_use(fleet):
    """vLLM binds a rank's thread to its core; the worker's threads (which serve peers' pulls) must
    not all sit there with it, behind its steps and whatever else the host put on that core."""
    for engine in ("engine1", "engine2"):
        ranks = _rank_processes(fleet, engine)
        assert len(ranks) == 2, f"{engine}: {len(ranks)} rank processes"
        for rank in ranks:
            engine_cores = _cores(rank.ppid(), rank.ppid())  # its engine core's main thread: unbound
            bound = _cores(rank.pid, rank.pid)
            assert bound != engine_cores, f"{engine} {rank.name()}: vLLM left the rank unbound ({bound})"
            spread = [t.id for t in rank.threads() if _cores(rank.pid, t.id) == engine_cores]
            # The worker's loop thread, its ZMQ I/O threads, the tcp data threads...
            assert len(spread) >= 3, f"{engine} {rank.name()}: {len(spread)} thread(s) on cores {engine_cores}"


def test_a_killed_rank_makes_its_instance_a_miss_not_half_a_prompt(fleet):
    """Last in this module: it takes engine 1 down (vLLM stops an engine whose worker died)."""
    e1, e2 = fleet.engine_urls
    tokens = token_ids(fleet, sample_text(1000, seed=5))
    cold = stream_completion(e1, fleet.model, tokens)
    wait_for(lambda: held(fleet, tokens)[0] == {"engine1": [CPU, full_chunks(tokens)]}, 15, "both ranks indexed")

    engine1 = psutil.Process(fleet.processes["engine1"].process.pid)
    rank_1 = []
    for child in engine1.children(recursive=True):
        with contextlib.suppress(psutil.Error):  # a child gone meanwhile
            if "Worker_TP1" in " ".join(child.cmdline()) + child.name():
                rank_1.append(child)
    assert rank_1, "no Worker_TP1 process under engine 1"
    for process in rank_1:  # the rank, and any helper that took its title
        with contextlib.suppress(psutil.Error):
            process.send_signal(signal.SIGKILL)
    wait_for(lambda: held(fleet, tokens)[0] == {}, 30, "the controller to stop offering engine 1's prompt")

    before = len(pulls(fleet.processes["engine2"].log()))
    started = time.monotonic()
    answer = stream_completion(e2, fleet.model, tokens)
    assert answer["text"] == cold["text"]
    log = fleet.processes["engine2"].log()
    assert len(pulls(log)) == before, "a rank of engine 2 pulled from the half-dead engine 1"
    assert hit_tokens(log, len(tokens))[-1] == 0
    assert time.monotonic() - started < 30
