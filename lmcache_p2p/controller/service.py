"""The controller service: the shared state and the three parts that work on it, wired together.

* :class:`Monitor` (monitor.py): the ZMQ monitor sockets, registration, heartbeats, peer lookups, reaping;
* :class:`Orchestrator` (orchestration.py): move, copy, clear, pin, health and status commands;
* :class:`Views` (views.py): lookups, worker and key views, ``/check_finish``, the dashboard.

api.py routes HTTP to the orchestrator and the views; cli.py binds, starts and closes the whole.
Everything runs on one asyncio loop, so index updates and lookups never interleave mid-operation.
"""

from __future__ import annotations

import time
import uuid

import zmq.asyncio

from lmcache_p2p.controller.commands import CommandBus
from lmcache_p2p.controller.events import EventLog
from lmcache_p2p.controller.metrics import Metrics
from lmcache_p2p.controller.monitor import Monitor
from lmcache_p2p.controller.orchestration import Orchestrator
from lmcache_p2p.controller.registry import Registry
from lmcache_p2p.controller.settings import ControllerSettings
from lmcache_p2p.controller.traffic import FleetTraffic
from lmcache_p2p.controller.views import Views


class Controller:
    def __init__(self, settings: ControllerSettings):
        self.settings = settings
        # A new epoch on every start: a worker that heartbeats with another epoch re-registers.
        self.epoch = f"{int(time.time())}-{uuid.uuid4().hex[:8]}"
        self.started_at = time.time()
        self.registry = Registry()
        self.events = EventLog()
        self.metrics = Metrics()
        self.traffic = FleetTraffic(self.started_at)
        self.ctx = zmq.asyncio.Context()
        self.orchestrator = Orchestrator(settings, self.registry, self.events, CommandBus(self.ctx), self.metrics)
        self.monitor = Monitor(
            self.ctx, settings, self.epoch, self.registry, self.traffic, self.orchestrator, self.metrics
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
        self.monitor.start()

    def close(self) -> None:
        self.monitor.close()
        self.orchestrator.close()
