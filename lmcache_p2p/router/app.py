"""``lmcache_router``'s HTTP side: an OpenAI-compatible proxy that asks the controller where each
request should go.

One request, in order:

1. the body is checked just enough to route it (JSON object, ``model``, ``prompt`` or
   ``messages``): a 400 in OpenAI's error shape names the field otherwise;
2. the prompt becomes token ids on an engine's own ``/tokenize`` (so they are the ids the engine
   will prefill, chat template included), unless ``prompt`` already is token ids;
3. the controller's ``POST /route`` ranks the live instances for those tokens (cached prefix,
   peer pulls, load); the policy (policies.py) orders them;
4. the original body bytes go to the first instance's ``serve_url``; when it cannot be reached
   (connection refused or timed out, dropped before answering, or a 502/503 before generating)
   the next one gets them. An engine that accepted the request is never asked again elsewhere:
   that could generate twice.

The controller being down does not stop traffic: with several controllers the next one is asked
(controllers.py), and with none answering the instances of the last good ``/route`` answer are
kept and served round-robin, with a WARNING saying why.

Tenants (:func:`route_identity`). Engines key a request's chunks by its ``cache_salt`` and LoRA
adapter too (keys.py), so ``/route`` is asked with the same identity: the body's ``cache_salt``,
and ``lora`` when ``model`` names an adapter the engines list in ``/v1/models``. A multimodal chat
is routed by the tokens of its messages before the first one holding a non-text part (an image):
the engines key those chunks as text alone, and the image's own placeholders start in that
message. A first message holding one, or a completion with ``prompt_embeds`` (never cached), is
routed by load. The decision log says which, and shows a salt only as ``salt#<digest>``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi_offline import FastAPIOffline
from starlette.background import BackgroundTask

from lmcache_p2p.http_body import BadContentLength, BodyTooLarge, read_bounded_body
from lmcache_p2p.keys import salt_tag
from lmcache_p2p.logs import RateLimitedLog
from lmcache_p2p.router.config import RouterConfig
from lmcache_p2p.router.controllers import ControllerChoice
from lmcache_p2p.router.policies import Candidate, RoundRobin, demote, make_policy
from lmcache_p2p.router.tokenizer import TEMPLATE_FIELDS, LocalTokenizer, TokenizerError

logger = logging.getLogger("lmcache_p2p.router")

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

# /route's body is capped at 4 MiB by the controller; 262,144 ids take at most 2.9 MB as compact
# JSON. Past that the prefix decides the route anyway (caches hold prefixes), so the tail is cut.
MAX_ROUTE_TOKENS = 262_144
TOKEN_LIMIT = 2**31  # the controller refuses larger ids (TokenId in its api.py)

# The chat request's fields that change what the engine prefills: the tokens /route is asked
# about must be those (a missing generation prompt shifts every chunk boundary after it).
CHAT_TEMPLATE_FIELDS = (
    "add_generation_prompt",
    "add_special_tokens",
    "chat_template_kwargs",
    "mm_processor_kwargs",
    *TEMPLATE_FIELDS,
)
# Request headers the engine may need: its --api-key (Authorization), request-id correlation,
# and the encodings the client accepts (answers are passed on still encoded).
FORWARDED_REQUEST_HEADERS = ("authorization", "accept", "accept-encoding", "x-request-id")
# Response headers passed back besides the content type (hop-by-hop ones are the server's own).
FORWARDED_RESPONSE_HEADERS = ("content-encoding", "x-request-id", "cache-control")
INSTANCE_HEADER = "x-lmcache-instance"  # which instance answered: for clients, logs and tests

# The engine never got (all of) the request: safe to send it elsewhere.
NOT_CONNECTED = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
# The connection broke before any answer: a pooled keep-alive connection the engine closed
# just then, or an engine that died with the request. Tried once more on a fresh connection
# (a stale pooled one is the common case), then elsewhere; an engine that died cannot be
# generating, and one that lives aborts a request whose client went away.
DROPPED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.WriteTimeout)
RETRY_STATUSES = (502, 503)  # the engine (or a proxy in front of it) refused before generating
MODELS_REFRESH_S = 10.0  # a model name no engine listed: /v1/models asked again at most this often


class BadRequest(Exception):
    """A body that cannot be routed; ``param`` names the field (None: the body as a whole)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


def openai_error(status: int, message: str, kind: str, param: str | None = None, **extra: Any) -> JSONResponse:
    """OpenAI's error shape, so SDK clients raise their usual exceptions with the message."""
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": status, **extra}}, status_code=status
    )


# -- the request body ----------------------------------------------------------------------------


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < TOKEN_LIMIT


def _token_list(value: Any) -> list[int] | None:
    """``value`` as token ids when it is a non-empty list of them, else None."""
    if isinstance(value, list) and value and all(_is_token(t) for t in value):
        return value
    return None


