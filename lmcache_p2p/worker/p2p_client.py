"""Pulling chunks from peers into this rank's tiers: the worker's one entry point.

:class:`P2PClient` puts together the parts, each with one job, and keeps the engine's prefix
pulls taking turns:

- :mod:`.offers`: who holds a prompt's chunks (the controller) and how many to pull (the policy);
- :mod:`.pull_job`: one pull, a job object (batches pipelined, committed in order, logged once);
- :mod:`.pull_batch`: one batch's request, landing and checksums, and the pages it fills;
- :mod:`.peer_links`: a connection per peer rank, its channel agreed by one hello;
- :mod:`.warm_peers`: the controller's warm set, connected before any pull needs it;
- :mod:`.pull_stats`: the counters /status shows under ``p2p_client``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import AbstractAsyncContextManager, nullcontext

import numpy as np
import zmq.asyncio

from lmcache_p2p.mesh_security import MeshSecurity
from lmcache_p2p.miss_reasons import HOLDER_GONE, Miss, PulledChunks
from lmcache_p2p.protocol import MeshPeer
from lmcache_p2p.pull_policy import PullPolicy
from lmcache_p2p.rpc import RpcClient
from lmcache_p2p.storage.manager import StorageManager
from lmcache_p2p.transfer import Transport
from lmcache_p2p.vocab import CPU
from lmcache_p2p.worker.identity import WorkerIdentity
from lmcache_p2p.worker.link import REQUEST_TIMEOUT_S
from lmcache_p2p.worker.links import ControllerLinks
from lmcache_p2p.worker.offers import OfferMaker, PeerOffer
from lmcache_p2p.worker.peer_links import Peer, PeerConnections
from lmcache_p2p.worker.pull_batch import PullPages
from lmcache_p2p.worker.pull_job import PullJob, PullResult, PullSetup
from lmcache_p2p.worker.pull_stats import PullStats
from lmcache_p2p.worker.warm_peers import WarmSet

logger = logging.getLogger(__name__)


class PrefixTurns:
    """The engine's prefix pulls take turns, first asked first served: requests that arrive
    together then become ready one after another, each at full bandwidth, instead of all sharing
    it and all being ready only when the last pull ends. Pulls whose time is per-request latency
    rather than bytes (VRAM to VRAM on one host) finish sooner all at once (``enabled`` False).

    It also tells whether a pull ran alone: only such a pull measures the link for the pull
    policy (one sharing it would make the link look slower than it is)."""

    def __init__(self, enabled: bool = True):
        self.turn: AbstractAsyncContextManager = asyncio.Lock() if enabled else nullcontext()
        self._running = 0  # prefix pulls running now
        self._started = 0  # and started so far

    def begin(self) -> tuple[bool, int]:
        """A pull starts: whether it started alone, and its number."""
        self._running += 1
        self._started += 1
        return self._running == 1, self._started

    def end(self, started_alone: bool, number: int) -> bool:
        """The pull ended: whether it ran alone (it started so, and none began meanwhile)."""
        self._running -= 1
        return started_alone and self._started == number


class P2PClient:
    """The worker's peer pulls: offers for the engine's prompts, the pulls that bring them (and
    move/copy's), the connections and warm set behind them, and their counters."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        identity: WorkerIdentity,
        storage: StorageManager,
        link: ControllerLinks,
        transports: dict[str, Transport],
        preferred: str,
        batch_chunks: int = 8,
        pipeline_depth: int = 3,
        policy: PullPolicy | None = None,
        security: MeshSecurity | None = None,
        prefix_pull_turns: bool = True,
    ):
        self.me = identity
        self.storage = storage
        # Whether a prefix pull beats recomputing it (config p2p_pull_policy); None: always pull.
        self.policy = policy
        self.stats = PullStats(pull_policy=policy.snapshot() if policy else None)
        self.connections = PeerConnections(ctx, identity, storage.fingerprint, transports, preferred, security)
        self.warm = WarmSet(self.connections)
        self.offers = OfferMaker(link, self.connections, self.stats, policy)
        self.setup = PullSetup(
            identity,
            self.connections,
            transports,
            PullPages(storage, self.stats),
            self.stats,
            batch_chunks=batch_chunks,
            pipeline_depth=pipeline_depth,
        )
        self.turns = PrefixTurns(prefix_pull_turns)

    # -- the engine's question: pull the rest of this prefix -------------------------------------

    async def offer_prefix(self, hashes: np.ndarray, timeout: float = REQUEST_TIMEOUT_S) -> PeerOffer | Miss:
        """What a pull of ``hashes`` (a prompt's chunks after the local hit) would bring, without
        moving a byte: the holder the controller names and the leading chunks the pull policy
        says to pull from it; or why none (no live peer holds the first one, or recomputing
        wins). The engine's scheduler promises these chunks at once; :meth:`pull_offer` brings them."""
        return await self.offers.offer(hashes, timeout)

    async def pull_offer(self, offer: PeerOffer) -> PulledChunks:
        """Pull an offer's chunks from its holder, in the engine's turn (prefix pulls take turns
        unless ``prefix_pull_turns`` is off): how many leading chunks are now held locally, and
        if fewer than offered, why."""
        peer, hashes = offer.peer, offer.hashes
        t_turn = time.perf_counter()
        async with self.turns.turn:
            logger.info(
                "%s: pulling %d chunk(s) from %s (offered %.1f ms ago; waited %.1f ms for the turn)",
                self.me.describe(),
                len(hashes),
                peer.describe(),
                (time.perf_counter() - offer.made) * 1e3,
                (time.perf_counter() - t_turn) * 1e3,
            )
            job = PullJob(self.setup, peer, hashes, CPU, into_gpu_tier=True)
            # Say hello first: a hello is no part of a pull's time, and a failed one is reported
            # as the pull's failure (the job's run logs and counts it).
            if self.connections.channel_of(peer) is None and not await job.connect():
                failed = await job.run()
                return PulledChunks(0, failed.miss or Miss(HOLDER_GONE, failed.error or ""))
            started_alone, number = self.turns.begin()
            t0 = time.perf_counter()
            try:
                result = await job.run()
            finally:
                alone = self.turns.end(started_alone, number)
            elapsed = time.perf_counter() - t0
        if self.policy is not None and alone and result.error is None and result.held:
            # Only clean pulls measure the link: a failure's time says how long a timeout is.
            self.policy.observe_pull(peer.describe(), job.channel, len(result.held) * self.storage.page_bytes, elapsed)
            self.stats.pull_policy = self.policy.snapshot()
        self.stats.prefix_hit_chunks += len(result.held)  # pulled for the engine (not for a move)
        if len(result.held) >= len(hashes):
            return PulledChunks(len(result.held))
        return PulledChunks(len(result.held), result.miss or Miss(HOLDER_GONE, result.error or "the pull ended early"))

    # -- move/copy destinations, and the command server ------------------------------------------

    async def pull(
        self, peer: Peer, hashes, location: str, skip_missing: bool = False, into_gpu_tier: bool = False
    ) -> PullResult:
        """Pull ``hashes`` from ``peer`` into ``location`` (see :class:`PullJob`)."""
        return await PullJob(self.setup, peer, hashes, location, skip_missing, into_gpu_tier).run()

    def lookup_socket(self, peer: Peer) -> RpcClient:
        """The peer's p2p_lookup socket, for requests that need no channel session (FetchChunks)."""
        return self.connections.connection(peer).lookup

    # -- the warm set -----------------------------------------------------------------------------

    def set_warm_peers(self, peers: list[MeshPeer], registered: bool = False, limit: int | None = None) -> None:
        """Take the controller's warm set (see :meth:`WarmSet.set_peers`)."""
        self.warm.set_peers(peers, registered, limit)

    def is_warm(self, instance_id: str, rank: int) -> bool:
        """Whether (instance_id, rank) is in the warm set the controller last sent."""
        return self.warm.holds(instance_id, rank)

    def warm_peers(self) -> list[dict]:
        """The warm set as /status shows it (read from the engine's thread too: a snapshot)."""
        return self.warm.describe()

    def close(self) -> None:
        self.warm.close()
        self.connections.close()
