"""The worker's threads on the cores the engine may use, not only on its rank's compute core.

vLLM's CPU engine binds each rank's thread to that rank's OpenMP cores (``VLLM_CPU_OMP_THREADS_BIND``),
and a thread starts with the binding of the thread that started it: the worker's loop thread, its
ZMQ I/O threads and the tcp data threads land on the compute core. A peer's pull from this rank
then waits for the rank's own steps, and for whatever else the host runs on that core.

The engine's other processes (its API server, its engine core) are left unbound, so the cores the
process that started this rank may use are the ones the engine may use. The worker's loop thread
takes those at its start, and every thread it starts inherits them; where
``VLLM_CPU_OMP_THREADS_BIND`` lists every rank's cores (``0-31|32-63``), only those no rank
computes on (vLLM leaves some for the rest of the engine), unless none is left (a 2-core host
with a rank per core). Threads started on the engine's own thread (the scheduler's lookup server,
the store's checksum and disk threads) stay where the engine put them. GPU engines are left alone
(a binding there is a NUMA choice).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

OMP_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def describe_cores(cores: set[int]) -> str:
    """``0-3,8`` for {0, 1, 2, 3, 8}."""
    runs: list[list[int]] = []
    for core in sorted(cores):
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(f"{first}-{last}" if last > first else str(first) for first, last in runs)


def ranks_compute_cores(env: Mapping[str, str]) -> set[int] | None:
    """Every rank's OpenMP cores from an explicit ``VLLM_CPU_OMP_THREADS_BIND`` (a core list per
    rank, ``|`` between ranks: ``0-31|32-63``, ``0,2|1,3``); None when vLLM chooses them
    (``auto``), binds none, or the value is not such a list."""
    cores: set[int] = set()
    try:
        for rank in env.get(OMP_BIND_ENV, "").split("|"):
            for part in rank.split(","):
                first, _, last = part.strip().partition("-")
                cores.update(range(int(first), int(last or first) + 1))
    except ValueError:
        return None
    return cores or None


def widen_to_engine_cores(env: Mapping[str, str] = os.environ) -> tuple[set[int], set[int]] | None:
    """Give the calling thread the cores of the process that started ours, when it is bound to
    fewer of them (a rank's compute binding): ``(bound, now)``. Of those, the ones no rank
    computes on when ``env`` says which and some are left. None when there was nothing to
    widen, or the OS does not say or refuses."""
    if not hasattr(os, "sched_setaffinity"):  # not Linux
        return None
    try:
        bound = os.sched_getaffinity(0)  # 0: this thread
        engine = os.sched_getaffinity(os.getppid())
    except OSError:  # the parent is gone or not ours to read
        return None
    if not bound < engine:
        return None
    spare = engine - (ranks_compute_cores(env) or set())
    now = spare or engine
    try:
        os.sched_setaffinity(0, now)
    except OSError:  # a cpuset that does not allow them
        return None
    return bound, now
