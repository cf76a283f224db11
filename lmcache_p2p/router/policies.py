"""Which engine a request goes to first, second, ...: the router's policies, as pure code.

Every policy takes the instances the controller's ``POST /route`` ranked (as :class:`Candidate`,
in the controller's order) and returns them all, reordered: the router forwards to the first and
falls back along the list when an engine cannot be reached. Returning the whole list (not one
pick) is what lets every policy share the fallback path.

* ``kv-aware`` (default): the controller's order, lowest expected time to first token first. It
  already weighs cached prefix, peer pulls and load, and takes turns among equal scores.
* ``round-robin``: the instances sorted by id, rotated one step per request. Blind to caches
  and load: the baseline the other two are compared against.
* ``least-loaded``: fewest requests running plus waiting (as of each engine's last heartbeat),
  then lowest KV usage; equal loads take turns like round-robin, so a burst that arrives before
  the next heartbeat does not pile onto one idle engine.

No I/O and no clock here (tests drive them directly). The turn counters are plain ints: the
router calls policies from one asyncio loop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import Any


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


@dataclass(frozen=True)
class Candidate:
    """One instance the router could forward to, with the controller's numbers for this prompt
    (zeros where the answer lacks them: a fallback candidate knows only its URL)."""

    instance_id: str
    serve_url: str | None
    model: str | None = None
    expected_ttft_ms: float | None = None
    local_tokens: int = 0
    peer_tokens: int = 0
    pull_tokens: int = 0
    recompute_tokens: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0

    @classmethod
    def from_route(cls, entry: Mapping[str, Any]) -> Candidate:
        """A candidate from one entry of ``/route``'s ``ranked`` list. Tolerant of missing or
        mistyped fields (an older or newer controller): only ``instance_id`` is required."""
        instance_id = entry.get("instance_id")
        if not isinstance(instance_id, str) or not instance_id:
            raise ValueError(f"/route entry without an instance_id: {dict(entry)!r:.200}")
        serve_url = entry.get("serve_url")
        model = entry.get("model")
        load = entry.get("load")
        load = load if isinstance(load, Mapping) else {}
        return cls(
            instance_id=instance_id,
            serve_url=serve_url if isinstance(serve_url, str) and serve_url else None,
            model=model if isinstance(model, str) else None,
            expected_ttft_ms=_float(entry.get("expected_ttft_ms")),
            local_tokens=_int(entry.get("local_tokens")),
            peer_tokens=_int(entry.get("peer_tokens")),
            pull_tokens=_int(entry.get("pull_tokens")),
            recompute_tokens=_int(entry.get("recompute_tokens")),
            running=_int(load.get("running")),
            waiting=_int(load.get("waiting")),
            kv_usage=_float(load.get("kv_usage")) or 0.0,
        )

    @property
    def queued(self) -> int:
        """Requests ahead of a new one: running plus waiting."""
        return self.running + self.waiting


class Policy:
    """Orders candidates; subclasses override :meth:`order`."""

    name = ""

    def order(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        raise NotImplementedError


class KvAware(Policy):
    """The controller's ranking, unchanged."""

    name = "kv-aware"

    def order(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        return list(candidates)


class RoundRobin(Policy):
    """Sorted by instance id, rotated one step per call. Sorting first makes the cycle
    independent of the controller's order (which changes with caches and load)."""

    name = "round-robin"

    def __init__(self) -> None:
        self.turn = 0

    def order(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        self.turn += 1
        return _rotate(sorted(candidates, key=lambda c: c.instance_id), self.turn - 1)


class LeastLoaded(Policy):
    """Fewest running + waiting, then lowest KV usage; ties rotate one step per call."""

    name = "least-loaded"

    def __init__(self) -> None:
        self.turn = 0

    def order(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        turn = self.turn
        self.turn += 1
        # Sorted by load (ties by id), then each run of equal loads rotated by the turn: equals
        # take turns evenly however many others there are.
        ordered = sorted(candidates, key=lambda c: (c.queued, c.kv_usage, c.instance_id))
        out: list[Candidate] = []
        for _, group in groupby(ordered, key=lambda c: (c.queued, c.kv_usage)):
            out += _rotate(list(group), turn)
        return out


def _rotate(items: list[Candidate], turn: int) -> list[Candidate]:
    """``items`` started at position ``turn`` (modulo their number), wrapping around."""
    if not items:
        return []
    start = turn % len(items)
    return items[start:] + items[:start]


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (KvAware, RoundRobin, LeastLoaded)}
POLICY_NAMES = tuple(POLICIES)


def make_policy(name: str) -> Policy:
    """The policy called ``name`` (one of :data:`POLICY_NAMES`); ValueError naming the choices."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}: expected one of {', '.join(POLICY_NAMES)}")
    return POLICIES[name]()


def demote(candidates: Sequence[Candidate], cooling: set[str] | frozenset[str]) -> list[Candidate]:
    """``candidates`` with those in ``cooling`` (engines that just refused a connection) moved to
    the end, each group in its order. Moved, not dropped: when every engine is cooling, the
    request still tries them all rather than failing without a try."""
    if not cooling:
        return list(candidates)
    warm = [c for c in candidates if c.instance_id not in cooling]
    return warm + [c for c in candidates if c.instance_id in cooling]
