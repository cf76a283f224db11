"""Who a worker is: one engine rank of one instance, and the addresses it is reached on."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from dataclasses import dataclass

from lmcache_p2p.config import LMCacheConfig, expand_serve_url, rank_port, split_host_port
from lmcache_p2p.keys import LayoutFingerprint

logger = logging.getLogger(__name__)

_PORT_FIELDS = ("worker_port", "p2p_init_port", "p2p_lookup_port")
LOOPBACK = "127.0.0.1"


@dataclass
class WorkerIdentity:
    """Fixed for the worker's life, except that a port configured as 0 is filled in by
    :meth:`bound` when its socket binds, before the worker first registers."""

    instance_id: str
    rank: int
    host: str  # where the controller and peers reach this rank
    worker_port: int
    layout: LayoutFingerprint
    chunk_size: int
    p2p_init_port: int | None = None
    p2p_lookup_port: int | None = None
    transfer_channel: str | None = None
    session: str = ""  # unique per process: the NIXL agent name and the peer session id
    serve_url: str | None = None  # the engine's OpenAI URL (config serve_url, {host} expanded)

    @classmethod
    def from_config(cls, config: LMCacheConfig, layout: LayoutFingerprint, rank: int) -> WorkerIdentity:
        config.validate_for_tp(rank + 1)
        # Several controllers: the first one's route (they are expected on one network).
        replies = config.controller_urls()[1]
        host = config.p2p_host or _route_address(replies[0] if replies else None)
        instance_id, worker_ports = config.lmcache_instance_id, config.lmcache_worker_ports
        # A worker runs only with enable_controller, where config.validate() requires the ports
        # and config.for_engine() fills in the instance id.
        assert instance_id is not None and worker_ports is not None, "worker built from an unresolved config"
        p2p_init_port: int | None = None
        p2p_lookup_port: int | None = None
        if config.enable_p2p:
            # config.validate() requires the per-rank p2p port lists with enable_p2p.
            assert config.p2p_init_ports is not None and config.p2p_lookup_ports is not None
            p2p_init_port, p2p_lookup_port = (
                rank_port(config.p2p_init_ports, rank),
                rank_port(config.p2p_lookup_ports, rank),
            )
        return cls(
            instance_id=instance_id,
            rank=rank,
            host=host,
            worker_port=rank_port(worker_ports, rank),
            layout=layout,
            chunk_size=config.chunk_size,
            p2p_init_port=p2p_init_port,
            p2p_lookup_port=p2p_lookup_port,
            transfer_channel=config.transfer_channel if config.enable_p2p else None,
            session=f"{instance_id}-r{rank}-{os.getpid()}-{uuid.uuid4().hex[:6]}",
            serve_url=expand_serve_url(config.serve_url, host) if config.serve_url else None,
        )

    def bound(self, port_field: str, port: int) -> None:
        """Record the port a socket bound: the configured one, or the OS's choice for 0."""
        if port_field not in _PORT_FIELDS:
            raise ValueError(f"not a port of WorkerIdentity: {port_field!r}")
        configured = getattr(self, port_field)
        if configured not in (0, port):
            raise ValueError(f"{self.describe()}: {port_field} {configured} was asked for, but {port} was bound")
        if configured == 0:
            logger.info("%s: %s 0 in the config: bound %d", self.describe(), port_field, port)
        setattr(self, port_field, port)

    def describe(self) -> str:
        return f"{self.instance_id} rank {self.rank}"


def _route_address(url: str | None) -> str:
    """The local address that routes to the controller: what it should call us back on when
    p2p_host is not set (no packet is sent; a UDP connect only picks the route). A host that
    does not resolve falls back to loopback, with a warning: only this host reaches that."""
    if url is None:
        return LOOPBACK
    try:
        host, _ = split_host_port(url)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except (ValueError, OSError) as e:
        logger.warning(
            "no local address routes to the controller at %s (%s); registering as %s, which only "
            "this host can reach: set p2p_host to the address peers should use",
            url,
            e,
            LOOPBACK,
        )
        return LOOPBACK
