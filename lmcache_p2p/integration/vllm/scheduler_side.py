"""The connector's scheduler half: decides, per request, what to load and what to store.

It runs in vLLM's scheduler (EngineCore) process and never touches KV itself: it asks the ranks
how much of a prompt they can load (:mod:`lookup_channel`), follows each request's blocks through
the scheduler's outputs, and hands the ranks a :class:`P2PConnectorMetadata` every step. A
request's prompt is hashed into chunk keys once, when it is first seen; lookups, loads and
stores carry those keys.

The keys carry what vLLM's own block hash carries besides the tokens (tenancy.request_keys): the
request's cache_salt, LoRA adapter and multimodal items, read from vLLM's ``Request`` when
``get_num_new_matched_tokens`` first sees it. A request with prompt embeddings (or an adapter
whose files cannot be read here) is not keyed: never looked up, never stored. A request first
met in ``build_connector_meta`` (whose ``NewRequestData`` carries no cache_salt) is never keyed
from that data: it is treated as unkeyed.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lmcache_p2p.config import AUTO, ConfigError, LMCacheConfig
from lmcache_p2p.integration.vllm import compat
from lmcache_p2p.integration.vllm.blending import BlendPlanner, BlendRequest
from lmcache_p2p.integration.vllm.kv_events import BlockEventMapper, ChunkStorageEvents, kv_events_enabled
from lmcache_p2p.integration.vllm.lookup_channel import (
    LookupClient,
    engine_socket_path,
    pull_ended_path,
    tokens_by_source,
)
from lmcache_p2p.integration.vllm.metadata import LoadSpec, P2PConnectorMetadata, StoreSpec
from lmcache_p2p.integration.vllm.model_kinds import check_model
from lmcache_p2p.keys import chunk_hash_array
from lmcache_p2p.tenancy import RequestKeys, request_keys
from lmcache_p2p.vocab import OFFER_TIMEOUT_S, PEER_FETCH_TIMEOUT_S, REMOTE_OFFER_TIMEOUT_S, SOURCE_REMOTE

logger = logging.getLogger(__name__)

# How long the scheduler waits for every rank's answer to a lookup: a rank answers at once from
# its tiers and its offers (the controller's holders within OFFER_TIMEOUT_S, the remote store's
# exists round within REMOTE_OFFER_TIMEOUT_S); past this a rank is stuck, and the lookup a miss.
LOOKUP_REPLY_TIMEOUT_S = OFFER_TIMEOUT_S + REMOTE_OFFER_TIMEOUT_S + 10.0
# pull_before_grant: requests of this engine whose offers are pulled before their grant at once (a
# request past it takes the grant and the load beside the steps); and how long vLLM is told to
# ask again about one before the ranks are asked what they hold (their pulls end by then).
MAX_PULLS_BEFORE_GRANT = 16
PULL_BEFORE_GRANT_TIMEOUT_S = PEER_FETCH_TIMEOUT_S + 5.0


@dataclass
class _Lookup:
    """The ranks' answer to the request's lookup (``hit`` None until they answered)."""

    hit: int | None = None  # tokens the ranks can load
    host_until: int = 0  # where the part of the hit some rank holds in host memory ends (0: none)
    fetched: bool = False  # part of the hit is fetched for this lookup (a pull, the remote store)
    sources: tuple[str, ...] = ()  # each chunk of the hit's source (vocab.HIT_SOURCES)
    pull_from: int | None = None  # past this token the hit is an offer (a peer's, the store's), pulled by the load
    # pull_before_grant: the ranks pull the offer now (since this time.monotonic()), and this many
    # of them say when their pull ended; vLLM is told to ask again until then.
    pull_started: float | None = None
    pulling_ranks: frozenset[int] = frozenset()
    settled: bool = False  # the hit is what such a pull landed: loaded in the step, whatever async_kv_loads says
    ms: float = 0.0  # from the request's first sight until every rank answered
    logged_need: int | None = None  # the last "need to load" logged for it


@dataclass
class _Grant:
    """vLLM's grant of the hit (update_state_after_alloc), until it goes into a step's metadata."""

    tokens: int = 0  # granted external tokens, not yet handed to the ranks
    # vLLM's own prefix-cache tokens when the hit was granted (the load starts there)
    local_tokens: int = 0
    beside_steps: bool = False  # the last answer to vLLM granted the load beside the steps


@dataclass
class _AsyncLoads:
    """The request's loads beside the steps (async_kv_loads): the ranks run each as a job."""

    in_flight: bool = False  # one is copying into its blocks (they must outlive it)
    reported: int = 0  # of those, reported done (vLLM asks again only after a failed one)
    # ``reported`` when the last failed one was looked up again; past 1, two failed: no more
    # grants, it is recomputed.
    retried_after: int = 0


