"""The worker's threads on the cores the engine may use, not only on its rank's compute core.

vLLM's CPU engine binds each rank's thread to that rank's OpenMP cores (``VLLM_CPU_OMP_THREADS_BIND``),
and a thread starts with the binding of the thread that started it: the worker's loop thread, its
ZMQ I/O threads, the tcp data threads and the checksum pool all land on the compute core. A peer's
pull from this rank then waits for the rank's own steps, and for whatever else the host runs on
that core.

The engine's other processes (its API server, its engine core) are left unbound, so the cores the
process that started this rank may use are the ones the engine may use: the worker's loop thread
takes those at its start, and every thread it starts inherits them. GPU engines are left alone (a
binding there is a NUMA choice).
"""

from __future__ import annotations

import os


def describe_cores(cores: set[int]) -> str:
    """``0-3,8`` for {0, 1, 2, 3, 8}."""
    runs: list[list[int]] = []
    for core in sorted(cores):
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(f"{first}-{last}" if last > first else str(first) for first, last in runs)


def widen_to_engine_cores() -> tuple[set[int], set[int]] | None:
    """Give the calling thread the cores of the process that started ours, when it is bound to
    fewer of them (a rank's compute binding): ``(bound, now)``. None when there was nothing to
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
    try:
        os.sched_setaffinity(0, engine)
    except OSError:  # a cpuset that does not allow them
        return None
    return bound, engine
