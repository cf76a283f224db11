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

A journal line is trusted no more than a live event (issue 47): each is decoded as a
:class:`JournalRecord` and checked by :func:`check_event`, the check :meth:`EventLog.create`
makes of every live event. A line that fails (not UTF-8, nested too deeply, a number out of range,
a string where a time belongs, cut short, a field missing) is skipped with one WARNING naming its
line number and why, and the controller starts with the rest.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal, TextIO

import msgspec

from lmcache_p2p.controller.admission import MAX_ID_CHARS, shown
from lmcache_p2p.utf8 import utf8_fault

Status = Literal["pending", "done", "failed"]

logger = logging.getLogger(__name__)

# What a journalled event that was pending when the controller stopped becomes on the next start.
INTERRUPTED = "the controller restarted before this command finished; its outcome is unknown"

# An event's error joins its ranks' reasons; bounded, as a TP group of many ranks could say a lot.
MAX_ERROR_CHARS = 2000
# The commands orchestration.py issues; an event of any other kind is not one this controller made.
COMMAND_KINDS = ("move", "copy", "clear", "pin", "unpin", "health", "status")
STATUSES = ("pending", "done", "failed")
# An event id is "<kind>-<16 hex digits>"; a detail names two instance/location pairs at most.
MAX_EVENT_ID_CHARS = 64
MAX_DETAIL_CHARS = 2 * MAX_ID_CHARS + 256
MAX_NUM_TOKENS = 2**53  # exact in a float, so the dashboard's JavaScript shows it as it is
# What a controller keeps of a completion for an event it did not issue (ReportedElsewhere):
# enough to tell an operator what the ranks said, bounded whatever a TP group reports.
MAX_REPORTS_PER_EVENT = 16
MAX_REPORT_ERROR_CHARS = 200
# A journal line is one event (under 3 KiB with the longest error); a longer line is not ours.
MAX_JOURNAL_LINE_BYTES = 64 * 1024
# Warnings about bad journal lines, one a line up to here; past it only their count (a file of
# garbage must not flood the log).
MAX_LINE_WARNINGS = 100


class EventInvalid(ValueError):
    """An event (live or read back) whose ``field`` holds ``value``, which no event can."""

    def __init__(self, field: str, value: Any, expected: str):
        super().__init__(f"{field}={shown(value)}: expected {expected}")
        self.field, self.value = field, value


class JournalRecord(msgspec.Struct, forbid_unknown_fields=True):
    """One journal line, typed: what :meth:`EventLog._line` writes. Decoding checks the types (a
    string ``finished_at`` or a float ``num_tokens`` is refused here); :func:`check_event` the values."""

    event_id: str
    kind: str
    instance_id: str
    detail: str
    status: str
    num_tokens: int
    error: str | None
    created_at: float
    finished_at: float | None


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


def _check_time(name: str, value: float | None, optional: bool) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise EventInvalid(name, value, "a finite Unix time >= 0" + (", or null" if optional else ""))


def check_event(event: CommandEvent) -> None:
    """Raise :class:`EventInvalid` naming the first field of ``event`` no event of ours can hold:
    what /check_finish, /controller/events and the dashboard rely on (a string ``finished_at`` made
    ``duration_ms`` raise mid-answer)."""
    if event.kind not in COMMAND_KINDS:
        raise EventInvalid("kind", event.kind, f"one of {', '.join(COMMAND_KINDS)}")
    if not (0 < len(event.event_id) <= MAX_EVENT_ID_CHARS and event.event_id.startswith(f"{event.kind}-")):
        raise EventInvalid("event_id", event.event_id, f"'{event.kind}-' and an id, at most {MAX_EVENT_ID_CHARS} chars")
    if not event.event_id.isprintable():
        raise EventInvalid("event_id", event.event_id, "printable characters")
    if not 0 < len(event.instance_id) <= MAX_ID_CHARS or not event.instance_id.isprintable():
        raise EventInvalid("instance_id", event.instance_id, f"1..{MAX_ID_CHARS} printable characters")
    if len(event.detail) > MAX_DETAIL_CHARS or not event.detail.isprintable():
        raise EventInvalid("detail", event.detail, f"at most {MAX_DETAIL_CHARS} printable characters")
    if event.status not in STATUSES:
        raise EventInvalid("status", event.status, f"one of {', '.join(STATUSES)}")
    tokens = event.num_tokens
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens <= MAX_NUM_TOKENS:
        raise EventInvalid("num_tokens", tokens, f"an integer 0..{MAX_NUM_TOKENS}")
    if event.error is not None and len(event.error) > MAX_ERROR_CHARS:
        raise EventInvalid("error", event.error, f"at most {MAX_ERROR_CHARS} characters, or null")
    _check_time("created_at", event.created_at, optional=False)
    _check_time("finished_at", event.finished_at, optional=True)


