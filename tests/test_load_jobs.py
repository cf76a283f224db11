"""A rank's loads beside the steps as jobs by id (integration/vllm/load_jobs.py, async_loads.py):
the phase table, and every event driven through a rank's jobs: grants, landings, a pull's end or
deadline, aborts in each phase, a piece that cannot be queued, and a request granted again after
a preemption, and a blended load's segment pulls. Copies are stand-ins "on a device"
(test_load_timing.TimedCopy) where their timing is the point."""

from __future__ import annotations

import concurrent.futures
import logging
import re
from types import SimpleNamespace

import pytest
from test_load_timing import TimedCopy, stored_prompt

from lmcache_p2p.integration.vllm import async_loads
from lmcache_p2p.integration.vllm.async_loads import AsyncLoads
from lmcache_p2p.integration.vllm.load_jobs import TRANSITIONS, JobEvent, JobPhase, LoadJob, LoadTimeline
from lmcache_p2p.integration.vllm.metadata import LoadSpec
from lmcache_p2p.miss_reasons import PulledChunks

P, E = JobPhase, JobEvent
CHUNK = 32

# The table in our words: what each event does to a job in each phase. Everything else is a bug
# and raises. An abort is taken in every phase (it only gives a pull up).
EXPECTED = {
    P.PULLING: {E.LANDED: P.PULLING, E.PULL_ENDED: P.COPYING, E.PULL_LATE: P.COPYING, E.ABORTED: P.COPYING},
    P.COPYING: {E.ABORTED: P.COPYING, E.COPIES_DONE: P.CHECKING},
    P.CHECKING: {E.ABORTED: P.CHECKING, E.LOADED_ALL: P.DONE, E.LOADED_SHORT: P.FAILED},
    P.DONE: {E.ABORTED: P.DONE},
    P.FAILED: {E.ABORTED: P.FAILED},
}


def a_job(phase: JobPhase) -> LoadJob:
    spec = LoadSpec("r", None, 64, [0, 1, 2, 3], 0, 64, beside_steps=True)  # type: ignore[arg-type]
    return LoadJob(1, spec, LoadTimeline(0.0), phase)


@pytest.mark.parametrize("phase", list(JobPhase))
@pytest.mark.parametrize("event", list(JobEvent))
def test_each_event_moves_a_job_as_the_table_says_and_any_other_is_refused(phase, event):
    job = a_job(phase)
    expected = EXPECTED[phase].get(event)
    if expected is None:
        with pytest.raises(RuntimeError, match=re.escape(f"{event.value} while {phase.value}")):
            job.on(event)
        assert job.phase is phase
    else:
        assert job.on(event) is expected and job.phase is expected
        assert job.aborted == (event is E.ABORTED)


def test_the_table_holds_exactly_the_transitions_written_out_here():
    assert set(TRANSITIONS) == {(p, e) for p, events in EXPECTED.items() for e in events}


def test_a_job_ends_done_or_failed_with_the_blocks_vllm_recomputes():
    job = a_job(P.CHECKING)
    job.end(64, block_size=16)
    assert job.phase is P.DONE and job.unloaded_blocks == []
    short = a_job(P.CHECKING)
    short.end(40, block_size=16)  # block 2 holds tokens 32-47: partly loaded, recomputed
    assert short.phase is P.FAILED and short.loaded_to == 40 and short.unloaded_blocks == [2, 3]


# -- the events driven through a rank's jobs --------------------------------------------------------


@pytest.fixture
def rank(monkeypatch):
    """A CPU engine holding 4 chunks, and its jobs, whose copies are TimedCopy stand-ins "on a
    device"; ``pull()`` makes the engine's next pull one the test lands and ends by hand."""
    engine, kv, hashes, blocks = stored_prompt("cpu", chunks=4)
    monkeypatch.setattr(async_loads, "LayerwiseLoad", TimedCopy)
    TimedCopy.next_seconds, TimedCopy.next_delay = 0.0, 0.0
    jobs = AsyncLoads(engine, [SimpleNamespace(is_cuda=False)])  # type: ignore[list-item]
    pulls: list[tuple[concurrent.futures.Future, object]] = []

    def pull():
        def start(offer, on_landed=None):
            future: concurrent.futures.Future = concurrent.futures.Future()
            pulls.append((future, on_landed))
            return future

        monkeypatch.setattr(engine, "pull_offer_async", start)
        return pulls

    yield SimpleNamespace(engine=engine, hashes=hashes, blocks=blocks, jobs=jobs, pull=pull)
    jobs.close()
    engine.close()


