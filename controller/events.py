"""Command events: what ``/check_finish`` answers and the WebUI's event log shows.

Every command the controller issues (move, copy, clear, pin, health) gets an event id at once;
its status goes pending -> done | failed as the workers of every TP rank report back.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal, Optional

Status = Literal["pending", "done", "failed"]


@dataclass
class CommandEvent:
    event_id: str
    kind: str
    instance_id: str
    detail: str
    ranks: set[int]  # ranks still to report
    status: Status = "pending"
    num_tokens: int = 0
    error: Optional[str] = None
    created_at: float = field(default_factory=time.time)
    finished_at: Optional[float] = None
    rank_tokens: dict[int, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        duration = (self.finished_at - self.created_at) if self.finished_at else None
        return {"event_id": self.event_id, "kind": self.kind, "instance_id": self.instance_id, "detail": self.detail,
                "status": self.status, "num_tokens": self.num_tokens, "error": self.error,
                "created_at": self.created_at, "duration_ms": round(duration * 1e3, 2) if duration is not None else None}


class EventLog:
    """The newest ``capacity`` events, by id."""

    def __init__(self, capacity: int = 10_000):
        self.capacity = capacity
        self._events: "OrderedDict[str, CommandEvent]" = OrderedDict()

    def create(self, kind: str, instance_id: str, ranks: set[int], detail: str = "") -> CommandEvent:
        event = CommandEvent(f"{kind}-{uuid.uuid4().hex[:16]}", kind, instance_id, detail, set(ranks))
        self._events[event.event_id] = event
        while len(self._events) > self.capacity:
            self._events.popitem(last=False)
        return event

    def get(self, event_id: str) -> Optional[CommandEvent]:
        return self._events.get(event_id)

    def newest(self, limit: int = 100) -> list[CommandEvent]:
        return list(reversed(self._events.values()))[:limit]

    def pending(self) -> list[CommandEvent]:
        return [e for e in self._events.values() if e.status == "pending"]

    def in_flight(self) -> int:
        return len(self.pending())

    @staticmethod
    def rank_done(event: CommandEvent, rank: int, ok: bool, num_tokens: int, error: Optional[str]) -> None:
        """One rank reported. The event's tokens are the fewest any rank moved: a chunk counts
        only when every rank's part of it arrived."""
        if event.status != "pending" or rank not in event.ranks:
            return
        event.ranks.discard(rank)
        event.rank_tokens[rank] = num_tokens
        if not ok:
            event.status, event.error = "failed", f"rank {rank}: {error or 'failed'}"
        if not event.ranks or event.status == "failed":
            event.num_tokens = min(event.rank_tokens.values()) if event.rank_tokens else 0
            if event.status == "pending":
                event.status = "done"
            event.finished_at = time.time()

    @staticmethod
    def fail(event: CommandEvent, error: str) -> None:
        if event.status == "pending":
            event.status, event.error, event.finished_at = "failed", error, time.time()