@dataclass
class _Stores:
    saved_upto: int = 0  # prompt tokens already handed to the ranks to store
    stored: bool = False  # a store was handed to the ranks: its blocks are freed after get_finished


@dataclass
class _Request:
    """Everything the scheduler side keeps about one request, in parts."""

    chunk_hashes: np.ndarray  # the prompt's full chunks' chained hashes, uint64
    num_tokens: int  # the prompt's length
    # What its keys are made of besides the tokens (salt, adapter, images), or why it has none.
    keys: RequestKeys = field(default_factory=RequestKeys)
    seen_at: float = field(default_factory=time.monotonic)  # first asked about (its lookup's start)
    block_ids: list[int] = field(default_factory=list)  # its block table
    may_fetch: bool = True  # may its lookup fetch (peers, the remote store)? Not after a failed load
    remembered: bool = False  # its chunks' blocks are known to the KV-event mapper
    lookup: _Lookup = field(default_factory=_Lookup)
    grant: _Grant = field(default_factory=_Grant)
    async_loads: _AsyncLoads = field(default_factory=_AsyncLoads)
    stores: _Stores = field(default_factory=_Stores)
    blend: BlendRequest | None = None

    @property
    def unkeyed(self) -> bool:
        return bool(self.keys.unkeyed)


class LoadPlacement:
    """Where a granted load runs: in the step, or beside the steps (vLLM's asynchronous loads,
    load_kv_async). ``setting`` is async_kv_loads: True, False or "auto"."""

    def __init__(self, setting: bool | str, fetch_missing: bool, device: str):
        self.setting = setting
        # Whether any request may be granted a load beside the steps before its lookup says so: an
        # offer (a peer's, the remote store's) always loads there, and "auto" puts host-memory
        # hits there on a GPU only.
        self.possible = fetch_missing or setting is True or (setting == AUTO and device == "cuda")

    def beside_steps(self, blended: bool, from_host: bool, fetched: bool) -> bool:
        """Whether a load with no offered part (``from_host``: part of it crosses PCIe;
        ``fetched``: fetched for this lookup) is granted beside the steps. Under "auto" only a
        load crossing PCIe from what the ranks held before the lookup is: a copy from host memory
        (~26 ms a 10,000-token document on the H200) then overlaps other requests' steps, while a
        load from GPU memory (~1 ms) costs less than the step it would add, and a hit just pulled
        shares PCIe with the next request's pull (on the H200 such loads beside the steps ran at
        26-31 GB/s against 48 in the step; see docs/architecture.md). A blend with nothing to
        pull stays in the step: it computes as it loads."""
        if blended or self.setting is False:
            return False
        if self.setting is True:
            return True
        return from_host and not fetched