def spec(rank, req_id: str) -> LoadSpec:
    return LoadSpec(req_id, rank.hashes, 4 * CHUNK, rank.blocks, 0, 4 * CHUNK, beside_steps=True)


def granted_pull(rank, req_id: str) -> tuple[LoadJob, concurrent.futures.Future, object]:
    """A grant whose chunks 1-3 a peer offered past the rank's own chunk 0."""
    pulls = rank.pull()
    offer = SimpleNamespace(chunks=3, first=lambda n: offer)
    job = rank.jobs.pull_then_load(spec(rank, req_id), offer, rank.engine.pin_prefix(rank.hashes[:1]))
    assert job is not None and job.phase is P.PULLING
    future, landed = pulls[-1]
    return job, future, landed


def step(rank, computing: bool = True) -> list[LoadJob]:
    rank.jobs.begin_step(512 if computing else 0)
    return rank.jobs.finished()


def test_a_local_grant_copies_then_is_reported_done_once(rank):
    TimedCopy.next_seconds = 0.2
    job = rank.jobs.start(spec(rank, "a"), rank.engine.pin_prefix(rank.hashes))
    assert job.phase is P.COPYING and step(rank) == []  # its copy runs
    job.pieces[0].copy.seconds = 0.0  # ... and ends
    assert step(rank) == [job] and job.phase is P.DONE and job.loaded_to == 4 * CHUNK
    assert step(rank) == [] and rank.jobs.jobs == {}
    assert rank.engine.counters.retrieved_tokens == 4 * CHUNK


def test_a_pull_copies_each_landing_then_the_rest_once_it_ends(rank):
    job, future, landed = granted_pull(rank, "p")
    landed(1)  # chunk 1 is held now (the engine holds all four: the pin finds it)
    assert step(rank) == [] and job.phase is P.PULLING and job.copied_to == 2 * CHUNK
    future.set_result(PulledChunks(3))
    assert step(rank) == [job] and job.phase is P.DONE and len(job.pieces) == 2


def test_a_pull_past_its_deadline_is_given_up_and_loads_what_is_held(rank, monkeypatch, caplog):
    job, future, _ = granted_pull(rank, "late")
    monkeypatch.setattr(async_loads, "PEER_FETCH_TIMEOUT_S", 0.0)
    with caplog.at_level(logging.WARNING):
        ended = step(rank)
    assert future.cancelled() and "pull past its 0 s deadline" in caplog.text
    # The engine held every chunk already: what it holds is loaded, and counted as a timeout miss.
    assert ended == [job] and job.phase is P.DONE


def test_an_abort_while_pulling_gives_the_pull_up_and_the_job_is_still_reported(rank, caplog):
    job, future, landed = granted_pull(rank, "ab")
    landed(1)
    step(rank)
    with caplog.at_level(logging.WARNING):
        rank.jobs.abort("ab")
    assert future.cancelled() and job.phase is P.COPYING and job.aborted
    assert "aborted while pulling" in caplog.text
    assert step(rank) == [job]  # reported, for vLLM to free its blocks


def test_an_abort_while_copying_waits_for_the_copy_and_after_the_end_changes_nothing(rank):
    TimedCopy.next_seconds = 0.2
    copying = rank.jobs.start(spec(rank, "c"), rank.engine.pin_prefix(rank.hashes))
    rank.jobs.abort("c")
    assert copying.phase is P.COPYING and step(rank) == []  # its copy still writes vLLM's blocks
    copying.pieces[0].copy.seconds = 0.0
    assert step(rank) == [copying] and copying.phase is P.DONE

    TimedCopy.next_seconds = 0.0
    ended = rank.jobs.start(spec(rank, "d"), rank.engine.pin_prefix(rank.hashes))
    rank.jobs.begin_step(512)
    for job in rank.jobs.jobs.values():  # what finished() does first: the copy is done and checked
        job.on(E.COPIES_DONE)
        job.end(4 * CHUNK, 16)
    rank.jobs.abort("d")
    assert ended.phase is P.DONE and rank.jobs.finished() == [ended]


