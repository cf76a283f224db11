"""What blending accepts, checked without torch: the vLLM scheduler half refuses an unsupported
model at start-up from its config alone (architectures, rope type), before any KV exists.

* :data:`SUPPORTED`: the architectures with a model adapter (blend/models.py);
* :func:`check_full_attention`: every layer attends to the whole prompt (a sliding-window layer
  would need the blend to mask by window, which it does not);
* :data:`LINEAR_ANGLE_ROPE`: the RoPE kinds whose angle is position * inv_freq, the ones a cached
  key can be re-rotated to a new position exactly (blend/rope.py says why).
"""

from __future__ import annotations

# Llama's layer layout: the Qwen2 and Qwen3 families differ only in what sits inside it (biases
# in the projections, per-head q/k norms before RoPE: Qwen3, and Qwen2 with qk_norm).
SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# rope_type values (vLLM's / transformers' names) whose angle is position * inv_freq.
LINEAR_ANGLE_ROPE = frozenset({"default", "linear", "llama3"})


class UnsupportedModel(ValueError):
    pass


class UnsupportedRope(ValueError):
    pass


def check_architecture(architectures: list[str] | None) -> str:
    """The architecture blending will run, or UnsupportedModel naming what was given."""
    for arch in architectures or []:
        if arch in SUPPORTED:
            return arch
    raise UnsupportedModel(
        f"enable_blending supports {', '.join(SUPPORTED)}; this model is {architectures or 'of unknown architecture'}"
    )


def check_rope_kind(rope_type: str | None) -> None:
    kind = rope_type or "default"
    if kind not in LINEAR_ANGLE_ROPE:
        raise UnsupportedRope(
            f"rope_type {kind!r}: blending re-rotates cached keys, which is exact only for RoPE "
            f"whose angle is linear in the position ({', '.join(sorted(LINEAR_ANGLE_ROPE))})"
        )


def check_full_attention(config: object) -> None:
    """UnsupportedModel for a model with sliding-window layers (Qwen2's ``use_sliding_window``, or
    a ``layer_types`` entry other than full attention), named; ``config`` is the HF config."""
    types = [str(t) for t in (getattr(config, "layer_types", None) or [])]
    windowed = sorted({t for t in types if t != "full_attention"})
    if getattr(config, "use_sliding_window", False) or windowed:
        raise UnsupportedModel(
            "enable_blending needs every layer to attend to the whole prompt; this model has sliding-window "
            f"layers ({', '.join(windowed) or 'use_sliding_window: true'})"
        )
