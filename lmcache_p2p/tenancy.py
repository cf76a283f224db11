"""What a request's chunk keys are made of besides its tokens, read from a vLLM ``Request``.

vLLM's prefix cache shares a block between two requests only when their ``cache_salt``, LoRA
adapter, multimodal items and prompt embeddings agree too. :func:`request_keys` reads those from
the request the scheduler hands the connector, so that its keys (keys.py, format 2) carry them:

* ``cache_salt``: in the identity (every chunk of a salted request); an empty salt is no salt;
* the LoRA adapter: its name and ``lora_id`` (adapter_id.py: its path and weights);
* each multimodal item's identifier and placeholder range (the chunks overlapping it);
* prompt embeddings: such a request is **not keyed** (``unkeyed = "prompt_embeds"``): neither
  looked up nor stored. Hashing embeddings per chunk would cost the scheduler 10-40 ms per
  25k-token request for a rare use.

An adapter whose files cannot be read here (a hub id not in the local cache, a path on another
host) makes the request unkeyed too, with a WARNING at most once a minute per adapter: better a
recompute than a key that cannot tell two adapters apart.

Attributes are read with ``getattr``, so any object shaped like vLLM's ``Request`` works (vLLM
0.27.1 through 0.34 name them alike). Nothing here imports torch or vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lmcache_p2p.adapter_id import AdapterIds, AdapterUnreadable
from lmcache_p2p.keys import KeyIdentity, MMPlacement
from lmcache_p2p.logs import RateLimitedLog

logger = logging.getLogger(__name__)
_unkeyed_log = RateLimitedLog(logger, every_s=60.0)

PROMPT_EMBEDS = "prompt_embeds"


@dataclass(frozen=True)
class RequestKeys:
    """How one request is keyed: ``identity`` (None: plain), its multimodal items, and, when it is
    not keyed at all, why (``unkeyed``; identity and mm then mean nothing)."""

    identity: KeyIdentity | None = None
    mm: tuple[MMPlacement, ...] = ()
    unkeyed: str = ""

    @property
    def plain(self) -> bool:
        """Keyed by its tokens alone, as before key format 2."""
        return not self.unkeyed and (self.identity is None or self.identity.plain) and not self.mm

    @property
    def blendable(self) -> bool:
        """Whether its segments may be blended: segment KV is computed with the base model alone
        (no adapter, no vision tower), so only plain or salt-only requests."""
        return not self.unkeyed and not self.mm and (self.identity is None or self.identity.lora_name is None)

    @property
    def lora(self) -> tuple[str, str] | None:
        """(name, lora_id) of its adapter, for the engine to report to the controller."""
        ident = self.identity
        if ident is None or ident.lora_name is None or ident.lora_id is None:
            return None
        return ident.lora_name, ident.lora_id

    def describe(self) -> str:
        """For logs: never the salt itself (``salt#`` and a short digest)."""
        if self.unkeyed:
            return f"not keyed ({self.unkeyed})"
        parts = []
        ident = self.identity
        if ident is not None and ident.cache_salt:
            parts.append(str(ident.salt_tag()))
        if ident is not None and ident.lora_name is not None:
            parts.append(f"adapter {ident.lora_name} (id {(ident.lora_id or '')[:8]})")
        if self.mm:
            parts.append(f"{len(self.mm)} multimodal item(s)")
        return ", ".join(parts) or "plain"


_ADAPTERS = AdapterIds()


def request_keys(request: Any, adapters: AdapterIds | None = None) -> RequestKeys:
    """What ``request`` (a vLLM ``Request``, or anything with its attributes) is keyed by."""
    if getattr(request, "prompt_embeds", None) is not None:
        return RequestKeys(unkeyed=PROMPT_EMBEDS)
    salt = getattr(request, "cache_salt", None) or None
    lora_name = lora_id = None
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        lora_name = str(getattr(lora, "lora_name", "") or "")
        path = str(getattr(lora, "lora_path", "") or "")
        try:
            lora_id = (adapters or _ADAPTERS).get(lora_name, path).lora_id
        except AdapterUnreadable as e:
            _unkeyed_log.warning(
                ("adapter", lora_name, path),
                "adapter %s (%s): %s; its requests are neither looked up nor stored",
                lora_name,
                path,
                e,
            )
            return RequestKeys(unkeyed=f"adapter {lora_name}: {e}")
    try:
        mm = mm_placements(request)
    except ValueError as e:
        return RequestKeys(unkeyed=str(e))
    identity = KeyIdentity(cache_salt=salt, lora_name=lora_name, lora_id=lora_id)
    return RequestKeys(identity=None if identity.plain else identity, mm=mm)


def mm_placements(request: Any) -> tuple[MMPlacement, ...]:
    """The request's multimodal items as (identifier, offset, length), in prompt order; ValueError
    for an item without an identifier or a placement (it could not be told apart)."""
    features: Sequence[Any] = getattr(request, "mm_features", None) or ()
    out = []
    for feature in features:
        position = getattr(feature, "mm_position", None)
        identifier = getattr(feature, "identifier", None) or getattr(feature, "mm_hash", None)
        if position is None or not identifier:
            raise ValueError("a multimodal item without an identifier or a placement")
        out.append(MMPlacement(str(identifier), int(position.offset), int(position.length)))
    out.sort(key=lambda f: (f.offset, f.length, f.identifier))
    return tuple(out)
