"""The controller's reverse index: chunk hash -> the holders that have it.

A holder is one (worker, location) pair, numbered by the registry. At 10M keys a Python dict of
ints costs ~100 bytes a key and ingests a few hundred thousand keys a second, so the index is
instead:

* an open-addressing hash table in two numpy arrays: ``uint64`` key and ``uint32`` holder-set id,
  probed linearly and *vectorised over a whole batch* (each round advances every still-unresolved
  key one slot), kept between 30% and 60% full: ~40 bytes a key;
* interned holder sets (:class:`HolderSets`): the few distinct combinations of holders that occur
  ("instance 1's CPU", "instance 1's CPU and disk", ...) get small ids; adding or removing a holder
  maps an id to another through a cached transition, done once per distinct id in a batch.

A key whose set becomes empty keeps its slot (a tombstone the same key can reuse) until the next
rebuild drops it. Lookups cost per chunk asked, never per instance.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
# Slot value 0 means "empty"; a real key of 0 (probability 2**-64 per chunk) is stored as this.
_ZERO_ALIAS = np.uint64(0x5BD1E9955BD1E995)
_MAX_LOAD = 0.6
_MIN_LOAD_AFTER_GROW = 0.3


class HolderSets:
    """Interned frozensets of holder ids; id 0 is the empty set."""

    def __init__(self) -> None:
        self._sets: list[frozenset[int]] = [frozenset()]
        self._ids: dict[frozenset[int], int] = {frozenset(): 0}
        self._plus: dict[tuple[int, int], int] = {}
        self._minus: dict[tuple[int, int], int] = {}

    def __len__(self) -> int:
        return len(self._sets)

    def members(self, set_id: int) -> frozenset[int]:
        return self._sets[set_id]

    def intern(self, members: frozenset[int]) -> int:
        set_id = self._ids.get(members)
        if set_id is None:
            set_id = self._ids[members] = len(self._sets)
            self._sets.append(members)
        return set_id

    def plus(self, set_id: int, holder: int) -> int:
        out = self._plus.get((set_id, holder))
        if out is None:
            out = self._plus[(set_id, holder)] = self.intern(self._sets[set_id] | {holder})
        return out

    def minus(self, set_id: int, holder: int) -> int:
        out = self._minus.get((set_id, holder))
        if out is None:
            out = self._minus[(set_id, holder)] = self.intern(self._sets[set_id] - {holder})
        return out

    def containing(self, holder: int) -> np.ndarray:
        """Boolean mask over set ids: which sets contain ``holder``."""
        return np.fromiter((holder in s for s in self._sets), dtype=bool, count=len(self._sets))


class ChunkIndex:
    def __init__(self, capacity: int = 1 << 16):
        capacity = 1 << max(4, (capacity - 1).bit_length())
        self._keys = np.zeros(capacity, dtype=np.uint64)
        self._set_ids = np.zeros(capacity, dtype=np.uint32)
        self._occupied = 0  # slots holding a key, live or tombstone
        self.live_keys = 0  # keys with at least one holder
        self.sets = HolderSets()
        self._holder_counts: dict[int, int] = {}

    # -- queries ---------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return len(self._keys)

    @property
    def nbytes(self) -> int:
        return self._keys.nbytes + self._set_ids.nbytes

    def holder_count(self, holder: int) -> int:
        return self._holder_counts.get(holder, 0)

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Holder-set id per key (0 where nobody holds it)."""
        slots = self._probe(_as_keys(keys), insert=False)
        out = np.zeros(len(slots), dtype=np.uint32)
        found = slots >= 0
        out[found] = self._set_ids[slots[found]]
        return out

    def holder_runs(self, keys: np.ndarray) -> list[tuple[int, int, frozenset[int]]]:
        """Runs of consecutive ``keys`` with one holder set, as (start, end, holders), from the first
        key to the first that nobody holds. A prompt's chunks come in a few runs: every walk over a
        prefix's holders (/lookup's, /route's) steps run by run, not key by key."""
        set_ids = self.lookup(keys)
        if not len(set_ids) or set_ids[0] == 0:
            return []
        starts = [0, *(np.flatnonzero(set_ids[1:] != set_ids[:-1]) + 1).tolist()]
        ends = [*starts[1:], len(set_ids)]
        runs = []
        for start, end in zip(starts, ends, strict=True):
            set_id = int(set_ids[start])
            if set_id == 0:
                break
            runs.append((start, end, self.sets.members(set_id)))
        return runs

    def prefix_holders(self, keys: np.ndarray) -> dict[int, int]:
        """holder -> number of leading ``keys`` it holds, for every holder of ``keys[0]``."""
        runs = self.holder_runs(keys)
        if not runs:
            return {}
        alive = set(runs[0][2])
        matched: dict[int, int] = {}
        for start, _, members in runs:
            for holder in alive - members:
                matched[holder] = start
            alive &= members
            if not alive:
                return matched
        for holder in alive:
            matched[holder] = runs[-1][1]
        return matched

    def holder_keys(self, holder: int) -> np.ndarray:
        """Every key ``holder`` has (a full scan: for rare admin paths, not lookups)."""
        mask = self.sets.containing(holder)[self._set_ids]
        return _from_slots(self._keys[mask])

    # -- updates ---------------------------------------------------------------------------------

    def add(self, holder: int, keys: np.ndarray) -> int:
        """Record that ``holder`` has ``keys``; returns how many it did not have before."""
        keys = _as_keys(keys)
        if not len(keys):
            return 0
        self._reserve(len(keys))
        gained = self._transition(holder, self._probe(keys, insert=True), self.sets.plus)
        self._holder_counts[holder] = self._holder_counts.get(holder, 0) + gained
        return gained

    def remove(self, holder: int, keys: np.ndarray) -> int:
        """Record that ``holder`` no longer has ``keys``; returns how many it actually had."""
        keys = _as_keys(keys)
        if not len(keys):
            return 0
        slots = self._probe(keys, insert=False)
        lost = self._transition(holder, slots[slots >= 0], self.sets.minus)
        self._holder_counts[holder] = self._holder_counts.get(holder, 0) - lost
        return lost

    def drop_holder(self, holder: int) -> int:
        """Forget everything ``holder`` has (a reaped worker, a replaced key set). One pass."""
        affected = np.flatnonzero(self.sets.containing(holder))
        if not len(affected):
            return 0
        transition = np.arange(len(self.sets), dtype=np.uint32)
        transition[affected] = [self.sets.minus(int(s), holder) for s in affected]
        before = self._set_ids
        after = transition[before]
        self.live_keys -= int(np.count_nonzero((before != 0) & (after == 0)))
        self._set_ids = after
        return self._holder_counts.pop(holder, 0)

    def replace_holder(self, holder: int, keys: np.ndarray) -> None:
        """``holder`` has exactly ``keys`` (a full re-sync), applied in one step."""
        self.drop_holder(holder)
        self.add(holder, keys)

    def _transition(self, holder: int, slots: np.ndarray, step) -> int:
        """Map the holder sets at ``slots`` through ``step`` (plus or minus ``holder``); returns
        how many keys' sets changed."""
        if not len(slots):
            return 0
        slots = np.unique(slots)  # a key repeated in one batch counts once
        old = self._set_ids[slots]
        unique_old, inverse = np.unique(old, return_inverse=True)
        mapped = np.array([step(int(s), holder) for s in unique_old], dtype=np.uint32)
        new = mapped[inverse]
        self._set_ids[slots] = new
        self.live_keys += int(np.count_nonzero(old == 0)) - int(np.count_nonzero(new == 0))
        return int(np.count_nonzero(old != new))

    # -- the table -------------------------------------------------------------------------------

    def _home(self, keys: np.ndarray) -> np.ndarray:
        shift = np.uint64(64 - (self.capacity.bit_length() - 1))
        return ((keys * _GOLDEN) >> shift).astype(np.int64)

    def _probe(self, keys: np.ndarray, insert: bool) -> np.ndarray:
        """Slot of each key (-1 if absent and not inserting). Linear probing, vectorised: every
        round examines one slot for each key still unresolved."""
        mask = self.capacity - 1
        slots = np.full(len(keys), -1, dtype=np.int64)
        pos = self._home(keys)
        pending = np.arange(len(keys))
        table = self._keys
        while len(pending):
            p = pos[pending]
            want = keys[pending]
            there = table[p]
            found = there == want
            empty = there == 0
            slots[pending[found]] = p[found]
            resolved = found | empty
            if insert:
                claim = np.flatnonzero(empty)
                table[p[claim]] = want[claim]  # rivals for one slot: the last write wins...
                won = claim[table[p[claim]] == want[claim]]  # ...and copies of one key all win
                slots[pending[won]] = p[won]
                self._occupied += len(np.unique(p[won]))
                # Losers stay on the same slot: next round it holds the winner's key, so they
                # move on (or find it is their own key after all).
                resolved = found.copy()
                resolved[won] = True
            advance = ~found & ~empty
            pos[pending[advance]] = (p[advance] + 1) & mask
            pending = pending[~resolved]
        return slots

    def _reserve(self, incoming: int) -> None:
        if self._occupied + incoming <= _MAX_LOAD * self.capacity:
            return
        live = self._set_ids != 0
        keys, set_ids = self._keys[live], self._set_ids[live]
        capacity = self.capacity
        while (len(keys) + incoming) > _MIN_LOAD_AFTER_GROW * capacity:
            capacity *= 2
        self._keys = np.zeros(capacity, dtype=np.uint64)
        self._set_ids = np.zeros(capacity, dtype=np.uint32)
        self._occupied = 0
        slots = self._probe(keys, insert=True)
        self._set_ids[slots] = set_ids


def _as_keys(keys: Iterable[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(keys, dtype=np.uint64)
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    if np.any(arr == 0):
        arr = np.where(arr == 0, _ZERO_ALIAS, arr)
    return arr


def _from_slots(keys: np.ndarray) -> np.ndarray:
    return np.where(keys == _ZERO_ALIAS, np.uint64(0), keys)
