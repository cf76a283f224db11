"""The remote store's side of a lookup, the way a peer's is: an offer of the chunks it holds past
the local hit (one ``exists`` round, no bytes moved), which the load then fetches beside the
engine's steps, reporting each chunk as it lands (``CacheEngine.pull_offer_async``).

The scheduler waits on the ``exists`` round, so its deadline is short and follows the store
(:class:`ExistsRounds`); a round past it is served without the store, and until that round ends
no lookup asks again: a stopped store costs the running streams one deadline, not one per request.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from lmcache_p2p.miss_reasons import EVICTED, HOLDER_GONE, NOT_HELD, POOL_FULL, TIMEOUT, Miss, PulledChunks
from lmcache_p2p.remote.tier import PageSink, RemoteTier
from lmcache_p2p.vocab import REMOTE_OFFER_TIMEOUT_S

logger = logging.getLogger(__name__)

FETCH_THREADS = 4  # several: one slow round must not queue every other request's fetch


@dataclass(frozen=True)
class RemoteOffer:
    """Leading chunks past a lookup's local hit that the remote store holds (its ``exists`` round
    said so): promised to the scheduler like a peer's offer and fetched by the load. A chunk may
    be gone by then: the load ends there and vLLM recomputes the rest."""

    hashes: tuple[int, ...]
    then: Miss | None = None  # why the chunk after the offered ones is not offered (None: none follows)

    @property
    def chunks(self) -> int:
        return len(self.hashes)

    def first(self, chunks: int) -> RemoteOffer:
        if chunks >= len(self.hashes):
            return self
        return RemoteOffer(self.hashes[:chunks])


class ExistsRounds:
    """How long a lookup waits for the store's ``exists`` round: a store that stopped answering
    must cost a running stream about what a prefill costs it, while a healthy store on a busy host
    must still answer in time. The deadline is ``DEADLINE_PER_USUAL`` times the usual (median)
    round of late, between ``DEADLINE_MIN_S`` and ``REMOTE_OFFER_TIMEOUT_S``; a round past it goes
    on, and until it ends no lookup asks again. Before any round was measured the deadline is
    ``REMOTE_OFFER_TIMEOUT_S``: a first round may open the connections (a cluster client also
    discovers the slots and connects to each master), which takes more than a round on a busy host."""

    DEADLINE_PER_USUAL = 20
    DEADLINE_MIN_S = 0.05  # a round on loopback takes ~1 ms; a loaded 2-core host's, a few
    WINDOW = 32

    def __init__(self) -> None:
        self._recent: deque[float] = deque(maxlen=self.WINDOW)
        self._slow: concurrent.futures.Future | None = None

    def usual_s(self) -> float:
        return sorted(self._recent)[len(self._recent) // 2] if self._recent else 0.0

    def deadline(self) -> float:
        if not self._recent:
            return REMOTE_OFFER_TIMEOUT_S
        return min(REMOTE_OFFER_TIMEOUT_S, max(self.DEADLINE_MIN_S, self.DEADLINE_PER_USUAL * self.usual_s()))

    def took(self, seconds: float) -> None:
        self._recent.append(seconds)

    def slow(self, round_: concurrent.futures.Future) -> None:
        self._slow = round_

    def slow_round_running(self) -> bool:
        if self._slow is not None and self._slow.done():
            self._slow = None
        return self._slow is not None


class RemoteOffers:
    """Offers from ``tier`` and their fetches into ``sink``'s CPU pool, on threads of its own."""

    def __init__(self, tier: RemoteTier, sink: PageSink):
        self.tier = tier
        self._sink = sink
        self.rounds = ExistsRounds()
        self._threads: concurrent.futures.ThreadPoolExecutor | None = concurrent.futures.ThreadPoolExecutor(
            FETCH_THREADS, thread_name_prefix="lmcache-fetch"
        )
        # Connect now, off the step path, so that the first lookup pays a round and not the set-up.
        self._threads.submit(tier.connect)

    def offer(self, hashes: list[int], timeout: float | None = None) -> RemoteOffer | Miss:
        """The leading chunks of ``hashes`` the store holds, as an offer, capped at what the CPU
        pool can take unpinned (more would evict the prompt's own first chunks); a Miss when it
        holds none, or did not answer its ``exists`` round within ``timeout`` (default: the
        rounds' deadline)."""
        rounds, threads = self.rounds, self._threads
        if threads is None:
            return Miss(HOLDER_GONE, "the remote tier is closed")
        if rounds.slow_round_running():
            return Miss(TIMEOUT, "the remote store has not yet answered an earlier exists round")
        keys = [self._sink.key(h) for h in hashes]
        timeout = rounds.deadline() if timeout is None else timeout
        started = time.perf_counter()
        round_ = threads.submit(self.tier.prefix_length, keys)
        try:
            held = round_.result(timeout)
        except concurrent.futures.TimeoutError:
            rounds.slow(round_)
            logger.warning(
                "remote tier %s: its exists round for %d chunk(s) took over %.0f ms (usually %.1f ms); served "
                "without it (no lookup asks the store again until that round ends)",
                self.tier.name,
                len(keys),
                timeout * 1e3,
                rounds.usual_s() * 1e3,
            )
            return Miss(TIMEOUT, f"the remote store did not answer within {timeout * 1e3:.0f} ms")
        rounds.took(time.perf_counter() - started)
        offered = min(held, self._sink.cpu_pages_unpinned)
        if not offered:
            return Miss(POOL_FULL, "no unpinned CPU page to fetch into") if held else Miss(NOT_HELD)
        if offered < held:
            logger.info(
                "remote tier %s holds %d chunk(s) of this prompt; offering the %d the CPU pool has room for",
                self.tier.name,
                held,
                offered,
            )
        then = None
        if offered < len(hashes):
            then = Miss(POOL_FULL, "the CPU pool has no more room") if offered < held else Miss(NOT_HELD)
        return RemoteOffer(tuple(hashes[:offered]), then)

    def fetch_async(self, offer: RemoteOffer, on_landed: Callable[[int], object] | None) -> concurrent.futures.Future:
        """Fetch an offer's chunks into the CPU pool; a future of :class:`PulledChunks`."""
        threads = self._threads
        if threads is None:  # closed since the offer
            closed: concurrent.futures.Future = concurrent.futures.Future()
            closed.set_result(PulledChunks(0, Miss(HOLDER_GONE, "the remote tier is closed")))
            return closed
        return threads.submit(self._fetch, offer, on_landed)

    def _fetch(self, offer: RemoteOffer, on_landed: Callable[[int], object] | None) -> PulledChunks:
        errors = self.tier.counters.errors
        done = self.tier.fetch_prefix_into(self._sink, offer.hashes, held=offer.chunks, on_landed=on_landed)
        if done >= offer.chunks:
            return PulledChunks(done)
        if self.tier.counters.errors > errors:
            return PulledChunks(done, Miss(HOLDER_GONE, f"the remote store failed: {self.tier.counters.last_error}"))
        if not self._sink.cpu_pages_unpinned:
            return PulledChunks(done, Miss(POOL_FULL, "no unpinned CPU page left to fetch into"))
        return PulledChunks(done, Miss(EVICTED, "from the remote store (or unusable there) since its exists round"))

    def close(self) -> None:
        """Wait for the fetches under way (a stalled store's: up to its timeout); drop the queued."""
        threads, self._threads = self._threads, None
        if threads is not None:
            threads.shutdown(wait=True, cancel_futures=True)