_JOURNAL_DECODER = msgspec.json.Decoder(JournalRecord)


def read_journal_line(line: bytes) -> CommandEvent:
    """One journal line as the event it records; a ValueError (:class:`EventInvalid` for a value
    out of bounds) says why it cannot be one."""
    line = line.rstrip(b"\r\n")
    if len(line) > MAX_JOURNAL_LINE_BYTES:
        raise ValueError(f"{len(line)} bytes long; an event record is at most {MAX_JOURNAL_LINE_BYTES} bytes")
    try:
        r = _JOURNAL_DECODER.decode(line)
    except msgspec.ValidationError as e:
        raise ValueError(f"not an event record: {e}") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        # Invalid UTF-8 is named from the bytes: msgspec reports it as either exception.
        fault = utf8_fault(line)
        if fault is not None:
            raise ValueError(f"not valid UTF-8: {fault}") from None
        raise ValueError(f"not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError("nests arrays or objects too deeply (an event record nests none)") from None
    event = CommandEvent(
        r.event_id,
        r.kind,
        r.instance_id,
        r.detail,
        set(),
        status=r.status,  # type: ignore[arg-type]  # check_event refuses any other
        num_tokens=r.num_tokens,
        error=r.error,
        created_at=r.created_at,
        finished_at=r.finished_at,
    )
    check_event(event)
    return event


class ReportedElsewhere:
    """Completions ranks reported for command events this controller did not issue: with several
    controllers a rank reports each completion to all of them (it cannot tell which one issued
    the command). Kept, bounded, so that ``/check_finish`` asked of the wrong controller (or of
    the survivor after the issuing one died) answers that the event is not its own and what its
    ranks said, instead of a bare "unknown". The newest ``capacity`` event ids, at most
    ``MAX_REPORTS_PER_EVENT`` ranks' words each."""

    def __init__(self, capacity: int = 1000):
        self.capacity = capacity
        self._reports: OrderedDict[str, list[str]] = OrderedDict()

    def note(self, event_id: str, instance_id: str, rank: int, ok: bool, num_tokens: int, error: str | None) -> None:
        if not 0 < len(event_id) <= MAX_EVENT_ID_CHARS:
            return  # no event this mesh issues; nobody will ask about it
        reports = self._reports.pop(event_id, [])
        if len(reports) < MAX_REPORTS_PER_EVENT:
            words = f"{shown(instance_id)} rank {rank}: {'done' if ok else 'failed'}, {num_tokens} tokens"
            reports.append(words + (f" ({shown(error[:MAX_REPORT_ERROR_CHARS])})" if error else ""))
        self._reports[event_id] = reports  # the newest last
        while len(self._reports) > self.capacity:
            self._reports.popitem(last=False)

    def get(self, event_id: str) -> list[str] | None:
        return self._reports.get(event_id)


class EventLog:
    """The newest ``capacity`` events, by id; kept in ``journal`` (a JSON-lines file) when given.
    ``elsewhere`` keeps what ranks reported about events another controller issued."""

    def __init__(self, capacity: int = 10_000, journal: str | None = None):
        self.capacity = capacity
        self._events: OrderedDict[str, CommandEvent] = OrderedDict()
        self.elsewhere = ReportedElsewhere()
        self._journal_path = journal
        self._journal: TextIO | None = None
        self._journal_lines = 0
        if journal is not None:
            self._load(journal)
            self._rewrite()  # only what was kept, and the interrupted ones as failed

    def create(self, kind: str, instance_id: str, ranks: set[int], detail: str = "") -> CommandEvent:
        event = CommandEvent(f"{kind}-{uuid.uuid4().hex[:16]}", kind, instance_id, detail, set(ranks))
        check_event(event)  # the same check a journal line passes on the next start
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
            # Binary: a line that is not UTF-8 is one bad line, not an exception for the whole file.
            with open(path, "rb") as f:
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        event = read_journal_line(line)
                    except ValueError as e:  # EventInvalid too
                        bad += 1
                        if bad <= MAX_LINE_WARNINGS:
                            logger.warning("events journal %s line %d skipped: %s", path, number, e)
                        continue
                    self._events.pop(event.event_id, None)
                    self._events[event.event_id] = event  # the later line (its finish) wins
        except FileNotFoundError:
            return
        if bad > MAX_LINE_WARNINGS:
            logger.warning(
                "events journal %s: %d more lines skipped, not listed (%d in all)", path, bad - MAX_LINE_WARNINGS, bad
            )
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
