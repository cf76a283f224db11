"""Pulling chunks from peers into this rank's tiers: the worker's one entry point.

:class:`P2PClient` puts together the parts, each with one job:

- :mod:`.offers`: who holds a prompt's chunks (the controller) and how many to pull (the policy);
- :mod:`.pull_pump`: the engine's prefix pulls from one holder as one pipeline (a queue and a
  pump per holder: a pipeline across pull boundaries, each pull done when its own chunks are);
- :mod:`.pull_job`: one move/copy pull, a job object (batches pipelined, committed in order, logged once);
- :mod:`.pull_batch`: one batch's request, landing and checksums, and the pages it fills;
- :mod:`.peer_links`: a connection per peer rank, its channel agreed by one hello;
- :mod:`.warm_peers`: the controller's warm set, connected before any pull needs it;
- :mod:`.pull_stats`: the counters /status shows under ``p2p_client``.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import zmq.asyncio

from lmcache_p2p.mesh_security import MeshSecurity
from lmcache_p2p.miss_reasons import HOLDER_GONE, Miss, PulledChunks
from lmcache_p2p.protocol import MeshPeer
from lmcache_p2p.pull_policy import PullPolicy
from lmcache_p2p.rpc import RpcClient
from lmcache_p2p.storage.chunk_store import ChunkStore, PullLanding
from lmcache_p2p.transfer import Transport
from lmcache_p2p.vocab import PULL_REQUEST_TIMEOUT_S
from lmcache_p2p.worker.identity import WorkerIdentity
from lmcache_p2p.worker.links import ControllerLinks
from lmcache_p2p.worker.offers import OfferMaker, PeerOffer
from lmcache_p2p.worker.peer_links import Peer, PeerConnections
from lmcache_p2p.worker.pull_batch import PullPages
from lmcache_p2p.worker.pull_job import PullJob, PullResult, PullSetup
from lmcache_p2p.worker.pull_pump import Landed, PullOverlap, PullPump
from lmcache_p2p.worker.pull_stats import PullStats
from lmcache_p2p.worker.session import REQUEST_TIMEOUT_S
from lmcache_p2p.worker.warm_peers import WarmSet

logger = logging.getLogger(__name__)


class P2PClient:
    """The worker's peer pulls: offers for the engine's prompts, the pulls that bring them (and
    move/copy's), the connections and warm set behind them, and their counters."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        identity: WorkerIdentity,
        storage: ChunkStore,
        landing: PullLanding,
        link: ControllerLinks,
        transports: dict[str, Transport],
        preferred: str,
        batch_chunks: int = 8,
        pipeline_depth: int = 3,
        pull_timeout_s: float = PULL_REQUEST_TIMEOUT_S,
        policy: PullPolicy | None = None,
        security: MeshSecurity | None = None,
        prefix_pull_turns: bool = False,
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
            PullPages(storage, landing, self.stats),
            self.stats,
            batch_chunks=batch_chunks,
            pipeline_depth=pipeline_depth,
            timeout_s=pull_timeout_s,
        )
        # The engine's prefix pulls: a pump per holder (first asked first served, batches across
        # pull boundaries); with prefix_pull_turns, one pull at a time per holder.
        self.one_pull_at_a_time = prefix_pull_turns
        self.overlap = PullOverlap()  # which pulls ran alone (and so may measure the link)
        self.pumps: dict[Peer, PullPump] = {}

    # -- the engine's question: pull the rest of this prefix -------------------------------------

    async def offer_prefix(self, hashes: np.ndarray, timeout: float = REQUEST_TIMEOUT_S) -> PeerOffer | Miss:
        """What a pull of ``hashes`` (a prompt's chunks after the local hit) would bring, without
        moving a byte: the holder the controller names and the leading chunks the pull policy
        says to pull from it; or why none (no live peer holds the first one, or recomputing
        wins). The engine's scheduler promises these chunks at once; :meth:`pull_offer` brings them."""
        return await self.offers.offer(hashes, timeout)

    async def pull_offer(self, offer: PeerOffer, on_landed: Landed | None = None) -> PulledChunks:
        """Pull an offer's chunks from its holder, in its holder's queue (first asked first
        served; the next pull's batches go out while this one's last are still on the wire):
        how many leading chunks are now held locally, and if fewer than offered, why. Once done
        it does not wait for pulls queued behind it. ``on_landed`` (on the worker's loop) is told
        after each batch how many leading chunks are held so far, for a loader that starts
        copying them while the rest arrive."""
        peer, hashes = offer.peer, offer.hashes
        pump = self._pump(peer)
        pull = pump.join(hashes, offer.made, on_landed)
        try:
            # Shielded: a caller that gives up leaves the pull to the pump, which drops its
            # chunks not yet asked for and gives back the pages of those out when they end.
            result = await asyncio.shield(pull.done)
        except asyncio.CancelledError:
            pump.leave(pull)
            raise
        if self.policy is not None and pull.alone and result.error is None and result.held:
            # Only clean pulls that had the link to themselves measure it: a failure's time says
            # how long a timeout is, and a shared link looks slower than it is.
            nbytes = len(result.held) * self.storage.page_bytes
            self.policy.observe_pull(peer.describe(), pull.channel, nbytes, pull.times.elapsed_s)
            self.stats.pull_policy = self.policy.snapshot()
        self.stats.prefix_hit_chunks += len(result.held)  # pulled for the engine (not for a move)
        if len(result.held) >= len(hashes):
            return PulledChunks(len(result.held))
        return PulledChunks(len(result.held), result.miss or Miss(HOLDER_GONE, result.error or "the pull ended early"))

    def _pump(self, peer: Peer) -> PullPump:
        pump = self.pumps.get(peer)
        if pump is None:
            pump = PullPump(self.setup, peer, self.overlap, self.one_pull_at_a_time, on_idle=self._pump_idle)
            self.pumps[peer] = pump
        return pump

    def _pump_idle(self, pump: PullPump) -> None:
        """A holder's queue emptied: its pump goes (peers come and go; the next pull makes one)."""
        if self.pumps.get(pump.peer) is pump and pump.idle:
            del self.pumps[pump.peer]

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
        for pump in list(self.pumps.values()):
            pump.close()
        self.warm.close()
        self.connections.close()