def parse_body(raw: bytes, path: str) -> tuple[dict[str, Any], str | list[int] | None]:
    """The JSON body of a completions (``path`` = :data:`COMPLETIONS`) or chat request, checked
    only as far as routing needs (everything else is the engine's to judge), and what a
    completion is routed by (:func:`prompt_text_or_tokens`; None for a chat)."""
    if not raw.strip():
        raise BadRequest("the request has no body: expected a JSON object")
    try:
        body = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body is a JSON {type(body).__name__}, expected an object")
    if "model" not in body:
        raise BadRequest("'model' is required", "model")
    if not isinstance(body["model"], str) or not body["model"]:
        raise BadRequest(f"'model' must be a non-empty string, got {body['model']!r:.100}", "model")
    if path == CHAT:
        messages = body.get("messages")
        if "messages" not in body:
            raise BadRequest("'messages' is required", "messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list of messages", "messages")
        return body, None
    if "prompt" not in body:
        raise BadRequest("'prompt' is required", "prompt")
    return body, prompt_text_or_tokens(body["prompt"])  # raises on a shape that is none of OpenAI's


def prompt_text_or_tokens(prompt: Any) -> str | list[int]:
    """What to route a completions prompt by: its text, or its token ids when it is ids already.
    A batch (a list of prompts) routes by its first: one request goes to one engine."""
    if isinstance(prompt, str):
        return prompt
    tokens = _token_list(prompt)
    if tokens is not None:
        return tokens
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first
        tokens = _token_list(first)
        if tokens is not None:
            return tokens
    raise BadRequest(
        f"'prompt' must be a string, a list of token ids (0 <= id < 2^31), or a non-empty list of either; "
        f"got {prompt!r:.100}",
        "prompt",
    )


def tokenize_body(body: Mapping[str, Any], prompt: str | None) -> dict[str, Any]:
    """vLLM's ``/tokenize`` body for a request: the completion's ``prompt`` text, or (None) the
    chat's messages with every field that shapes the chat template (``add_generation_prompt``
    defaults to true, as in a chat request)."""
    if prompt is None:
        out = {"model": body["model"], "messages": body["messages"], "add_generation_prompt": True}
        out.update({k: body[k] for k in CHAT_TEMPLATE_FIELDS if k in body})
        return out
    out = {"model": body["model"], "prompt": prompt}
    if "add_special_tokens" in body:
        out["add_special_tokens"] = body["add_special_tokens"]
    return out


# -- the request's identity -----------------------------------------------------------------------


@dataclass(frozen=True)
class RouteIdentity:
    """What keys a request's chunks besides its tokens, and what the router tokenizes of it.

    ``messages``: the chat messages to tokenize (None: all of them, as before; a multimodal chat's
    messages before its first non-text part); ``multimodal``: (index of that message, the part's
    type); ``unkeyed``: why the request is routed by load alone."""

    cache_salt: str | None = None
    lora: str | None = None
    messages: list[Any] | None = None
    multimodal: tuple[int, str] | None = None
    unkeyed: str = ""

    def route_fields(self) -> dict[str, Any]:
        """The fields /route takes for it (none for a plain request: the body stays today's)."""
        out: dict[str, Any] = {}
        if self.cache_salt is not None:
            out["cache_salt"] = self.cache_salt
        if self.lora is not None:
            out["lora"] = self.lora
        return out

    @property
    def by_load(self) -> bool:
        """Nothing can be asked about it: routed by load alone."""
        return bool(self.unkeyed) or (self.multimodal is not None and self.multimodal[0] == 0)

    def notes(self, tokens: int) -> list[str]:
        """For the decision log: the identity (never the salt itself) and how it was tokenized."""
        out = []
        if self.cache_salt is not None or self.lora is not None:
            parts = [salt_tag(self.cache_salt)] if self.cache_salt is not None else []
            if self.lora is not None:
                parts.append(f"lora={self.lora}")
            out.append("identity " + " ".join(p for p in parts if p))
        if self.unkeyed:
            out.append(f"{self.unkeyed}: not cached by lmcache-p2p, routed by load")
        elif self.multimodal is not None:
            k, kind = self.multimodal
            if k == 0:
                out.append(f"multimodal: its first message holds an {kind}: routed by load")
            else:
                out.append(f"multimodal: routed by the {tokens} tokens of the {k} message(s) before its first {kind}")
        return out


def first_multimodal(messages: Sequence[Any]) -> tuple[int, str] | None:
    """The first message whose content holds a part that is not text, and that part's type
    (``image_url``, ``input_audio``, ...); None for a text-only chat."""
    for k, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            continue
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind != "text":
                return k, kind if isinstance(kind, str) and kind else "non-text part"
    return None


def route_identity(body: Mapping[str, Any], path: str, is_adapter: Callable[[str], bool]) -> RouteIdentity:
    """A parsed request's identity (:class:`RouteIdentity`); ``is_adapter(model)`` says whether
    the engines serve ``model`` as a LoRA adapter."""
    salt = body.get("cache_salt")
    cache_salt = salt if isinstance(salt, str) and salt else None
    model = body.get("model")
    lora = model if isinstance(model, str) and is_adapter(model) else None
    if path != CHAT:
        unkeyed = "prompt_embeds" if body.get("prompt_embeds") is not None else ""
        return RouteIdentity(cache_salt, lora, unkeyed=unkeyed)
    messages = body.get("messages") or []
    found = first_multimodal(messages)
    if found is None:
        return RouteIdentity(cache_salt, lora)
    return RouteIdentity(cache_salt, lora, messages=list(messages[: found[0]]), multimodal=found)


