"""The warm set: peers the controller names worth connecting before any pull needs them.

Each gets a keeper task that says hello in the background, retries with backoff while the peer
does not answer (logged once), connects again after a failed pull dropped the connection, and
ends when the peer leaves the set (its connection is then closed). Pulls from other peers
connect on demand (:meth:`PeerConnections.connect`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from lmcache_p2p.protocol import MeshPeer
from lmcache_p2p.rpc import RequestFailed
from lmcache_p2p.transfer import TransferError
from lmcache_p2p.worker.peer_links import Peer, PeerConnections

logger = logging.getLogger(__name__)

# A warm-set peer that does not answer its hello is tried again after 1 s, then 2, 4... up to a
# minute; the controller drops it from the set once it is reaped.
WARM_RETRY_FIRST_S = 1.0
WARM_RETRY_MAX_S = 60.0


@dataclass
class _Warm:
    """A warm-set peer and its keeper task (WarmSet._keep_warm)."""

    peer: Peer
    session: str  # the peer's process, as the controller knows it
    keeper: asyncio.Task | None = None
    state: str = "connecting"  # "connecting", "warm" or "retrying"
    ms: float | None = None  # the last warm-up's time
    failures: int = 0  # hellos failed in a row
    error: str | None = None


class WarmSet:
    """Keeps a connection open to each peer of the controller's warm set."""

    def __init__(self, connections: PeerConnections):
        self.connections = connections
        self.me = connections.me
        self._warm: dict[tuple[str, int], _Warm] = {}

    def set_peers(self, peers: list[MeshPeer], registered: bool = False, limit: int | None = None) -> None:
        """Take the controller's warm set (at most ``limit`` of ``peers``): keep a connection to
        each, in the background. A peer that left the set is dropped, and one at the same address
        under another session (it restarted) is connected afresh. With ``registered`` (the set
        that came with a registration: the controller may have restarted and not every peer be
        back yet), connections to peers missing from it stay open, as on-demand ones."""
        wanted: dict[tuple[str, int], tuple[Peer, str]] = {}
        for p in peers[:limit]:
            if p.p2p_init_port and p.p2p_lookup_port:
                peer = Peer(p.instance_id, p.rank, p.host, p.p2p_init_port, p.p2p_lookup_port)
                wanted[peer.key] = (peer, p.session)
        for key, warm in list(self._warm.items()):
            target = wanted.get(key)
            if target == (warm.peer, warm.session):
                continue
            del self._warm[key]
            if warm.keeper is not None:
                warm.keeper.cancel()
            if target is not None:
                outcome = "restarted: connecting to its new process"
                self.connections.drop(warm.peer)
            elif registered:
                outcome = "not in the controller's first warm set since registering: kept, on demand"
            elif self.connections.busy(key):
                outcome = "left the warm set: its pulls in flight finish, then it connects on demand"
            else:
                outcome = "left the warm set: connection closed"
                self.connections.drop(warm.peer)
            logger.info("%s: peer %s %s", self.me.describe(), warm.peer.describe(), outcome)
        for key, (peer, session) in wanted.items():
            if key not in self._warm:
                warm = self._warm[key] = _Warm(peer, session)
                warm.keeper = asyncio.ensure_future(self._keep_warm(warm))

    async def _keep_warm(self, warm: _Warm) -> None:
        """Connect to a warm-set peer, and again whenever its connection is dropped (a failed
        pull); a hello that fails is retried with backoff, logged once. Runs until cancelled."""
        peer, delay = warm.peer, WARM_RETRY_FIRST_S
        while True:
            t0 = time.perf_counter()
            try:
                conn = self.connections.connection(peer)
                if conn.channel is None or conn.peer_session != warm.session:
                    # Also on a connection a pull opened: the hello is idempotent at the holder
                    # and (re)opens our session there if this is a process it has not seen.
                    await asyncio.shield(self.connections.start_hello(peer, conn, "warm-up"))
                    conn.peer_session = warm.session
            except (RequestFailed, TransferError) as e:
                warm.failures += 1
                warm.state, warm.error = "retrying", str(e)
                log = logger.warning if warm.failures == 1 else logger.debug
                log(
                    "%s: could not warm peer %s (%s); retrying in %.0f s and then with backoff up to %.0f s "
                    "(pulls from it connect on demand meanwhile)",
                    self.me.describe(),
                    peer.describe(),
                    e,
                    delay,
                    WARM_RETRY_MAX_S,
                )
                await asyncio.sleep(delay)
                delay = min(2 * delay, WARM_RETRY_MAX_S)
                continue
            warm.state, warm.ms, warm.error = "warm", (time.perf_counter() - t0) * 1e3, None
            logger.info(
                "%s: peer %s warm over %s in %.1f ms (hello %.1f ms)%s",
                self.me.describe(),
                peer.describe(),
                conn.describe_channel(),
                warm.ms,
                conn.hello_ms,
                f" after {warm.failures} failed tries" if warm.failures else "",
            )
            warm.failures, delay = 0, WARM_RETRY_FIRST_S
            await conn.closed.wait()
            warm.state = "connecting"
            await asyncio.sleep(WARM_RETRY_FIRST_S)  # a pull just failed on it: give the peer a moment

    def holds(self, instance_id: str, rank: int) -> bool:
        """Whether (instance_id, rank) is in the warm set the controller last sent."""
        return any(w.peer.instance_id == instance_id and w.peer.rank == rank for w in self._warm.values())

    def describe(self) -> list[dict]:
        """The warm set as /status shows it (read from the engine's thread too: a snapshot)."""
        out = []
        for key, warm in list(self._warm.items()):
            conn = self.connections.get(key)
            out.append(
                {
                    "peer": warm.peer.describe(),
                    "state": warm.state,
                    "channel": conn.describe_channel() if conn else None,
                    "warm_ms": None if warm.ms is None else round(warm.ms, 1),
                    "failures": warm.failures,
                    "error": warm.error,
                }
            )
        return out

    def close(self) -> None:
        for warm in self._warm.values():
            if warm.keeper is not None:
                warm.keeper.cancel()
        self._warm.clear()
