"""What a peer pull of a prompt's chunks would bring, decided before a byte moves.

The controller names the live peers holding the prompt's leading chunks; the pull policy says
how many of them to pull from which (the longest prefix whose pull beats recomputing it). The
engine's scheduler promises the offered chunks at once, and the pull brings them later.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import numpy as np

from lmcache_p2p.miss_reasons import BELOW_BREAK_EVEN, NOT_HELD, Miss
from lmcache_p2p.pull_policy import PullPolicy
from lmcache_p2p.worker.links import ControllerLinks
from lmcache_p2p.worker.peer_links import Peer, PeerConnections
from lmcache_p2p.worker.pull_stats import PullStats
from lmcache_p2p.worker.session import REQUEST_TIMEOUT_S

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerOffer:
    """Leading chunks of a prompt (after the asking rank's local hit) that a pull from ``peer``
    would bring, as the controller and the pull policy decided when the engine asked."""

    peer: Peer
    hashes: np.ndarray  # uint64, in prompt order
    made: float = field(default_factory=time.perf_counter)
    then: Miss | None = None  # why the chunk after the offered ones is not offered (None: none is left)

    @property
    def chunks(self) -> int:
        return len(self.hashes)

    def first(self, chunks: int) -> PeerOffer:
        return replace(self, hashes=self.hashes[:chunks])


class OfferMaker:
    """Asks the controller who holds a prompt's chunks and the pull policy what to pull."""

    def __init__(
        self, link: ControllerLinks, connections: PeerConnections, stats: PullStats, policy: PullPolicy | None = None
    ):
        self.link = link
        self.connections = connections  # the channels agreed so far, and the requests in flight
        self.stats = stats
        self.policy = policy  # whether a prefix pull beats recomputing it; None: always pull

    async def offer(self, hashes: np.ndarray, timeout: float = REQUEST_TIMEOUT_S) -> PeerOffer | Miss:
        """The holder the controller names for ``hashes`` (a prompt's chunks after the local hit)
        and the leading chunks the pull policy says to pull from it; or why there are none (no
        live peer holds the first one, the controller did not answer, or recomputing wins)."""
        t0 = time.perf_counter()
        reply = await self.link.p2p_lookup(hashes, timeout)
        holders = [
            (h.matched_chunks, Peer(h.instance_id, h.rank, h.host, h.p2p_init_port, h.p2p_lookup_port))
            for h in reply.holders
            if h.p2p_lookup_port and h.p2p_init_port and h.matched_chunks > 0
        ]
        # Past the longest prefix a holder offers: why no one offers the next chunk.
        beyond = Miss(reply.miss_reason or NOT_HELD, reply.miss_detail)
        if not holders:
            return beyond
        asked_ms = (time.perf_counter() - t0) * 1e3
        # Longest prefix first; among equals the peer we have the fewest requests in flight to.
        holders.sort(key=lambda h: (-h[0], self.connections.busy(h[1].key)))
        peer, chunks, declined = self._decide(holders, asked_ms)
        if not chunks:
            return declined or beyond
        then = declined if declined is not None else (beyond if chunks < len(hashes) else None)
        return PeerOffer(peer, np.asarray(hashes[:chunks], dtype=np.uint64), then=then)

    def _decide(self, holders: list[tuple[int, Peer]], asked_ms: float = 0.0) -> tuple[Peer, int, Miss | None]:
        """The holder to pull from and how many leading chunks, by the pull policy: the longest
        prefix whose pull beats recomputing it (holders come longest first), and, where it
        pulls less than the longest prefix held, the miss of the chunks it leaves (the
        estimates behind it). Logs the decision."""
        matched, peer = holders[0]
        if self.policy is None:
            return peer, matched, None
        channel_of = self.connections.channel_of
        first = chosen = None
        seen = set()
        for matched, peer in holders:
            if peer.key in seen:
                continue  # the same rank again (another of its tiers): its longest prefix came first
            seen.add(peer.key)
            decision = self.policy.decide(peer.describe(), channel_of(peer), matched)
            if first is None:
                first = (peer, decision)
            if decision.pull:
                chosen = (peer, decision)
                break
        assert first is not None
        peer, decision = chosen or first
        # tests/test_pull_policy*.py read this line ("peer pull decision: ..."): keep its wording.
        line = decision.describe(peer.describe(), channel_of(peer))
        if chosen is not None and chosen[0] is not first[0]:  # a shorter prefix over a faster link
            line += f" (instead of {first[1].offered} chunks at {first[0].describe()}: {first[1].numbers()})"
        logger.info("%s [holders from the controller in %.1f ms]", line, asked_ms)
        recomputed = first[1].offered - decision.chunks  # offered by a peer, recomputed instead
        if recomputed > 0:
            self.stats.chunks_skipped += recomputed
        if not decision.pull:
            self.stats.pulls_skipped += 1
            by_peer = self.stats.pulls_skipped_by_peer
            by_peer[peer.describe()] = by_peer.get(peer.describe(), 0) + 1
        self.stats.pull_policy = self.policy.snapshot()
        declined = Miss(BELOW_BREAK_EVEN, f"{first[0].describe()}: {first[1].numbers()}") if recomputed > 0 else None
        return peer, decision.chunks, declined
