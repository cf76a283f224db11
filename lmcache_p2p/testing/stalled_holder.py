"""A stalled holder must not stall the asking engine (benchmarks/bench_stalled_holder.py and
tests/test_stalled_holder.py run this): vLLM CPU engines, engine 1 holding prompts and one
asking engine per lookup mode. Each asker in turn streams a long generation; gets a cold prompt
(what one prefill costs the stream); then, engine 1 stopped with SIGSTOP, a prompt engine 1
holds. Its pull from the stopped holder gives up and the prompt is recomputed; the stream must
keep its pace meanwhile, as it does around the cold prompt.

:func:`run_stalled_stores` does the same with a stopped remote store (Redis, ``lmcache_server``)
in the holder's place: an engine whose lookups ask the store which chunks it holds.
"""

from __future__ import annotations

import os
import signal
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from lmcache_p2p.testing.processes import CPU_ENGINE_ENV, freeze_group, wait_indexed
from lmcache_p2p.testing.served_fleet import ServedFleet
from lmcache_p2p.testing.tiny_model import sample_text

# The seeds' asynchronous lookups, and the default (synchronous) ones.
LOOKUP_MODES = {
    "async": {"enable_async_loading": True, "extra_config": {"lookup_backoff_time": 0.001}},
    "sync": {},
}
STREAM_TOKENS = 1200
ABORT_AFTER_S = 0.5  # the abandoning client's timeout
PROMPT_WORDS = 1500


def _stream(url: str, model: str, prompt: str, out: list[float]) -> None:
    """Stream a greedy completion of STREAM_TOKENS tokens, appending each one's arrival time."""
    body = {"model": model, "prompt": prompt, "max_tokens": STREAM_TOKENS, "temperature": 0.0, "stream": True}
    body["ignore_eos"] = True
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(time.monotonic())


def _largest_gap(arrivals: list[float], start: float, end: float) -> float:
    """The longest wait for a token that arrived after ``start``, over tokens up to ``end``."""
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False) if b > start and a < end]
    return max(gaps, default=0.0)


def run(
    model: str, workdir: Path, modes: list[str], seed: int = 100, extra: dict | None = None, abort: bool = False
) -> list[dict]:
    """One fleet: engine 1 holds the prompt, engine i + 2 asks in lookup ``modes[i]``
    (LOOKUP_MODES), one after another; each asker's figures, with the fleet's logs' directory.
    Engines are pinned to cores in turn, so an asker may share its core with the holder, which
    is stopped while it is measured. With ``abort``, then a request to the first asker for
    another held prompt is abandoned by its client while the holder is stopped
    (:func:`_abort_while_stalled`): its figures come last."""
    fleet = ServedFleet(
        workdir,
        model,
        engines=1 + len(modes),
        engine_env={**CPU_ENGINE_ENV, "VLLM_LOGGING_LEVEL": "INFO"},
        engine_extra=extra or {},
        engine_extras={i + 2: LOOKUP_MODES[mode] for i, mode in enumerate(modes)},
        pin_engines=True,
    )
    fleet.start()
    try:
        holder = fleet.engine_urls[0]
        for i, url in enumerate(fleet.engine_urls):  # each engine's first forward pass out of the figures
            _complete(url, model, sample_text(300, seed=seed + 500 + i))
        # One prompt per asker (and one for the abort): an asker that recomputed one holds it too.
        held = [sample_text(PROMPT_WORDS, seed=seed + i) for i in range(len(modes) + abort)]
        expected = [_complete(holder, model, prompt) for prompt in held]

        def indexed(prompt: str) -> None:
            # Right before each stop: a holder stopped for the run before may have missed
            # heartbeats, and the controller offers its chunks again only once it re-registered them.
            if not wait_indexed(holder, fleet.controller_url, model, prompt, timeout=30):
                raise RuntimeError("the controller did not index the holder's chunks")

        group = os.getpgid(fleet.processes["engine1"].process.pid)

        def stop_holder(sig: int) -> None:
            freeze_group(group) if sig == signal.SIGSTOP else os.killpg(group, sig)

        runs = []
        for i, mode in enumerate(modes):
            indexed(held[i])
            figures = _ask_while_stalled(fleet.engine_urls[i + 1], model, held[i], stop_holder, seed + 100 + i)
            same = figures.pop("answer") == expected[i]
            runs.append({"mode": mode, **figures, "same_output": same, "logs": str(workdir)})
        if abort:
            indexed(held[-1])
            figures = _abort_while_stalled(fleet.engine_urls[1], model, held[-1], group)
            runs.append({"mode": "abort", **figures, "logs": str(workdir)})
        return runs
    finally:
        fleet.stop()


