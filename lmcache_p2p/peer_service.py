"""The contract between a rank's :class:`CacheEngine` and its network side.

The engine is core and the worker package (controller link, commands, peer pulls) is built on
the core, so the engine must not import the worker: it asks for peers through the
:class:`PeerService` interface, and ``lmcache_p2p.worker.build_engine`` hands it the rank's
:class:`Worker`. :class:`EngineCounters` are the totals both sides read: the engine counts, the
worker reports them to the controller; with them travels the engine's measured prefill rate
(:class:`~lmcache_p2p.pull_policy.PrefillRate`), which the worker's pull policy weighs pulls against.

Torch-free.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from lmcache_p2p.keys import ChunkHashes
from lmcache_p2p.miss_reasons import Miss
from lmcache_p2p.pull_policy import PrefillRate


@dataclass
class EngineCounters:
    """A rank's totals since start, in tokens: what the engine's ``status()`` reports and tests
    and dashboards read. The lookup totals also travel to the controller with every heartbeat
    (``protocol.Traffic``)."""

    stored_tokens: int = 0
    retrieved_tokens: int = 0
    retrieves: int = 0
    lookups: int = 0  # prompts looked up, each once, when its hit is final
    lookup_tokens: int = 0
    hit_tokens: int = 0  # of lookup_tokens, those found locally or pulled from a peer
    # Not a total: the engine's prefill rate, measured by the engine (CacheEngine.observe_prefill),
    # read by the worker's pull policy. build_engine seeds it from config and device class.
    prefill: PrefillRate = field(default_factory=lambda: PrefillRate.for_engine(None, "cpu"), compare=False)

    def totals(self) -> dict[str, int]:
        """The counts (everything but ``prefill``), for status answers."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "prefill"}


class Offer(Protocol):
    """Leading chunks a peer would send (``PeerService.offer_prefix``): the engine promises them
    to its scheduler at once and hands the offer back to ``pull_offer_async`` when it loads."""

    @property
    def chunks(self) -> int: ...

    @property
    def then(self) -> Miss | None:
        """Why the chunk after the offered ones is not offered (None: the offer ends the prompt)."""
        ...

    def first(self, chunks: int) -> Offer:
        """The same offer cut to its first ``chunks`` chunks (what the load needs)."""
        ...


# A pull's progress hook: called on the worker's thread with how many leading chunks of the offer
# are held here now, after each batch that brought some (a loader may copy those while the rest
# arrive). Keep it short: the worker's loop runs it.
Landed = Callable[[int], object]


class PeerService(Protocol):
    """What the engine needs from the network side (the rank's worker)."""

    def offer_prefix(self, hashes: ChunkHashes, timeout: float) -> Offer | Miss:
        """The leading chunks of ``hashes`` a live peer holds and the pull policy would pull
        (no bytes moved); or why no peer offers the first one (miss_reasons; ``not_held``: no
        live instance holds it, for the engine to tell evicted from never stored)."""

    # ``Any``: the service takes back the offers it made (its own type), which a parameter typed
    # with the Offer protocol would not admit.
    def pull_offer_async(self, offer: Any, on_landed: Landed | None = None) -> concurrent.futures.Future:
        """Pull an offer's chunks; a future of a :class:`~lmcache_p2p.miss_reasons.PulledChunks`
        (the leading chunks now held locally, and why not more). ``on_landed``: see :data:`Landed`."""

    def status(self) -> dict:
        """The rank's state for operators and tests, its storage's stats under ``"storage"``."""

    def note_adapter(self, name: str, lora_id: str) -> None:
        """The engine served LoRA adapter ``name`` (``lora_id``: adapter_id.py): tell the controllers."""

    def flush(self) -> None:
        """Send the admit/evict reports queued for the controller now."""

    def close(self) -> None:
        """Deregister and close every socket."""
