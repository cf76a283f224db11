"""Event ids: what ``/check_finish`` answers about.

Every command the controller issues (move, copy, clear, pin, health, status) gets an event id at
once; its status goes pending -> done | failed as the workers of every TP rank report back, and
the WebUI's event log shows it. Reads (/lookup, /query_worker_info, /query_instance) are done
when they are answered; their ids live in a separate, cheaper record (:class:`ReadLog`), so that
every event id the API hands out is one ``/check_finish`` knows.

With a journal (``--events-file``), command events survive a restart: each is appended as a JSON
line when it is created and again when it finishes (the later line wins), the newest
``capacity`` are read back at start, and one still pending then is failed as interrupted. The
file is rewritten with only those once it holds twice as many lines, so it stays bounded.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal, TextIO

Status = Literal["pending", "done", "failed"]

logger = logging.getLogger(__name__)

# What a journalled event that was pending when the controller stopped becomes on the next start.
INTERRUPTED = "the controller restarted before this command finished; its outcome is unknown"

# An event's error joins its ranks' reasons; bounded, as a TP group of many ranks could say a lot.
MAX_ERROR_CHARS = 2000


@dataclass
class CommandEvent:
    event_id: str
    kind: str
    instance_id: str
    detail: str
    ranks: set[int]  # ranks still to report
    status: Status = "pending"
    num_tokens: int = 0
    error: str | None = None
    created_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    rank_tokens: dict[int, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        duration_ms = round((self.finished_at - self.created_at) * 1e3, 2) if self.finished_at else None
        return {
            "event_id": self.event_id,
            "kind": self.kind,
            "instance_id": self.instance_id,
            "detail": self.detail,
            "status": self.status,
            "num_tokens": self.num_tokens,
            "error": self.error,
            "created_at": self.created_at,
            "duration_ms": duration_ms,
        }


class EventLog:
    """The newest ``capacity`` events, by id; kept in ``journal`` (a JSON-lines file) when given."""

    def __init__(self, capacity: int = 10_000, journal: str | None = None):
        self.capacity = capacity
        self._events: OrderedDict[str, CommandEvent] = OrderedDict()
        self._journal_path = journal
        self._journal: TextIO | None = None
        self._journal_lines = 0
        if journal is not None:
            self._load(journal)
            self._rewrite()  # only what was kept, and the interrupted ones as failed

    def create(self, kind: str, instance_id: str, ranks: set[int], detail: str = "") -> CommandEvent:
        event = CommandEvent(f"{kind}-{uuid.uuid4().hex[:16]}", kind, instance_id, detail, set(ranks))
        self._events[event.event_id] = event
        while len(self._events) > self.capacity:
            self._events.popitem(last=False)
        self._record(event)
        return event

    # -- the journal -------------------------------------------------------------------------------

    @staticmethod
    def _line(event: CommandEvent) -> str:
        fields = ("event_id", "kind", "instance_id", "detail", "status", "num_tokens", "error")
        record = {name: getattr(event, name) for name in fields}
        record.update(created_at=event.created_at, finished_at=event.finished_at)
        return json.dumps(record) + "\n"

    def _record(self, event: CommandEvent) -> None:
        if self._journal is None:
            return
        try:
            self._journal.write(self._line(event))
        except OSError as e:  # a full disk costs the history, never the command
            logger.warning("events journal %s: %s; events are no longer kept across restarts", self._journal_path, e)
            self._journal = None
            return
        self._journal_lines += 1
        if self._journal_lines > 2 * self.capacity:
            self._rewrite()

    def _load(self, path: str) -> None:
        bad = 0
        try:
            with open(path, encoding="utf-8") as f:
                for line in f:
                    try:
                        r = json.loads(line)
                        event = CommandEvent(
                            str(r["event_id"]),
                            str(r["kind"]),
                            str(r["instance_id"]),
                            str(r["detail"]),
                            set(),
                            status=r["status"] if r["status"] in ("pending", "done", "failed") else "failed",
                            num_tokens=int(r["num_tokens"]),
                            error=r["error"],
                            created_at=float(r["created_at"]),
                            finished_at=r["finished_at"],
                        )
                    except (ValueError, KeyError, TypeError):
                        bad += 1  # a line cut short by a crash, or not ours
                        continue
                    self._events.pop(event.event_id, None)
                    self._events[event.event_id] = event  # the later line (its finish) wins
        except FileNotFoundError:
            return
        interrupted = 0
        for event in self._events.values():
            if event.status == "pending":
                event.status, event.error, event.finished_at = "failed", INTERRUPTED, event.created_at
                interrupted += 1
        while len(self._events) > self.capacity:
            self._events.popitem(last=False)
        logger.info(
            "events journal %s: %d command events read back (%d interrupted by the restart, %d unreadable lines)",
            path,
            len(self._events),
            interrupted,
            bad,
        )

    def _rewrite(self) -> None:
        """The journal as the events kept now, replaced in one rename (a crash leaves the old one)."""
        assert self._journal_path is not None
        if self._journal is not None:
            self._journal.close()
        tmp = f"{self._journal_path}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(self._line(e) for e in self._events.values())
            os.replace(tmp, self._journal_path)
            self._journal = open(self._journal_path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        except OSError as e:
            logger.warning("events journal %s: %s; events are not kept across restarts", self._journal_path, e)
            self._journal = None
            return
        self._journal_lines = len(self._events)

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()
            self._journal = None

    def get(self, event_id: str) -> CommandEvent | None:
        return self._events.get(event_id)

    def newest(self, limit: int = 100) -> list[CommandEvent]:
        return list(reversed(self._events.values()))[:limit]

    def pending(self) -> list[CommandEvent]:
        return [e for e in self._events.values() if e.status == "pending"]

    def in_flight(self) -> int:
        return len(self.pending())

    def rank_done(self, event: CommandEvent, rank: int, ok: bool, num_tokens: int, error: str | None) -> bool:
        """One rank reported; True when that finished the event. The event's tokens are the fewest
        any rank moved: a chunk counts only when every rank's part of it arrived."""
        if event.status != "pending" or rank not in event.ranks:
            return False
        event.ranks.discard(rank)
        event.rank_tokens[rank] = num_tokens
        if not ok:
            # The failure leads; a partial rank's reason noted before it stays after it.
            failure = f"rank {rank}: {error or 'failed'}"
            event.status, event.error = "failed", failure if event.error is None else f"{failure}; {event.error}"
        elif error:
            # Done, but not all of it (a move that stopped at the destination's full pool): the
            # reason stays on the event, or /check_finish would show fewer tokens and no why.
            note = f"rank {rank}: {error}"
            event.error = note if event.error is None else f"{event.error}; {note}"
        if event.error is not None and len(event.error) > MAX_ERROR_CHARS:
            event.error = event.error[: MAX_ERROR_CHARS - 3] + "..."
        if not event.ranks or event.status == "failed":
            event.num_tokens = min(event.rank_tokens.values()) if event.rank_tokens else 0
            if event.status == "pending":
                event.status = "done"
            event.finished_at = time.time()
            self._record(event)
            return True
        return False

    def fail(self, event: CommandEvent, error: str) -> bool:
        """Fail a pending event; True when it was still pending (an event finishes once)."""
        if event.status != "pending":
            return False
        event.status, event.error, event.finished_at = "failed", error, time.time()
        self._record(event)
        return True


