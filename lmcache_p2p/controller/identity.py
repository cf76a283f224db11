"""A request's identity in the controller's API: the ``cache_salt``, ``lora``, ``lora_id`` and
``mm_features`` fields every prompt-taking route accepts (/lookup, /explain, /route, /move, /copy,
/pin), and how they become the key identities engines hash with (keys.KeyIdentity).

The salt and the multimodal items are used as given. An adapter is named (``lora``: the OpenAI
``model`` of an adapter request), and its ``lora_id`` (adapter_id.py: its path and weights) is
what engines reported for that name (``Register``/``Heartbeat.adapters``):

* usually one id: every instance is judged with it;
* several (one name, different adapters on different engines): each instance is judged with its
  own, and one that never reported the name with the most common one;
* none (no engine reported the name): no chunk can be found (/lookup and /explain: no holders;
  /route: ranked by load alone; /move and /pin: 409), and the answer says so;
* ``lora_id`` given: used as is, whatever engines reported.

Answers carry ``identity`` (:meth:`Resolved.describe`), where the salt appears only as
``salt#<8 hex>``: the controller never echoes or logs a salt.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from lmcache_p2p.controller.admission import MAX_ADAPTER_NAME_CHARS
from lmcache_p2p.controller.errors import Conflict, InvalidRequest
from lmcache_p2p.keys import KeyIdentity, MMPlacement, salt_tag

if TYPE_CHECKING:
    from lmcache_p2p.controller.registry import Registry

MAX_SALT_CHARS = 1024  # vLLM's own limit is 128; other front ends may allow more
MAX_MM_FEATURES = 1024
MAX_MM_IDENTIFIER_CHARS = 1024
LORA_ID = re.compile(r"[0-9a-f]{32}")


class MMFeature(msgspec.Struct, forbid_unknown_fields=True):
    """One multimodal item of the prompt, as vLLM places it: its identifier (the content hash, or
    the request's multi_modal_uuids entry) and the placeholder tokens [offset, offset + length)."""

    identifier: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_MM_IDENTIFIER_CHARS)]
    offset: Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
    length: Annotated[int, msgspec.Meta(ge=1, lt=2**31)]


# The fields as request structs declare them (api.py): decoded and bounded by msgspec.
CacheSalt = Annotated[str, msgspec.Meta(max_length=MAX_SALT_CHARS)]
AdapterName = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ADAPTER_NAME_CHARS)]
MMFeatures = Annotated[list[MMFeature], msgspec.Meta(max_length=MAX_MM_FEATURES)]


@dataclass(frozen=True)
class RequestIdentity:
    """What a body said besides its tokens (all empty: a plain request, keyed as before)."""

    cache_salt: str | None = None
    lora: str | None = None
    lora_id: str | None = None
    mm: tuple[MMPlacement, ...] = ()

    @property
    def empty(self) -> bool:
        return self.cache_salt is None and self.lora is None and not self.mm


PLAIN = RequestIdentity()


def from_body(body: Any) -> RequestIdentity:
    """The identity fields of a decoded request body, checked; :class:`InvalidRequest` naming the
    field otherwise. A body type without the fields is plain."""
    salt = getattr(body, "cache_salt", None)
    lora = getattr(body, "lora", None)
    lora_id = getattr(body, "lora_id", None)
    features = getattr(body, "mm_features", None)
    if salt is not None and salt == "":
        raise InvalidRequest("cache_salt is empty: leave it out for no salt", "cache_salt")
    if lora_id is not None:
        if lora is None:
            raise InvalidRequest("lora_id needs lora (the adapter's name)", "lora_id")
        if not LORA_ID.fullmatch(lora_id):
            raise InvalidRequest(
                "lora_id must be 32 lowercase hex characters (lmcache-p2p adapter-id prints it)", "lora_id"
            )
    mm: tuple[MMPlacement, ...] = ()
    if features:
        mm = tuple(sorted((MMPlacement(f.identifier, f.offset, f.length) for f in features), key=_mm_order))
    if salt is None and lora is None and not mm:
        return PLAIN
    return RequestIdentity(cache_salt=salt, lora=lora, lora_id=lora_id, mm=mm)


def _mm_order(f: MMPlacement) -> tuple[int, int, str]:
    return (f.offset, f.length, f.identifier)


@dataclass(frozen=True)
class Variant:
    """One way to key the prompt: its identity, and the instances that key it so (None: every
    instance; else those that reported this lora_id for the adapter's name)."""

    identity: KeyIdentity | None
    instances: frozenset[str] | None = None


