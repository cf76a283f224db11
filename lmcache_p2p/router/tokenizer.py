"""The engine's tokenizer inside the router (``--tokenizer``): prompt token ids without a round trip
to an engine's ``/tokenize``.

Asking an engine costs an HTTP call to a server that is busy generating (measured on the routing
benchmark's CPU fleet: 8-30 ms per request, more than the routing decision it feeds). A local
tokenizer answers in about a millisecond. It must be the engine's own: /route finds cached chunks
by the hashes of the exact token ids the engine will prefill, so the ids have to match
token for token. Completions are tokenized with the special tokens the engine adds (vLLM's
default), chats through the tokenizer's chat template, as vLLM renders them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger("lmcache_p2p.router")


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
        return list(self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])

    def chat(self, body: Mapping[str, Any]) -> list[int]:
        """A chat request's prompt ids: its messages through the chat template (the request's own
        ``chat_template`` if it gives one), with the fields of the request that shape it."""
        kwargs: dict[str, Any] = dict(body.get("chat_template_kwargs") or {})
        for field in ("tools", "chat_template", "continue_final_message"):
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
