"""What the scheduler-side connector tells the worker-side connectors for one engine step.

Prompts travel as their chunk hashes (uint64, computed once per request by the scheduler side),
not their tokens: 8 bytes a chunk instead of 4 bytes a token, and no rank hashes them again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class BlendSegment:
    """A reusable segment of a blended prompt: tokens ``[start, end)`` and its chunk keys."""

    start: int
    end: int
    keys: np.ndarray  # uint64, blend.segments.segment_chunks' keys
    held: bool  # every rank holds it whole (pinned by the segment lookup) or pulls it first, offered whole


@dataclass
class BlendSpec:
    """How a blended load fills ``[0, end)``: the tokens, and the segments that may be reused."""

    token_ids: np.ndarray  # int32, the prompt's tokens [0, end)
    segments: list[BlendSegment]


@dataclass
class LoadSpec:
    """Load the request's tokens ``[start, end)`` from the local tiers into its blocks (with
    ``blend``: blend them from cached segments, docs/blend.md)."""

    req_id: str
    chunk_hashes: np.ndarray  # the prompt's, uint64
    num_tokens: int  # the prompt's length
    block_ids: list[int]  # the request's blocks from token 0
    start: int
    end: int
    blend: BlendSpec | None = None
    # async_kv_loads: copied beside the steps; the request computes once get_finished reports it.
    beside_steps: bool = False


@dataclass
class SegmentStoreSpec:
    """Compute these segments' KV on their own (positions from 0) and store them under their keys."""

    req_id: str
    token_ids: np.ndarray  # int32, the prompt's
    segments: list[BlendSegment]


@dataclass
class StoreSpec:
    """Store the prompt's leading chunks (computed by the end of this step) from its blocks."""

    req_id: str
    chunk_hashes: np.ndarray  # uint64, the chunks of tokens [0, len(chunk_hashes) * chunk_size)
    block_ids: list[int]


@dataclass
class P2PConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
    segment_stores: list[SegmentStoreSpec] = field(default_factory=list)
    # Requests whose lookup pins the ranks may drop (finished, or scheduled with nothing to load).
    released: list[str] = field(default_factory=list)
    # Blocks were freed without waiting for our stores (a preemption), and may be written this
    # step: the forward pass must wait for the store copies in flight.
    fence_stores: bool = False
    # The step's size, for the ranks' prefill rate (the pull policy weighs pulls against it): the
    # tokens it computes, and how many of those are prompt tokens (the rest are decodes).
    step_tokens: int = 0
    prefill_tokens: int = 0
    # vLLM >= 0.32 runs start_load_kv after the forward pass when this step loads nothing in
    # it: what must precede the forward then happens in handle_preemptions.
    load_after_forward: bool = False
