"""A rank's answers to the scheduler's lookups (the lookup server's thread), and the state each
answer leaves until the request's load takes it (the model runner's thread).

A prefix lookup pins the chunks the local tiers hold and asks for an offer past them (a live
peer's, the remote store's: ``CacheEngine.lookup_async``); the answer is the held tokens plus the
offered ones, with where the offer starts. A segment lookup (blending) pins the segments held
whole and asks for an offer of each of the others (the blended load pulls those first, beside the
steps). Pins live until the load takes them, the step releases the request, or
``LOOKUP_PIN_TTL_S`` passes unclaimed.

With ``pull_before_grant`` the offer is pulled from the first answer on (``pull_now``): the
thread that ends the pull tells the scheduler (``on_pull_ended``: the rank's
``lookup_channel.PullEndedSender``), and the scheduler's second ask (``settle``) pins what is
held then, the pulled chunks with the rest, for a load in the step.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from lmcache_p2p.cache_engine import CacheEngine, PinnedPrefix, PrefixLookup
from lmcache_p2p.integration.vllm.load_jobs import pin_whole
from lmcache_p2p.integration.vllm.lookup_channel import LookupReply, LookupRequest, pack_sources
from lmcache_p2p.miss_reasons import EVICTED, HOLDER_GONE, Miss, PulledChunks
from lmcache_p2p.peer_service import Offer
from lmcache_p2p.protocol import unpack_hashes
from lmcache_p2p.remote.offers import RemoteOffer
from lmcache_p2p.vocab import SOURCE_HOST, SOURCE_P2P, SOURCE_REMOTE

logger = logging.getLogger(__name__)

# Pins of a lookup whose request never came back (scheduler gone, a lost release) are dropped.
LOOKUP_PIN_TTL_S = 300.0


@dataclass
class RankLookup:
    """One request's lookup on this rank, kept for its load."""

    chunk_hashes: np.ndarray  # the prompt's, uint64 (the load's spec carries them again)
    num_tokens: int  # the prompt's length
    # Each leading chunk held in the local tiers when first asked, as its hit source (vocab); and
    # what comes after it: an offer (a peer's or the remote store's) that the load pulls.
    local_sources: list[str]
    started: float  # when the rank was first asked (time.monotonic)
    offer: Offer | None = None  # chunks after the local hit a peer or the store offers
    offered_at: float | None = None  # when the offer was known
    prefix: PinnedPrefix | None = None
    miss: Miss | None = None  # why the first chunk past the hit and the offer is missed
    pull: concurrent.futures.Future | None = None  # the offer's pull before the grant (pull_now)
    pull_started: float = 0.0


@dataclass
class SegmentOffer:
    """A segment this rank lacks that a peer or the remote store offers whole past what is held."""

    keys: list[int]  # the segment's chunk keys
    offer: Offer  # its chunks past the leading ones held here


@dataclass
class SegmentLookup:
    """One blended request's segment lookup on this rank, kept for its load."""

    started: float  # when the rank was asked (time.monotonic)
    pins: dict[int, Any]  # the segments held whole: key -> pinned chunk, the load's to release
    offers: list[SegmentOffer]  # the segments the load pulls first


