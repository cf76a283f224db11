"""``POST /explain``: for a prompt, chunk by chunk, who holds it (instance, rank, tier), and why a
target instance would not get the rest.

The controller sees every holder's keys, so it can say for each chunk of the target's chunk size:

* ``own``: every rank of the target holds it (a local hit);
* ``peer``: every rank of an instance that can share with the target holds it (a pull, if the
  target's pull policy judges it faster than recomputing; its log says);
* ``layout_mismatch``: only instances serving the model with another layout hold it (the fields
  that differ are named: compatibility.py);
* ``other_model``: only instances serving another model hold it;
* ``partial_tp``: an instance holds it on some of its TP ranks only;
* ``not_held``: nobody holds it now (never stored, or every holder evicted it).

A prefix is reused up to the first chunk the target cannot get: ``usable_tokens``. Consecutive
chunks with the same answer come as one run.

With a salt, an adapter or multimodal items (identity.py) the prompt is keyed as the target keys
it (its own lora_id for the adapter); without a target, every way engines key it, merged. An
adapter no engine reported makes every chunk ``not_held``, and the detail says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from lmcache_p2p.controller.compatibility import differences, model_name
from lmcache_p2p.controller.errors import InvalidRequest
from lmcache_p2p.controller.identity import Resolved
from lmcache_p2p.controller.registry import Registry, WorkerRecord
from lmcache_p2p.keys import chunk_hash_array

USABLE = ("own", "peer")
DEFAULT_CHUNK_SIZE = 256


def explain(
    registry: Registry,
    tokens: Sequence[int] | np.ndarray,
    target: str | None,
    chunk_size: int | None,
    resolved: Resolved | None = None,
) -> dict[str, Any]:
    target_records = registry.instance_workers(target, "instance_id") if target is not None else []
    if target_records:
        if chunk_size is not None and chunk_size != target_records[0].info.chunk_size:
            raise InvalidRequest(
                f"chunk_size {chunk_size} is not {target}'s ({target_records[0].info.chunk_size}); leave it out",
                "chunk_size",
            )
        chunk_size = target_records[0].info.chunk_size
    chunk_size = chunk_size or min((w.info.chunk_size for w in registry.workers.values()), default=DEFAULT_CHUNK_SIZE)
    whole_chunks = len(tokens) // chunk_size
    set_ids = [registry.index.lookup(h).tolist() for h in _hashes(tokens, chunk_size, target, resolved)]
    unknown = resolved.note() if resolved is not None else ""
    instances = registry.instances()
    runs: list[dict[str, Any]] = []
    usable_chunks, blocked = 0, False
    for i in range(whole_chunks):
        held = _held_by_any(registry, [ids[i] for ids in set_ids])
        if target is None:
            status, detail = ("held", "") if held else ("not_held", unknown)
        else:
            status, detail = _status(target, target_records, held, instances)
            if unknown:
                detail = unknown
        if target is not None and not blocked and status in USABLE:
            usable_chunks += 1
        else:
            blocked = True
        holders = sorted(held)
        last = runs[-1] if runs else None
        if last is not None and (last["status"], last["detail"], last["_holders"]) == (status, detail, holders):
            last["end_token"] = (i + 1) * chunk_size
            last["chunks"] += 1
            continue
        runs.append(
            {
                "start_token": i * chunk_size,
                "end_token": (i + 1) * chunk_size,
                "chunks": 1,
                "status": status,
                "detail": detail,
                "holders": [
                    {"instance_id": inst, "ranks": sorted(ranks), "locations": sorted(locs)}
                    for inst, (ranks, locs) in sorted(held.items())
                ],
                "_holders": holders,
            }
        )
    for run in runs:
        del run["_holders"]
    return {
        "instance_id": target,
        "chunk_size": chunk_size,
        "prompt_tokens": len(tokens),
        "whole_chunks": whole_chunks,
        "usable_tokens": usable_chunks * chunk_size if target else None,
        "runs": runs,
        "cannot_share_with": dict(registry.cannot_share.get(target, {})) if target else {},
        **({"identity": resolved.describe()} if resolved is not None else {}),
    }


def _hashes(
    tokens: Sequence[int] | np.ndarray, chunk_size: int, target: str | None, resolved: Resolved | None
) -> list[np.ndarray]:
    """The prompt's keys as ``target`` makes them (its own adapter id), or every variant's."""
    if resolved is None:
        return [chunk_hash_array(tokens, chunk_size)]
    if not resolved.variants:
        return []
    if target is not None:
        return [chunk_hash_array(tokens, chunk_size, identity=resolved.for_instance(target), mm=resolved.mm)]
    return [chunk_hash_array(tokens, chunk_size, identity=v.identity, mm=resolved.mm) for v in resolved.variants]


def _held_by_any(registry: Registry, set_ids: list[int]) -> dict[str, tuple[set[int], set[str]]]:
    if len(set_ids) == 1:
        return _held_by(registry, set_ids[0])
    held: dict[str, tuple[set[int], set[str]]] = {}
    for set_id in set_ids:
        for instance_id, (ranks, locations) in _held_by(registry, set_id).items():
            mine = held.setdefault(instance_id, (set(), set()))
            mine[0].update(ranks)
            mine[1].update(locations)
    return held


def _held_by(registry: Registry, set_id: int) -> dict[str, tuple[set[int], set[str]]]:
    """instance -> (ranks holding the chunk, their locations)."""
    held: dict[str, tuple[set[int], set[str]]] = {}
    if set_id == 0:
        return held
    for holder in registry.index.sets.members(set_id):
        instance_id, rank, location = registry.holders[holder]
        if (instance_id, rank) not in registry.workers:
            continue
        ranks, locations = held.setdefault(instance_id, (set(), set()))
        ranks.add(rank)
        locations.add(location)
    return held


def _status(
    target: str,
    target_records: list[WorkerRecord],
    held: dict[str, tuple[set[int], set[str]]],
    instances: dict[str, list[WorkerRecord]],
) -> tuple[str, str]:
    tp = target_records[0].info.layout.tp_size
    if target in held and len(held[target][0]) == tp:
        return "own", ", ".join(sorted(held[target][1]))
    if not held:
        return "not_held", "nobody holds it now: never stored, or evicted by every holder"
    compatible, mismatched, other_model, partial = [], [], [], []
    for instance_id, (ranks, _) in held.items():
        if instance_id == target:
            partial.append(f"{target} itself on ranks {sorted(ranks)} of {tp}")
            continue
        info = instances[instance_id][0].info
        if model_name(info.layout.model) != model_name(target_records[0].info.layout.model):
            other_model.append(f"{instance_id} ({info.layout.model})")
            continue
        found = differences(target_records[0].info, info)
        if found:
            mismatched.append(f"{instance_id}: {'; '.join(str(d) for d in found)}")
        elif len(ranks) < info.layout.tp_size:
            partial.append(f"{instance_id} on ranks {sorted(ranks)} of {info.layout.tp_size}")
        else:
            compatible.append(instance_id)
    if compatible:
        return "peer", ", ".join(sorted(compatible))
    if mismatched:
        return "layout_mismatch", "; ".join(sorted(mismatched))
    if partial:
        return "partial_tp", "; ".join(sorted(partial))
    return "other_model", ", ".join(sorted(other_model))