def _complete(url: str, model: str, prompt: str) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=300).json()["choices"][0]["text"]


def run_stalled_stores(
    model: str, workdir: Path, stores: list[tuple[str, str, Callable[[int], None]]], seed: int = 300
) -> list[dict]:
    """One fleet, an engine per remote store (``stores``: name, ``remote_url``, and how to signal
    the store's process), peers off; each engine in turn streams, gets a cold prompt, then a
    prompt while its store is stopped (SIGSTOP): that lookup's ``exists`` round goes unanswered
    and the prompt is recomputed. Each engine's figures, with the fleet's logs' directory."""
    fleet = ServedFleet(
        workdir,
        model,
        engines=len(stores),
        engine_env={**CPU_ENGINE_ENV, "VLLM_LOGGING_LEVEL": "INFO"},
        engine_extras={i + 1: {"remote_url": url, "enable_p2p": False} for i, (_, url, _) in enumerate(stores)},
        pin_engines=True,
    )
    fleet.start()
    try:
        for i, url in enumerate(fleet.engine_urls):  # each engine's first forward pass out of the figures
            _complete(url, model, sample_text(300, seed=seed + 500 + i))
        runs = []
        for i, (name, _, signal_store) in enumerate(stores):
            prompt = sample_text(PROMPT_WORDS, seed=seed + i)
            figures = _ask_while_stalled(fleet.engine_urls[i], model, prompt, signal_store, seed + 100 + i)
            figures.pop("answer")
            runs.append({"store": name, "engine": f"engine{i + 1}", **figures, "logs": str(workdir)})
        return runs
    finally:
        fleet.stop()


def _ask_while_stalled(asker: str, model: str, held: str, stop: Callable[[int], None], seed: int) -> dict:
    """Stream from ``asker``; send it a cold prompt, then, what it would ask stopped (``stop``
    sends it a signal: the holder, the store), the held prompt."""
    arrivals: list[float] = []
    streamer = threading.Thread(target=_stream, args=(asker, model, sample_text(20, seed=seed), arrivals))
    streamer.start()
    while len(arrivals) < 50:
        time.sleep(0.01)
    c0 = time.monotonic()
    _complete(asker, model, sample_text(PROMPT_WORDS, seed=seed + 1000))  # a cold prompt: one prefill
    c1 = time.monotonic()
    time.sleep(0.2)
    stop(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        answer = _complete(asker, model, held)
        t1 = time.monotonic()
    finally:
        stop(signal.SIGCONT)
    streamer.join()
    if not arrivals or arrivals[-1] < t1:
        raise RuntimeError("the stream ended before the stalled request: make STREAM_TOKENS longer")
    median = statistics.median(b - a for a, b in zip(arrivals[:49], arrivals[1:50], strict=True))
    return {
        "median_gap_ms": round(median * 1e3, 2),
        "largest_gap_cold_prompt_ms": round(_largest_gap(arrivals, c0, c1) * 1e3, 1),
        "largest_gap_stalled_holder_ms": round(_largest_gap(arrivals, t0, t1) * 1e3, 1),
        "cold_prompt_s": round(c1 - c0, 3),
        "stalled_request_s": round(t1 - t0, 3),
        "answer": answer,
    }


def _abort_while_stalled(asker: str, model: str, held: str, holder_group: int) -> dict:
    """The held prompt sent to ``asker`` while the holder is stopped, its client gone after
    ABORT_AFTER_S (vLLM aborts the request mid-pull); then, the holder still stopped, a cold
    prompt: how long it took (the engine must not wait on the aborted pull)."""
    freeze_group(holder_group)
    try:
        t0 = time.monotonic()
        body = {"model": model, "prompt": held, "max_tokens": 4, "temperature": 0.0}
        try:
            httpx.post(f"{asker}/v1/completions", json=body, timeout=ABORT_AFTER_S)
            abandoned = False
        except httpx.TimeoutException:
            abandoned = True
        t1 = time.monotonic()
        _complete(asker, model, sample_text(PROMPT_WORDS, seed=7777))
        t2 = time.monotonic()
    finally:
        os.killpg(holder_group, signal.SIGCONT)
    return {"abandoned": abandoned, "abandoned_after_s": round(t1 - t0, 3), "next_request_s": round(t2 - t1, 3)}