@dataclass
class Resolved:
    """A :class:`RequestIdentity` against what engines reported: the key variants to try."""

    request: RequestIdentity
    variants: list[Variant]
    known: bool = True  # False: an adapter no engine reported (variants is empty)
    # instance -> the lora_id it reported for the name (only with an adapter)
    reported: dict[str, str] = field(default_factory=dict)

    @property
    def mm(self) -> tuple[MMPlacement, ...]:
        return self.request.mm

    def for_instance(self, instance_id: str) -> KeyIdentity | None:
        """How ``instance_id`` keys this prompt: its own reported lora_id, else the most common
        one (the first variant). Raises LookupError when no variant exists (an unknown adapter)."""
        if not self.variants:
            raise LookupError(self.note())
        own = self.reported.get(instance_id)
        if own is not None:
            for v in self.variants:
                if v.identity is not None and v.identity.lora_id == own:
                    return v.identity
        return self.variants[0].identity

    def variant_index(self, instance_id: str) -> int:
        """Which of :attr:`variants` ``instance_id`` keys this prompt by (see :meth:`for_instance`)."""
        own = self.reported.get(instance_id)
        if own is not None:
            for i, v in enumerate(self.variants):
                if v.identity is not None and v.identity.lora_id == own:
                    return i
        return 0

    def note(self) -> str:
        if self.known:
            return ""
        return f"adapter {self.request.lora!r} not reported by any engine"

    def describe(self) -> dict[str, Any]:
        """The ``identity`` of answers and logs: never the salt itself."""
        out: dict[str, Any] = {}
        req = self.request
        if req.cache_salt is not None:
            out["cache_salt"] = salt_tag(req.cache_salt)
        if req.lora is not None:
            ids = [v.identity.lora_id for v in self.variants if v.identity is not None]
            out["lora"] = {"name": req.lora, "known": self.known, "lora_ids": ids}
        if req.mm:
            out["mm_features"] = len(req.mm)
        if not self.known:
            out["note"] = self.note()
        return out

    def brief(self) -> str:
        """One log fragment: ``salt#1a2b3c4d lora=sql`` (and the item count)."""
        req = self.request
        parts = []
        if req.cache_salt is not None:
            parts.append(str(salt_tag(req.cache_salt)))
        if req.lora is not None:
            parts.append(f"lora={req.lora}" + ("" if self.known else " (unknown)"))
        if req.mm:
            parts.append(f"mm_features={len(req.mm)}")
        return " ".join(parts)


def resolve(registry: Registry, request: RequestIdentity) -> Resolved:
    """The key variants of ``request`` given what the registry's engines reported."""
    salt = request.cache_salt
    if request.lora is None:
        ident = KeyIdentity(cache_salt=salt)
        return Resolved(request, [Variant(None if ident.plain else ident)])
    if request.lora_id is not None:
        return Resolved(request, [Variant(KeyIdentity(salt, request.lora, request.lora_id))])
    reported = registry.adapter_reports(request.lora)
    if not reported:
        return Resolved(request, [], known=False)
    by_id: dict[str, set[str]] = {}
    for instance_id, lora_id in reported.items():
        by_id.setdefault(lora_id, set()).add(instance_id)
    counts = Counter({lora_id: len(instances) for lora_id, instances in by_id.items()})
    ordered = sorted(counts, key=lambda i: (-counts[i], i))  # the most common first
    variants = [Variant(KeyIdentity(salt, request.lora, i), frozenset(by_id[i])) for i in ordered]
    return Resolved(request, variants, reported=reported)


def instance_identity(registry: Registry, request: RequestIdentity, instance_id: str) -> KeyIdentity | None:
    """How ``instance_id`` itself keys ``request`` (/move's source, /pin's instance): with the
    lora_id it reported for the adapter, or the one given; :class:`Conflict` when it never
    served the adapter (its chunks of it cannot be named)."""
    if request.lora is None:
        ident = KeyIdentity(cache_salt=request.cache_salt)
        return None if ident.plain else ident
    lora_id = request.lora_id or registry.adapter_of(instance_id, request.lora)
    if lora_id is None:
        raise Conflict(
            f"{instance_id} has not served adapter {request.lora!r} (no lora_id reported for it); give lora_id to "
            "name its chunks"
        )
    return KeyIdentity(request.cache_salt, request.lora, lora_id)