def prefix_body(body: Mapping[str, Any], messages: list[Any]) -> dict[str, Any]:
    """A chat body whose tokens are a prefix of ``body``'s: ``messages`` (those before the first
    multimodal one) templated without a generation prompt, nor a final message continued."""
    out = {**body, "messages": messages, "add_generation_prompt": False}
    if "continue_final_message" in out:
        out["continue_final_message"] = False
    return out


# -- state: engines known, engines cooling, counters ---------------------------------------------


@dataclass
class RouterStats:
    """What GET /router/stats shows; counted in the one event loop, so no locks."""

    policy: str
    requests: int = 0  # POSTs to /v1/completions and /v1/chat/completions
    bad_requests: int = 0
    forwarded: int = 0  # answered by an engine (any status it chose)
    per_instance: dict[str, int] = field(default_factory=dict)
    fallbacks: int = 0  # an engine could not be reached and the next was tried
    requests_with_fallback: int = 0
    failures: int = 0  # every candidate failed: 503
    engine_errors: int = 0  # an engine accepted and then failed (504/502, or a broken stream)
    route_errors: int = 0  # /route failed: served from the known engines, round-robin
    tokenize_errors: int = 0  # no engine tokenized: routed by load only
    tokenize_ms_total: float = 0.0
    tokenize_calls: int = 0
    route_ms_total: float = 0.0
    route_calls: int = 0
    identity_routes: int = 0  # routed with a cache_salt or an adapter (/route asked with them)
    multimodal_prefix_routes: int = 0  # multimodal chats routed by the text before the first image
    unkeyed_routes: int = 0  # routed by load: prompt_embeds, or an image in the first message

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "requests": self.requests,
            "bad_requests": self.bad_requests,
            "forwarded": self.forwarded,
            "per_instance": dict(sorted(self.per_instance.items())),
            "fallbacks": self.fallbacks,
            "requests_with_fallback": self.requests_with_fallback,
            "failures": self.failures,
            "engine_errors": self.engine_errors,
            "route_errors": self.route_errors,
            "tokenize_errors": self.tokenize_errors,
            "mean_tokenize_ms": round(self.tokenize_ms_total / self.tokenize_calls, 3) if self.tokenize_calls else None,
            "mean_route_ms": round(self.route_ms_total / self.route_calls, 3) if self.route_calls else None,
            "identity_routes": self.identity_routes,
            "multimodal_prefix_routes": self.multimodal_prefix_routes,
            "unkeyed_routes": self.unkeyed_routes,
        }


class KnownEngines:
    """The instances of the last good /route answer that have a serve_url: where to tokenize,
    where /v1/models comes from, and the whole fleet while the controller cannot be asked."""

    def __init__(self) -> None:
        self.engines: dict[str, Candidate] = {}  # instance_id -> a candidate without scores
        # What the engines' /v1/models list: base models (no parent) and LoRA adapters (a
        # parent), read when the set of engines changes and for a model name in neither
        # (at most every MODELS_REFRESH_S); models_read_for: the engines they were read from.
        self.base_models: set[str] = set()
        self.adapters: set[str] = set()
        self.models_read_for: frozenset[str] | None = None
        self.models_read_at = -math.inf
        self._no_url_logged: set[str] = set()
        self._tokenize_turn = RoundRobin()
        self._fallback_turn = RoundRobin()

    def update(self, ranked: Sequence[Candidate]) -> None:
        """Replace the set with ``ranked``'s forwardable instances. An empty answer keeps the old
        set: an empty registry is what a controller restart looks like for a few seconds."""
        fresh: dict[str, Candidate] = {}
        for c in ranked:
            if c.serve_url is None:
                if c.instance_id not in self._no_url_logged:
                    self._no_url_logged.add(c.instance_id)
                    logger.warning(
                        "instance %s has no serve_url: it cannot be forwarded to and is skipped (set the worker "
                        "config key serve_url, or LMCACHE_SERVE_URL, to the URL its engine serves on)",
                        c.instance_id,
                    )
                continue
            fresh[c.instance_id] = Candidate(c.instance_id, c.serve_url, c.model)
        if fresh:
            added = sorted(fresh.keys() - self.engines.keys())
            gone = sorted(self.engines.keys() - fresh.keys())
            if added or gone:
                logger.info(
                    "engines: %d known%s%s",
                    len(fresh),
                    f"; new {', '.join(f'{i} ({fresh[i].serve_url})' for i in added)}" if added else "",
                    f"; gone {', '.join(gone)}" if gone else "",
                )
            self.engines = fresh

    def is_adapter(self, model: str) -> bool:
        """Whether the engines serve ``model`` as a LoRA adapter (as their /v1/models said)."""
        return model in self.adapters

    def models_stale(self, model: str | None) -> bool:
        """Whether /v1/models should be read again: the engines changed, or ``model`` is in
        neither list and the last read is older than MODELS_REFRESH_S."""
        if not self.engines:
            return False
        if self.models_read_for != frozenset(self.engines):
            return True
        unknown = model is not None and model not in self.base_models and model not in self.adapters
        return unknown and time.monotonic() - self.models_read_at >= MODELS_REFRESH_S

    def fallback_order(self) -> list[Candidate]:
        return self._fallback_turn.order(list(self.engines.values()))

    def tokenize_order(self, model: str | None) -> list[Candidate]:
        """Every known engine, those serving ``model`` first (another model's tokenizer would
        give other ids), rotated so tokenizing spreads."""
        ordered = self._tokenize_turn.order(list(self.engines.values()))
        return [c for c in ordered if c.model == model] + [c for c in ordered if c.model != model]