class SchedulerSide:
    def __init__(self, vllm_config: Any, config: LMCacheConfig):
        self.block_size = int(vllm_config.cache_config.block_size)
        config.validate_for_block_size(self.block_size)
        self.chunk_size = config.chunk_size
        transfer = vllm_config.kv_transfer_config
        _recompute_failed_loads(transfer)
        self.loads = bool(getattr(transfer, "is_kv_consumer", True))
        self.stores = bool(getattr(transfer, "is_kv_producer", True))
        parallel = vllm_config.parallel_config
        if getattr(parallel, "pipeline_parallel_size", 1) > 1:
            raise ConfigError(
                "pipeline_parallel_size",
                "lmcache-p2p supports tensor parallelism only",
                value=parallel.pipeline_parallel_size,
            )
        check_model(vllm_config.model_config)  # refuses models whose layers keep no KV per token
        paths = [engine_socket_path(vllm_config, r) for r in range(parallel.tensor_parallel_size)]
        # Beyond the local tiers: peers (enable_p2p) and the remote store (remote_url).
        self.fetch_missing = config.enable_p2p or config.remote_url is not None
        self.pull_before_grant = config.pull_before_grant and self.fetch_missing
        self._pulling: set[str] = set()  # requests whose offers the ranks pull before the grant
        ended = pull_ended_path(vllm_config) if self.pull_before_grant else None
        self.client = LookupClient(paths, self.chunk_size, ended)
        device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu"))
        self.placement = LoadPlacement(config.async_kv_loads, self.fetch_missing, device)
        self._beside_steps: list[str] = []  # granted loads beside the steps, for the next metadata
        self._requests: dict[str, _Request] = {}
        self._released: list[str] = []
        # Finished requests whose blocks wait for our store copies (request_finished said so),
        # until the ranks report them sent: vLLM waits for these frees instead of preempting.
        self._frees_pending: set[str] = set()
        # Our tiers' admits and evicts as vLLM KV events, when the engine publishes them.
        self.kv_events = (
            BlockEventMapper(self.chunk_size, self.block_size, parallel.tensor_parallel_size)
            if kv_events_enabled(vllm_config)
            else None
        )
        self.blend: BlendPlanner | None = None
        if config.enable_blending:
            self.blend = BlendPlanner(vllm_config, config, self.block_size)
        logger.info(
            "lmcache-p2p scheduler side: chunk %d tokens, vLLM block %d, %d TP rank(s), peers %s, "
            "remote tier %s; what peers or the store offer is loaded beside the steps%s",
            self.chunk_size,
            self.block_size,
            len(paths),
            "on" if config.enable_p2p else "off",
            "on" if config.remote_url else "off",
            " (enable_async_loading and lookup_backoff_time have no effect: no lookup waits for bytes)"
            if config.enable_async_loading
            else "",
        )

    # -- lookup ----------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens the ranks can load past ``num_computed_tokens``, and whether beside the steps.

        vLLM may ask again before any ``update_state_after_alloc`` (a request that found no free
        blocks; on 0.34 one parked at ``--max-num-inflight-kv-loads``). Asking again takes
        nothing more: the ranks pin a lookup's chunks once per request id (released by its load,
        by a release in the step metadata, or when it finishes), a peer's offer is pulled only by
        the load, and once the hit is known the answer comes from the request's state."""
        req_id = request.request_id
        state = self._request(req_id, request)
        if state.unkeyed:
            return 0, False  # prompt embeddings, or an adapter unreadable here: never shared
        if self.kv_events is not None and not state.remembered:
            self.kv_events.remember(state.chunk_hashes.tolist(), request)
            state.remembered = True
        if not self.loads or compat.skips_external_kv(request):
            return 0, False  # (vLLM >= 0.32 also drops our answer for such a request)
        if state.async_loads.retried_after > 1:
            return 0, False
        if state.async_loads.reported > state.async_loads.retried_after and not self._retry_beside_steps(req_id, state):
            return 0, False
        if state.blend is not None:
            hit = state.lookup.hit if state.lookup.hit is not None else self._ask_segments(req_id, state, state.blend)
        elif not len(state.chunk_hashes):
            return 0, False
        else:
            if state.lookup.hit is None:
                self._ask(req_id, state)
                if state.lookup.pull_started is not None and not self._pull_adds(state, num_computed_tokens):
                    self._end_pull(req_id)  # granted now: the ranks' pulls end on their own, unwaited for
                    state.lookup.pull_started = None
            if state.lookup.pull_started is not None and not self._pull_settled(req_id, state):
                return None, False  # vLLM asks again on its next pass; the request holds no blocks
            hit = state.lookup.hit or 0
        # vLLM must compute at least the prompt's last token to sample from it.
        usable = min(hit, state.num_tokens - 1)
        need = max(0, usable - num_computed_tokens)
        host = min(state.lookup.host_until, usable)  # loading [num_computed_tokens, usable) crosses PCIe up to here
        from_host = host > num_computed_tokens
        # Part of it offered (by a peer, by the remote store): the load pulls it first, always
        # beside the steps (vLLM holds the request as WAITING_FOR_REMOTE_KVS, and no step waits
        # on those bytes).
        pulls = state.lookup.pull_from is not None and state.lookup.pull_from < usable
        pulls = pulls or (state.blend is not None and state.blend.pulls)
        beside = (
            need > 0
            and not state.lookup.settled
            and (pulls or self.placement.beside_steps(state.blend is not None, from_host, state.lookup.fetched))
        )
        state.grant.local_tokens, state.grant.beside_steps = num_computed_tokens, beside
        if need != state.lookup.logged_need:
            state.lookup.logged_need = need
            how = ""
            if beside and pulls and state.blend is not None:
                how = ", beside the steps after pulling the segments offered (the blend runs in the step after)"
            elif beside and pulls:
                origin = self._offered_by(state)
                how = f", beside the steps after pulling tokens [{state.lookup.pull_from}, {usable}) from {origin}"
            elif beside:
                how = ", beside the steps" + (f" (host memory up to token {host})" if from_host else "")
            elif need and from_host and self.placement.setting == AUTO:  # auto kept it: fetched
                how = f", in the step (host memory up to token {host}, fetched for this lookup: "
                how += "the next pull shares PCIe)"
            logger.info(
                "Reqid: %s, Total tokens %d, LMCache hit tokens: %d, need to load: %d (lookup %.1f ms)%s",
                req_id,
                state.num_tokens,
                hit,
                need,
                state.lookup.ms,
                how,
            )
        return need, beside

    def _offered_by(self, state: _Request) -> str:
        """Who offered the hit past ``pull_from``, for the log."""
        index = (state.lookup.pull_from or 0) // self.chunk_size
        source = state.lookup.sources[index] if index < len(state.lookup.sources) else ""
        return "the remote store" if source == SOURCE_REMOTE else "a peer"

    def may_load_async(self, request: Any) -> bool:
        """vLLM 0.34 with ``--max-num-inflight-kv-loads``: whether the request may be granted a
        load beside the steps, which puts it in the queue whose loads start while the running batch
        is full. Asked on every enqueue, so answered without a lookup: after one (a request
        parked at the cap, or requeued), by its last answer; before, by whether this engine grants
        such loads at all. A wrong yes only holds the queue's other loads for a step; a wrong no
        makes the request wait for a running slot before its load starts."""
        if not self.loads or compat.skips_external_kv(request):
            return False
        state = self._requests.get(request.request_id)
        if state is not None and state.lookup.hit is not None and state.lookup.pull_started is None:
            return state.grant.beside_steps
        return self.placement.possible

    def _retry_beside_steps(self, req_id: str, state: _Request) -> bool:
        """vLLM asks again about a request whose load beside the steps is done only when that load
        failed from its first block (it freed the blocks and retries). The ranks are asked afresh
        once (what failed may be gone now); after a second failure it is recomputed."""
        state.async_loads.retried_after = state.async_loads.reported
        if state.async_loads.reported > 1:
            logger.warning(
                "Reqid: %s, its load beside the steps failed %d times: recomputing its %d tokens",
                req_id,
                state.async_loads.reported,
                state.num_tokens,
            )
            return False
        # In the local tiers only: a pull that failed (a holder stalled or died) is not made
        # again, and what it brought before failing is here now.
        logger.warning("Reqid: %s, its load beside the steps failed: looking it up again in the local tiers", req_id)
        state.lookup = _Lookup()
        state.may_fetch = False
        return True

    def _request(self, req_id: str, request: Any) -> _Request:
        """The request's state; made (and its prompt hashed, the one time) when first seen, from
        vLLM's ``Request``: its tokens, and its salt, adapter and multimodal items."""
        state = self._requests.get(req_id)
        if state is None:
            keys = request_keys(request)
            if keys.unkeyed:
                state = self._unkeyed_state(request.prompt_token_ids, keys)
                logger.info("Reqid: %s, not keyed (%s): neither looked up nor stored", req_id, keys.unkeyed)
            else:
                tokens = compat.prompt_tokens(request.prompt_token_ids)  # our int32 copy (0.34: of a TokenBuffer)
                state = _Request(
                    chunk_hash_array(tokens, self.chunk_size, identity=keys.identity, mm=keys.mm), len(tokens)
                )
                state.keys = keys
                if not keys.plain:  # never the salt itself: salt#<digest>
                    logger.info("Reqid: %s, keys: %s", req_id, keys.describe())
                planned = (
                    self.blend.segments(tokens, keys.identity) if self.blend is not None and keys.blendable else None
                )
                if planned is not None:
                    state.blend = BlendRequest(tokens, *planned)
            self._requests[req_id] = state
        return state

    @staticmethod
    def _unkeyed_state(prompt_token_ids: Any, keys: RequestKeys) -> _Request:
        """A request that is neither looked up nor stored: no chunk keys at all."""
        num_tokens = len(prompt_token_ids) if prompt_token_ids is not None else 0
        return _Request(np.zeros(0, dtype=np.uint64), num_tokens, keys=keys)

    def _ask_segments(self, req_id: str, state: _Request, blend: BlendRequest) -> int:
        """Blending: the tokens a blended load fills, from the segments the ranks hold or have
        offered (not after a failed load: then only the local tiers count, as for a prefix)."""
        assert self.blend is not None
        fetch = self.fetch_missing and state.may_fetch
        state.lookup.hit = self.blend.ask(self.client, req_id, blend, state.num_tokens, fetch)
        state.lookup.ms = (time.monotonic() - state.seen_at) * 1e3
        if not state.lookup.hit:  # nothing to blend: segments some ranks pinned go now (as in _ask)
            self._released.append(req_id)
        return state.lookup.hit

    def _ask(self, req_id: str, state: _Request, settle: bool = False) -> int:
        """Ask the ranks: the tokens they can load now or pull beside the steps (``state.lookup.hit``).
        With pull_before_grant (and a free slot) they start pulling what is offered now;
        ``settle``: that pull ended, and they answer what they hold."""
        fetch = self.fetch_missing and state.may_fetch
        pull_now = fetch and not settle and self.pull_before_grant and len(self._pulling) < MAX_PULLS_BEFORE_GRANT
        hit = self.client.lookup(
            req_id,
            state.chunk_hashes,
            state.num_tokens,
            fetch,
            LOOKUP_REPLY_TIMEOUT_S,
            lora=state.keys.lora,
            pull_now=pull_now,
            settle=settle,
        )
        state.lookup = _Lookup(
            hit.tokens,
            hit.host_until,
            hit.fetched,
            hit.sources,
            hit.pull_from,
            ms=(time.monotonic() - state.seen_at) * 1e3,
            logged_need=state.lookup.logged_need,
        )
        state.lookup.settled = settle
        if hit.pulling_ranks and not hit.tokens:
            self.client.forget_pull(req_id)  # (released below: the ranks give their pulls up)
        elif hit.pulling_ranks and not settle:
            state.lookup.pull_started, state.lookup.pulling_ranks = time.monotonic(), hit.pulling_ranks
            self._pulling.add(req_id)
            logger.info(
                "Reqid: %s, Total tokens %d, LMCache hit tokens: %d (lookup %.1f ms): pulling tokens [%d, %d) from %s "
                "before its grant",
                req_id,
                state.num_tokens,
                hit.tokens,
                state.lookup.ms,
                hit.pull_from if hit.pull_from is not None else 0,
                hit.tokens,
                self._offered_by(state),
            )
        if not hit.tokens:
            # Some rank can load none of it (it holds none, failed or did not answer), so the
            # engine loads nothing: what the other ranks pinned goes with the next step, not
            # when the request finishes. (A hit above 0 is released by its load, or below.)
            self._released.append(req_id)
        return hit.tokens

    @staticmethod
    def _pull_adds(state: _Request, num_computed_tokens: int) -> bool:
        """Whether what the ranks pull before the grant adds to what vLLM would load: part of the
        offer lies before the prompt's last token and past vLLM's own prefix-cache hit."""
        usable = min(state.lookup.hit or 0, state.num_tokens - 1)
        pull_from = state.lookup.pull_from
        return pull_from is not None and pull_from < usable and num_computed_tokens < usable

    def _pull_settled(self, req_id: str, state: _Request) -> bool:
        """Whether the ranks' pull before the grant ended (or was waited for long enough); if so,
        the ranks are asked what they hold now, and that is the request's hit."""
        started = state.lookup.pull_started
        assert started is not None
        waited = time.monotonic() - started
        if not self.client.pulls_ended(req_id, state.lookup.pulling_ranks):
            if waited < PULL_BEFORE_GRANT_TIMEOUT_S:
                return False
            logger.warning(
                "Reqid: %s, its pull before the grant did not end in %.0f s: taking what landed", req_id, waited
            )
        self._end_pull(req_id)
        offered = state.lookup.hit or 0
        self._ask(req_id, state, settle=True)
        logger.info(
            "Reqid: %s, pulled before its grant in %.1f ms: %d of the %d tokens offered held to load",
            req_id,
            waited * 1e3,
            state.lookup.hit or 0,
            offered,
        )
        return True

    def _end_pull(self, req_id: str) -> None:
        self._pulling.discard(req_id)
        self.client.forget_pull(req_id)

    def hit_sources(self, req_id: str, num_external_tokens: int) -> dict[str, int]:
        """The ``num_external_tokens`` granted for the request, split by where they came from
        (``vocab.HIT_SOURCES``; vLLM >= 0.32 counts them as vllm:prompt_tokens_cached_by_source).
        A blended load is not split by tier: it counts as the unspecified source."""
        state = self._requests.get(req_id)
        if not num_external_tokens or state is None:
            return {}
        start = state.grant.local_tokens
        counts = tokens_by_source(state.lookup.sources, start, start + num_external_tokens, self.chunk_size)
        if state.blend is not None or sum(counts.values()) != num_external_tokens:
            return {SOURCE_REMOTE: num_external_tokens}
        return counts

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            return
        state.grant.tokens = num_external_tokens
        pending_blend = state.blend is not None and state.blend.blend_at > 0  # its pins are for this step
        if num_external_tokens == 0 and state.lookup.hit and not pending_blend:
            self._released.append(request.request_id)  # nothing to load: the ranks may unpin
        elif num_external_tokens and state.grant.beside_steps:
            # Granted asynchronously: no step schedules the request until its load is done, so its
            # load goes into the next metadata with the blocks allocated for it here.
            state.block_ids = list(blocks.get_block_ids()[0])
            self._beside_steps.append(request.request_id)

    # -- per step --------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> P2PConnectorMetadata:
        meta = P2PConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        meta.step_tokens = int(scheduler_output.total_num_scheduled_tokens)
        meta.load_after_forward = compat.loads_after_forward(scheduler_output)
        for req_id in self._beside_steps:
            state = self._requests.get(req_id)
            if state is not None and state.grant.tokens:
                self._add_load(meta, req_id, state, state.grant.local_tokens + state.grant.tokens, beside_steps=True)
                state.async_loads.in_flight = True
                # Stores handed out before a preemption read blocks freed then; the ranks forget
                # them too, so that an abort during this load is reported (and freed) once.
                state.stores.stored = False
        self._beside_steps = []
        for new in scheduler_output.scheduled_new_reqs:
            # A request id already tracked arriving as new was preempted and resumed (vLLM 0.34,
            # 0.33's Model Runner V2): its old blocks were freed, and this table replaces them.
            new_state = self._requests.get(new.req_id)
            if new_state is None:
                # Never seen by get_num_new_matched_tokens: NewRequestData has no cache_salt, so
                # its keys could be another tenant's. Not keyed.
                logger.debug("Reqid: %s, scheduled before we saw it: not keyed", new.req_id)
                new_state = self._unkeyed_state(new.prompt_token_ids, RequestKeys(unkeyed="not seen before scheduling"))
                self._requests[new.req_id] = new_state
            new_state.block_ids = list(new.block_ids[0]) if new.block_ids else []
            self._add_load(meta, new.req_id, new_state, new.num_computed_tokens)
            self._add_store(meta, new.req_id, new_state, new.num_computed_tokens + scheduled.get(new.req_id, 0))
            meta.prefill_tokens += _prompt_part(new_state, new.num_computed_tokens, scheduled.get(new.req_id, 0))

        cached = scheduler_output.scheduled_cached_reqs
        resumed = compat.resumed_req_ids(cached)  # none on vLLM 0.34: they come as new
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in resumed:  # preempted: its old blocks were freed; these replace them
                state.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                state.block_ids.extend(new_blocks[0])
            computed = cached.num_computed_tokens[i]
            self._add_load(meta, req_id, state, computed)
            self._add_store(meta, req_id, state, computed + scheduled.get(req_id, 0))
            meta.prefill_tokens += _prompt_part(state, computed, scheduled.get(req_id, 0))

        preempted = scheduler_output.preempted_req_ids or set()
        for req_id in preempted:
            state = self._requests.get(req_id)
            if state is not None:  # it will be looked up again when it is rescheduled
                state.lookup, state.async_loads = _Lookup(), _AsyncLoads()
                state.grant.tokens = 0
                if state.blend is not None:
                    state.blend.pulls, state.blend.blend_at = False, 0
        # A preempted request's blocks are freed at once, so copies of them still in flight must
        # finish before this step writes anything.
        meta.fence_stores = bool(preempted)
        meta.released, self._released = self._released, []
        if meta.load_after_forward and any(spec.blend is not None and not spec.beside_steps for spec in meta.loads):
            # A blend of segments pulled beside the steps: vLLM counts its tokens as loaded, but
            # the blend must write them before the forward pass reads them.
            compat.load_before_forward(scheduler_output)
            meta.load_after_forward = False
        return meta

    def _add_load(
        self, meta: P2PConnectorMetadata, req_id: str, state: _Request, computed: int, beside_steps: bool = False
    ) -> None:
        # ``computed`` already counts the external tokens the scheduler granted us.
        if state.blend is not None and not beside_steps and state.blend.scheduled(req_id, computed):
            state.grant.tokens = computed  # the blend its segments' pull was granted for: [0, computed)
        if state.grant.tokens:
            blend = None
            if state.blend is not None and self.blend is not None:
                blend = self.blend.load_spec(state.blend.tokens, state.blend.segments, computed)
                if beside_steps:
                    state.blend.blend_at = computed
            meta.loads.append(
                LoadSpec(
                    req_id,
                    state.chunk_hashes,
                    state.num_tokens,
                    list(state.block_ids),
                    start=computed - state.grant.tokens,
                    end=computed,
                    blend=blend,
                    beside_steps=beside_steps,
                )
            )
            # Where a hit's time to first token goes: seen -> hit known (the lookup line) -> its
            # load scheduled in a step (this line) -> the step's forward pass.
            logger.info(
                "Reqid: %s, loading %d tokens %s, %.1f ms after the request was first seen (hit known at %.1f ms)",
                req_id,
                state.grant.tokens,
                "beside the steps" if beside_steps else "in this step",
                (time.monotonic() - state.seen_at) * 1e3,
                state.lookup.ms,
            )
            state.grant.tokens = 0

    def _add_store(self, meta: P2PConnectorMetadata, req_id: str, state: _Request, computed_after: int) -> None:
        if not self.stores or state.unkeyed:
            return
        if state.blend is not None:
            # Blended KV is approximate: never stored as prefix chunks. New segments are stored
            # once, computed on their own by the rank (from the tokens, not from these blocks).
            if not state.blend.segments_stored and self.blend is not None:
                spec = self.blend.store_spec(req_id, state.blend.tokens, state.blend.segments)
                if spec is not None:
                    meta.segment_stores.append(spec)
                state.blend.segments_stored = True
            return
        end = min(computed_after, state.num_tokens) // self.chunk_size * self.chunk_size
        # Chunks the lookup found are held already; storing starts after them.
        if end <= max(state.stores.saved_upto, state.lookup.hit or 0) or len(state.block_ids) * self.block_size < end:
            return
        meta.stores.append(
            StoreSpec(req_id, state.chunk_hashes[: end // self.chunk_size], state.block_ids[: end // self.block_size])
        )
        state.stores.saved_upto = end
        state.stores.stored = True

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict | None]:
        """Blocks of a request we stored from stay allocated until the ranks report its store
        copies done (get_finished): they are read beside the next forward pass."""
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return False, None
        self._end_pull(request.request_id)  # (the ranks give a pull before the grant up with the release)
        self._released.append(request.request_id)
        # A load beside the steps still copying into its blocks (an abort): they are freed once
        # the ranks report it done (get_finished's receiving side).
        delay_free = state.stores.stored or state.async_loads.in_flight
        if state.stores.stored:
            self._frees_pending.add(request.request_id)
        return delay_free, None

    def has_pending_block_frees(self) -> bool:
        """Finished requests' blocks wait for our store copies (usually within a step): vLLM >=
        0.32 waits for them rather than preempting a running request to find room."""
        return bool(self._frees_pending)

    # -- KV events -------------------------------------------------------------------------------

    def update_connector_output(self, connector_output: Any) -> None:
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if invalid:
            self._forget_failed_loads(set(invalid))
        for req_id in getattr(connector_output, "failed_recving", None) or ():  # vLLM >= 0.32
            self._forget_failed_load(req_id)
        self._frees_pending.difference_update(getattr(connector_output, "finished_sending", None) or ())
        for req_id in getattr(connector_output, "finished_recving", None) or ():
            state = self._requests.get(req_id)
            if state is not None and state.async_loads.in_flight:
                state.async_loads.in_flight = False
                state.async_loads.reported += 1
        carrier = getattr(connector_output, "kv_cache_events", None)
        if self.kv_events is not None and isinstance(carrier, ChunkStorageEvents):
            self.kv_events.take_rank_events(carrier)

    def _forget_failed_loads(self, invalid: set[int]) -> None:
        """Blocks a rank could not load: vLLM recomputes the request from the first of them, and
        the ranks stored none of that step's chunks for it (wait_for_save skips a request whose
        load failed). Its hit and stored marks go back to that chunk, so that what is recomputed
        is stored, and not taken for held by the next store's cut."""
        for req_id, state in self._requests.items():
            first = next((i for i, block in enumerate(state.block_ids) if block in invalid), None)
            if first is not None:
                self._forget_failed_load(req_id, first * self.block_size)

    def _forget_failed_load(self, req_id: str, from_token: int | None = None) -> None:
        """The request's load failed from ``from_token`` (None: from where it started, a failed
        receive): its hit and stored marks go back to the chunk holding that token."""
        state = self._requests.get(req_id)
        if state is None:
            return
        if state.blend is not None:
            state.blend.blend_at = 0  # no blend follows a failed segment pull: vLLM computes the prompt
        start = state.grant.local_tokens if from_token is None else from_token
        token = start // self.chunk_size * self.chunk_size
        if (state.lookup.hit or 0) <= token and state.stores.saved_upto <= token:
            return
        logger.info(
            "Reqid: %s, its load failed from token %d: the chunks from there are stored once recomputed",
            req_id,
            token,
        )
        if state.lookup.hit is not None:
            state.lookup.hit = min(state.lookup.hit, token)
        state.stores.saved_upto = min(state.stores.saved_upto, token)

    def take_events(self) -> Iterable[Any]:
        return self.kv_events.take_events() if self.kv_events is not None else ()

    def close(self) -> None:
        self.client.close()


# How far up the call stack a connector that builds ours (vLLM's MultiConnector) is looked for.
_WRAPPER_FRAMES = 8


def _recompute_failed_loads(transfer: Any) -> None:
    """vLLM's default ``kv_load_failure_policy``, "fail", ends a request with an error when a chunk
    we promised does not load (a peer died, a checksum failed); here that is a miss, and its
    blocks are recomputed. vLLM's scheduler reads the policy after building its connector, so
    setting it here takes effect, unless ours is a MultiConnector child: vLLM hands each child a
    fresh copy and reads the top-level config, which only the user can set."""
    parent = _wrapping_transfer_config(transfer)
    if parent is not None:
        if getattr(parent, "kv_load_failure_policy", None) == "fail":
            logger.warning(
                "lmcache-p2p runs inside %s: vLLM reads kv_load_failure_policy from the top-level "
                "kv-transfer-config, which has 'fail', and gives our connector its own copy, so it cannot "
                'set it there. Add "kv_load_failure_policy": "recompute" to the top-level kv-transfer-config: '
                "until then a hit of ours that fails to load (a peer died mid-pull) ends its request with an error",
                getattr(parent, "kv_connector", None) or "a connector that wraps ours",
            )
        return
    if getattr(transfer, "kv_load_failure_policy", None) == "fail":
        # vLLM's KVTransferConfig (a pydantic dataclass, 0.25.1-0.33) keeps no record of which
        # fields were given, so an explicit "fail" cannot be told from the default: say what we did.
        transfer.kv_load_failure_policy = "recompute"
        logger.info(
            "lmcache-p2p: kv_load_failure_policy is 'recompute' (was 'fail': vLLM's default, which its config "
            "does not tell from a 'fail' given explicitly): a chunk of ours that fails to load is recomputed, "
            "not an error for its request"
        )


def _wrapping_transfer_config(transfer: Any) -> Any | None:
    """The kv_transfer_config of a connector that is building ours (vLLM's MultiConnector, whose
    __init__ keeps the top-level config before it builds its children), found up the call stack;
    None when vLLM built ours directly."""
    frame = sys._getframe(1)
    for _ in range(_WRAPPER_FRAMES):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        outer = getattr(owner, "_kv_transfer_config", None)
        if outer is not None and outer is not transfer:
            return outer
    return None


def _prompt_part(state: _Request, computed: int, scheduled: int) -> int:
    """Of ``scheduled`` tokens computed after ``computed``, those of the prompt (a prefill).
    ``computed`` counts the tokens loaded for the request: they are no part of this step."""
    return max(0, min(scheduled, state.num_tokens - computed))
