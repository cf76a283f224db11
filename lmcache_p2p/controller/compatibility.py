"""Which registered instances can never share KV, and why: checked when an instance arrives.

Two ranks exchange chunk pages only when their layouts match field for field and they cut prompts
into the same chunks (keys.LayoutFingerprint; DESIGN.md §4). Engines meant to share that differ
in one of those fields (a dtype flag, a TP size, a chunk size, the model given as a path on one
host and a hub id on another) register silently and then never hit each other. The controller
compares each arriving instance with the live ones serving the same model (by name, or by the
last part of its path) and says which field differs, once per pair.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmcache_p2p.protocol import Register

# Layout fields that must be equal (tp_rank is not: ranks pair up rank by rank). key_format: the
# rules chunk keys are made by (keys.KEY_FORMAT); engines with different ones never exchange.
LAYOUT_FIELDS = ("model", "dtype", "block_size", "block_shape", "block_stride", "num_layers", "tp_size", "key_format")


@dataclass(frozen=True)
class Difference:
    field: str
    ours: object
    theirs: object
    hint: str = ""  # what to do about it, where the field alone does not say

    def __str__(self) -> str:
        return f"{self.field} {self.ours} vs {self.theirs}" + (f" ({self.hint})" if self.hint else "")

    def mirrored(self) -> Difference:
        """The same difference as the other side sees it."""
        return Difference(self.field, self.theirs, self.ours, self.hint)


def model_name(model: str) -> str:
    """The model as a user names it: the last part of a path or hub id, case-insensitive."""
    return model.rstrip("/").rsplit("/", 1)[-1].lower()


def differences(ours: Register, theirs: Register) -> list[Difference]:
    """Why two instances' ranks cannot share chunks (empty: they can). Only for instances serving
    the same model (:func:`model_name`): engines serving different models are not meant to share."""
    if model_name(ours.layout.model) != model_name(theirs.layout.model):
        return []
    out = [
        Difference(name, getattr(ours.layout, name), getattr(theirs.layout, name))
        for name in LAYOUT_FIELDS
        if name != "key_format" and getattr(ours.layout, name) != getattr(theirs.layout, name)
    ]
    if ours.layout.key_format != theirs.layout.key_format:
        older = ours if ours.layout.key_format < theirs.layout.key_format else theirs
        out.append(
            Difference(
                "key_format",
                ours.layout.key_format,
                theirs.layout.key_format,
                f"{older.instance_id} runs an lmcache-p2p from before key format "
                f"{max(ours.layout.key_format, theirs.layout.key_format)} (tenant-safe keys): upgrade it",
            )
        )
    if ours.chunk_size != theirs.chunk_size:
        out.append(Difference("chunk_size", ours.chunk_size, theirs.chunk_size))
    return out