READ_KINDS = ("lookup", "query_worker_info", "query_instance", "explain")


@dataclass(frozen=True)
class ReadEvent:
    """A read, done when answered: ``/check_finish`` reports it as done with ``num_tokens``."""

    event_id: str
    kind: str
    num_tokens: int


class ReadLog:
    """The ids of the newest ``capacity`` reads, with each read's kind and tokens.

    Reads stay out of the :class:`EventLog`: thousands of lookups a second would push the
    commands an operator is waiting on out of it, and a ``CommandEvent`` per lookup would cost
    the hot path an object and a uuid. Here a read costs two array stores and an f-string
    (well under a microsecond), in fixed memory."""

    def __init__(self, capacity: int = 100_000):
        self.capacity = capacity
        # Per controller run: an id a previous run handed out is unknown here, not someone else's read.
        self._run = uuid.uuid4().hex[:8]
        self._codes = {kind: code for code, kind in enumerate(READ_KINDS)}
        self._issued = 0
        self._kinds = array("B", bytes(capacity))
        self._tokens = array("q", bytes(8 * capacity))

    def record(self, kind: str, num_tokens: int = 0) -> str:
        """A new read's event id."""
        self._issued += 1
        slot = self._issued % self.capacity
        self._kinds[slot] = self._codes[kind]
        self._tokens[slot] = num_tokens
        return f"{kind}-{self._run}-{self._issued}"

    def get(self, event_id: str) -> ReadEvent | None:
        prefix, _, serial_text = event_id.rpartition("-")
        if not (serial_text.isascii() and serial_text.isdigit()):
            return None
        serial = int(serial_text)
        if not self._issued - self.capacity < serial <= self._issued:
            return None  # never issued, or overwritten since
        slot = serial % self.capacity
        kind = READ_KINDS[self._kinds[slot]]
        if prefix != f"{kind}-{self._run}":
            return None
        return ReadEvent(event_id, kind, self._tokens[slot])
