"""The engine's tokenizer inside the router (``--tokenizer``): prompt token ids without a round trip
to an engine's ``/tokenize``.

Asking an engine costs an HTTP call to a server that is busy generating (on the routing
benchmark's CPU fleet, 14.5 ms per request against 6.1 ms in the router, and more than the 4-6 ms
routing decision it feeds). It must be the engine's own: /route finds cached chunks
by the hashes of the exact token ids the engine will prefill, so the ids have to match
token for token. Completions are tokenized with the special tokens the engine adds (vLLM's
default), chats through the tokenizer's chat template, as vLLM renders them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# A chat request's fields that vLLM passes to the chat template besides the messages and the
# generation prompt (the router's tokenize_body sends the same ones to an engine's /tokenize).
TEMPLATE_FIELDS = ("tools", "documents", "chat_template", "continue_final_message")


class TokenizerError(Exception):
    """The tokenizer cannot be loaded, or cannot tokenize this request."""


class LocalTokenizer:
    def __init__(self, source: str):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise TokenizerError(
                f"--tokenizer {source}: needs the transformers package (installed with vLLM): pip install transformers"
            ) from None
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(source)
        except Exception as e:  # a missing path, a hub id that does not resolve, a broken file
            raise TokenizerError(f"--tokenizer {source}: cannot load a tokenizer: {e}") from None
        self.source = source

    def completion(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return list(self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])
        except Exception as e:  # the engine's /tokenize may still do it
            raise TokenizerError(f"tokenizer of {self.source}: {e}") from None

    def chat(self, body: Mapping[str, Any]) -> list[int]:
        """A chat request's prompt ids: its messages through the chat template (the request's own
        ``chat_template`` if it gives one), with the fields of the request that shape it."""
        kwargs: dict[str, Any] = dict(body.get("chat_template_kwargs") or {})
        for field in TEMPLATE_FIELDS:
            if body.get(field) is not None:
                kwargs[field] = body[field]
        try:
            ids = self.tokenizer.apply_chat_template(
                body["messages"],
                add_generation_prompt=body.get("add_generation_prompt", True),
                tokenize=True,
                **kwargs,
            )
        except Exception as e:  # no template, a template error: the engine's /tokenize may still do it
            raise TokenizerError(f"chat template of {self.source}: {e}") from None
        if isinstance(ids, Mapping):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
