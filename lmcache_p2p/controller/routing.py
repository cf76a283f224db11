"""POST /route: which instance should serve a prompt, ranked by expected time to first token.

A router (or anything in front of the engines) asks with the prompt's token ids; the controller
answers with every eligible instance, lowest expected TTFT first, each with the numbers behind
its score, and ``chosen`` / ``serve_url`` for the first.

What the controller knows about an instance for one prompt (:class:`Facts`):

* **held locally**, per location: the prompt's leading chunks the instance holds in its own tiers.
  A chunk counts only when *every* TP rank holds it (the rule of /lookup's ``layout_info``), in
  any of that rank's tiers: the engine looks a chunk up across its tiers by hash. Each held chunk
  is counted for the fastest tier holding it (GPU, then CPU, then others, then disk), and for
  TP > 1 the split reported is that of the rank serving most from slow tiers (it finishes last);
* **pullable from peers**: how far past its own prefix the instance could get by pulling from
  *other* instances of its exact layout (same model, dtype, block shape, TP rank: a peer's pages
  are usable only then). Per rank the best live peer's prefix counts; the instance gets as far as
  its furthest-behind rank. Only ranks with p2p ports pull and serve;
* **load**, from the ranks' latest heartbeats (``Heartbeat.load``): running and waiting requests
  and KV usage (the busiest rank's), the measured prefill rate (the slowest rank's), the measured
  pull bandwidth and fixed cost per pull (the slowest rank's). The queue comes from the rank that
  reads the engine's ``/metrics`` (rank 0, with ``serve_url`` set: worker/engine_load.py); ``load``
  in the answer says ``reported: false`` when no rank did. Rates an instance does not report, the
  settings' defaults stand in for (``--route-*``, :class:`RouteWeights`); a prefill rate measured
  over fewer than ``--route-prefill-min-steps`` steps (or none) gives way to the median of the
  candidates measured over more, when any is (``prefill_source`` in the answer says which).

:func:`expected_ttft_ms` turns those into one number (its docstring has the formula). It favours,
in this order of typical size: an instance holding the prefix (loading it costs a fraction of
recomputing it), then one that can pull it cheaply, and among instances holding nothing the least
loaded. Equal scores (idle instances, nothing cached) are broken by a turn that advances with
every /route call, so a burst of identical asks spreads over the idle instances instead of
piling onto the first: loads arrive with heartbeats, seconds late.

Eligible instances: every registered one (or only ``candidates``), serving ``model`` when one is
given (the registry knows each rank's model from its layout), with every TP rank registered and
none silent past ``worker_timeout`` (a reaped or deregistered instance is not in the registry at
all). Candidates that are unknown, serve another model, miss a rank or are silent are listed in
``skipped`` with the reason rather than failing the request: a router's list may be a heartbeat
out of date, and it still wants the best of the rest.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lmcache_p2p.controller.identity import Resolved
from lmcache_p2p.controller.registry import Registry, WorkerKey, WorkerRecord
from lmcache_p2p.controller.settings import ControllerSettings
from lmcache_p2p.keys import KeyIdentity, MMPlacement, chunk_hash_array

logger = logging.getLogger("lmcache_p2p.controller")

GB = 1e9


# -- the score -----------------------------------------------------------------------------------


def tier_order(location: str) -> int:
    """How slow a tier is to load from, by its name: GPU-resident 0, CPU 1, others 2, disk 3."""
    if "GPU" in location:
        return 0
    if "CPU" in location:
        return 1
    return 3 if "Disk" in location else 2


@dataclass(frozen=True)
class RouteWeights:
    """The defaults and weights of :func:`expected_ttft_ms`, from ``ControllerSettings.route_*``."""

    prefill_tokens_per_s: float  # engines that report no prefill rate
    prefill_min_steps: float  # steps a reported rate must be measured over to count on its own
    pull_bytes_per_s: float  # ranks that report no pull bandwidth
    pull_fixed_ms: float  # ... nor a fixed cost per pull
    cpu_load_bytes_per_s: float  # a CPU tier (and any tier neither GPU nor disk) into the engine
    disk_load_bytes_per_s: float
    running_ms: float  # per running request
    waiting_ms: float  # per waiting request
    kv_full_ms: float  # at 100% KV usage, growing linearly from kv_knee
    kv_knee: float

    @classmethod
    def from_settings(cls, settings: ControllerSettings) -> RouteWeights:
        return cls(
            prefill_tokens_per_s=settings.route_prefill_tokens_per_s,
            prefill_min_steps=settings.route_prefill_min_steps,
            pull_bytes_per_s=settings.route_pull_gbps * GB,
            pull_fixed_ms=settings.route_pull_fixed_ms,
            cpu_load_bytes_per_s=settings.route_cpu_load_gbps * GB,
            disk_load_bytes_per_s=settings.route_disk_load_gbps * GB,
            running_ms=settings.route_running_ms,
            waiting_ms=settings.route_waiting_ms,
            kv_full_ms=settings.route_kv_full_ms,
            kv_knee=settings.route_kv_knee,
        )

    def load_bytes_per_s(self, location: str) -> float:
        order = tier_order(location)
        if order == 0:
            return math.inf  # already in GPU memory: nothing to copy in
        return self.disk_load_bytes_per_s if order == 3 else self.cpu_load_bytes_per_s


@dataclass(slots=True)  # not frozen: built for every instance on every /route, and frozen costs 2x
class Facts:
    """One instance against one prompt. Tokens are prompt tokens; rates are as reported, 0 where
    the instance reports none (the weights' defaults then stand in)."""

    prompt_tokens: int
    local_tokens: int  # leading tokens every rank holds in its own tiers
    local_by_location: dict[str, int]  # local_tokens split by the tier serving them
    peer_tokens: int  # further tokens, past local_tokens, that peers of its layout hold for every rank
    bytes_per_token: int  # KV bytes a token on one rank (TP ranks load and pull their shares at once)
    tp_size: int = 1
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefill_tokens_per_s: float = 0.0
    prefill_steps: int = 0  # steps that rate was measured over (the fewest of its ranks')
    prefill_source: str = "measured"  # or "candidates' median" / "default": see Router._settle_rates
    pull_bytes_per_s: float = 0.0
    pull_fixed_ms: float = 0.0


@dataclass(slots=True)
class Score:
    local_tokens: int  # loaded from its own tiers
    peer_tokens: int  # peers could give (past local_tokens, within the prompt's cacheable part)
    pull_tokens: int  # of those, pulled (0 when recomputing them is estimated faster)
    pull_bytes: int  # over all ranks
    pull_ms: float
    recompute_tokens: int
    prefill_tokens_per_s: float  # the rate used
    recompute_ms: float
    local_load_ms: float
    load_ms: float
    expected_ttft_ms: float


def expected_ttft_ms(facts: Facts, w: RouteWeights) -> Score:
    """The expected time to first token of the prompt on this instance, in ms, and its parts::

        expected_ttft_ms = recompute_tokens / prefill_tokens_per_s           (recompute)
                         + pull_fixed_ms + pull_bytes_per_rank / pull_bytes_per_s   (peer pull)
                         + sum over tiers of tokens * bytes_per_token / tier rate   (local load)
                         + running * running_ms + waiting * waiting_ms
                         + kv_full_ms * clamp((kv_usage - kv_knee) / (1 - kv_knee), 0, 1)  (load)

    * The engine always computes the prompt's last token (the connector never claims the whole
      prompt), so at most ``prompt_tokens - 1`` come from caches.
    * Peer tokens are pulled only when the pull beats recomputing them, as the engine's pull
      policy decides (``pull_policy.decide``, here without its margin); otherwise they count as
      recompute and ``pull_tokens`` is 0.
    * Tier rates: GPU tiers cost nothing, disk tiers ``disk_load_bytes_per_s``, the rest
      ``cpu_load_bytes_per_s``. TP ranks move their own shares at the same time, so times use
      one rank's bytes.
    * Queueing is linear in requests ahead; a nearly full KV cache adds up to ``kv_full_ms``
      (blocks to wait for, preemptions).
    """
    claimable = max(0, facts.prompt_tokens - 1)
    local = min(facts.local_tokens, claimable)
    offered = peer = max(0, min(facts.peer_tokens, claimable - local))
    rate = facts.prefill_tokens_per_s or w.prefill_tokens_per_s
    bandwidth = facts.pull_bytes_per_s or w.pull_bytes_per_s
    fixed_ms = facts.pull_fixed_ms or w.pull_fixed_ms
    pull_ms = fixed_ms + offered * facts.bytes_per_token / bandwidth * 1e3 if offered else 0.0
    if offered and pull_ms >= offered / rate * 1e3:
        offered, pull_ms = 0, 0.0
    recompute = facts.prompt_tokens - local - offered
    recompute_ms = recompute / rate * 1e3
    # When the cap above cut the local prefix (by at most a token), each tier gives up its share.
    scale = local / facts.local_tokens if facts.local_tokens else 0.0
    local_load_ms = sum(
        tokens * scale * facts.bytes_per_token / w.load_bytes_per_s(location) * 1e3
        for location, tokens in facts.local_by_location.items()
    )
    kv_excess = min(1.0, max(0.0, (facts.kv_usage - w.kv_knee) / (1.0 - w.kv_knee)))
    load_ms = facts.running * w.running_ms + facts.waiting * w.waiting_ms + w.kv_full_ms * kv_excess
    return Score(
        local_tokens=local,
        peer_tokens=peer,
        pull_tokens=offered,
        pull_bytes=offered * facts.bytes_per_token * facts.tp_size,
        pull_ms=pull_ms,
        recompute_tokens=recompute,
        prefill_tokens_per_s=rate,
        recompute_ms=recompute_ms,
        local_load_ms=local_load_ms,
        load_ms=load_ms,
        expected_ttft_ms=recompute_ms + pull_ms + local_load_ms + load_ms,
    )


# -- what the index says about a prompt ----------------------------------------------------------

Segment = tuple[int, int, str]  # chunks [start, end) served from one location
_NOTHING: tuple[int, list[Segment]] = (0, [])


def held_prefixes(registry: Registry, hashes: np.ndarray, workers: dict[WorkerKey, WorkerRecord]) -> dict:
    """For each of ``workers`` holding the first chunk: (leading chunks of ``hashes`` it holds in
    any of its locations, the runs of them each location serves, fastest tier first), walking the
    index's runs of chunks with one holder set (:meth:`ChunkIndex.holder_runs`): a few per prompt."""
    runs = registry.index.holder_runs(hashes)
    if not runs:
        return {}
    # Who holds chunk 0, each with its holders in tier order (the engine reads the fastest copy).
    alive: dict[WorkerKey, list[tuple[int, str]]] = {}
    for hid in runs[0][2]:
        instance_id, rank, _ = registry.holders[hid]
        record = workers.get((instance_id, rank))
        if record is not None and record.key not in alive:
            alive[record.key] = sorted(
                ((st.holder, loc) for loc, st in record.locations.items()), key=lambda h: (tier_order(h[1]), h[1])
            )
    prefix: dict[WorkerKey, int] = {}
    segments: dict[WorkerKey, list[Segment]] = {key: [] for key in alive}
    for start, end, members in runs:
        for key in list(alive):
            for hid, location in alive[key]:
                if hid in members:
                    key_segments = segments[key]
                    if key_segments and key_segments[-1][2] == location:
                        key_segments[-1] = (key_segments[-1][0], end, location)
                    else:
                        key_segments.append((start, end, location))
                    break
            else:
                prefix[key] = start
                del alive[key]
        if not alive:
            break
    for key in alive:
        prefix[key] = runs[-1][1]
    return {key: (prefix[key], segments[key]) for key in prefix}


def _split(segments: list[Segment], chunks: int, chunk_size: int) -> dict[str, int]:
    """Tokens each location serves of the first ``chunks`` chunks."""
    out: dict[str, int] = {}
    for start, end, location in segments:
        if start >= chunks:
            break
        out[location] = out.get(location, 0) + (min(end, chunks) - start) * chunk_size
    return out


def _slowness(split: dict[str, int]) -> tuple[int, ...]:
    """Orders splits by how much comes from slow tiers: disk first, then others, CPU, GPU."""
    by_tier = [0, 0, 0, 0]
    for location, tokens in split.items():
        by_tier[tier_order(location)] += tokens
    return tuple(reversed(by_tier))


@dataclass
class _BestPeers:
    """The two longest prefixes among one layout's P2P ranks: enough to find the best peer of
    each instance without comparing every pair."""

    top: list[tuple[int, str]]  # (chunks, instance_id), longest first, two at most

    def best_other(self, instance_id: str) -> tuple[int, str | None]:
        for chunks, holder in self.top:
            if holder != instance_id:
                return chunks, holder
        return 0, None


# -- the router ----------------------------------------------------------------------------------


class Router:
    """Answers POST /route from the registry and the index (one asyncio loop: nothing changes
    while it runs)."""

    def __init__(self, registry: Registry, settings: ControllerSettings):
        self.registry = registry
        self.settings = settings
        self.weights = RouteWeights.from_settings(settings)
        self._turn = 0  # advances every call: the tie-break among equal scores

    def route(
        self,
        tokens: Sequence[int] | np.ndarray,
        model: str | None = None,
        candidates: list[str] | None = None,
        resolved: Resolved | None = None,
    ) -> dict:
        """``tokens``' instances ranked by :func:`expected_ttft_ms`, lowest first; see the module
        docstring for who is eligible. ``model``: only instances serving it (their layout's model).
        ``resolved``: the request's salt, adapter and multimodal items (identity.py): each
        instance is judged by the keys it would make (its own lora_id for the adapter); an
        adapter no engine reported leaves nothing cached anywhere (ranked by load)."""
        now = time.monotonic()
        self._turn += 1
        instances = self.registry.instances()
        skipped: list[dict[str, str]] = []
        if candidates is None:
            asked = [i for i, records in instances.items() if model is None or records[0].info.layout.model == model]
        else:
            asked = list(dict.fromkeys(candidates))  # each once, in the caller's order
        eligible: dict[str, list[WorkerRecord]] = {}
        for instance_id in asked:
            records = instances.get(instance_id)
            why = "not registered" if records is None else self._ineligible(records, model, now)
            if why is None and records is not None:
                eligible[instance_id] = records
            else:
                skipped.append({"instance_id": instance_id, "reason": str(why)})

        # Every live worker counts as a holder: candidates may pull from instances not asked about.
        timeout = self.settings.worker_timeout
        live = {k: r for k, r in self.registry.workers.items() if now - r.last_seen <= timeout}
        chunk_sizes = sorted({r.info.chunk_size for records in eligible.values() for r in records})
        # One key variant (the prompt's keys) unless an adapter name has several lora_ids.
        if resolved is None:
            views = [self._holders(tokens, chunk_sizes, live, None, ())]
        else:
            views = [self._holders(tokens, chunk_sizes, live, v.identity, resolved.mm) for v in resolved.variants]
        nothing: tuple[dict, dict] = ({}, {})

        def view_of(instance_id: str) -> tuple[dict, dict]:
            if not views:
                return nothing  # an adapter nobody reported: nothing is cached for it
            return views[resolved.variant_index(instance_id)] if resolved is not None else views[0]

        prompt_tokens = len(tokens)
        gathered = [
            (instance_id, records, *self._facts(instance_id, records, prompt_tokens, *view_of(instance_id), now))
            for instance_id, records in sorted(eligible.items())
        ]
        self._settle_rates([g[2] for g in gathered])
        ranked = []
        for position, (instance_id, records, facts, pull_from, load) in enumerate(gathered):
            score = expected_ttft_ms(facts, self.weights)
            rotation = (position - self._turn) % len(eligible)
            ranked.append(
                (round(score.expected_ttft_ms, 6), rotation, instance_id, records, facts, score, pull_from, load)
            )
        ranked.sort(key=lambda r: (r[0], r[1]))
        answer = [self._describe(*r[2:]) for r in ranked]
        chosen = answer[0] if answer else None
        self._log(prompt_tokens, answer, skipped, resolved)
        out = {
            "prompt_tokens": prompt_tokens,
            "chosen": chosen["instance_id"] if chosen else None,
            "serve_url": chosen["serve_url"] if chosen else None,
            "ranked": answer,
            "skipped": skipped,
        }
        if resolved is not None:
            out["identity"] = resolved.describe()
        return out

    def _holders(
        self,
        tokens: Sequence[int] | np.ndarray,
        chunk_sizes: list[int],
        live: dict[WorkerKey, WorkerRecord],
        identity: KeyIdentity | None,
        mm: Sequence[MMPlacement],
    ) -> tuple[dict[WorkerKey, tuple[int, list[Segment]]], dict[tuple[int, int], _BestPeers]]:
        """Who holds how much of the prompt keyed one way, and the best peers per peer group."""
        held: dict[WorkerKey, tuple[int, list[Segment]]] = {}
        for chunk_size in chunk_sizes:
            same_size = {k: r for k, r in live.items() if r.info.chunk_size == chunk_size}
            hashes = chunk_hash_array(tokens, chunk_size, identity=identity, mm=mm)
            held.update(held_prefixes(self.registry, hashes, same_size))
        peers: dict[tuple[int, int], _BestPeers] = {}
        for key, (chunks, _) in held.items():
            record = live[key]
            if not record.serves_peers or not chunks:
                continue
            best = peers.setdefault(record.peer_group, _BestPeers([]))
            best.top = sorted([*best.top, (chunks, key[0])], key=lambda t: (-t[0], t[1]))[:2]
        return held, peers

    def _settle_rates(self, candidates: list[Facts]) -> None:
        """A prefill rate measured over fewer than ``prefill_min_steps`` steps is replaced by the
        median of the candidates' rates measured over more, when there are any. Recompute time is
        most of a score, so one cold engine's slow first step would otherwise keep the router
        away from it, and an engine that gets no traffic measures nothing new."""
        settled = [f.prefill_tokens_per_s for f in candidates if f.prefill_steps >= self.weights.prefill_min_steps]
        if not settled:
            return
        median = float(np.median(settled))
        for facts in candidates:
            if facts.prefill_steps < self.weights.prefill_min_steps:
                facts.prefill_tokens_per_s, facts.prefill_source = median, "candidates' median"

    def _ineligible(self, records: list[WorkerRecord], model: str | None, now: float) -> str | None:
        info = records[0].info
        if model is not None and info.layout.model != model:
            return f"serves model {info.layout.model!r}, not {model!r}"
        missing = sorted(set(range(info.layout.tp_size)) - {r.info.rank for r in records})
        if missing:
            return f"rank(s) {missing} of tp_size {info.layout.tp_size} not registered"
        for record in records:
            silent = now - record.last_seen
            if silent > self.settings.worker_timeout:
                return f"rank {record.info.rank} silent for {silent:.1f} s (dead, not yet reaped)"
        return None

    def _facts(
        self,
        instance_id: str,
        records: list[WorkerRecord],
        prompt_tokens: int,
        held: dict[WorkerKey, tuple[int, list[Segment]]],
        peers: dict[tuple[int, int], _BestPeers],
        now: float,
    ) -> tuple[Facts, list[str], dict]:
        # One pass over the ranks (this runs for every instance on every /route): the instance's
        # local prefix (its furthest-behind rank's), how far peers take it, the busiest load.
        own = [held.get(r.key, _NOTHING) for r in records]
        local = reach = prompt_tokens + 1  # narrowed to the minimum over ranks below
        can_pull = True
        best_peer: list[tuple[int, str | None]] = []
        running = waiting = 0
        kv_usage = pull_fixed_ms = 0.0
        prefill = pull_rate = math.inf
        prefill_steps = 0
        load_at = math.inf
        bytes_per_token = 0
        for record, (chunks, _) in zip(records, own, strict=True):
            info = record.info
            if chunks * info.chunk_size < local:
                local = chunks * info.chunk_size
            if record.bytes_per_token > bytes_per_token:
                bytes_per_token = record.bytes_per_token
            can_pull = can_pull and record.serves_peers
            if can_pull:
                best = peers.get(record.peer_group)
                peer = best.best_other(instance_id) if best is not None else (0, None)
                best_peer.append(peer)
                reach = min(reach, max(chunks, peer[0]) * info.chunk_size)
            load = record.load
            if load is not None:
                if load.queue_reported:  # rank 0 reads the engine's queue; the others send rates only
                    running, waiting = max(running, load.running), max(waiting, load.waiting)
                    kv_usage = max(kv_usage, load.kv_usage)
                    load_at = min(load_at, record.load_at)
                pull_fixed_ms = max(pull_fixed_ms, load.pull_fixed_ms)
                if load.prefill_tokens_per_s and load.prefill_tokens_per_s < prefill:
                    prefill, prefill_steps = load.prefill_tokens_per_s, load.prefill_steps
                pull_rate = min(pull_rate, load.pull_bytes_per_s or math.inf)
        reach = max(local, reach) if can_pull else local
        pull_from = sorted(
            {
                holder
                for (chunks, _), (peer_chunks, holder) in zip(own, best_peer, strict=False)
                if holder and peer_chunks > chunks
            }
            if reach > local
            else ()
        )
        by_location: dict[str, int] = {}
        if local:
            splits = [
                _split(segments, local // r.info.chunk_size, r.info.chunk_size)
                for r, (_, segments) in zip(records, own, strict=True)
            ]
            by_location = max(splits, key=_slowness)
        load_view: dict = {"reported": load_at < math.inf}
        if load_at < math.inf:
            load_view["age_s"] = round(now - load_at, 3)
        facts = Facts(
            prompt_tokens=prompt_tokens,
            local_tokens=local,
            local_by_location=by_location,
            peer_tokens=reach - local,
            bytes_per_token=bytes_per_token,
            tp_size=len(records),
            running=running,
            waiting=waiting,
            kv_usage=kv_usage,
            prefill_tokens_per_s=prefill if prefill < math.inf else 0.0,
            prefill_steps=prefill_steps,
            prefill_source="measured" if prefill < math.inf else "default",
            pull_bytes_per_s=pull_rate if pull_rate < math.inf else 0.0,
            pull_fixed_ms=pull_fixed_ms,
        )
        return facts, pull_from, load_view

    def _describe(
        self,
        instance_id: str,
        records: list[WorkerRecord],
        facts: Facts,
        score: Score,
        pull_from: list[str],
        load: dict,
    ) -> dict:
        info = records[0].info
        return {
            "instance_id": instance_id,
            "serve_url": next((r.info.serve_url for r in records if r.info.serve_url), None),
            "model": info.layout.model,
            "tp_size": info.layout.tp_size,
            "expected_ttft_ms": round(score.expected_ttft_ms, 3),
            "local_tokens": score.local_tokens,
            # Whole chunks per tier: one token more than local_tokens when the prompt's last
            # token (always computed) falls in a held chunk.
            "local_tokens_by_location": facts.local_by_location,
            "local_load_ms": round(score.local_load_ms, 3),
            "peer_tokens": score.peer_tokens,
            "pull_tokens": score.pull_tokens,
            "pull_from": pull_from,  # who holds peer_tokens (pulled or not)
            "pull_bytes": score.pull_bytes,
            "pull_ms": round(score.pull_ms, 3),
            "pull_bytes_per_s": facts.pull_bytes_per_s or self.weights.pull_bytes_per_s,
            "recompute_tokens": score.recompute_tokens,
            "prefill_tokens_per_s": score.prefill_tokens_per_s,
            # measured (over prefill_steps steps), the candidates' median (measured over too few),
            # or the default (--route-prefill-tokens-per-s: none reported)
            "prefill_source": facts.prefill_source,
            "prefill_steps": facts.prefill_steps,
            "recompute_ms": round(score.recompute_ms, 3),
            "load": {
                **load,
                "running": facts.running,
                "waiting": facts.waiting,
                "kv_usage": facts.kv_usage,
            },
            "load_ms": round(score.load_ms, 3),
        }

    def _log(self, prompt_tokens: int, ranked: list[dict], skipped: list[dict], resolved: Resolved | None) -> None:
        if not logger.isEnabledFor(logging.INFO):
            return  # the arguments below cost more than the rest of a small fleet's ranking
        # The keys' identity: the salt only as a digest (salt#...), never itself.
        identity = f"; identity {resolved.brief()}" if resolved is not None else ""
        if resolved is not None and not resolved.known:
            identity += f" ({resolved.note()}: ranked by load)"
        if not ranked:
            logger.info(
                "route %d tokens: no eligible instance (%d skipped: %s)%s",
                prompt_tokens,
                len(skipped),
                "; ".join(f"{s['instance_id']}: {s['reason']}" for s in skipped[:5]),
                identity,
            )
            return
        best = ranked[0]
        load = best["load"]
        runner_up = (
            f"; next {ranked[1]['instance_id']} {ranked[1]['expected_ttft_ms']:.1f} ms" if len(ranked) > 1 else ""
        )
        logger.info(
            "route %d tokens -> %s: expected TTFT %.1f ms = local %d tokens %s (%.1f ms) + pull %d tokens from %s "
            "(%.1f ms) + recompute %d tokens at %.0f tokens/s %s (%.1f ms) + load running %d waiting %d kv %.2f%s "
            "(%.1f ms)%s; %d ranked, %d skipped%s",
            prompt_tokens,
            best["instance_id"],
            best["expected_ttft_ms"],
            best["local_tokens"],
            best["local_tokens_by_location"],
            best["local_load_ms"],
            best["pull_tokens"],
            ",".join(best["pull_from"]) if best["pull_tokens"] else "-",
            best["pull_ms"],
            best["recompute_tokens"],
            best["prefill_tokens_per_s"],
            f"({best['prefill_source']}, {best['prefill_steps']} steps)"
            if best["prefill_source"] != "default"
            else "(default)",
            best["recompute_ms"],
            load["running"],
            load["waiting"],
            load["kv_usage"],
            "" if load["reported"] else " (not reported)",
            best["load_ms"],
            runner_up,
            len(ranked),
            len(skipped),
            identity,
        )
