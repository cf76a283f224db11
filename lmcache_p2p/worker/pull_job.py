"""One pull of chunks from one peer into this rank's tiers, as a job object (move/copy), and
what every pull shares: the route to a peer (:func:`open_route`) and its report (:func:`report_pull`).

A job connects (or finds the connection agreed), splits its chunks into batches of
``batch_chunks``, keeps ``pipeline_depth`` of them in flight (checksums of one batch are verified
while the next is on the wire) and commits them in order. The run ends at the first failure;
those chunks are a miss, logged with the reason. Nothing here raises into the engine. The
engine's prefix pulls from one holder share one pipeline instead (:mod:`.pull_pump`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from lmcache_p2p.miss_reasons import HOLDER_GONE, REFUSED, Miss
from lmcache_p2p.rpc import RequestFailed
from lmcache_p2p.transfer import TransferError, Transport
from lmcache_p2p.vocab import PULL_REQUEST_TIMEOUT_S
from lmcache_p2p.worker.identity import WorkerIdentity
from lmcache_p2p.worker.peer_links import Peer, PeerConnection, PeerConnections
from lmcache_p2p.worker.pull_batch import PHASES, Batch, BatchFetch, PullPages, describe_phases
from lmcache_p2p.worker.pull_stats import PullStats

logger = logging.getLogger(__name__)


@dataclass
class PullResult:
    held: list[int] = field(default_factory=list)  # hashes now held here (in order of the request)
    error: str | None = None  # why the run ended early, if it did
    miss: Miss | None = None  # that, as the miss reason of the chunk it stopped at
    gpu_landed: int = 0  # of those, chunks the holder wrote into our GPU tier
    gpu_checked_on_device: int = 0  # of those, checked against the holder's device checksums


@dataclass(frozen=True)
class PullSetup:
    """What every pull of a rank shares: its connections, channels, pages and counters."""

    me: WorkerIdentity
    connections: PeerConnections
    transports: dict[str, Transport]
    pages: PullPages
    stats: PullStats
    batch_chunks: int = 8  # chunks per request (config p2p_batch_chunks)
    pipeline_depth: int = 3  # requests in flight per pull (p2p_pipeline_depth)
    timeout_s: float = PULL_REQUEST_TIMEOUT_S  # a request's, before its bytes (p2p_pull_timeout_s)


def _split(items: list[int], size: int) -> list[list[int]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


@dataclass(frozen=True)
class PullRoute:
    """A peer's agreed connection as pulls use it: the batch requests over it, the most chunks
    one carries, and the channel as log lines name it."""

    conn: PeerConnection
    fetch: BatchFetch
    batch_chunks: int
    channel: str


@dataclass(frozen=True)
class RouteFailed:
    """The hello failed: why, and that as the miss of the first chunk."""

    error: str
    miss: Miss


async def open_route(setup: PullSetup, peer: Peer, into_gpu_tier: bool) -> PullRoute | RouteFailed:
    """Find (or make) the peer's agreed connection, and the batch size its channel carries:
    ``p2p_batch_chunks``, at most what one request may carry there (the receive slots of GPU
    staging; a pull landing in our GPU tier may carry more)."""
    try:
        conn = await setup.connections.connect(peer)
    except (RequestFailed, TransferError) as e:
        refused = "refus" in str(e).lower()
        return RouteFailed(str(e), Miss(REFUSED if refused else HOLDER_GONE, f"{peer.describe()}: {e}"))
    transport = setup.transports[conn.agreed]
    limit = transport.max_batch(into_gpu_tier and conn.staged)
    batch_chunks = min(setup.batch_chunks, limit or setup.batch_chunks)
    fetch = BatchFetch(peer, conn, transport, setup.pages, setup.pipeline_depth, setup.timeout_s, into_gpu_tier)
    return PullRoute(conn, fetch, batch_chunks, conn.describe_channel() or "?")


class PullJob:
    """Pull ``hashes`` from ``peer`` into ``location``, in order. With ``skip_missing``
    (move/copy of an arbitrary key set) a chunk the holder merely lacks (or sent damaged) is
    skipped instead of ending the run; a full pool here ends it either way. With
    ``into_gpu_tier`` (the engine's prefix pulls) a same-host holder may write them into our GPU
    tier, where the engine loads them at once; other pulls (move, copy) land in the CPU tier,
    whose index their callers read right after."""

    def __init__(
        self,
        setup: PullSetup,
        peer: Peer,
        hashes,
        location: str,
        skip_missing: bool = False,
        into_gpu_tier: bool = False,
    ):
        self.setup = setup
        self.peer = peer
        self.hashes = [int(h) for h in hashes]
        self.location = location
        self.skip_missing = skip_missing
        self.into_gpu_tier = into_gpu_tier
        self.result = PullResult()
        self.channel = "?"  # as the log line names it, once connected
        self._fetch: BatchFetch | None = None
        self._todo: deque[list[int]] = deque()
        self._connected = False  # the connection was asked for (it may have failed: result.error)
        self._started = time.perf_counter()
        self._times = PullTimes()

    async def connect(self) -> bool:
        """Find (or make) the peer's agreed connection and cut the chunks into batches its
        channel carries; False, with the pull's error set, when the hello failed."""
        self._connected = True
        route = await open_route(self.setup, self.peer, self.into_gpu_tier)
        if isinstance(route, RouteFailed):
            self.result.error, self.result.miss = route.error, route.miss
            return False
        self.channel = route.channel
        self._todo.extend(_split(self.hashes, route.batch_chunks))
        self._fetch = route.fetch
        return True

    async def run(self) -> PullResult:
        """The pull, start to end (connecting first unless :meth:`connect` ran); logged once."""
        self._started = time.perf_counter()
        if not self._connected:
            await self.connect()
        pages, todo, result = self.setup.pages, self._todo, self.result
        window: deque[asyncio.Task] = deque()
        stopped = False
        while todo or window:
            while todo and not stopped and len(window) < self.setup.pipeline_depth:
                assert self._fetch is not None  # batches exist only once connected
                window.append(asyncio.ensure_future(self._fetch.fetch(todo.popleft())))
            try:
                # Shielded: a caller that gives up (the engine's timeout) leaves the batches to
                # finish their own requests, and their pages (CPU and GPU tier) are given back then.
                batch = await asyncio.shield(window[0])
            except BaseException:  # given up on (or a batch raised): nothing commits what is in flight
                for task in window:
                    task.add_done_callback(pages.abandon_finished)
                raise
            window.popleft()
            self._times.add(batch)
            if stopped:  # an earlier batch failed: what follows it is a miss
                pages.abandon(batch)
                continue
            landed = min(batch.good, len(batch.gpu_pages))
            result.gpu_landed += landed
            if batch.device_checksums is not None:
                result.gpu_checked_on_device += landed
                self.setup.stats.gpu_landed_checked_on_device += landed
            result.held += pages.commit(batch, self.location)
            if batch.error is None:
                continue
            result.error = batch.error
            result.miss = result.miss or batch.miss
            if batch.peer_failed:
                self.setup.connections.drop(self.peer)
            if self.skip_missing and batch.skippable:
                if batch.rest:
                    todo.appendleft(batch.rest)  # go on after the chunk the holder lacked
            else:
                stopped = True
                todo.clear()
        self._times.elapsed_s = time.perf_counter() - self._started
        report_pull(self.setup, self.peer, self.channel, len(self.hashes), result, self._times)
        return result


@dataclass
class PullTimes:
    """Where a pull's time went: start to end, and its batches' phases summed (batches overlap)."""

    elapsed_s: float = 0.0
    batches: int = 0
    phases_ms: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    def add(self, batch: Batch) -> None:
        self.batches += 1
        for phase, ms in batch.phases_ms.items():
            self.phases_ms[phase] += ms


def report_pull(setup: PullSetup, peer: Peer, channel: str, asked: int, result: PullResult, times: PullTimes) -> None:
    """Count a pull and log it: the seed's line for what came, a warning for the rest."""
    stats, me = setup.stats, setup.me
    nbytes = len(result.held) * setup.pages.storage.page_bytes
    elapsed = times.elapsed_s
    stats.pulls += 1
    stats.durations.add(elapsed * 1e3)
    stats.chunks_pulled += len(result.held)
    stats.bytes_pulled += nbytes
    per_peer = stats.by_peer.setdefault(f"{peer.instance_id} rank {peer.rank} over {channel}", {})
    for key, n in (("pulls", 1), ("bytes", nbytes), ("failures", 1 if result.error else 0)):
        per_peer[key] = per_peer.get(key, 0) + n
    if result.held:
        # The seed's line, then where the batches' time went (summed: batches overlap).
        # benchmarks/gpu/e2e.py and testing.processes.P2P_LINE parse it: keep its wording.
        logger.info(
            "Retrieved %d out of total %d tokens. size: %.4f gb, cost %.4f ms, throughput: %.4f GB/s "
            "(from %s over %s, to rank %d) [%d batches, ms summed: %s]%s",
            len(result.held) * me.chunk_size,
            asked * me.chunk_size,
            nbytes / 1e9,
            elapsed * 1e3,
            nbytes / 1e9 / max(elapsed, 1e-9),
            peer.describe(),
            channel,
            me.rank,  # vLLM's per-process line prefixes interleave when ranks log at once
            times.batches,
            describe_phases(times.phases_ms),
            (
                f"; {result.gpu_landed} chunk(s) landed in the GPU tier"
                f" ({result.gpu_checked_on_device} checked on the device)"
            )
            if result.gpu_landed
            else "",
        )
        stats.gpu_landed_chunks += result.gpu_landed
    if result.error:
        stats.pull_failures += 1
        logger.warning(
            "peer pull from %s: %d of %d chunks; the rest is a miss: %s",
            peer.describe(),
            len(result.held),
            asked,
            result.error,
        )
