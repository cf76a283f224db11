"""Where the worker's threads run on a CPU engine: off the cores vLLM bound its ranks' compute to
when the binding leaves some spare, else on every core the engine may use."""

from __future__ import annotations

import os
import threading

import pytest

from lmcache_p2p.worker.cpu_cores import describe_cores, ranks_compute_cores, widen_to_engine_cores


@pytest.mark.parametrize(
    ("value", "cores"),
    [
        ("0-3|4-7", set(range(8))),
        ("0,2|1,3", {0, 1, 2, 3}),
        (" 0 | 1 ", {0, 1}),
        ("auto", None),
        ("nobind", None),
        ("", None),
        ("0-x|1", None),
    ],
)
def test_every_ranks_compute_cores_are_read_from_an_explicit_binding(value, cores):
    assert ranks_compute_cores({"VLLM_CPU_OMP_THREADS_BIND": value}) == cores
    assert ranks_compute_cores({}) is None


def test_cores_are_described_as_ranges():
    assert describe_cores({0, 1, 2, 3, 8}) == "0-3,8"
    assert describe_cores({1, 3}) == "1,3"


def _in_a_thread_bound_to(core: int, env: dict[str, str]) -> tuple[object, set[int]]:
    """widen_to_engine_cores' answer in a fresh thread bound to ``core``, and that thread's cores after."""
    out: list = []

    def run() -> None:
        os.sched_setaffinity(0, {core})
        out.append(widen_to_engine_cores(env))
        out.append(os.sched_getaffinity(0))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out[0], out[1]


needs_two_cores = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(os.getppid())) < 2,
    reason="needs Linux and two cores this test's parent process may use",
)


@needs_two_cores
def test_a_thread_bound_to_one_core_takes_every_core_of_the_engine_when_none_is_spare():
    engine = os.sched_getaffinity(os.getppid())
    core = min(engine)
    every_core = "|".join(str(c) for c in sorted(engine))  # a rank on each core: none spare
    for env in ({}, {"VLLM_CPU_OMP_THREADS_BIND": "auto"}, {"VLLM_CPU_OMP_THREADS_BIND": every_core}):
        widened, now = _in_a_thread_bound_to(core, env)
        assert widened == ({core}, engine) and now == engine, env


@needs_two_cores
def test_a_thread_takes_only_the_cores_no_rank_computes_on_when_some_are_spare():
    engine = sorted(os.sched_getaffinity(os.getppid()))
    ranks = {"VLLM_CPU_OMP_THREADS_BIND": str(engine[0])}  # one rank on the first core
    widened, now = _in_a_thread_bound_to(engine[0], ranks)
    assert now == set(engine[1:]) and widened == ({engine[0]}, set(engine[1:]))


@needs_two_cores
def test_a_thread_on_every_core_already_is_left_alone():
    engine = os.sched_getaffinity(os.getppid())
    out: list = []

    def run() -> None:
        os.sched_setaffinity(0, engine)
        out.append(widen_to_engine_cores({}))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert out == [None]