@dataclass
class Tried:
    instance_id: str
    serve_url: str
    error: str

    def to_json(self) -> dict[str, str]:
        return {"instance_id": self.instance_id, "serve_url": self.serve_url, "error": self.error}


@dataclass
class RouteResult:
    candidates: list[Candidate]
    route_ms: float
    note: str = ""  # how the order was made when not by the policy over /route's answer


def _describe_error(e: BaseException) -> str:
    """``e`` for a message: what failed in our words where we know it (no connection), then the
    exception's class and text (httpx's, kept as the detail)."""
    text = str(e) or type(e).__name__
    described = f"{type(e).__name__}: {text}" if type(e).__name__ not in text else text
    if isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout)):
        return f"cannot connect: {described}"
    return described


def _brief(body: bytes, limit: int = 200) -> str:
    return body[:limit].decode("utf-8", errors="replace").strip()


# -- the service ---------------------------------------------------------------------------------


class RouterService:
    """Everything behind the routes: one httpx client, the engines known, the counters."""

    def __init__(self, config: RouterConfig, tokenizer: LocalTokenizer | None = None):
        self.config = config
        self.tokenizer = tokenizer  # --tokenizer: ids without asking an engine
        self.policy = make_policy(config.policy)
        self.stats = RouterStats(policy=self.policy.name)
        self.engines = KnownEngines()
        self._cooling: dict[str, float] = {}  # instance_id -> monotonic time it may go first again
        self._warn = RateLimitedLog(logger, every_s=10.0)
        self._client: httpx.AsyncClient | None = None
        self.controllers = ControllerChoice(config.controller_urls)
        self._controller_headers = {"content-type": "application/json"}
        if config.api_token:
            self._controller_headers["authorization"] = f"Bearer {config.api_token}"
        self._route_timeout = httpx.Timeout(config.route_timeout_s, connect=config.connect_timeout_s)
        # The listener's refusals and closes (http_listener.ListenerCounts), when served by it.
        self.listener_counts: Any = None

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("RouterService.start() has not run")
        return self._client

    async def start(self) -> None:
        c = self.config
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(c.request_timeout_s, connect=c.connect_timeout_s),
            # No total cap: concurrency is bounded by the clients of this proxy, and a pool limit
            # would queue requests to idle engines behind busy ones.
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=512),
            # Engines and the controller are inside the fleet's network: an HTTP(S)_PROXY meant
            # for the outside must not capture them.
            trust_env=False,
        )
        error = await self.discover()
        if error:
            logger.warning(
                "controller %s not reachable at start-up (%s); will ask again per request",
                self.controllers.describe(),
                error,
            )
        logger.info(
            "routing with policy %s via controller %s; %d engine(s) known",
            self.policy.name,
            self.controllers.describe(),
            len(self.engines.engines),
        )

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # -- the controller --------------------------------------------------------------------------

    def _controller_words(self) -> str:
        """Who failed, for messages: "controller URL", or "controllers URL, URL" when several."""
        if len(self.controllers.urls) == 1:
            return f"controller {self.controllers.current}"
        return f"controllers {self.controllers.describe()}"

    async def ask_route(
        self, tokens: list[int], ident: RouteIdentity | None = None
    ) -> tuple[dict[str, Any] | None, str | None]:
        """The controller's /route answer for ``tokens`` (an empty list ranks by load alone) keyed
        with ``ident``'s salt and adapter, or None and why not."""
        body: dict[str, Any] = {"tokens": tokens if len(tokens) <= MAX_ROUTE_TOKENS else tokens[:MAX_ROUTE_TOKENS]}
        if self.config.model:
            body["model"] = self.config.model
        if ident is not None and tokens:
            body.update(ident.route_fields())
        content = msgspec.json.encode(body)
        failures: list[str] = []
        for url in self.controllers.order():
            answer, error, next_one = await self._ask_route_at(url, content)
            if answer is not None:
                self.controllers.answered(url, failures)
                return answer, None
            assert error is not None
            if len(self.controllers.urls) == 1:
                return None, error
            failures.append(f"{url}: {error}")
            if not next_one:
                break
        return None, "; ".join(failures)

    async def _ask_route_at(self, url: str, content: bytes) -> tuple[dict[str, Any] | None, str | None, bool]:
        """One controller's /route answer, or None, why not, and whether another controller might
        answer (a connection error or a 5xx: yes; a 4xx or a bad answer: it would say the same)."""
        try:
            response = await self.client.post(
                f"{url}/route", content=content, headers=self._controller_headers, timeout=self._route_timeout
            )
        except httpx.HTTPError as e:
            return None, _describe_error(e), True
        if response.status_code != 200:
            hint = " (set --api-token-file or LMCACHE_API_TOKEN)" if response.status_code == 401 else ""
            return None, f"HTTP {response.status_code}: {_brief(response.content)}{hint}", response.status_code >= 500
        try:
            answer = response.json()
            ranked = answer["ranked"]
            if not isinstance(ranked, list):
                raise TypeError("'ranked' is not a list")
        except (ValueError, KeyError, TypeError) as e:
            return None, f"unexpected answer ({_describe_error(e)}): {_brief(response.content)}", False
        return answer, None, False

    @staticmethod
    def _candidates(answer: Mapping[str, Any]) -> list[Candidate]:
        out = []
        for entry in answer["ranked"]:
            if isinstance(entry, Mapping):
                try:
                    out.append(Candidate.from_route(entry))
                except ValueError as e:
                    logger.warning("%s", e)
        return out

    async def discover(self) -> str | None:
        """Refresh the known engines from /route with no tokens; None, or why it failed."""
        answer, error = await self.ask_route([])
        if answer is not None:
            self.engines.update(self._candidates(answer))
        return error

    async def route(self, tokens: list[int], ident: RouteIdentity | None = None) -> RouteResult:
        t0 = time.perf_counter()
        answer, error = await self.ask_route(tokens, ident)
        route_ms = (time.perf_counter() - t0) * 1e3
        self.stats.route_ms_total += route_ms
        self.stats.route_calls += 1
        if answer is None:
            self.stats.route_errors += 1
            kind, why = "error", f"{self._controller_words()} /route failed: {error}"
        else:
            ranked = self._candidates(answer)
            self.engines.update(ranked)
            forwardable = [c for c in ranked if c.serve_url is not None]
            if forwardable:
                return RouteResult(self.policy.order(forwardable), route_ms)
            kind, why = (
                "empty",
                "the controller ranked no instance with a serve_url"
                + (f" (skipped: {answer.get('skipped')!r:.300})" if answer.get("skipped") else ""),
            )
        self._warn.warning(
            ("route", kind), "%s; routing round-robin over the %d known engine(s)", why, len(self.engines.engines)
        )
        return RouteResult(self.engines.fallback_order(), route_ms, f"round-robin fallback ({why})")

    # -- engines ---------------------------------------------------------------------------------

    async def tokenize(
        self, body: Mapping[str, Any], prompt: str | list[int] | None, headers: Mapping[str, str]
    ) -> tuple[list[int], str]:
        """The prompt's token ids (``prompt``: a completion's text or ids, None for a chat) from
        --tokenizer or a known engine's /tokenize, and a note when there are none (then the
        request is routed by load alone: ``[]``)."""
        if isinstance(prompt, list):
            return prompt, ""  # already ids: nothing to ask
        t0 = time.perf_counter()
        if self.tokenizer is not None:
            try:
                if prompt is None:
                    tokens = self.tokenizer.chat(body)
                else:
                    tokens = self.tokenizer.completion(prompt, body.get("add_special_tokens", True) is not False)
                self.stats.tokenize_ms_total += (time.perf_counter() - t0) * 1e3
                self.stats.tokenize_calls += 1
                return tokens, ""
            except TokenizerError as e:  # timed and counted once, with the engine's answer below
                self._warn.warning(("local tokenizer",), "%s; asking an engine's /tokenize instead", e)
        if not self.engines.engines:
            await self.discover()
        payload = msgspec.json.encode(tokenize_body(body, prompt))
        problems: list[str] = []
        try:
            for engine in demote(self.engines.tokenize_order(body.get("model")), self.cooling()):
                assert engine.serve_url is not None
                try:
                    response = await self.client.post(
                        f"{engine.serve_url.rstrip('/')}/tokenize",
                        content=payload,
                        headers={"content-type": "application/json", **headers},
                        timeout=httpx.Timeout(self.config.tokenize_timeout_s, connect=self.config.connect_timeout_s),
                    )
                except httpx.HTTPError as e:
                    problems.append(f"{engine.instance_id}: {_describe_error(e)}")
                    if isinstance(e, NOT_CONNECTED):
                        self._cool(engine.instance_id)  # forwarding would wait on it too
                    continue  # unreachable or slow: any engine of the model tokenizes the same
                if response.status_code != 200:
                    # The request itself is wrong for the engine (unknown model, bad messages):
                    # another engine would say the same, and forwarding will give the client
                    # the engine's own error.
                    problems.append(f"{engine.instance_id}: HTTP {response.status_code}: {_brief(response.content)}")
                    break
                ids: Any = None
                with suppress(ValueError, KeyError, TypeError):
                    ids = response.json()["tokens"]
                if isinstance(ids, list) and all(_is_token(t) for t in ids):
                    if problems:  # an engine down: it is demoted for cooldown_s, forwarding too
                        logger.warning(
                            "tokenized on %s after %s; demoted for %.0f s",
                            engine.instance_id,
                            "; ".join(problems),
                            self.config.cooldown_s,
                        )
                    return ids, ""
                problems.append(
                    f"{engine.instance_id}: /tokenize answered without token ids: {_brief(response.content)}"
                )
                break
        finally:
            self.stats.tokenize_ms_total += (time.perf_counter() - t0) * 1e3
            self.stats.tokenize_calls += 1
        self.stats.tokenize_errors += 1
        why = "; ".join(problems) or "no engine known to tokenize on"
        self._warn.warning(("tokenize",), "could not tokenize the prompt (%s): routing by load alone", why)
        return [], f"not tokenized ({why})"

    async def refresh_models(self, model: str | None, headers: Mapping[str, str]) -> None:
        """Read the known engines' /v1/models when :meth:`KnownEngines.models_stale`: which names
        are base models and which are LoRA adapters (cards with a ``parent``), over every engine
        that answers (engines may serve different adapters)."""
        if not self.engines.engines:
            await self.discover()
        known = self.engines
        if not known.models_stale(model):
            return
        engines = list(known.engines.values())
        known.models_read_for, known.models_read_at = frozenset(known.engines), time.monotonic()
        answers = await asyncio.gather(*(self._models_of(e, headers) for e in engines))
        base: set[str] = set()
        adapters: set[str] = set()
        for cards in answers:
            for card in cards:
                name, parent = card.get("id"), card.get("parent")
                if isinstance(name, str):
                    (adapters if isinstance(parent, str) and parent else base).add(name)
        if any(answers):
            known.base_models, known.adapters = base, adapters - base

    async def _models_of(self, engine: Candidate, headers: Mapping[str, str]) -> list[Mapping[str, Any]]:
        """``engine``'s model cards (``headers``: the client's Authorization, for an engine with an
        API key); none when it does not answer."""
        assert engine.serve_url is not None
        try:
            response = await self.client.get(
                f"{engine.serve_url.rstrip('/')}/v1/models",
                headers=dict(headers),
                timeout=httpx.Timeout(self.config.tokenize_timeout_s, connect=self.config.connect_timeout_s),
            )
            cards = response.json()["data"] if response.status_code == 200 else []
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return []
        return [c for c in cards if isinstance(c, Mapping)] if isinstance(cards, list) else []

    def cooling(self) -> set[str]:
        now = time.monotonic()
        for instance_id in [i for i, until in self._cooling.items() if until <= now]:
            del self._cooling[instance_id]
        return set(self._cooling)

    def _cool(self, instance_id: str) -> None:
        self._cooling[instance_id] = time.monotonic() + self.config.cooldown_s

    async def forward(
        self, path: str, raw: bytes, headers: Mapping[str, str], stream: bool, candidates: Sequence[Candidate]
    ) -> tuple[Response, Candidate | None, list[Tried]]:
        """Send the request to the first candidate that takes it. Returns the client's response,
        the candidate that answered (None: nobody) and the candidates that could not be reached."""
        tried: list[Tried] = []
        for candidate in candidates:
            url = candidate.serve_url
            assert url is not None
            upstream: httpx.Response | None = None
            error = ""
            for attempt in (1, 2):
                request = self.client.build_request("POST", f"{url.rstrip('/')}{path}", content=raw, headers=headers)
                try:
                    upstream = await self.client.send(request, stream=True)
                    break
                except NOT_CONNECTED as e:
                    error = _describe_error(e)
                    break
                except DROPPED as e:
                    error = f"{_describe_error(e)} (attempt {attempt})"
                    continue
                except httpx.TimeoutException as e:
                    # Sent, and no answer within request_timeout_s: it may still be generating.
                    return (
                        self._engine_failed(504, candidate, f"no answer within the timeout: {_describe_error(e)}"),
                        None,
                        tried,
                    )
                except httpx.HTTPError as e:
                    return self._engine_failed(502, candidate, _describe_error(e)), None, tried
            if upstream is not None and upstream.status_code in RETRY_STATUSES:
                try:
                    body = await upstream.aread()
                except httpx.HTTPError:
                    body = b""
                finally:
                    await upstream.aclose()
                error = f"HTTP {upstream.status_code} before generating: {_brief(body)}"
                upstream = None
            if upstream is None:
                tried.append(Tried(candidate.instance_id, url, error))
                self._cool(candidate.instance_id)
                continue
            self._cooling.pop(candidate.instance_id, None)
            response = await (self._relay(upstream, candidate) if stream else self._whole(upstream, candidate))
            return response, candidate, tried
        return self._all_failed(tried, candidates), None, tried

    def _response_headers(self, upstream: httpx.Response, candidate: Candidate) -> dict[str, str]:
        headers = {k: upstream.headers[k] for k in FORWARDED_RESPONSE_HEADERS if k in upstream.headers}
        headers[INSTANCE_HEADER] = candidate.instance_id
        return headers

    async def _whole(self, upstream: httpx.Response, candidate: Candidate) -> Response:
        """A non-streamed answer, read whole and passed on byte for byte (raw: still encoded
        as the engine sent it, with its Content-Encoding)."""
        try:
            body = b"".join([chunk async for chunk in upstream.aiter_raw()])
        except httpx.HTTPError as e:
            return self._engine_failed(502, candidate, f"broke off its answer: {_describe_error(e)}")
        finally:
            await upstream.aclose()
        return Response(
            body,
            status_code=upstream.status_code,
            headers=self._response_headers(upstream, candidate),
            media_type=upstream.headers.get("content-type"),
        )

    async def _relay(self, upstream: httpx.Response, candidate: Candidate) -> Response:
        """A streamed answer: bytes passed on as they come. The upstream is open already (the
        fallback decision is behind us); it is closed when the stream ends, fails, or the client
        goes away (Starlette cancels the iterator, and the background task runs after either)."""
        content_type = upstream.headers.get("content-type", "")

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:
                self.stats.engine_errors += 1
                logger.warning(
                    "engine %s (%s) broke off a stream: %s",
                    candidate.instance_id,
                    candidate.serve_url,
                    _describe_error(e),
                )
                if content_type.startswith("text/event-stream"):
                    # The client's SDK raises on an error event; a silent end would look complete.
                    message = f"engine {candidate.instance_id} broke off the stream: {_describe_error(e)}"
                    error = {"error": {"message": message, "type": "engine_error", "param": None, "code": 502}}
                    yield b"\n\ndata: " + msgspec.json.encode(error) + b"\n\n"
            finally:
                await upstream.aclose()

        return StreamingResponse(
            chunks(),
            status_code=upstream.status_code,
            headers=self._response_headers(upstream, candidate),
            media_type=content_type or None,
            background=BackgroundTask(upstream.aclose),
        )

    def _engine_failed(self, status: int, candidate: Candidate, why: str) -> Response:
        self.stats.engine_errors += 1
        message = f"engine {candidate.instance_id} ({candidate.serve_url}) accepted the request and failed: {why}"
        logger.warning("%s", message)
        return openai_error(status, message, "engine_error", instance_id=candidate.instance_id)

    def _all_failed(self, tried: list[Tried], candidates: Sequence[Candidate]) -> Response:
        self.stats.failures += 1
        if not candidates:
            message = (
                f"no engine to send the request to: the controller ({self.controllers.current}) lists no instance "
                "with a serve_url, and none is known from earlier answers"
            )
        else:
            message = "no engine could take the request: " + "; ".join(
                f"{t.instance_id} ({t.serve_url}): {t.error}" for t in tried
            )
        logger.warning("%s", message)
        return openai_error(503, message, "service_unavailable", tried=[t.to_json() for t in tried])

    # -- one request -----------------------------------------------------------------------------

    async def handle(self, request: Request, path: str) -> Response:
        self.stats.requests += 1
        try:
            # Bounded as the controller bounds its bodies: a 100 MB body is refused, not held and forwarded.
            raw = await read_bounded_body(request, self.config.max_body_bytes)
        except BodyTooLarge as e:
            self.stats.bad_requests += 1
            logger.warning("%s refused with 413: %s", path, e)
            return openai_error(413, str(e), "invalid_request_error", e.field, max_body_bytes=e.limit)
        except BadContentLength as e:
            self.stats.bad_requests += 1
            return openai_error(400, str(e), "invalid_request_error", e.field)
        try:
            body, prompt = parse_body(raw, path)
        except BadRequest as e:
            self.stats.bad_requests += 1
            return openai_error(400, e.message, "invalid_request_error", e.param)
        client_headers = {k: request.headers[k] for k in FORWARDED_REQUEST_HEADERS if k in request.headers}
        auth = {k: v for k, v in client_headers.items() if k == "authorization"}
        t0 = time.perf_counter()
        await self.refresh_models(body["model"], auth)
        ident = route_identity(body, path, self.engines.is_adapter)
        tokens: list[int]
        if ident.by_load:
            tokens, tokenize_note = [], ""
            self.stats.unkeyed_routes += 1
        elif ident.messages is not None:
            tokens, tokenize_note = await self.tokenize(prefix_body(body, ident.messages), None, auth)
            self.stats.multimodal_prefix_routes += 1
        else:
            tokens, tokenize_note = await self.tokenize(body, prompt, auth)
        if tokens and (ident.cache_salt is not None or ident.lora is not None):
            self.stats.identity_routes += 1
        tokenize_ms = (time.perf_counter() - t0) * 1e3
        routed = await self.route(tokens, ident)
        candidates = demote(routed.candidates, self.cooling())
        headers = {
            "content-type": request.headers.get("content-type", "application/json"),
            # httpx would offer gzip for us; the engine must encode only what the client accepts.
            "accept-encoding": "identity",
            **client_headers,
        }
        stream = body.get("stream") is True
        response, chosen, tried = await self.forward(path, raw, headers, stream, candidates)
        if tried:
            self.stats.fallbacks += len(tried)
            self.stats.requests_with_fallback += 1
        if chosen is not None:
            self.stats.forwarded += 1
            self.stats.per_instance[chosen.instance_id] = self.stats.per_instance.get(chosen.instance_id, 0) + 1
        notes = [n for n in (tokenize_note, *ident.notes(len(tokens))) if n]
        self._log(path, body, tokens, routed, chosen, tried, tokenize_ms, response.status_code, "; ".join(notes))
        return response

    def _log(
        self,
        path: str,
        body: Mapping[str, Any],
        tokens: list[int],
        routed: RouteResult,
        chosen: Candidate | None,
        tried: list[Tried],
        tokenize_ms: float,
        status: int,
        tokenize_note: str,
    ) -> None:
        if not logger.isEnabledFor(logging.INFO):
            return
        notes = [n for n in (routed.note, tokenize_note) if n]
        if tried:
            notes.append("fell back past " + ", ".join(f"{t.instance_id} ({t.error})" for t in tried))
        if chosen is None:
            target = "no engine"
        else:
            ttft = f"{chosen.expected_ttft_ms:.1f}" if chosen.expected_ttft_ms is not None else "-"
            target = (
                f"{chosen.instance_id} expected_ttft_ms={ttft} local={chosen.local_tokens} peer={chosen.peer_tokens} "
                f"pull={chosen.pull_tokens} recompute={chosen.recompute_tokens} running={chosen.running} "
                f"waiting={chosen.waiting} kv={chosen.kv_usage:.2f}"
            )
        logger.info(
            "%s model=%s stream=%s policy=%s prompt_tokens=%d -> %s; status=%d fallbacks=%d candidates=%d "
            "tokenize_ms=%.1f route_ms=%.1f%s",
            path,
            body.get("model"),
            body.get("stream") is True,
            self.policy.name if not routed.note else "round-robin",
            len(tokens),
            target,
            status,
            len(tried),
            len(routed.candidates),
            tokenize_ms,
            routed.route_ms,
            f"; {'; '.join(notes)}" if notes else "",
        )

    async def models(self, request: Request) -> Response:
        """The first reachable known engine's /v1/models, as it answers."""
        if not self.engines.engines:
            await self.discover()
        headers = {k: request.headers[k] for k in ("authorization",) if k in request.headers}
        tried: list[Tried] = []
        for engine in demote(self.engines.tokenize_order(None), self.cooling()):
            assert engine.serve_url is not None
            try:
                upstream = await self.client.get(
                    f"{engine.serve_url.rstrip('/')}/v1/models",
                    headers=headers,
                    timeout=httpx.Timeout(self.config.tokenize_timeout_s, connect=self.config.connect_timeout_s),
                )
            except httpx.HTTPError as e:
                tried.append(Tried(engine.instance_id, engine.serve_url, _describe_error(e)))
                continue
            return Response(
                upstream.content,
                status_code=upstream.status_code,
                media_type=upstream.headers.get("content-type"),
                headers={INSTANCE_HEADER: engine.instance_id},
            )
        return self._all_failed(tried, list(self.engines.engines.values()))

    async def health(self) -> Response:
        error = await self.discover()
        n = len(self.engines.engines)
        if error is not None:
            reason = f"{self._controller_words()} /route failed: {error}"
            return JSONResponse({"status": "unavailable", "reason": reason, "engines": n}, status_code=503)
        if not n:
            reason = f"the controller ({self.controllers.current}) lists no live instance with a serve_url"
            return JSONResponse({"status": "unavailable", "reason": reason, "engines": 0}, status_code=503)
        return JSONResponse({"status": "ok", "engines": n, "policy": self.policy.name})

    def stats_json(self) -> dict[str, Any]:
        return {
            **self.stats.to_json(),
            "controller_url": self.controllers.current,
            "controller_urls": list(self.controllers.urls),
            "controller_switches": self.controllers.switches,
            "engines": {i: e.serve_url for i, e in sorted(self.engines.engines.items())},
            "cooling": sorted(self.cooling()),
            **(
                {"connections": {"refused": dict(c.refused), "closed": dict(c.closed)}}
                if (c := self.listener_counts) is not None
                else {}
            ),
        }


