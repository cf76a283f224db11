"""How busy this rank's engine is, for the heartbeat's ``EngineLoad`` (what POST /route weighs).

Two sources, because no one place knows it all:

* **The engine's queue and KV usage** come from the engine's own Prometheus endpoint,
  ``{serve_url}/metrics`` (vLLM's ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc``). The worker lives in a vLLM worker process, and the scheduler's
  counts live in another process (the engine core); the API server already publishes them, so
  scraping it needs no hook into vLLM's scheduler. Only rank 0 scrapes: every rank of an engine
  would read the same numbers. Without ``serve_url`` (an offline ``LLM``, a Ray replica behind
  Ray's proxy) the queue is not reported.
* **Rates** are this rank's own measurements: the engine's prefill rate (``PrefillRate``, fed by
  its forward passes) and the pull policy's per-link estimates (the median link).

:class:`EngineLoadProbe` scrapes on its own task every ``interval`` seconds and keeps the latest
reading; the heartbeat takes it without waiting, so a slow or dead API server never delays a
heartbeat (a reading older than ``stale_after_s`` is dropped instead of reported as current).
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from lmcache_p2p.protocol import EngineLoad
from lmcache_p2p.pull_policy import PrefillRate, PullPolicy

logger = logging.getLogger(__name__)

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
# vLLM renamed the KV usage gauge (0.10): read either, the newer first.
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
SCRAPE_TIMEOUT_S = 1.0


@dataclass
class QueueReading:
    running: int
    waiting: int
    kv_usage: float
    at: float  # time.monotonic() of the scrape


def parse_engine_metrics(text: str) -> QueueReading | None:
    """The queue gauges from a vLLM /metrics page, summed over the engines it lists (a data-parallel
    server lists one per engine); KV usage is the fullest engine's. None when the page has none of
    them (not a vLLM server)."""
    running = waiting = 0.0
    kv_usage: dict[str, float] = {}
    found = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == RUNNING:
                running += sample.value
                found = True
            elif sample.name == WAITING:
                waiting += sample.value
                found = True
            elif sample.name in KV_USAGE:
                kv_usage.setdefault(sample.name, 0.0)
                kv_usage[sample.name] = max(kv_usage[sample.name], sample.value)
                found = True
    if not found:
        return None
    usage = next((kv_usage[name] for name in KV_USAGE if name in kv_usage), 0.0)
    return QueueReading(int(running), int(waiting), min(1.0, max(0.0, usage)), time.monotonic())


class EngineLoadProbe:
    """The latest :class:`EngineLoad` of one rank; :meth:`run` keeps the queue part fresh."""

    def __init__(
        self,
        serve_url: str | None,
        prefill: PrefillRate,
        policy: Callable[[], PullPolicy | None],
        interval: float,
        describe: str,
    ):
        self.metrics_url = f"{serve_url.rstrip('/')}/metrics" if serve_url else None
        self.prefill = prefill
        self.policy = policy  # the P2P client's, once it exists (None without P2P)
        self.interval = interval
        self.stale_after_s = max(3 * interval, 5.0)
        self.describe = describe
        self.queue: QueueReading | None = None
        self.stats = {"scrapes": 0, "scrape_failures": 0}
        self._failing = False

    async def run(self) -> None:
        """Scrape until cancelled. Failures are logged once per outage, not per scrape."""
        if self.metrics_url is None:
            return
        async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S) as client:
            while True:
                await self.scrape(client)
                await asyncio.sleep(self.interval)

    async def scrape(self, client: httpx.AsyncClient) -> None:
        assert self.metrics_url is not None
        try:
            response = await client.get(self.metrics_url)
            response.raise_for_status()
            reading = parse_engine_metrics(response.text)
            if reading is None:
                raise ValueError("no vllm:num_requests_* gauges on the page")
        except Exception as e:  # the engine's server starting, restarting, or not vLLM's
            self.stats["scrape_failures"] += 1
            if not self._failing:
                logger.warning(
                    "%s: cannot read the engine's load from %s (%s); routing sees no queue until it answers",
                    self.describe,
                    self.metrics_url,
                    e,
                )
            self._failing = True
            return
        self.stats["scrapes"] += 1
        if self._failing:
            logger.info("%s: reading the engine's load from %s again", self.describe, self.metrics_url)
        self._failing = False
        self.queue = reading

    def current(self) -> EngineLoad | None:
        """For the next heartbeat: None when there is nothing measured to report."""
        queue = self.queue
        if queue is not None and time.monotonic() - queue.at > self.stale_after_s:
            queue = None
        prefill = self.prefill.tokens_per_s if self.prefill.steps else 0.0
        bytes_per_s, fixed_ms = self._link_rates()
        if queue is None and not prefill and not bytes_per_s:
            return None
        return EngineLoad(
            running=queue.running if queue else 0,
            waiting=queue.waiting if queue else 0,
            kv_usage=queue.kv_usage if queue else 0.0,
            queue_reported=queue is not None,
            prefill_tokens_per_s=prefill,
            prefill_steps=self.prefill.steps,
            pull_bytes_per_s=bytes_per_s,
            pull_fixed_ms=fixed_ms,
        )

    def _link_rates(self) -> tuple[float, float]:
        """The median measured link's bandwidth and fixed cost: what a pull from a typical peer
        costs (the controller does not know which peer a routed request will pull from)."""
        policy = self.policy()
        links = [e for e in policy.links.values() if e.pulls] if policy is not None else []
        if not links:
            return 0.0, 0.0
        return (
            statistics.median(e.bytes_per_s for e in links),
            statistics.median(e.fixed_s for e in links) * 1e3,
        )
