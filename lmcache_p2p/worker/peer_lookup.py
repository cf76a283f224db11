"""Peer lookups at one controller: who holds a prefix of a prompt's chunks.

A lookup goes out only while the session is registered and the controller answers: one that goes
unanswered marks the controller unanswered in the session and asks for a heartbeat now, and the
lookups after it are ``timeout`` misses at once (no full timeout each) until a heartbeat hears the
controller again.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from lmcache_p2p.miss_reasons import TIMEOUT
from lmcache_p2p.protocol import P2PLookup, P2PLookupReply, pack_hashes
from lmcache_p2p.rpc import RemoteError, RequestFailed, RpcClient
from lmcache_p2p.worker.identity import WorkerIdentity
from lmcache_p2p.worker.session import REQUEST_TIMEOUT_S, ControllerSession

logger = logging.getLogger(__name__)


class PeerLookup:
    """This rank's peer lookups at one controller, over its reply socket (the link's)."""

    def __init__(self, identity: WorkerIdentity, reply: RpcClient, session: ControllerSession):
        self.me = identity
        self.reply = reply
        self.session = session
        self.stats = {
            "p2p_lookups": 0,
            "p2p_lookups_skipped": 0,  # fast misses while the controller did not answer
            "p2p_lookups_rechecked": 0,  # its short answers while settling, checked with the next one
        }

    async def p2p_lookup(self, hashes: np.ndarray, timeout: float = REQUEST_TIMEOUT_S) -> P2PLookupReply:
        """Holders of a prefix of ``hashes`` (longest first) and why the rest is not offered
        (``miss_reason``: ``timeout`` when the controller is away)."""
        if not len(hashes):
            return P2PLookupReply(holders=[])
        session = self.session
        if not session.registered:
            return _no_answer("not registered with the controller yet")
        if session.unanswered_since is not None:
            # The last lookup got no answer: until a heartbeat (sent now) hears the controller
            # again, a lookup is a miss at once instead of one more full timeout per request.
            self.stats["p2p_lookups_skipped"] += 1
            away = time.monotonic() - session.unanswered_since
            return _no_answer(f"controller unanswered for {away:.1f} s")
        self.stats["p2p_lookups"] += 1
        try:
            return await self.reply.request(
                P2PLookup(instance_id=self.me.instance_id, rank=self.me.rank, hashes=pack_hashes(hashes)),
                P2PLookupReply,
                timeout,
            )
        except RequestFailed as e:
            session.note_unanswered()
            logger.warning(
                "%s: peer lookup of %d chunk(s) unanswered (%s); lookups are misses until a heartbeat "
                "hears the controller",
                self.me.describe(),
                len(hashes),
                e,
            )
            session.beat_soon("a peer lookup went unanswered")
            return _no_answer(f"holder lookup unanswered in {timeout} s")
        except RemoteError as e:
            logger.warning("%s: peer lookup of %d chunk(s) failed: %s", self.me.describe(), len(hashes), e)
            return _no_answer(f"holder lookup failed: {e}")


def _no_answer(why: str) -> P2PLookupReply:
    """A holder lookup the controller did not answer: no holders, and a ``timeout`` miss."""
    return P2PLookupReply(holders=[], miss_reason=TIMEOUT, miss_detail=why)