def create_app(config: RouterConfig, tokenizer: LocalTokenizer | None = None) -> FastAPI:
    """The router's FastAPI app; its httpx client lives as long as the app's lifespan.
    ``tokenizer``: --tokenizer's."""
    service = RouterService(config, tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.close()

    # /docs (Swagger UI) and /redoc from files in the package, not a CDN: air-gapped clusters too.
    app = FastAPIOffline(
        title="lmcache_router",
        version="1",
        description="OpenAI-compatible proxy that routes each request by the lmcache-p2p controller's POST /route.",
        lifespan=lifespan,
    )
    app.state.router = service

    @app.post(COMPLETIONS, summary="OpenAI completions, forwarded to the engine the policy picks")
    async def completions(request: Request) -> Response:
        return await service.handle(request, COMPLETIONS)

    @app.post(CHAT, summary="OpenAI chat completions, forwarded to the engine the policy picks")
    async def chat_completions(request: Request) -> Response:
        return await service.handle(request, CHAT)

    @app.get("/v1/models", summary="The first reachable engine's models")
    async def models(request: Request) -> Response:
        return await service.models(request)

    @app.get("/health", summary="200 when the controller answers and at least one engine is known")
    async def health() -> Response:
        return await service.health()

    @app.get("/router/stats", summary="Requests, fallbacks, failures, route errors, mean tokenize/route times")
    async def stats() -> Response:
        return JSONResponse(service.stats_json())

    return app
