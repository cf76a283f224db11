"""Blending in the connector (issue 23; docs/blend.md): both halves' parts.

* :class:`BlendPlanner` (scheduler side): splits a prompt at the separator into segments, keys
  the reusable ones (all but the last: the new text), and decides how much of the prompt a
  blended load fills: ``[0, N)`` with N the last segment's start, rounded down to a block, when
  the ranks hold at least a block's worth of the reusable segments; 0 (a plain prefill) otherwise.
* :class:`SegmentBlender` (worker side): loads a request's held segments from the local tiers,
  moves their keys to the segments' places, blends ``[0, N)`` with the engine's own Llama modules
  (:class:`~lmcache_p2p.integration.vllm.blend_model.VllmDecoder`) and writes every layer's KV into
  the request's blocks through the attention backend's own cache writer. New segments are computed
  on their own (positions from 0) and stored under their keys, in the tiers' pages, token-major:
  ``[layers, 2 (K, V), tokens, kv_heads, head_dim]`` in the KV's dtype, a page per chunk of the
  segment, the last one padded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np

from lmcache_p2p.blend.segments import segment_chunks, separator_ids, split_segments
from lmcache_p2p.blend.support import check_architecture, check_full_attention
from lmcache_p2p.config import ConfigError, LMCacheConfig
from lmcache_p2p.integration.vllm.lookup_channel import LookupClient
from lmcache_p2p.integration.vllm.metadata import BlendSegment, BlendSpec, SegmentStoreSpec
from lmcache_p2p.keys import KeyIdentity
from lmcache_p2p.vocab import OFFER_TIMEOUT_S, REMOTE_OFFER_TIMEOUT_S

logger = logging.getLogger(__name__)

MAX_KEPT_GAPS = 64  # distinct separator runs a rank keeps the KV of (a few KB to MB each)
MAX_KEPT_GAP_TOKENS = 32  # longer gaps are text no rank held, not separators
# How long the scheduler waits for every rank's answer to a segment lookup, beyond the offers it
# asks for (each rank asks for an offer of each segment it lacks, one after another).
SEGMENT_LOOKUP_SLACK_S = 10.0


@dataclass
class BlendRequest:
    """A prompt of two or more segments (enable_blending), as the scheduler side keeps it: it
    takes the segment path, never the prefix one."""

    tokens: np.ndarray  # the prompt's, int32
    segments: list[BlendSegment]  # the reusable ones
    last_start: int  # where its last segment starts
    segments_stored: bool = False
    pulls: bool = False  # some rank pulls an offered segment first: the load goes beside the steps
    # The segments were pulled beside the steps for a blend of [0, blend_at): the step that first
    # schedules the request from there blends them (0: none pending).
    blend_at: int = 0

    def scheduled(self, req_id: str, computed: int) -> bool:
        """vLLM scheduled the request from token ``computed``: whether this step blends the
        segments its load pulled beside the steps (it was granted the blend of ``[0, computed)``)."""
        pending, self.blend_at = self.blend_at, 0  # blended now, or (a failed pull) computed in full
        if pending and computed and computed != pending:  # vLLM counts tokens as loaded that no blend writes
            logger.error(
                "Reqid: %s, scheduled from token %d, not at its blend's end %d: not blended", req_id, computed, pending
            )
        return bool(pending) and computed == pending


class BlendPlanner:
    def __init__(self, vllm_config: Any, config: LMCacheConfig, block_size: int):
        model_config = vllm_config.model_config
        if vllm_config.cache_config.enable_prefix_caching:
            raise ConfigError(
                "enable_blending",
                "needs vLLM's prefix caching off (--no-enable-prefix-caching): blended KV is approximate, "
                "and vLLM would reuse its blocks as exact",
                value=True,
            )
        try:
            check_architecture(list(getattr(model_config.hf_config, "architectures", None) or []))
            check_full_attention(model_config.hf_config)
        except ValueError as e:
            raise ConfigError("enable_blending", str(e), value=True) from None
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer)
        try:
            self.separator = separator_ids(
                lambda t: tokenizer.encode(t, add_special_tokens=False), config.blend_special_str
            )
        except ValueError as e:
            raise ConfigError("blend_special_str", str(e), value=config.blend_special_str) from None
        self.chunk_size = config.chunk_size
        self.block_size = block_size
        logger.info(
            "lmcache-p2p blending: separator %r = token ids %s, recompute ratio %.2f, check layer %d",
            config.blend_special_str,
            self.separator,
            config.blend_recompute_ratios[0],
            config.blend_check_layers[0],
        )

    def segments(
        self, tokens: np.ndarray, identity: KeyIdentity | None = None
    ) -> tuple[list[BlendSegment], int] | None:
        """The prompt's reusable segments and where its last (new) segment starts; None for a
        prompt with fewer than two segments (nothing to blend: the prefix path serves it).
        ``identity``: a salted request's (its segments are its tenant's alone)."""
        found = split_segments(tokens, self.separator)
        if len(found) < 2:
            return None
        reusable = [
            BlendSegment(
                s.start,
                s.end,
                np.fromiter(
                    (c.key for c in segment_chunks(tokens[s.start : s.end], self.chunk_size, identity)), np.uint64
                ),
                held=False,
            )
            for s in found[:-1]
        ]
        return reusable, found[-1].start

    def decide(self, segments: list[BlendSegment], last_start: int, num_tokens: int) -> int:
        """Tokens ``[0, N)`` a blended load fills, 0 for none."""
        cached = sum(s.end - s.start for s in segments if s.held)
        end = min(last_start, num_tokens - 1) // self.block_size * self.block_size
        return end if cached >= self.block_size and end > 0 else 0

    def ask(self, client: LookupClient, req_id: str, request: BlendRequest, num_tokens: int, fetch: bool) -> int:
        """Ask the ranks which reusable segments they hold or (``fetch``) have offered whole;
        mark each segment usable or not and whether a rank pulls first; the tokens a blended
        load fills (0: none)."""
        per_segment = OFFER_TIMEOUT_S + REMOTE_OFFER_TIMEOUT_S if fetch else 0.0
        timeout_s = SEGMENT_LOOKUP_SLACK_S + per_segment * len(request.segments)
        hits = client.lookup_segments(req_id, [s.keys for s in request.segments], fetch, timeout_s)
        for segment, usable in zip(request.segments, hits.usable, strict=True):
            segment.held = usable
        hit = self.decide(request.segments, request.last_start, num_tokens)
        request.pulls = bool(hit) and hits.pulls
        logger.info(
            "Reqid: %s, blend: %d segment(s) before the last, %d held or offered (%d tokens; %d pulled first); "
            "blending tokens [0, %d) of %d%s",
            req_id,
            len(request.segments),
            sum(hits.usable),
            sum(s.end - s.start for s in request.segments if s.held),
            sum(hits.pulled),
            hit,
            num_tokens,
            "" if hit else " (nothing: a plain prefill, then the segments are stored)",
        )
        return hit

    @staticmethod
    def load_spec(tokens: np.ndarray, segments: list[BlendSegment], end: int) -> BlendSpec:
        return BlendSpec(tokens[:end].copy(), [s for s in segments if s.start < end])

    @staticmethod
    def store_spec(req_id: str, tokens: np.ndarray, segments: list[BlendSegment]) -> SegmentStoreSpec | None:
        missing = [s for s in segments if not s.held]
        return SegmentStoreSpec(req_id, tokens, missing) if missing else None


@dataclass
class _StoredChunk:
    """One chunk of a new segment on its way to the tiers: copied straight into a reserved pool
    page (``page``), or, where no page could be reserved (no CPU tier, every page pinned), into
    ``host``, a page-shaped buffer the tiers' ``put`` takes."""

    key: int
    page: int | None
    host: Any = None


