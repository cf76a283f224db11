"""The controller service: the shared state and the three parts that work on it, wired together.

* :class:`Monitor` (monitor.py): the ZMQ monitor sockets, registration, heartbeats, peer lookups, reaping;
* :class:`Orchestrator` (orchestration.py): move, copy, clear, pin, health and status commands;
* :class:`Views` (views.py): lookups, worker and key views, ``/check_finish``, the dashboard.

api.py routes HTTP to the orchestrator and the views; cli.py binds, starts and closes the whole.
Everything runs on one asyncio loop, so index updates and lookups never interleave mid-operation.
"""

from __future__ import annotations

import logging
import time
import uuid

import zmq.asyncio

from lmcache_p2p.controller.admission import Resolver
from lmcache_p2p.controller.commands import CommandBus
from lmcache_p2p.controller.events import EventLog
from lmcache_p2p.controller.heap import HeapKeeper
from lmcache_p2p.controller.metrics import Metrics
from lmcache_p2p.controller.monitor import Monitor
from lmcache_p2p.controller.orchestration import Orchestrator
from lmcache_p2p.controller.registry import Registry
from lmcache_p2p.controller.settings import ControllerSettings
from lmcache_p2p.controller.traffic import FleetTraffic
from lmcache_p2p.controller.views import Views
from lmcache_p2p.mesh_security import (
    HOW_TO_SET_CONTROLLER,
    MeshSecurity,
    gate_connections,
    stop_zap,
    warn_unauthenticated,
)

logger = logging.getLogger("lmcache_p2p.controller")


class Controller:
    """``resolver``: how registrants' host names are looked up (None: the system's; a test's own)."""

    def __init__(self, settings: ControllerSettings, resolver: Resolver | None = None):
        self.settings = settings
        # A new epoch on every start: a worker that heartbeats with another epoch re-registers.
        self.epoch = f"{int(time.time())}-{uuid.uuid4().hex[:8]}"
        self.started_at = time.time()
        self.registry = Registry()
        self.events = EventLog(journal=settings.events_file)
        self.metrics = Metrics()
        self.traffic = FleetTraffic(self.started_at)
        self.ctx = zmq.asyncio.Context()
        # Every ZMQ socket of the controller authenticated with the mesh secret (CurveZMQ). The
        # monitor's sockets get the keys by name; the command bus's clients take them from the
        # context, attached (its ZAP handler started) only once the bus is built: the bus sizes
        # the context's socket table, which ZMQ fixes at the first socket.
        self.security = MeshSecurity(settings.mesh_secret) if settings.mesh_secret else None
        self.orchestrator = Orchestrator(
            settings, self.registry, self.events, CommandBus(self.ctx), self.metrics, resolver
        )
        if self.security is not None:
            self.security.attach(self.ctx)
        # Every connection to the monitor sockets is asked about first: none is accepted that
        # would leave the controller short of descriptors (commands.py, "Connections").
        capacity = self.orchestrator.bus.capacity
        gate_connections(self.ctx, capacity.admit_connection)
        capacity.gated = True
        self.monitor = Monitor(
            self.ctx, settings, self.epoch, self.registry, self.traffic, self.orchestrator, self.metrics, self.security
        )
        self.heap = HeapKeeper(self.registry.workers.__len__)
        self.metrics.read_counter(
            "lmcache_controller_gc_freezes_total",
            "Times the heap was frozen out of the garbage collector's walks (after start-up, after the registry "
            "changed size)",
            lambda: [({}, float(self.heap.freezes))],
        )
        self.metrics.gauge(
            "lmcache_controller_gc_frozen_objects",
            "Objects the garbage collector no longer walks",
            lambda: [({}, float(self.heap.frozen_objects))],
        )
        self.views = Views(
            settings,
            self.epoch,
            self.started_at,
            self.registry,
            self.events,
            self.traffic,
            self.monitor.departed,
            self.metrics,
        )

    def bind(self) -> None:
        """Bind the monitor sockets; a port in use is a SettingsError naming it."""
        self.monitor.bind()

    def start(self) -> None:
        # Said once the ports are bound: a controller that cannot start says one line, and only that.
        if self.security is not None:
            logger.info("ZMQ sockets authenticated: CurveZMQ, mesh key %s", self.security.fingerprint)
        else:
            warn_unauthenticated("controller", HOW_TO_SET_CONTROLLER)
        self.monitor.start()
        self.heap.start()

    def close(self) -> None:
        self.heap.close()
        self.monitor.close()
        self.orchestrator.close()
        self.events.close()
        stop_zap(self.ctx)  # the mesh's ZAP handler, or the gate's plain one