class RankLookups:
    """The rank's lookups and segment pins by request id; the lookup thread writes them, the
    model runner's thread takes them (one lock)."""

    def __init__(self, engine: CacheEngine, on_gpu: bool, blender: Any = None):
        self.engine = engine
        self.on_gpu = on_gpu  # a GPU rank says how far its hit is in host memory
        self.blender = blender  # blending.SegmentBlender: segment stores to wait for
        self._lookups: dict[str, RankLookup] = {}
        self._segments: dict[str, SegmentLookup] = {}
        self._lock = threading.Lock()
        # Told (from the thread that ended it) that a pull before the grant ended: the rank's word
        # to the scheduler (PullEndedSender.send).
        self.on_pull_ended: Callable[[str], None] = lambda req_id: None

    def answer(self, request: LookupRequest) -> LookupReply:
        """The lookup server's handler (its thread): a prefix's hit and offer, or a segment lookup."""
        self._expire()
        if request.segments is not None:
            return self._on_segment_lookup(request)
        with self._lock:
            state = self._lookups.get(request.req_id)
        if state is None:
            if request.hashes is None:
                return LookupReply(seq=request.seq, req_id=request.req_id, error="a prefix lookup without its hashes")
            chunk_hashes = unpack_hashes(request.hashes)
            seen = time.monotonic()
            if request.lora and len(request.lora) == 2:  # its adapter's id, for the controllers
                self.engine.note_adapter(request.lora[0], request.lora[1])
            if request.fetch_missing:
                first = self.engine.lookup_async(chunk_hashes)
            else:
                first = PrefixLookup(self.engine.local_sources(chunk_hashes))
            state = RankLookup(chunk_hashes, request.num_tokens, first.sources, seen)
            state.offer, state.miss = first.offer, first.miss
            if first.offer is not None:
                state.offered_at = time.monotonic()
            with self._lock:
                self._lookups[request.req_id] = state
        if state.prefix is None:
            state.prefix = self.engine.pin_prefix(state.chunk_hashes)
            if state.offer is not None and len(state.prefix.chunks) != len(state.local_sources):
                # Part of the local hit was evicted since: the offer no longer continues it.
                state.offer = None
                state.miss = Miss(EVICTED, "from this rank's tiers while its lookup ran")
            if state.offer is None:  # with an offer, counted once its load pulled it
                self.engine.count_lookup(state.num_tokens, state.prefix.num_tokens, state.miss)
        if request.pull_now and state.offer is not None and state.pull is None:
            self._start_pull(request.req_id, state)
        elif request.settle:
            self._settle(request.req_id, state)
        # A GPU rank says how far loading the hit crosses PCIe and whether it fetched part of it
        # (async_kv_loads "auto" decides on both); a CPU rank's loads cross no link.
        host_until = state.prefix.host_until() if self.on_gpu else 0
        sources = self._hit_sources(state)
        held = state.prefix.num_tokens
        offered = state.offer.chunks * self.engine.chunk_size if state.offer is not None else 0
        return LookupReply(
            seq=request.seq,
            req_id=request.req_id,
            hit_tokens=held + offered,
            host_until=host_until,
            fetched=any(source in (SOURCE_P2P, SOURCE_REMOTE) for source in sources),
            chunk_sources=pack_sources(sources),
            pull_from=held if offered else -1,
            pulling=state.pull is not None,
        )

    def _start_pull(self, req_id: str, state: RankLookup) -> None:
        """Pull the offer before the grant; the scheduler hears when it ended. Not the prompt's last
        token's chunk: vLLM computes that token whatever is held."""
        assert state.offer is not None and state.prefix is not None
        needed = -(-(state.num_tokens - 1 - state.prefix.num_tokens) // self.engine.chunk_size)
        if needed <= 0:
            return
        if needed < state.offer.chunks:
            state.offer = state.offer.first(needed)
        state.pull_started = time.monotonic()
        state.pull = self.engine.pull_offer_async(state.offer)
        state.pull.add_done_callback(lambda _: self.on_pull_ended(req_id))

    def running_pulls(self) -> list[concurrent.futures.Future]:
        """The pulls before a grant still running (an idle step waits on them)."""
        with self._lock:
            pulls = [state.pull for state in self._lookups.values() if state.pull is not None]
        return [pull for pull in pulls if not pull.done()]

    def _settle(self, req_id: str, state: RankLookup) -> None:
        """The scheduler's second ask after a pull before the grant: what came is held like any
        local hit (pinned for the load in the step), and the offer is gone."""
        pull, offer = state.pull, state.offer
        state.pull = None
        if pull is None or offer is None:
            return
        if not pull.done():  # the scheduler stopped waiting (its deadline): the pull is given up
            pull.cancel()
            logger.warning(
                "request %s: its pull before the grant given up after %.1f s",
                req_id,
                time.monotonic() - state.pull_started,
            )
        miss: Miss | None = None
        try:
            outcome: PulledChunks = pull.result(timeout=0)
            pulled = outcome.chunks
            if pulled < offer.chunks:
                miss = outcome.miss
        except (concurrent.futures.CancelledError, concurrent.futures.TimeoutError):
            pulled, miss = 0, Miss(HOLDER_GONE, "the pull was given up before its grant")
        except Exception as e:
            logger.exception("request %s: pulling the chunks offered failed", req_id)
            pulled, miss = 0, Miss(HOLDER_GONE, f"the pull failed: {e}")
        offered_by = SOURCE_REMOTE if isinstance(offer, RemoteOffer) else SOURCE_P2P
        before = state.prefix
        state.prefix = self.engine.pin_prefix(state.chunk_hashes)
        if before is not None:
            before.release()
        with self._lock:
            kept = self._lookups.get(req_id) is state
        if not kept:  # dropped meanwhile (the scheduler gave this answer up): nothing will release it
            state.prefix.release()
            return
        held = len(state.prefix.chunks)
        local = min(len(state.local_sources), held)
        state.local_sources = state.local_sources[:local] + [offered_by] * (held - local)
        state.offer = None
        state.miss = miss if held < len(state.chunk_hashes) else None
        self.engine.count_lookup(state.num_tokens, state.prefix.num_tokens, state.miss)
        logger.info(
            "request %s: pulled %d of the %d chunk(s) %s offered before its grant in %.1f ms; %d token(s) held to load",
            req_id,
            pulled,
            offer.chunks,
            "from the remote store" if offered_by == SOURCE_REMOTE else "a peer",
            (time.monotonic() - state.pull_started) * 1e3,
            state.prefix.num_tokens,
        )

    def _hit_sources(self, state: RankLookup) -> list[str]:
        """Where each chunk of the hit comes from: the tier it was in when first asked; after
        those, an offer the load pulls (a peer's, or the remote store's); one that arrived
        otherwise (another request stored it) by where it is now."""
        assert state.prefix is not None
        held = len(state.prefix.chunks)
        sources = state.local_sources[:held]
        if state.offer is not None:
            offered_by = SOURCE_REMOTE if isinstance(state.offer, RemoteOffer) else SOURCE_P2P
            return sources + [offered_by] * state.offer.chunks
        for index in range(len(sources), held):
            location = self.engine.local_sources(state.chunk_hashes[index : index + 1])
            sources.append(location[0] if location else SOURCE_HOST)
        return sources

    def _on_segment_lookup(self, request: LookupRequest) -> LookupReply:
        """Which segments this rank holds whole in its local tiers (pinned for the load) and,
        with ``fetch_missing``, which of the others a peer or the remote store offers whole (a
        segment's keys are a chain like a prefix's, indexed by the controller like any chunk).
        Nothing is pulled here: the blended load pulls the offered segments beside the steps."""
        engine = self.engine
        storage = engine.storage
        self._release_segments(request.req_id)  # asked again (a preempted request): the new answer stands
        segments = [unpack_hashes(packed).tolist() for packed in request.segments or []]
        if self.blender is not None:
            # Segments being stored behind an earlier step count: wait for those stores only.
            wanted = {int(key) for keys in segments for key in keys}
            self.blender.poll_stores(wait=True, keys=wanted, req_id=request.req_id)
        held, offered = [], []
        found = SegmentLookup(time.monotonic(), {}, [])
        for keys in segments:
            whole = pin_whole(storage, keys, found.pins)
            held.append(whole)
            offer = self._offer_segment(request.req_id, keys) if not whole and request.fetch_missing else None
            offered.append(offer is not None)
            if offer is not None:
                found.offers.append(offer)
        with self._lock:
            self._segments[request.req_id] = found
        return LookupReply(seq=request.seq, req_id=request.req_id, segments_held=held, segments_offered=offered)

    def _offer_segment(self, req_id: str, keys: list[int]) -> SegmentOffer | None:
        """An offer of the segment's chunks past its leading ones held here, when it covers the
        rest of the segment (a segment is blended whole or not at all); else None."""
        if not keys:
            return None
        try:
            found = self.engine.lookup_async(keys)
        except Exception:  # a failed lookup is a segment not offered, never a failed answer
            logger.exception("request %s: looking up a segment's %d chunk(s) failed", req_id, len(keys))
            return None
        if found.offer is None or len(found.sources) + found.offer.chunks < len(keys):
            return None
        return SegmentOffer(keys, found.offer)

    def _release_segments(self, req_id: str) -> None:
        with self._lock:
            found = self._segments.pop(req_id, None)
        for chunk in (found.pins if found else {}).values():
            chunk.release()

    def take(self, req_id: str) -> RankLookup | None:
        """The request's lookup, for its load (which releases its pins), or None."""
        with self._lock:
            return self._lookups.pop(req_id, None)

    def _expire(self) -> None:
        cutoff = time.monotonic() - LOOKUP_PIN_TTL_S
        with self._lock:
            stale = [r for r, s in self._lookups.items() if s.started < cutoff]
            states = [self._lookups.pop(r) for r in stale]
            stale_segments = [r for r, found in self._segments.items() if found.started < cutoff]
        for req_id in stale_segments:
            self._release_segments(req_id)
        for req_id, state in zip(stale, states, strict=True):
            logger.warning("request %s: dropping its lookup pins after %.0f s unclaimed", req_id, LOOKUP_PIN_TTL_S)
            self._release(state)

    @staticmethod
    def _release(state: RankLookup) -> None:
        if state.pull is not None:
            state.pull.cancel()  # the request went before its pull ended (what landed is stored)
        if state.prefix is not None:
            state.prefix.release()

    def take_segments(self, req_id: str) -> SegmentLookup:
        """A blended load's segment lookup: its pinned chunks (the load's to release) and the
        offers it pulls; empty where none was kept."""
        with self._lock:
            return self._segments.pop(req_id, None) or SegmentLookup(time.monotonic(), {}, [])

    def take_segment_offers(self, req_id: str) -> list[SegmentOffer]:
        """The offered segments a blended load pulls beside the steps (its pins stay here for
        the step that blends them)."""
        with self._lock:
            found = self._segments.get(req_id)
            if found is None:
                return []
            offers, found.offers = found.offers, []
            found.started = time.monotonic()  # its pins now wait for the pull, then the blend
        return offers

    def add_segment_pins(self, req_id: str, pins: dict[int, Any]) -> None:
        """Pins of segments the blended load pulled, kept beside the lookup's for its blend."""
        with self._lock:
            found = self._segments.setdefault(req_id, SegmentLookup(time.monotonic(), {}, []))
            found.started = time.monotonic()
            for key, chunk in pins.items():
                if key in found.pins:
                    chunk.release()  # one pin per key is enough
                else:
                    found.pins[key] = chunk

    def drop(self, req_id: str) -> None:
        """A request released before its load (finished, aborted, or a miss): its pins go."""
        state = self.take(req_id)
        if state is not None:
            self._release(state)
        self._release_segments(req_id)

    def close(self) -> None:
        with self._lock:
            states, self._lookups = list(self._lookups.values()), {}
        for state in states:
            self._release(state)
        for req_id in list(self._segments):
            self._release_segments(req_id)