@dataclass
class _SegmentStore:
    """A request's new segments, computed alone and copied into pool pages (on a GPU by the store
    stream, behind the step: ``copied`` is recorded after the copies); the pages are indexed once
    the copies are done (:meth:`SegmentBlender.poll_stores`)."""

    req_id: str
    segments: int
    chunks: list[_StoredChunk]
    tokens: int
    copied: Any  # torch.cuda.Event, or None when the copies were made synchronously
    keep: list[Any]  # the device tensors the copies read, alive until they are done
    timer: Any  # PhaseTimer
    started: float

    def lands(self, keys: Collection[int]) -> bool:
        """Whether this store writes any of ``keys``."""
        return any(chunk.key in keys for chunk in self.chunks)


class SegmentBlender:
    """The worker side: blends loads and stores segments for one rank. Under tensor parallelism
    every rank gets the same specs in the same order each step and blends in step (the model's
    all-reduces run inside the blend): a rank must never skip a blend the others run."""

    def __init__(self, vllm_config: Any, config: LMCacheConfig, kv_caches: dict[str, Any], storage: Any, rank: int = 0):
        self.rank = rank
        import torch

        from lmcache_p2p.integration.vllm.blend_model import VllmDecoder, tracked_model

        model = tracked_model()
        if model is None:
            raise ConfigError(
                "enable_blending",
                "the engine's model was not built by lmcache-p2p's blending class: is the lmcache_p2p vLLM "
                "plugin loaded in this process (VLLM_PLUGINS), and LMCACHE_ENABLE_BLENDING set where vLLM starts?",
                value=True,
            )
        self.adapter = VllmDecoder(model)
        self.ratio = config.blend_recompute_ratios[0]
        self.check_layer = config.blend_check_layers[0]
        if self.check_layer >= self.adapter.num_layers:
            raise ConfigError(
                "blend_check_layers",
                f"layer {self.check_layer} does not exist: the model has {self.adapter.num_layers}",
                value=config.blend_check_layers,
            )
        context = vllm_config.compilation_config.static_forward_context
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        if len(names) != self.adapter.num_layers:
            raise ConfigError(
                "enable_blending",
                f"{len(names)} KV cache layers for a model of {self.adapter.num_layers} layers",
                value=True,
            )
        self.layers = [(context[name], kv_caches[name]) for name in names]
        first = kv_caches[names[0]]
        self.dtype = first.dtype
        self.device = first.device
        self.block_size = int(vllm_config.cache_config.block_size)
        self.chunk_size = config.chunk_size
        self.storage = storage
        # New segments are computed on a stream of their own on a GPU, so the request's first
        # token does not wait for them (on the H200 a store of 1.5-4.5k tokens took 0.3-1 s in
        # the step). Not under tensor parallelism: the computation all-reduces, and collectives
        # of one communicator on two streams could interleave differently on two ranks.
        tp = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1))
        self._store_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" and tp == 1 else None
        self._pending: list[_SegmentStore] = []
        self._pending_lock = threading.Lock()  # the step thread adds, the lookup thread may finish them
        # Naive reuse (ratio 0 at check layer 0) recomputes nothing: the gaps between segments
        # (separators) take their own KV, computed alone once, like a segment's.
        self.naive = self.ratio == 0.0 and self.check_layer == 0
        self._gaps: dict[tuple[int, ...], tuple[Any, Any]] = {}
        token_bytes = self.adapter.num_layers * 2 * self.adapter.num_kv_heads * self.adapter.head_dim
        token_bytes *= torch.tensor([], dtype=self.dtype).element_size()
        if token_bytes * self.chunk_size != storage.page_bytes:
            raise ConfigError(
                "enable_blending",
                f"a segment chunk is {token_bytes * self.chunk_size} bytes, the tier's pages {storage.page_bytes}",
                value=True,
            )

    # -- pages -----------------------------------------------------------------------------------

    def _page_shape(self) -> tuple[int, ...]:
        a = self.adapter
        return (a.num_layers, 2, self.chunk_size, a.num_kv_heads, a.head_dim)

    def _alone(self, token_ids: Any) -> tuple[Any, Any]:
        """The KV of ``token_ids`` computed on their own (positions 0..n-1): keys and values
        ``[layers, tokens, kv_heads, head_dim]`` on the device."""
        import torch

        from lmcache_p2p.blend.blender import blend

        n = len(token_ids)
        shape = (n, self.adapter.num_kv_heads, self.adapter.head_dim)
        empty = [torch.zeros(shape, dtype=self.dtype, device=self.device)]
        none = torch.zeros(n, dtype=torch.bool, device=self.device)
        result = blend(
            self.adapter, token_ids, empty * self.adapter.num_layers, empty * self.adapter.num_layers, none, 1.0, 0
        )
        return torch.stack(result.keys), torch.stack(result.values)

    def _land_chunks(self, stacked: Any, keys: np.ndarray, non_blocking: bool) -> tuple[list[_StoredChunk], Any]:
        """Queues the copies of a segment's KV ``[layers, 2, tokens, kv_heads, head_dim]`` (on the
        device) into the tiers' pages, a chunk per page, the last one zero-padded; returns the
        chunks and the device tensor the copies read. A chunk the tiers hold already is skipped.
        The copies go straight into reserved pool pages (pinned on a GPU host: one DMA a chunk at
        the link's speed); a page filled on the host and then copied again into the pool cost
        the H200 1.4 s for 12k tokens, in the engine's step."""
        import torch

        tokens = stacked.shape[2]
        count = -(-tokens // self.chunk_size)
        chunked = torch.zeros((count, *self._page_shape()), dtype=self.dtype, device=self.device)
        for i in range(count):
            lo, hi = i * self.chunk_size, min((i + 1) * self.chunk_size, tokens)
            chunked[i, :, :, : hi - lo] = stacked[:, :, lo:hi]
        landed = []
        for i, key in enumerate(int(k) for k in keys.tolist()[:count]):
            if self.storage.location_of(key) is not None:
                continue  # held already (another request stored it)
            reserved = self.storage.reserve_page()
            if reserved is None:
                host = torch.empty(self._page_shape(), dtype=self.dtype, pin_memory=non_blocking)
                host.copy_(chunked[i], non_blocking=non_blocking)
                landed.append(_StoredChunk(key, None, host))
                continue
            page, data = reserved
            data.view(self.dtype).view(self._page_shape()).copy_(chunked[i], non_blocking=non_blocking)
            landed.append(_StoredChunk(key, page))
        return landed, chunked

    def _commit_chunks(self, chunks: list[_StoredChunk]) -> int:
        """Indexes the landed chunks' pages (their copies done); returns the chunks newly held."""
        import torch

        stored = 0
        for chunk in chunks:
            if chunk.page is not None:
                stored += self.storage.commit_page(chunk.key, chunk.page)
            else:
                stored += bool(self.storage.put(chunk.key, chunk.host.view(torch.uint8).reshape(-1)))
        return stored

    @staticmethod
    def _gaps_between(spec: BlendSpec, n: int) -> list[tuple[int, int]]:
        """The spans of ``[0, n)`` outside the spec's held segments (from the spec alone: every
        rank finds the same gaps)."""
        gaps, at = [], 0
        for segment in sorted((s for s in spec.segments if s.held), key=lambda s: s.start):
            if segment.start > at:
                gaps.append((at, min(segment.start, n)))
            at = max(at, segment.end)
        if at < n:
            gaps.append((at, n))
        return [(lo, hi) for lo, hi in gaps if hi > lo]

    def _gap_kv(self, token_ids: tuple[int, ...]) -> tuple[Any, Any]:
        """A gap's KV computed on its own (the separators between segments: the same few tokens
        in every prompt), computed once per rank and kept. Under tensor parallelism every rank
        computes the same gaps in the same loads, so their all-reduces stay in step."""
        found = self._gaps.get(token_ids)
        if found is None:
            import torch

            found = self._alone(torch.as_tensor(token_ids, dtype=torch.long, device=self.device))
            if len(token_ids) > MAX_KEPT_GAP_TOKENS:
                return found  # a segment nobody holds, not a separator: computed alone, not kept
            if len(self._gaps) >= MAX_KEPT_GAPS:
                self._gaps.pop(next(iter(self._gaps)))
            self._gaps[token_ids] = found
        return found

    def store(self, spec: SegmentStoreSpec) -> None:
        """Computes the spec's new segments on their own (positions from 0) and queues their copy to
        the host; on a GPU without tensor parallelism that runs on the store stream, behind the
        step, and the pages are written by a later :meth:`poll_stores` (the next step's, or a
        lookup's: a segment stored is visible to every later lookup); elsewhere at once."""
        import contextlib

        import torch

        from lmcache_p2p.blend.timing import PhaseTimer

        started = time.perf_counter()
        side = self._store_stream
        step_stream = torch.cuda.current_stream(self.device) if side is not None else None
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            if side is not None and step_stream is not None:
                side.wait_stream(step_stream)  # the step's work first (it may still be queued)
            timer = PhaseTimer(self.device)
            tokens = torch.as_tensor(spec.token_ids, dtype=torch.long, device=self.device)
            chunks, keep, total = [], [], 0
            for segment in spec.segments:
                k, v = self._alone(tokens[segment.start : segment.end])
                stacked = torch.stack((k, v), dim=1)  # [layers, 2, tokens, kv_heads, head_dim]
                landed, source = self._land_chunks(stacked, segment.keys, non_blocking=side is not None)
                chunks.extend(landed)
                keep.append(source)
                total += segment.end - segment.start
            timer.mark("compute and copy")
            copied = None
            if side is not None:
                copied = torch.cuda.Event()
                copied.record(side)
        with self._pending_lock:
            store = _SegmentStore(spec.req_id, len(spec.segments), chunks, total, copied, keep, timer, started)
            self._pending.append(store)
        if side is None:
            self.poll_stores()

    def poll_stores(self, wait: bool = False, keys: Collection[int] | None = None, req_id: str = "") -> None:
        """Writes the pages of every queued store whose copies are done. With ``wait``, first waits
        for the copies of the queued stores landing any of ``keys`` (every queued store when None):
        a lookup must see the segments stored before it, but need not wait for a store of segments
        it does not use (on a GPU that store is a prefill of its own, run behind the steps)."""
        with self._pending_lock:
            waited_for, started = 0, time.perf_counter()
            for store in list(self._pending):
                done = store.copied is None or store.copied.query()
                if not done and not (wait and (keys is None or store.lands(keys))):
                    continue
                self._pending.remove(store)
                if not done:
                    store.copied.synchronize()
                    waited_for += 1
                self._finish(store)
            if waited_for and req_id:
                logger.info(
                    "request %s rank %d: its lookup waited %.1f ms for %d pending store(s) of segments it reuses",
                    req_id,
                    self.rank,
                    (time.perf_counter() - started) * 1e3,
                    waited_for,
                )

    def _finish(self, store: _SegmentStore) -> None:
        phases = store.timer.describe()  # (its events are done: no wait here)
        written = time.perf_counter()
        chunks = self._commit_chunks(store.chunks)
        logger.info(
            "request %s rank %d: stored %d segment(s) of %d tokens as %d chunk(s), computed on their own "
            "(%s; pages indexed in %.1f ms), %.1f ms after the step queued them",
            store.req_id,
            self.rank,
            store.segments,
            store.tokens,
            chunks,
            phases,
            (time.perf_counter() - written) * 1e3,
            (time.perf_counter() - store.started) * 1e3,
        )

    def close(self) -> None:
        """Writes what is still queued (the copies are waited for)."""
        self.poll_stores(wait=True)

    # -- load ------------------------------------------------------------------------------------

    def load(self, req_id: str, spec: BlendSpec, block_ids: list[int], pins: dict[int, Any]) -> int:
        """Blends ``[0, len(spec.token_ids))`` into the request's blocks; returns the tokens
        filled. A held segment whose chunk is not pinned here (this rank restarted, the pins
        expired) is recomputed like uncached text: the blend still runs, so that under tensor
        parallelism this rank stays in step with the others (the selection is summed over ranks,
        and an uncached token is selected on every rank)."""
        import torch

        from lmcache_p2p.blend.blender import blend
        from lmcache_p2p.blend.rope import rotate_keys
        from lmcache_p2p.blend.timing import PhaseTimer

        started = time.perf_counter()
        timer = PhaseTimer(self.device)
        a = self.adapter
        n = len(spec.token_ids)
        # Every layer's cached KV at once, [layers, tokens, kv_heads, head_dim], where the engine's
        # KV is: a page lands with two copies whatever the layer count, and the keys are re-rotated
        # in one call. (Per layer and per segment, a GPU ran thousands of tiny kernels here.)
        shape = (a.num_layers, n, a.num_kv_heads, a.head_dim)
        keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
        values = torch.zeros_like(keys)
        cached = torch.zeros(n, dtype=torch.bool, device=self.device)
        moved_by = torch.zeros(n, dtype=torch.float32, device=self.device)  # each cached token's new start
        reused = missing = 0
        for segment in spec.segments:
            if not segment.held:
                continue
            length = min(segment.end, n) - segment.start
            needed = segment.keys.tolist()[: -(-length // self.chunk_size)]
            chunks = [chunk for chunk in (pins.get(int(key)) for key in needed) if chunk is not None]
            if len(chunks) < len(needed):
                logger.warning(
                    "request %s: a chunk of segment [%d, %d) is not pinned on this rank; recomputing it",
                    req_id,
                    segment.start,
                    segment.end,
                )
                missing += 1
                continue
            for i, chunk in enumerate(chunks):
                lo, hi = i * self.chunk_size, min((i + 1) * self.chunk_size, length)
                # (pinned host pages: the copies queue; the pins are held until the blocks are written)
                page = chunk.data.to(self.device, non_blocking=True).view(self.dtype).view(self._page_shape())
                keys[:, segment.start + lo : segment.start + hi] = page[:, 0, : hi - lo]
                values[:, segment.start + lo : segment.start + hi] = page[:, 1, : hi - lo]
            span = slice(segment.start, segment.start + length)
            cached[span] = True
            moved_by[span] = segment.start
            reused += 1
        gaps = self._gaps_between(spec, n) if self.naive else []
        for start, end in gaps:
            gap_keys, gap_values = self._gap_kv(tuple(int(t) for t in spec.token_ids[start:end]))
            keys[:, start:end], values[:, start:end] = gap_keys, gap_values
            cached[start:end] = True
            moved_by[start:end] = start
        timer.mark("pages")
        if reused or gaps:  # (a rotation by 0, for tokens not cached, leaves them as they are)
            by_token = keys.permute(1, 0, 2, 3).reshape(n, a.num_layers * a.num_kv_heads, a.head_dim)
            by_token = rotate_keys(by_token, moved_by, a.inv_freq, a.rotary_dim, a.neox_style)
            keys = by_token.view(n, a.num_layers, a.num_kv_heads, a.head_dim).permute(1, 0, 2, 3).contiguous()
        timer.mark("rotate")
        if self.naive:
            # Nothing to recompute: every token is a segment's or a gap's, each computed alone.
            if missing:  # (decided per rank: no collective runs on this path, so ranks may differ)
                raise RuntimeError(f"{missing} held segment(s) not pinned on rank {self.rank}: naive reuse has no KV")
            layer_keys, layer_values, recomputed = list(keys.unbind(0)), list(values.unbind(0)), 0
        else:
            tokens = torch.as_tensor(spec.token_ids, dtype=torch.long, device=self.device)
            result = blend(
                a, tokens, list(keys.unbind(0)), list(values.unbind(0)), cached, self.ratio, self.check_layer, timer
            )
            layer_keys, layer_values, recomputed = result.keys, result.values, len(result.recomputed)
        positions = torch.arange(n)
        blocks = torch.as_tensor(block_ids, dtype=torch.long)
        slots = blocks[positions // self.block_size] * self.block_size + positions % self.block_size
        slots = slots.to(self.device)
        for (attn, kv_cache), k, v in zip(self.layers, layer_keys, layer_values, strict=True):
            attn.impl.do_kv_cache_update(attn, k.contiguous(), v.contiguous(), kv_cache, slots)
        timer.mark("write blocks")
        phases = timer.describe()  # waits for the device: the blocks are written before the step
        logger.info(
            "request %s rank %d: blended %d tokens: %d cached in %d segment(s) reused, %d recomputed past layer %d "
            "(ratio %.2f), in %.1f ms (%s)",
            req_id,
            self.rank,
            n,
            int(cached.sum()),
            reused,
            recomputed,
            self.check_layer,
            self.ratio,
            (time.perf_counter() - started) * 1e3,
            phases,
        )
        return n
