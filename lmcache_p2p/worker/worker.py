"""The per-rank worker: one background thread with one asyncio loop that owns every socket.

The engine calls in from its own thread (store, lookup, retrieve); everything that talks to the
network (controller link, command server, P2P server and client) runs on the worker's loop, so
no ZMQ socket or NIXL agent is ever used from two threads. Engine-facing calls submit a
coroutine to the loop and wait with a timeout; they never raise: a failure is a miss.

:func:`build_engine` puts a rank together: its tiers, its :class:`Worker` when the controller is
on, and the :class:`CacheEngine` they serve (the engine sees the worker only as a ``PeerService``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time

import msgspec
import numpy as np
import zmq.asyncio

from lmcache_p2p import device_checksum
from lmcache_p2p.cache_engine import CacheEngine
from lmcache_p2p.config import LMCacheConfig
from lmcache_p2p.keys import ChunkHashes, LayoutFingerprint
from lmcache_p2p.mesh_security import HOW_TO_SET_WORKER, MeshSecurity, warn_unauthenticated
from lmcache_p2p.miss_reasons import NOT_HELD, TIMEOUT, Miss
from lmcache_p2p.peer_service import EngineCounters
from lmcache_p2p.protocol import Traffic
from lmcache_p2p.pull_policy import PrefillRate, PullPolicy
from lmcache_p2p.storage.chunk_store import ChunkStore, PullLanding
from lmcache_p2p.storage.manager import StorageManager
from lmcache_p2p.transfer import TcpTransport, TransferError, Transport, make_transport
from lmcache_p2p.worker.adapters import ServedAdapters
from lmcache_p2p.worker.commands import CommandServer
from lmcache_p2p.worker.cpu_cores import describe_cores, widen_to_engine_cores
from lmcache_p2p.worker.engine_load import EngineLoadProbe
from lmcache_p2p.worker.identity import WorkerIdentity
from lmcache_p2p.worker.link import ControllerLink
from lmcache_p2p.worker.links import ControllerLinks
from lmcache_p2p.worker.offers import PeerOffer
from lmcache_p2p.worker.p2p_client import P2PClient
from lmcache_p2p.worker.p2p_server import PeerServer
from lmcache_p2p.worker.pull_pump import Landed
from lmcache_p2p.worker.pull_stats import PullStats

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0
# Beyond the controller's own timeout, how long an offer may take to come back from the loop.
OFFER_SLACK_S = 0.5


def build_engine(
    config: LMCacheConfig, layout: LayoutFingerprint, rank: int = 0, pin_memory: bool | None = None, device=None
) -> CacheEngine:
    """One rank's cache engine: its tiers, and with ``enable_controller`` its worker (which
    reports the engine's counters). ``pin_memory`` is for the CPU pool; ``device`` is the KV's
    (torch.device) when it is a GPU, where GPU staging goes. Everything that runs an engine builds
    it here (the vLLM connector's worker half, the stand-in). The one place that sees the
    ``StorageManager``: the worker gets it as a ``ChunkStore`` and its tiers as a ``PullLanding``."""
    config.validate()
    config.validate_for_tp(layout.tp_size)
    config.validate_for_block_size(layout.block_size)
    storage = StorageManager(config, layout, pin_memory=pin_memory, device=device)
    # The engine measures its prefill rate into this; the worker's pull policy reads it.
    device_class = "cuda" if device is not None and getattr(device, "type", None) == "cuda" else "cpu"
    counters = EngineCounters(
        prefill=PrefillRate.for_engine(config.prefill_tokens_per_s, device_class, min_tokens=config.chunk_size)
    )
    peers = None
    if config.enable_controller:
        try:
            # The store is its own PullLanding, once it has a CPU tier for pulls to land in.
            landing = storage if storage.cpu is not None else None
            peers = Worker(config, storage, landing, layout, rank, counters, device=device)
        except BaseException:
            storage.close()  # its disk writer thread
            raise
    return CacheEngine(config, layout, storage, rank=rank, peers=peers, counters=counters)


class Worker:
    """The network side of one rank (a ``PeerService`` for its :class:`CacheEngine`): its chunks
    through ``storage``, and with P2P its pulls landed through ``landing`` (None without a CPU
    tier, which P2P requires)."""

    def __init__(
        self,
        config: LMCacheConfig,
        storage: ChunkStore,
        landing: PullLanding | None,
        layout: LayoutFingerprint,
        rank: int,
        counters: EngineCounters,
        device=None,
    ):
        self.config = config
        self.device = device  # the engine's KV device (torch.device); GPU staging goes there
        self.storage = storage
        self.landing = landing
        self.counters = counters  # the engine's totals: the lookup ones go out with each heartbeat
        self.identity = WorkerIdentity.from_config(config, layout, rank)
        self.started_at = time.time()
        self.adapters = ServedAdapters()  # reported to every controller (worker/adapters.py)
        self.link: ControllerLinks | None = None  # one ControllerLink per configured controller
        self.client: P2PClient | None = None
        self.server: PeerServer | None = None
        self.commands: CommandServer | None = None
        self.transports: dict[str, Transport] = {}
        # Why the configured transfer channel is not the one running (None: it is); in /status,
        # at the controller (/controller/workers, the WebUI) and in one ERROR line at start-up.
        self.channel_error: str | None = None
        # The mesh's CurveZMQ keys (config mesh_secret_file / mesh_secret); None: plain sockets.
        # Read here, in the engine's thread, so a bad secret file fails the engine's start-up.
        secret = config.resolved_mesh_secret()
        self.security = MeshSecurity(secret) if secret is not None else None
        gpu_tier = landing.gpu_tier if landing is not None else None
        if config.enable_p2p and gpu_tier is not None and storage.page_bytes % 4 == 0:
            # What the first pull landing in the GPU tier checks its pages with. Made here, in the
            # engine's thread, not within the worker's start-up window: its first build on a
            # machine (nvcc) takes a minute or more, and failed every GPU engine's start.
            device_checksum.prepare(storage.page_bytes, gpu_tier.pool.buffer.device)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"lmcache-worker-r{rank}", daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise RuntimeError(f"{self.identity.describe()}: worker did not start within {START_TIMEOUT_S:.0f}s")
        if self._start_error is not None:
            self._thread.join(5)
            raise self._start_error

    # -- the loop thread -------------------------------------------------------------------------

    def _run(self) -> None:
        if self.device is None or getattr(self.device, "type", None) == "cpu":
            # Before any thread of ours starts: they inherit this one's cores (worker/cpu_cores.py).
            widened = widen_to_engine_cores()
            if widened is not None:
                logger.info(
                    "%s: the engine bound this rank to core(s) %s; the worker's threads (peer pulls served "
                    "and made, the controller link) run on core(s) %s, so they do not wait for its steps",
                    self.identity.describe(),
                    describe_cores(widened[0]),
                    describe_cores(widened[1]),
                )
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start())
        except BaseException as e:
            self._start_error = e
            self._ready.set()
            self._loop.close()
            return
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    async def _start(self) -> None:
        config, me = self.config, self.identity
        pull_urls, reply_urls = config.controller_urls()
        # config.validate(): required with enable_controller, as many pull URLs as reply URLs
        assert pull_urls and len(pull_urls) == len(reply_urls)
        self.ctx = zmq.asyncio.Context()
        # Rank 0 reads the engine's queue from its API server; every rank reports its own rates.
        self.load_probe = EngineLoadProbe(
            me.serve_url if me.rank == 0 else None,
            self.counters.prefill,
            lambda: self.client.policy if self.client is not None else None,
            interval=min(1.0, config.lmcache_worker_heartbeat_time),
            describe=me.describe(),
        )
        security = self.security
        if security is not None:
            # ZAP for this context, and the keys for the sockets built without naming them (the
            # command server's): every socket of this worker is a mesh member.
            security.attach(self.ctx)
        else:
            warn_unauthenticated("instance", HOW_TO_SET_WORKER)
        # Each link takes its own queue of the store's events: every controller indexes every key.
        self.link = ControllerLinks(
            [
                ControllerLink(
                    self.ctx,
                    me,
                    self.storage,
                    pull_url,
                    reply_url,
                    config.lmcache_worker_heartbeat_time,
                    traffic=self.traffic,
                    security=security,
                    load=self.load_probe.current,
                    adapters=self.adapters,
                )
                for pull_url, reply_url in zip(pull_urls, reply_urls, strict=True)
            ]
        )
        try:
            if config.enable_p2p:
                channel = config.transfer_channel
                assert channel is not None  # config.validate(): required with enable_p2p
                landing = self.landing
                assert landing is not None  # config.validate(): enable_p2p requires local_cpu
                self.transports = self._make_transports(channel, landing)
                self.client = P2PClient(
                    self.ctx,
                    me,
                    self.storage,
                    landing,
                    self.link,
                    self.transports,
                    channel,
                    config.p2p_batch_chunks,
                    config.p2p_pipeline_depth,
                    config.p2p_pull_timeout_s,
                    policy=PullPolicy(
                        self.counters.prefill,
                        config.chunk_size,
                        self.storage.page_bytes,
                        config.p2p_pull_policy,
                        config.p2p_pull_margin,
                        probe_chunks=config.p2p_batch_chunks,
                    ),
                    security=security,
                    prefix_pull_turns=config.p2p_prefix_pull_turns,
                )
                self.server = PeerServer(self.ctx, me, self.storage, self.transports, self.client, security=security)
            self.commands = CommandServer(self.ctx, me, self.storage, self.link, self.client, self.status)
        except BaseException:
            self._shutdown(deregister=False)
            raise
        self.link.effective_channel, self.link.channel_error = self.effective_channel, self.channel_error
        if self.client is not None and config.p2p_max_warm_peers > 0:
            # The controller answers registrations and heartbeats with the peers to keep warm.
            self.link.max_warm_peers = config.p2p_max_warm_peers
            self.link.on_peers = functools.partial(self.client.set_warm_peers, limit=config.p2p_max_warm_peers)
            if self.server is not None:
                self.server.on_greeted = self._greeted
        if self.server is not None:
            self.server.flush_events = self.link.flush
        self.link.start()
        self._load_task = asyncio.get_running_loop().create_task(self.load_probe.run(), name="engine-load")
        if self.server is not None:
            self.server.start()
        self.commands.start()
        logger.info(
            "worker %s up: commands on %d%s, controller %s, %s",
            me.describe(),
            me.worker_port,
            f", p2p init/lookup {me.p2p_init_port}/{me.p2p_lookup_port} ({', '.join(self.transports)})"
            if self.server
            else "",
            config.controller_reply_url,
            f"CurveZMQ with mesh key {security.fingerprint}" if security is not None else "unauthenticated",
        )

    def _greeted(self, instance_id: str, rank: int) -> None:
        """A peer opened a session with us. One we do not keep warm is likely a newcomer whose
        warm set has us: ask the controller for ours now, not a heartbeat interval later."""
        client, link = self.client, self.link
        if client is not None and link is not None and not client.is_warm(instance_id, rank):
            link.beat_soon(f"{instance_id} rank {rank} greeted us and is not in our warm set")

    def _make_transports(self, channel: str, landing: PullLanding) -> dict[str, Transport]:
        pool, session = landing.cpu_pool, self.identity.session
        transports: dict[str, Transport] = {}
        if channel != "tcp":
            try:
                transports[channel] = make_transport(
                    channel,
                    pool,
                    session,
                    self.config.nixl_progress_delay_us,
                    self.config.nixl_buffer_device,
                    self.config.nixl_buffer_size,
                    self.device,
                    gpu_tier=landing.gpu_tier,
                )
            except TransferError as e:
                if self.config.nixl_buffer_device == "cuda":  # the fast path was asked for by name
                    why = str(e) if "nixl_buffer_device" in str(e) else f"nixl_buffer_device is cuda, but {e}"
                    raise TransferError(f"{self.identity.describe()}: {why}") from None
                # An ERROR, not a warning: the engine runs, but every peer pull it makes or serves
                # is many times slower than asked for, and this line is the only place that says so.
                self.channel_error = str(e)
                logger.error(
                    "%s: transfer_channel %s is not available here, so peers pull over tcp: %s",
                    self.identity.describe(),
                    channel,
                    e,
                )
        transports["tcp"] = TcpTransport(pool, session)
        return transports

    @property
    def effective_channel(self) -> str | None:
        """The channel this rank pulls over and prefers to serve (None without P2P)."""
        if not self.transports:
            return None
        configured = self.config.transfer_channel
        return configured if configured in self.transports else "tcp"

    def _shutdown(self, deregister: bool) -> None:
        for part in (self.commands, self.server, self.client):
            if part is not None:
                part.close()
        if self.link is not None:
            self.link.close(deregister=deregister)
        for transport in self.transports.values():
            try:
                transport.close()
            except Exception as e:
                logger.debug("closing %s transport: %s", transport.name, e)
        if self.security is not None:
            self.security.detach(self.ctx)  # its ZAP thread's sockets would keep destroy() waiting
        self.ctx.destroy(linger=100 if deregister else 0)

    # -- engine-facing calls (any thread) --------------------------------------------------------

    def note_adapter(self, name: str, lora_id: str) -> None:
        """The engine served LoRA adapter ``name`` with id ``lora_id``: the controllers learn it
        with the next heartbeat, sent now when it is new (a router may ask about it next)."""
        if self.adapters.note(name, lora_id) and self.link is not None:
            link = self.link
            self._loop.call_soon_threadsafe(link.beat_soon, f"adapter {name} served")

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def offer_prefix(self, hashes: ChunkHashes, timeout: float) -> PeerOffer | Miss:
        """What a pull of ``hashes`` from a peer would bring (the controller's holders and the
        pull policy's decision, no bytes moved); or why no peer offers the first chunk (the
        controller not answering within ``timeout`` is a ``timeout`` miss)."""
        if self.client is None or not len(hashes):
            return Miss(NOT_HELD)
        coro = self.client.offer_prefix(np.asarray(hashes, dtype=np.uint64), timeout)
        unanswered = Miss(TIMEOUT, f"naming the holders took over {timeout + OFFER_SLACK_S:.1f} s")
        return self._wait(coro, timeout + OFFER_SLACK_S, f"naming the holders of {len(hashes)} chunk(s)", unanswered)

    def pull_offer_async(self, offer: PeerOffer, on_landed: Landed | None = None) -> concurrent.futures.Future:
        """Start pulling an offer's chunks; the future gives a :class:`PulledChunks`.
        ``on_landed`` is called on the worker's thread with the leading chunks held so far,
        after each batch that brought some (see :meth:`P2PClient.pull_offer`)."""
        assert self.client is not None  # an offer came from it
        return self.submit(self.client.pull_offer(offer, on_landed))

    def _wait(self, coro, timeout: float, what: str, default):
        """Run ``coro`` on the worker's loop and wait up to ``timeout`` for its result; past it
        (given up on) or on a failure, ``default``, said in the log: the engine treats it as a miss."""
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            logger.warning("%s: %s took over %.1f s; treating as a miss", self.identity.describe(), what, timeout)
        except Exception:
            logger.exception("%s: %s failed; treating as a miss", self.identity.describe(), what)
        return default

    def call(self, fn, timeout: float = 10.0):
        """Run ``fn()`` on the worker's loop (for state that lives there) and return its result."""

        async def run():
            return fn()

        return self.submit(run()).result(timeout)

    def flush(self) -> None:
        """Send the queued admit/evict reports now."""
        link = self.link
        assert link is not None  # set before the constructor returned
        self.call(link.flush)

    def traffic(self) -> Traffic:
        """This rank's totals for the controller's dashboard (sent with each heartbeat)."""
        engine = self.counters
        pulls = self.client.stats if self.client else PullStats()
        server = self.server.stats if self.server else {}
        return Traffic(
            started_at=self.started_at,
            lookups=engine.lookups,
            lookup_tokens=engine.lookup_tokens,
            hit_tokens=engine.hit_tokens,
            peer_hit_tokens=pulls.prefix_hit_chunks * self.config.chunk_size,
            pulls=pulls.pulls,
            pull_failures=pulls.pull_failures,
            pulled_bytes=pulls.bytes_pulled,
            served_bytes=server.get("bytes_served", 0),
            pulls_skipped=pulls.pulls_skipped,
            skipped_tokens=pulls.chunks_skipped * self.config.chunk_size,
        )

    def status(self) -> dict:
        me = self.identity
        out = {
            "instance_id": me.instance_id,
            "rank": me.rank,
            "host": me.host,
            "uptime_s": time.time() - self.started_at,
            "registered": self.link.registered if self.link else False,
            "controller_epoch": self.link.epoch if self.link else "",
            "storage": self.storage.stats(),
        }
        if self.link:
            out["link"] = dict(self.link.stats)
            out["controllers"] = self.link.status()
        if self.client:
            out["p2p_client"] = self.client.stats.as_dict()
        if self.server:
            out["p2p_server"] = dict(self.server.stats)
            out["channels"] = list(self.transports)
            out["transfer_channel"] = self.config.transfer_channel
            out["effective_channel"] = self.effective_channel
            out["channel_error"] = self.channel_error
        if self.client:
            out["warm_peers"] = self.client.warm_peers()
        if self.commands:
            out["command_pins"] = self.commands.pinned_chunks
        load = self.load_probe.current()
        out["engine_load"] = {
            "serve_url": me.serve_url,
            "metrics_url": self.load_probe.metrics_url,
            **self.load_probe.stats,
            "reported": msgspec.structs.asdict(load) if load is not None else None,
        }
        security = self.security
        out["mesh"] = (
            {"authenticated": True, "key": security.fingerprint, "refused": security.refused}
            if security is not None
            else {"authenticated": False}
        )
        return out

    def close(self) -> None:
        if not self._thread.is_alive():
            return

        async def stop():
            link = self.link
            assert link is not None  # set before the constructor returned
            link.flush()
            self._shutdown(deregister=True)
            # Let every cancelled task finish before the loop stops.
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        try:
            self.submit(stop()).result(10)
        except Exception as e:
            logger.warning("%s: worker shutdown: %s", self.identity.describe(), e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