def test_a_piece_that_cannot_be_queued_ends_the_load_there_once_the_pull_ends(rank, monkeypatch):
    job, future, landed = granted_pull(rank, "q")
    landed(1)
    step(rank)

    def refuse(*args, **kwargs):
        raise RuntimeError("no room on the load stream")

    monkeypatch.setattr(async_loads, "LayerwiseLoad", refuse)
    landed(2)
    assert step(rank) == [] and job.broken and job.phase is P.PULLING
    monkeypatch.setattr(async_loads, "LayerwiseLoad", TimedCopy)
    landed(3)
    future.set_result(PulledChunks(3))
    assert step(rank) == [job] and job.phase is P.FAILED
    assert job.loaded_to == 2 * CHUNK  # chunks 0-1, the piece before the refused one
    assert job.unloaded_blocks == rank.blocks[2 * CHUNK // 16 :]


def test_a_request_granted_again_after_a_preemption_gets_a_new_job(rank):
    first = rank.jobs.start(spec(rank, "r"), rank.engine.pin_prefix(rank.hashes))
    assert step(rank) == [first]
    again = rank.jobs.start(spec(rank, "r"), rank.engine.pin_prefix(rank.hashes))
    assert again.job_id != first.job_id and rank.jobs.job_of("r") is again
    assert step(rank) == [again]


# -- a blended load's segments, pulled beside the steps -----------------------------------------


def test_a_blended_loads_segments_are_pulled_pinned_whole_and_reported_for_the_step_that_blends(rank):
    """Both segments a peer offered land: the job ends DONE with every chunk pinned here (the
    step that first schedules the request blends from those pins); it copies nothing itself."""
    pulls = rank.pull()
    keys = [int(h) for h in rank.hashes]
    segments = [(keys[:2], SimpleNamespace(chunks=2)), (keys[2:], SimpleNamespace(chunks=2))]
    job = rank.jobs.pull_segments(spec(rank, "b"), segments)  # type: ignore[arg-type]
    assert job.phase is P.PULLING and len(pulls) == 2
    pulls[0][0].set_result(PulledChunks(2))
    assert step(rank) == [] and job.phase is P.PULLING  # one of two pulls ended: nothing is blended yet
    pulls[1][0].set_result(PulledChunks(2))
    assert step(rank, computing=False) == [job]
    assert job.phase is P.DONE and job.loaded_to == 4 * CHUNK and job.pieces == []
    assert job.segments is not None and sorted(job.segments.pins) == sorted(keys)
    job.segments.release()


def test_a_segment_that_does_not_land_whole_fails_the_blended_load_and_its_pins_go(rank):
    """A blend needs every segment: where one pulled segment is not held whole once its pull
    ends (a chunk the holder no longer had), the job fails from the load's start, vLLM
    recomputes the prompt, and no chunk stays pinned for it."""
    pulls = rank.pull()
    keys = [int(h) for h in rank.hashes]
    segments = [(keys[:2], SimpleNamespace(chunks=2)), ([keys[2], 0xDEAD], SimpleNamespace(chunks=2))]
    job = rank.jobs.pull_segments(spec(rank, "c"), segments)  # type: ignore[arg-type]
    for future, _ in pulls:
        future.set_result(PulledChunks(1))
    assert step(rank, computing=False) == [job]
    assert job.phase is P.FAILED and job.loaded_to == 0 and job.unloaded_blocks == rank.blocks
    assert job.segments is not None and job.segments.missing == 1 and job.segments.pins == {}


def test_an_abort_while_segments_pull_gives_the_pulls_up_and_ends_the_job_failed(rank):
    pulls = rank.pull()
    keys = [int(h) for h in rank.hashes]
    job = rank.jobs.pull_segments(spec(rank, "d"), [(keys, SimpleNamespace(chunks=4))])  # type: ignore[arg-type]
    rank.jobs.abort("d")
    assert pulls[0][0].cancelled()
    assert step(rank) == [job] and job.phase is P.FAILED and job.aborted


def test_a_rank_that_holds_every_segment_reports_the_blended_load_at_once(rank):
    """Under TP another rank may pull while this one holds them all: its job ends at the next step."""
    job = rank.jobs.pull_segments(spec(rank, "e"), [])
    assert job.pull is None and step(rank) == [job] and job.phase is P.DONE
