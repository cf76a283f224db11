"""Whether a peer pull beats recomputing: this rank's estimates and the decision (issue 17).

Owns :class:`PrefillRate` (how fast this rank's engine prefills, measured), :class:`LinkEstimate`
(how long a pull over one (peer, channel) takes, measured), :func:`decide` (the rule) and
:class:`PullPolicy` (the three put together for ``OfferMaker.offer``). Torch-free: the
engine feeds :class:`PrefillRate` from its forward passes, the worker reads it.

The model, for a pull of the next ``n`` chunks of a prompt (``c`` tokens and ``p`` bytes each):

* recomputing them takes ``n * c / R``, ``R`` the engine's prefill rate in tokens/s;
* pulling them takes ``F + n * p / B``, ``F`` the link's fixed cost per pull (request round
  trips, the first batch's latency, the last one's checks), ``B`` its bandwidth in bytes/s;
* ``auto`` pulls when ``F + n*p/B <= margin * n*c/R`` (``p2p_pull_margin``, 0.8: a pull must win
  clearly, since it also costs the holder and the link); ``always`` pulls whatever a peer holds.

Both sides are affine in ``n``, so the difference is monotonic: if the longest prefix a holder
offers loses, every shorter prefix from that link loses too (its per-chunk cost is worse than
recomputing, or its fixed cost is spread over fewer chunks). One test per holder decides it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

POLICIES = ("auto", "always")

# Start-up prefill rates per device class, tokens/s, until this rank has measured its own. A rank
# whose prompts all hit a peer computes only short tails, so it may keep this value for long: it
# is the low end of what such an engine does, so that only a pull clearly slower than even a slow
# engine's prefill is skipped before measurements exist (a wrongly skipped pull costs the whole
# recompute; the always-pull behaviour before this policy is the limit of a low value).
# * cuda: Llama-3.1-8B prefills ~34k tokens/s on one H200 (10,000 tokens in 0.29 s, BENCHMARKS.md
#   engine 1's fastest cold TTFTs); a 70B over 8 GPUs does roughly 5-10k. 10k skips a pull of
#   8B KV (128 KiB/token) only below ~1.6 GB/s, where an H100/H200 would indeed recompute faster.
# * cpu: vLLM's CPU backend runs an 8B model at a few hundred to ~2k tokens/s depending on cores
#   and AMX; 200 skips only pulls below ~33 MB/s of 8B KV. The tests' tiny model (62k tokens/s)
#   measures itself on its first cold prompt.
DEFAULT_PREFILL_TOKENS_PER_S = {"cuda": 10_000.0, "cpu": 200.0}

# EWMA weights of the newest sample. Prefill steps are many and noisy (batch mix): a slow weight.
# Pulls are fewer and each one matters: a faster one, about the last four pulls.
PREFILL_ALPHA = 0.2
LINK_ALPHA = 0.3
# A fixed cost is fitted only when the link's recent pull sizes vary by at least this much
# (coefficient of variation); pulls of one size cannot tell fixed cost from bandwidth.
MIN_SIZE_SPREAD = 0.25
# A link estimated too slow is never pulled over, so it would never be measured again. After this
# long without a measurement, one batch is pulled to measure it anew (the congestion that made it
# slow may be gone); the rest of the prefix is still recomputed.
REMEASURE_AFTER_S = 60.0


@dataclass
class PrefillRate:
    """This rank's prefill rate: an EWMA over the engine's measured steps, ``start_up`` until the
    first one. A step counts only when it prefilled at least ``min_tokens`` (a chunk: the least a
    pull replaces); decode steps say nothing about prefill. Thread-safe: the engine observes on its
    thread, the worker reads on its loop."""

    start_up: float  # tokens/s before any measurement
    source: str  # where start_up came from, for the log
    min_tokens: int = 1
    alpha: float = PREFILL_ALPHA
    steps: int = 0  # steps measured
    _tokens: float = 0.0  # EWMA of a measured step's tokens
    _seconds: float = 0.0  # ... and of its seconds
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @classmethod
    def for_engine(cls, configured: float | None, device_class: str, min_tokens: int = 1) -> PrefillRate:
        """``prefill_tokens_per_s`` when configured, else the default of ``device_class`` ("cuda", "cpu")."""
        if configured is not None:
            return cls(configured, "configured prefill_tokens_per_s", min_tokens)
        device_class = device_class if device_class in DEFAULT_PREFILL_TOKENS_PER_S else "cpu"
        return cls(DEFAULT_PREFILL_TOKENS_PER_S[device_class], f"start-up default for {device_class}", min_tokens)

    def observe(self, tokens: int, seconds: float, prefill_tokens: int | None = None) -> bool:
        """A step computed ``tokens`` in ``seconds``, ``prefill_tokens`` of them prompt tokens
        (default: all). Returns whether it counted."""
        prefill = tokens if prefill_tokens is None else prefill_tokens
        if prefill < self.min_tokens or tokens <= 0 or seconds <= 0:
            return False
        with self._lock:
            # The rate is the ratio of the two averages, so long steps weigh in by their length.
            if self.steps == 0:
                self._tokens, self._seconds = float(tokens), seconds
            else:
                self._tokens += self.alpha * (tokens - self._tokens)
                self._seconds += self.alpha * (seconds - self._seconds)
            self.steps += 1
        return True

    @property
    def tokens_per_s(self) -> float:
        with self._lock:
            return self._tokens / self._seconds if self.steps else self.start_up

    def describe(self) -> str:
        with self._lock:
            steps, rate = self.steps, (self._tokens / self._seconds if self.steps else self.start_up)
        how = f"measured over {steps} step(s)" if steps else self.source
        return f"{rate:,.0f} tok/s, {how}"

    def snapshot(self) -> dict:
        return {
            "tokens_per_s": self.tokens_per_s,
            "steps_measured": self.steps,
            "start_up": self.start_up,
            "source": self.source,
        }


@dataclass
class LinkEstimate:
    """Pull time over one (peer, channel) as ``fixed_s + bytes / bytes_per_s``: an exponentially
    weighted least-squares line through the (bytes, seconds) of this rank's clean pulls over it.
    When the recent pulls were all about one size the line has no defined intercept: then the
    fixed cost is taken as 0 and the bandwidth is their effective rate, exact at that size,
    optimistic for smaller pulls and pessimistic for larger ones."""

    alpha: float = LINK_ALPHA
    pulls: int = 0
    fixed_s: float = 0.0
    bytes_per_s: float = 0.0
    measured_at: float = 0.0  # clock() of the newest pull
    last_bytes: int = 0
    last_s: float = 0.0
    # EWMA moments: E[x], E[y], E[x^2], E[xy] with x = bytes, y = seconds
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    def observe(self, nbytes: int, seconds: float, now: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        x, y = float(nbytes), seconds
        if self.pulls == 0:
            self._x, self._y, self._xx, self._xy = x, y, x * x, x * y
        else:
            a = self.alpha
            self._x += a * (x - self._x)
            self._y += a * (y - self._y)
            self._xx += a * (x * x - self._xx)
            self._xy += a * (x * y - self._xy)
        self.pulls += 1
        self.measured_at, self.last_bytes, self.last_s = now, nbytes, seconds
        self._fit()

    def _fit(self) -> None:
        var = self._xx - self._x * self._x
        cov = self._xy - self._x * self._y
        if var > (MIN_SIZE_SPREAD * self._x) ** 2 and cov > 0:
            slope = cov / var  # seconds per byte
            fixed = self._y - slope * self._x
            if fixed >= 0:
                self.fixed_s, self.bytes_per_s = fixed, 1.0 / slope
                return
        # Sizes too alike, or noise gave bigger pulls less time or a negative fixed cost.
        self.fixed_s, self.bytes_per_s = 0.0, self._x / self._y

    def seconds_for(self, nbytes: int) -> float:
        return self.fixed_s + nbytes / self.bytes_per_s

    def snapshot(self, now: float) -> dict:
        return {
            "pulls_measured": self.pulls,
            "gb_per_s": self.bytes_per_s / 1e9,
            "fixed_ms": self.fixed_s * 1e3,
            "last_pull": {"bytes": self.last_bytes, "ms": self.last_s * 1e3},
            "measured_ago_s": round(now - self.measured_at, 1),
        }


@dataclass(frozen=True)
class PullDecision:
    """How many of the ``offered`` leading chunks to pull (0: none, the prompt recomputes them),
    why, and the numbers behind it."""

    chunks: int
    offered: int
    tokens: int  # the offered chunks' tokens
    reason: str  # faster | slower | unmeasured | remeasure | always
    policy: str
    margin: float
    recompute_ms: float
    prefill: str  # the rate used and where it came from (PrefillRate.describe)
    pull_ms: float | None = None  # None: the link was never measured
    gb_per_s: float | None = None
    fixed_ms: float | None = None
    nbytes: int = 0  # the offered chunks' bytes

    @property
    def pull(self) -> bool:
        return self.chunks > 0

    def numbers(self) -> str:
        recompute = f"est recompute {self.recompute_ms:.1f} ms ({self.tokens} tokens at {self.prefill})"
        if self.pull_ms is None:
            return f"link not measured yet; {recompute}"
        cmp = "<=" if self.pull_ms <= self.margin * self.recompute_ms else ">"
        return (
            f"est pull {self.pull_ms:.1f} ms (fixed {self.fixed_ms:.1f} ms + {self.nbytes / 1e9:.4f} gb at "
            f"{self.gb_per_s:.4f} GB/s) {cmp} {self.margin:g} x {recompute}"
        )

    def describe(self, peer: str, channel: str | None) -> str:
        over = f" over {channel}" if channel else ""
        what = {
            "faster": "pulling beats recomputing",
            "slower": "recomputing beats pulling: a miss",
            "unmeasured": "pulling measures the link",
            "remeasure": "the estimate is old: one batch pulled to measure again, the rest recomputed",
            "always": "p2p_pull_policy always",
        }[self.reason]
        per_chunk = self.tokens // max(1, self.offered)
        verb = (
            f"pull {self.chunks} of {self.offered} chunks ({self.chunks * per_chunk} tokens) from"
            if self.pull
            else f"skip {self.offered} chunks ({self.tokens} tokens) at"
        )
        return f"peer pull decision: {verb} {peer}{over}: {self.numbers()}; policy {self.policy}: {what}"


def decide(
    offered: int,
    chunk_tokens: int,
    page_bytes: int,
    link: LinkEstimate | None,
    prefill: PrefillRate,
    policy: str = "auto",
    margin: float = 0.8,
    stale: bool = False,
    probe_chunks: int = 1,
) -> PullDecision:
    """The decision for a holder offering ``offered`` leading chunks over ``link`` (None: never
    measured). A link never measured is pulled over (optimistically): only a pull measures it,
    and the usual link is a hit worth having; the worst case is one slow pull per link. A
    ``stale`` estimate that says "slower" gets ``probe_chunks`` pulled to measure it again."""
    tokens, nbytes = offered * chunk_tokens, offered * page_bytes
    rate = prefill.tokens_per_s
    skip = PullDecision(
        chunks=0,
        offered=offered,
        tokens=tokens,
        reason="slower",
        policy=policy,
        margin=margin,
        recompute_ms=tokens / rate * 1e3,
        prefill=prefill.describe(),
        nbytes=nbytes,
    )
    if link is None or link.pulls == 0:
        return replace(skip, chunks=offered, reason="always" if policy == "always" else "unmeasured")
    pull_s = link.seconds_for(nbytes)
    measured = replace(skip, pull_ms=pull_s * 1e3, gb_per_s=link.bytes_per_s / 1e9, fixed_ms=link.fixed_s * 1e3)
    if policy == "always":
        return replace(measured, chunks=offered, reason="always")
    if pull_s <= margin * tokens / rate:
        return replace(measured, chunks=offered, reason="faster")
    if stale:
        return replace(measured, chunks=min(offered, max(1, probe_chunks)), reason="remeasure")
    return measured


class PullPolicy:
    """One rank's pull policy: its prefill rate, an estimate per (peer, channel), and the rule.
    Used on the worker's loop only (the prefill rate is the one part the engine writes)."""

    def __init__(
        self,
        prefill: PrefillRate,
        chunk_tokens: int,
        page_bytes: int,
        policy: str = "auto",
        margin: float = 0.8,
        probe_chunks: int = 8,
        remeasure_after_s: float = REMEASURE_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        if policy not in POLICIES:
            raise ValueError(f"p2p_pull_policy={policy!r}: expected one of {', '.join(POLICIES)}")
        self.prefill = prefill
        self.chunk_tokens = chunk_tokens
        self.page_bytes = page_bytes
        self.policy = policy
        self.margin = margin
        self.probe_chunks = probe_chunks  # a re-measuring pull: one request's worth (p2p_batch_chunks)
        self.remeasure_after_s = remeasure_after_s
        self.clock = clock
        self.links: dict[tuple[str, str], LinkEstimate] = {}

    def link(self, peer: str, channel: str | None) -> LinkEstimate | None:
        """The estimate for ``peer`` over ``channel``; with the channel not agreed yet (no
        connection), the peer's most recently measured one over any channel."""
        if channel is not None:
            return self.links.get((peer, channel))
        known = [e for (p, _), e in self.links.items() if p == peer]
        return max(known, key=lambda e: e.measured_at) if known else None

    def decide(self, peer: str, channel: str | None, offered: int) -> PullDecision:
        link = self.link(peer, channel)
        stale = link is not None and self.clock() - link.measured_at > self.remeasure_after_s
        return decide(
            offered,
            self.chunk_tokens,
            self.page_bytes,
            link,
            self.prefill,
            self.policy,
            self.margin,
            stale,
            self.probe_chunks,
        )

    def observe_pull(self, peer: str, channel: str, nbytes: int, seconds: float) -> None:
        """A clean pull over (peer, channel): ``nbytes`` landed and verified in ``seconds``."""
        self.links.setdefault((peer, channel), LinkEstimate()).observe(nbytes, seconds, self.clock())

    def snapshot(self) -> dict:
        now = self.clock()
        return {
            "policy": self.policy,
            "margin": self.margin,
            "prefill": self.prefill.snapshot(),
            "links": {f"{peer} over {channel}": e.snapshot(now) for (peer, channel), e in self.links.items()},
        }
