"""A rank's links to every controller of the mesh (``controller_pull_url``/``controller_reply_url``
listing several): one :class:`ControllerLink` per controller, behind the one face the rest of the
worker talks to.

Controllers share nothing: each is soft state rebuilt from what the workers tell it. So every link
does its whole job on its own, as with one controller: it registers, heartbeats, re-syncs, and
drains its own queue of the store's events (each link asks the store for one), so every
controller indexes every key. What the facade decides is only where a request goes:

* a peer lookup asks the links in order and takes the first answer; a link that is not registered
  or whose last lookup went unanswered answers a ``timeout`` miss at once (PeerLookup's fast
  miss), and a lookup that goes unanswered moves on to the next link right then, so a dead first
  controller costs one lookup timeout once, and nothing after its link has noticed. A controller
  that restarted a moment ago (``ControllerSession.settling``: within a heartbeat interval and a
  re-sync) knows only the ranks that registered again: an answer of it that does not offer every
  chunk is checked with the next controller, and the longer offer wins;
* a message (a command's ``CommandDone``, a ``Deregister``) goes to every controller: a worker
  does not know which one issued a command, and a controller counts a completion of an event it
  did not issue and otherwise ignores it;
* the warm set comes from the first registered link only: two controllers' sets, each a fair
  choice, would otherwise replace each other at every heartbeat and the hellos churn.

With one controller the facade passes everything through to its one link, unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from lmcache_p2p.miss_reasons import TIMEOUT
from lmcache_p2p.protocol import MeshPeer, P2PLookupReply
from lmcache_p2p.vocab import OFFER_TIMEOUT_S
from lmcache_p2p.worker.link import ControllerLink
from lmcache_p2p.worker.session import REQUEST_TIMEOUT_S

logger = logging.getLogger(__name__)

# The longest a peer lookup waits for one controller when another is left to ask: the engine's
# own lookup wait, so that a dead first controller costs one such wait at most.
FAILOVER_WAIT_S = OFFER_TIMEOUT_S

PeersCallback = Callable[[list[MeshPeer], bool], object]


class ControllerLinks:
    """One rank's :class:`ControllerLink` per controller, in the configured order."""

    def __init__(self, links: list[ControllerLink]):
        if not links:
            raise ValueError("ControllerLinks needs at least one ControllerLink")
        self.links = links
        self._on_peers: PeersCallback | None = None
        self._peers_from: ControllerLink | None = None  # the link whose warm set was taken last
        self._answered_by: ControllerLink | None = None  # the link that answered the last lookup

    # -- what the worker sets before start() -----------------------------------------------------

    @property
    def effective_channel(self) -> str | None:
        return self.links[0].session.effective_channel

    @effective_channel.setter
    def effective_channel(self, value: str | None) -> None:
        for link in self.links:
            link.session.effective_channel = value

    @property
    def channel_error(self) -> str | None:
        return self.links[0].session.channel_error

    @channel_error.setter
    def channel_error(self, value: str | None) -> None:
        for link in self.links:
            link.session.channel_error = value

    @property
    def max_warm_peers(self) -> int:
        return self.links[0].session.max_warm_peers

    @max_warm_peers.setter
    def max_warm_peers(self, value: int) -> None:
        for link in self.links:
            link.session.max_warm_peers = value

    @property
    def on_peers(self) -> PeersCallback | None:
        return self._on_peers

    @on_peers.setter
    def on_peers(self, callback: PeersCallback | None) -> None:
        self._on_peers = callback
        for link in self.links:
            link.session.on_peers = None if callback is None else self._peers_callback(link)

    def _peers_callback(self, link: ControllerLink) -> PeersCallback:
        def take(peers: list[MeshPeer], registered: bool) -> object:
            return self._take_peers(link, peers, registered)

        return take

    def _take_peers(self, link: ControllerLink, peers: list[MeshPeer], registered: bool) -> object:
        first = self.first_registered()
        # At its registration a link is already marked registered, so the first link's set wins
        # even on the heartbeat where it comes back; any other link's set is dropped meanwhile.
        if link is not first or self._on_peers is None:
            return None
        if self._peers_from is not link:
            if self._peers_from is not None:
                logger.info(
                    "%s: warm set now from the controller at %s (%d peer(s))",
                    link.me.describe(),
                    link.reply.address,
                    len(peers),
                )
            self._peers_from = link
        return self._on_peers(peers, registered)

    # -- state -----------------------------------------------------------------------------------

    def first_registered(self) -> ControllerLink | None:
        return next((link for link in self.links if link.session.registered), None)

    @property
    def registered(self) -> bool:
        """Registered with at least one controller (peer lookups can be answered)."""
        return self.first_registered() is not None

    @property
    def epoch(self) -> str:
        """The first registered controller's epoch ("" while none is)."""
        link = self.first_registered()
        return link.session.epoch if link is not None else ""

    @property
    def stats(self) -> dict[str, int]:
        """Every link's counters, summed (one controller: that link's own)."""
        total: dict[str, int] = {}
        for link in self.links:
            for name, value in link.stats.items():
                total[name] = total.get(name, 0) + value
        return total

    def status(self) -> list[dict]:
        """Each controller's link, in order: where, registered, epoch, lookups failing, counters."""
        return [
            {
                "reply_url": link.reply.address,
                "registered": link.session.registered,
                "controller_epoch": link.session.epoch,
                "lookups_failing": link.session.unanswered_since is not None,
                "warm_set_from_here": link is self._peers_from,
                **link.stats,
            }
            for link in self.links
        ]

    # -- lifecycle and messages ------------------------------------------------------------------

    def start(self) -> None:
        for link in self.links:
            link.start()

    def close(self, deregister: bool = True) -> None:
        for link in self.links:
            link.close(deregister=deregister)

    def send(self, message) -> bool:
        """To every controller (each flushes its own events first, as EventStream.send does);
        True when at least one could queue it."""
        sent = [link.events.send(message) for link in self.links]
        return any(sent)

    def flush(self) -> None:
        for link in self.links:
            link.events.flush()

    def beat_soon(self, why: str) -> None:
        for link in self.links:
            link.session.beat_soon(why)

    # -- peer lookup -----------------------------------------------------------------------------

    async def p2p_lookup(self, hashes: np.ndarray, timeout: float = REQUEST_TIMEOUT_S) -> P2PLookupReply:
        """The first answer from the controllers, in order. A ``timeout`` miss without holders
        (not registered, lookups failing: at once; unanswered: after its wait) moves on to the
        next controller; when none answers, the miss says what each link said. Every controller
        but the last is waited for at most FAILOVER_WAIT_S (a lookup willing to wait longer
        would otherwise spend its whole wait on a dead controller while a live one could
        answer); the last gets the whole ``timeout``, as a lone controller would."""
        if len(self.links) == 1:
            return await self.links[0].lookup.p2p_lookup(hashes, timeout)
        unanswered: list[str] = []
        unsettled: P2PLookupReply | None = None  # a settling controller's short answer, while others are asked
        for i, link in enumerate(self.links):
            wait = timeout if i == len(self.links) - 1 else min(timeout, FAILOVER_WAIT_S)
            reply = await link.lookup.p2p_lookup(hashes, wait)
            if not reply.holders and reply.miss_reason == TIMEOUT:
                unanswered.append(f"{link.reply.address}: {reply.miss_detail}")
                continue
            if unsettled is not None:  # the longer offer wins; the settling controller's on a tie
                return reply if _offered(reply) > _offered(unsettled) else unsettled
            if link.session.settling and _offered(reply) < len(hashes):
                link.lookup.stats["p2p_lookups_rechecked"] += 1
                unsettled = reply
                continue
            if self._answered_by is not link and unanswered:
                logger.info(
                    "%s: peer lookups answered by the controller at %s (%s)",
                    link.me.describe(),
                    link.reply.address,
                    "; ".join(unanswered),
                )
            self._answered_by = link
            return reply
        if unsettled is not None:  # no other controller answered
            return unsettled
        self._answered_by = None
        return P2PLookupReply(holders=[], miss_reason=TIMEOUT, miss_detail="; ".join(unanswered))


def _offered(reply: P2PLookupReply) -> int:
    """The leading chunks an answer's best holder offers."""
    return max((holder.matched_chunks for holder in reply.holders), default=0)
