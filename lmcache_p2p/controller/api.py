"""The controller's HTTP API (DESIGN.md §6): LMCache-compatible bodies and answers, plus what the
original lacked (/check_finish that works, all holders in /lookup, Prometheus metrics, and
/route: instances ranked by expected time to first token, routing.py).

Bodies are decoded with msgspec straight from the raw request (a 25,600-token /lookup body
decodes in ~0.1 ms, several times faster than pydantic); their JSON schemas are handed to
FastAPI so /openapi.json still documents every route.

HTTP status codes live here and nowhere else: the core raises the typed errors of errors.py and
:data:`HTTP_STATUS` gives each its code. Errors are JSON ``{"error", "field"}``: 422 names the
bad field, 404 the unknown instance or event, 409 a conflict or a worker's refusal, 504 the
worker that did not answer.

Security (issue 18): with an API token configured (``ControllerSettings.api_token``), every route
that changes state needs ``Authorization: Bearer <token>`` (401 otherwise), and with
``protect_reads`` so do the reads. Every POST must say ``Content-Type: application/json`` (415
otherwise): a web page can send a cross-origin POST without asking the browser first only as
text/plain or a form encoding, so refusing those keeps a page an operator happens to open from
clearing caches even where no token is set. Bodies are capped at :data:`MAX_BODY_BYTES` (413),
checked against Content-Length before anything is read and counted while a chunked body streams,
and a body that does not decode (too deeply nested, not UTF-8, wrong types) is a 422, never a 500.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
import warnings
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import jinja2
import msgspec
import numpy as np
from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from fastapi.security import HTTPBearer
from fastapi.staticfiles import StaticFiles
from fastapi_offline import FastAPIOffline
from markupsafe import Markup

from lmcache_p2p import webui
from lmcache_p2p.controller.admission import MAX_ID_CHARS
from lmcache_p2p.controller.errors import (
    CommandRefused,
    Conflict,
    ControllerError,
    InvalidRequest,
    UnknownEvent,
    UnknownInstance,
    WorkerUnreachable,
)
from lmcache_p2p.controller.identity import AdapterName, CacheSalt, MMFeatures, from_body
from lmcache_p2p.controller.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from lmcache_p2p.controller.service import Controller
from lmcache_p2p.controller.views import Entry, Steps
from lmcache_p2p.http_body import DEFAULT_MAX_BODY_BYTES, BadContentLength, BodyTooLarge, read_bounded_body
from lmcache_p2p.rpc import FairShare
from lmcache_p2p.utf8 import utf8_fault

logger = logging.getLogger("lmcache_p2p.controller")

# The largest body a client has reason to send is a /lookup (or /pin, /move) of a long prompt's
# token ids. 131,072 tokens as compact JSON take 0.89 MiB with a 128k-entry vocabulary (6-digit
# ids) and 1.44 MiB at worst (ids up to 2**31 - 1, 10 digits, plus ", "); indented, 2.0 MiB. 4 MiB
# leaves room for all of them and still bounds what one request can make the controller hold.
MAX_BODY_BYTES = DEFAULT_MAX_BODY_BYTES

# Client errors that belong to HTTP itself, not to the core: they are raised before a body is
# decoded, so the core never sees them.


class Unauthorized(ControllerError):
    """No bearer token, or the wrong one, on a route that needs it."""

    def __init__(self, message: str, *, token_sent: bool):
        super().__init__(message, "Authorization")
        # RFC 6750: a challenge says error="invalid_token" when a token came and was not the one.
        self.challenge = 'Bearer realm="lmcache-p2p controller"' + (', error="invalid_token"' if token_sent else "")


class PayloadTooLarge(ControllerError):
    """A body over :data:`MAX_BODY_BYTES`, declared or streamed."""


class UnsupportedMediaType(ControllerError):
    """A POST whose Content-Type is not application/json."""


HTTP_STATUS: dict[type[ControllerError], int] = {
    InvalidRequest: 422,
    UnknownInstance: 404,
    UnknownEvent: 404,
    Conflict: 409,
    CommandRefused: 409,
    WorkerUnreachable: 504,
    Unauthorized: 401,
    PayloadTooLarge: 413,
    UnsupportedMediaType: 415,
}

T = TypeVar("T")
ViewSteps = Callable[[Entry], Steps[dict]]  # a view's steps, given what each entry becomes
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]


class _Identity(msgspec.Struct, kw_only=True):
    """The fields that key a prompt besides its tokens (identity.py), on every route taking one:
    ``cache_salt`` (vLLM's; "" is refused: leave it out), ``lora`` (an adapter's name, the OpenAI
    ``model`` of an adapter request), ``lora_id`` (its id, instead of the ids engines reported)
    and ``mm_features`` (each multimodal item's identifier and placeholder range)."""

    cache_salt: CacheSalt | None = None
    lora: AdapterName | None = None
    lora_id: str | None = None
    mm_features: MMFeatures | None = None


class LookupRequest(_Identity):
    tokens: list[TokenId]
    model: str | None = None


class _LookupFastPath(_Identity):
    tokens: msgspec.Raw
    model: str | None = None


class ExplainRequest(_Identity):
    """POST /explain: ``tokens`` as /lookup takes them; ``instance_id``: the instance to explain the
    misses of (its chunk size is used); ``chunk_size``: without an instance, the size to cut at."""

    tokens: list[TokenId]
    instance_id: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)] | None = None
    chunk_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] | None = None


class _ExplainFastPath(_Identity):
    tokens: msgspec.Raw
    instance_id: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)] | None = None
    chunk_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] | None = None


# A router names the instances it can forward to; more than a fleet has is a mistake.
MAX_ROUTE_CANDIDATES = 10_000

# The most of the event loop's time GET /metrics renders take, however often it is scraped (unless
# --view-cache-s allows a render sooner).
METRICS_LOOP_SHARE = 0.1

InstanceId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
Candidates = Annotated[list[InstanceId], msgspec.Meta(min_length=1, max_length=MAX_ROUTE_CANDIDATES)]


class RouteRequest(_Identity):
    """POST /route: ``tokens`` as /lookup takes them; ``model``: only instances serving it;
    ``candidates``: only these instance ids (omitted: every instance; an empty list is a 422)."""

    tokens: list[TokenId]
    model: str | None = None
    candidates: Candidates | None = None


class _RouteFastPath(_Identity):
    tokens: msgspec.Raw
    model: str | None = None
    candidates: Candidates | None = None


def decode_prompt_body(raw: bytes, body_type: type, fast_type: type) -> tuple[np.ndarray | list[int], Any]:
    """A body carrying a prompt's ``tokens`` (/lookup, /route): the tokens, and the body for its
    other fields. ``fast_type`` is ``body_type`` with ``tokens`` as ``msgspec.Raw``, parsed straight
    into int64 (:func:`parse_token_array`); whatever that declines (or any other field that does
    not decode) goes through the strict ``body_type``, whose 422 names the field."""
    fast: Any = None
    try:
        fast = msgspec.json.decode(raw, type=fast_type)
        tokens = parse_token_array(bytes(fast.tokens))
    except _DECODE_FAILURES:
        tokens = None
    if tokens is None:
        body = _decode(raw, body_type)
        return body.tokens, body
    return tokens, fast


def parse_token_array(raw: bytes) -> np.ndarray | None:
    """A JSON array of token ids straight into int64, never building 25,600 Python ints (which
    alone costs ~0.8 ms on a 2-vCPU host). None whenever the text is anything but plain
    non-negative integers below 2**31: the strict decoder then produces the error message."""
    text = raw.strip()
    if text[:1] != b"[" or text[-1:] != b"]":
        return None
    inner = text[1:-1]
    if not inner.strip():
        return np.zeros(0, dtype=np.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy warns (instead of raising) on text it cannot parse
        try:
            tokens = np.fromstring(inner, dtype=np.int64, sep=",")
        except (ValueError, DeprecationWarning):
            return None
    if len(tokens) != inner.count(b",") + 1 or tokens.min() < 0 or tokens.max() >= 2**31:
        return None
    return tokens


class MoveRequest(_Identity):
    old_position: tuple[str, str]  # (instance_id, location), e.g. ["lmcache_instance_1", "LocalCPUBackend"]
    new_position: tuple[str, str]
    tokens: list[TokenId] | None = None  # omitted: every chunk the source holds at that location
    copy: bool = False
    should_copy: bool | None = None  # LMCache's older spelling of copy


class ClearRequest(msgspec.Struct):
    instance_id: str
    location: str = "LocalCPUBackend"


class PinRequest(_Identity):
    instance_id: str
    location: str
    tokens: list[TokenId]
    unpin: bool = False


class HealthRequest(msgspec.Struct):
    instance_id: str


class CheckFinishRequest(msgspec.Struct):
    event_id: str


class QueryWorkerInfoRequest(msgspec.Struct):
    instance_id: str = "all"
    worker_ids: list[int] | None = None


class QueryInstanceRequest(msgspec.Struct):
    ip: str


# The body's own field first (``at `$.mm_features[0]```: a nested struct's missing field names
# the body's field it is in), else the field a top-level message names.
_FIELD_PATTERNS = (re.compile(r"at `\$\.([A-Za-z_]+)"), re.compile(r"field `([^`]+)`"))


def _field_of(error: str) -> str | None:
    for pattern in _FIELD_PATTERNS:
        m = pattern.search(error)
        if m:
            return m.group(1)
    return None


# Every way msgspec can reject a body. RecursionError: msgspec descends one C-stack level per
# nested array or object (skipping an unknown field's value too) and stops at Python's recursion
# limit, so '[[[[...' 10,000 deep raises it; UnicodeDecodeError: a string that is not UTF-8.
_DECODE_FAILURES = (msgspec.ValidationError, msgspec.DecodeError, RecursionError, UnicodeDecodeError)


def _decode(raw: bytes, body_type: type) -> Any:
    try:
        return msgspec.json.decode(raw, type=body_type)
    except msgspec.ValidationError as e:
        field = _field_of(str(e))
        raise InvalidRequest(f"invalid {body_type.__name__}: {e}", field) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        # Invalid UTF-8 is named from the bytes: msgspec reports it as either exception.
        fault = utf8_fault(raw)
        if fault is not None:
            raise InvalidRequest(f"body is not valid UTF-8: {fault}") from None
        raise InvalidRequest(f"body is not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidRequest(
            f"body nests arrays or objects too deeply to decode as a {body_type.__name__} (past the decoder's "
            "recursion limit; a valid body nests at most 3 levels)"
        ) from None


def _media_type(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip().lower()


async def json_body(request: Request) -> bytes:
    """A POST's body, once its Content-Type says JSON and never more than :data:`MAX_BODY_BYTES` of it
    (read by :func:`lmcache_p2p.http_body.read_bounded_body`, which lmcache_router uses too)."""
    content_type = request.headers.get("content-type")
    if content_type is None:
        raise UnsupportedMediaType(
            "no Content-Type header: POST bodies are JSON; send 'Content-Type: application/json'", "Content-Type"
        )
    if _media_type(content_type) != "application/json":
        raise UnsupportedMediaType(
            f"Content-Type {content_type!r} is not accepted: POST bodies are JSON; send "
            "'Content-Type: application/json'",
            "Content-Type",
        )
    try:
        return await read_bounded_body(request, MAX_BODY_BYTES)
    except BodyTooLarge as e:
        raise PayloadTooLarge(str(e), e.field) from None
    except BadContentLength as e:
        raise InvalidRequest(str(e), e.field) from None


JsonBody = Annotated[bytes, Depends(json_body)]


class BearerToken(HTTPBearer):
    """FastAPI's bearer scheme, checking the token itself: one dependency per guarded route (a
    scheme plus a check on top of it was two, and FastAPI resolves each on every request), and
    still a security scheme, so /openapi.json declares it (and /docs can send the token).
    ``why`` says in the 401 why the route needs it."""

    def __init__(self, token: str, why: str):
        # auto_error=False: this class answers, so that a 401 says what is needed in the API's
        # own error shape.
        super().__init__(
            auto_error=False,
            scheme_name="api_token",
            description="The controller's API token (--api-token-file or LMCACHE_API_TOKEN)",
        )
        self._expected = token.encode()
        self._why = why

    async def __call__(self, request: Request) -> None:
        credentials = await super().__call__(request)
        if credentials is None:
            raise Unauthorized(
                f"{request.method} {request.url.path} {self._why}: it needs the controller's API token. Send "
                "'Authorization: Bearer <token>' with the token the controller was started with "
                "(--api-token-file or LMCACHE_API_TOKEN)",
                token_sent=False,
            )
        # Constant time, so the answer's timing does not tell how much of a guess was right.
        if not hmac.compare_digest(credentials.credentials.encode(), self._expected):
            raise Unauthorized(
                f"{request.method} {request.url.path} {self._why}: the bearer token sent is not the controller's "
                "API token",
                token_sent=True,
            )


def _json(obj: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


# A view's build is background work: it hands the loop back after a quarter of what a socket's
# receive loop takes (FAIR_SLICE_S). At 10,000 ranks under four polling clients, a member's
# heartbeat took p50 1.5-1.7 ms and p99 13-15 ms with 2 ms slices; 1.1-1.2 and 9-12 ms with 0.5.
VIEW_SLICE_S = 0.0005


async def _take_steps(steps: Steps[T]) -> T:
    """A view built in steps, a slice of the event loop at a time (FairShare): what else is
    ready (heartbeats, requests) runs between slices."""
    fair = FairShare(VIEW_SLICE_S)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        await fair.turn()


def _as_json(described: dict) -> msgspec.Raw:
    """A view's entry as JSON, encoded as soon as it is built (views.py's Entry says why)."""
    return msgspec.Raw(msgspec.json.encode(described))


def _script_safe(raw: bytes) -> bytes:
    """JSON made safe to place in a <script> element, as jinja's ``tojson`` makes it: <, >, & and '
    written as \\u escapes. They occur in JSON only inside strings, where the escapes mean the same."""
    for char, escape in ((b"<", b"\\u003c"), (b">", b"\\u003e"), (b"&", b"\\u0026"), (b"'", b"\\u0027")):
        raw = raw.replace(char, escape)
    return raw


_STATE_MARK = "\x00initial-state\x00"  # where the page's initial state goes; never in the template


def _page_around_state(templates: jinja2.Environment, version: str) -> tuple[bytes, bytes]:
    """index.html rendered once, in two halves: before and after its initial state."""
    page = templates.get_template("index.html").render(state=Markup(_STATE_MARK), version=version, poll_ms=2000)
    head, tail = page.encode().split(_STATE_MARK.encode())
    return head, tail


def _schema(body_type: type) -> dict:
    (_,), components = msgspec.json.schema_components([body_type], ref_template="#/components/schemas/{name}")
    schema = components[body_type.__name__]
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def create_app(controller: Controller) -> FastAPI:
    # /docs (Swagger UI) and /redoc from files in the package, not a CDN: air-gapped clusters too.
    app = FastAPIOffline(
        title="lmcache-p2p controller",
        version="1",
        description="Chunk index and commands for a mesh of vLLM instances sharing KV cache.",
    )

    @app.exception_handler(ControllerError)
    async def _controller_error(request: Request, exc: ControllerError) -> JSONResponse:
        headers = {"WWW-Authenticate": exc.challenge} if isinstance(exc, Unauthorized) else None
        return JSONResponse(
            {"error": exc.message, "field": exc.field}, status_code=HTTP_STATUS[type(exc)], headers=headers
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not a bad request: logged with its traceback, answered as JSON, never a bare 500.
        logger.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse(
            {"error": f"internal error in {request.url.path}: {type(exc).__name__}: {exc}", "field": None},
            status_code=500,
        )

    views, orchestrator = controller.views, controller.orchestrator
    settings = controller.settings
    # Who may do what. Without a token every route is open, as the seeds' scripts expect. With
    # one, routes that change what the mesh holds need it; reads need it too with protect_reads.
    # The guards are attached only where they apply, so /openapi.json says which routes need it.
    token = settings.api_token
    writes: list[Any] = [Depends(BearerToken(token, "changes state"))] if token else []
    reads: list[Any] = (
        [Depends(BearerToken(token, "is a read, and reads are protected (protect_reads)"))]
        if token and settings.protect_reads
        else []
    )
    reads_protected = bool(reads)

    def post(path: str, body_type: type, summary: str, guard: list[Any]):
        return app.post(path, summary=summary, openapi_extra=_schema(body_type), dependencies=guard)

    # -- reads -------------------------------------------------------------------------------------

    @post("/lookup", LookupRequest, "Which instances hold how much of this token prefix", reads)
    async def lookup(raw: JsonBody) -> Response:
        tokens, body = decode_prompt_body(raw, LookupRequest, _LookupFastPath)
        return _json(views.lookup(tokens, body.model, from_body(body)))

    @post("/explain", ExplainRequest, "Chunk by chunk: who holds this prompt, and why an instance would miss", reads)
    async def explain(raw: JsonBody) -> Response:
        tokens, body = decode_prompt_body(raw, ExplainRequest, _ExplainFastPath)
        return _json(views.explain(tokens, body.instance_id, body.chunk_size, from_body(body)))

    @post("/route", RouteRequest, "Instances ranked by expected time to first token for this prompt", reads)
    async def route(raw: JsonBody) -> Response:
        tokens, body = decode_prompt_body(raw, RouteRequest, _RouteFastPath)
        return _json(views.route(tokens, body.model, body.candidates, from_body(body)))

    # /health and /status ask the workers but change nothing they hold: reads.
    @post("/health", HealthRequest, "Ask every rank of an instance whether it is healthy", reads)
    async def health(raw: JsonBody) -> Response:
        body: HealthRequest = _decode(raw, HealthRequest)
        return _json(await orchestrator.health(body.instance_id))

    @post("/status", HealthRequest, "Ask every rank of an instance for its tiers, link and peer statistics", reads)
    async def status(raw: JsonBody) -> Response:
        body: HealthRequest = _decode(raw, HealthRequest)
        return _json(await orchestrator.status(body.instance_id))

    @post(
        "/check_finish",
        CheckFinishRequest,
        "Status of a command, or of a read, by the event id it answered with",
        reads,
    )
    async def check_finish(raw: JsonBody) -> Response:
        body: CheckFinishRequest = _decode(raw, CheckFinishRequest)
        return _json(views.check_finish(body.event_id))

    @post("/query_worker_info", QueryWorkerInfoRequest, "Registered workers of one instance, or all", reads)
    async def query_worker_info(raw: JsonBody) -> Response:
        body: QueryWorkerInfoRequest = _decode(raw, QueryWorkerInfoRequest)
        return _json(views.query_worker_info(body.instance_id, body.worker_ids))

    @post("/query_instance", QueryInstanceRequest, "The instance whose workers run on this host", reads)
    async def query_instance(raw: JsonBody) -> Response:
        body: QueryInstanceRequest = _decode(raw, QueryInstanceRequest)
        return _json(views.query_instance(body.ip))

    # -- commands that change what the mesh holds --------------------------------------------------

    @post("/move", MoveRequest, "Move (or copy) chunks between instances' locations", writes)
    async def move(raw: JsonBody) -> Response:
        body: MoveRequest = _decode(raw, MoveRequest)
        copy = body.copy or bool(body.should_copy)
        ident = from_body(body)
        return _json(await orchestrator.move(body.old_position, body.new_position, body.tokens, copy, ident))

    @post("/copy", MoveRequest, "Copy chunks between instances' locations (move with copy=true)", writes)
    async def copy(raw: JsonBody) -> Response:
        body: MoveRequest = _decode(raw, MoveRequest)
        ident = from_body(body)
        return _json(await orchestrator.move(body.old_position, body.new_position, body.tokens, True, ident))

    @post("/clear", ClearRequest, "Drop every chunk an instance holds at a location", writes)
    async def clear(raw: JsonBody) -> Response:
        body: ClearRequest = _decode(raw, ClearRequest)
        return _json(await orchestrator.clear(body.instance_id, body.location))

    @post(
        "/pin",
        PinRequest,
        "Pin (or unpin) the chunks of a token prefix against eviction (LocalCPUBackend only)",
        writes,
    )
    async def pin(raw: JsonBody) -> Response:
        body: PinRequest = _decode(raw, PinRequest)
        ident = from_body(body)
        return _json(await orchestrator.pin(body.instance_id, body.location, body.tokens, body.unpin, ident))

    # -- GET views ---------------------------------------------------------------------------------

    # The views that walk every worker (65-190 ms each at 10,000 ranks): built a slice of the loop
    # at a time (views.py's steps, each entry's JSON encoded as it is built), so heartbeats and
    # other requests keep their turns, and at most once per view_cache_s, the bytes shared by
    # every client meanwhile. One build per view at a time: a request finding its view stale waits
    # for the lock, then for the build it missed or its own. A worker joining or leaving (the
    # count changes) rebuilds at once.
    Cached = tuple[tuple, float, bytes]  # (what it was built for, when, the JSON)
    view_cache: dict[str, Cached] = {}
    view_locks = {"workers": asyncio.Lock(), "dashboard": asyncio.Lock()}
    controller.metrics.counter(
        "lmcache_controller_view_builds_total", "GET /controller/workers and /controller/dashboard built (not cached)"
    )

    def _stamp(args: tuple) -> tuple:
        return (*args, len(controller.registry.workers))

    def _fresh(name: str, args: tuple) -> Cached | None:
        hit = view_cache.get(name)
        interval = settings.view_cache_s
        fresh = interval > 0 and hit is not None and hit[0] == _stamp(args) and time.monotonic() - hit[1] < interval
        return hit if fresh else None

    async def _build(name: str, args: tuple, steps: ViewSteps) -> Cached:
        stamp, started = _stamp(args), time.monotonic()  # the age counts from the walk's start
        view = await _take_steps(steps(_as_json))
        view_cache[name] = hit = (stamp, started, msgspec.json.encode(view))
        controller.metrics.inc("lmcache_controller_view_builds_total", view=name)
        return hit

    async def _view(name: str, args: tuple, steps: ViewSteps) -> tuple[bytes, float]:
        """The view's JSON and its age in seconds."""
        hit = _fresh(name, args)
        if hit is None:
            async with view_locks[name]:
                hit = _fresh(name, args) or await _build(name, args, steps)
        return hit[2], time.monotonic() - hit[1]

    async def _cached(name: str, args: tuple, steps: ViewSteps) -> Response:
        body, age = await _view(name, args, steps)
        return Response(body, media_type="application/json", headers={"X-View-Age-S": f"{age:.3f}"})

    def _dashboard_steps(events: int) -> ViewSteps:
        return lambda entry: views.dashboard_steps(events, entry)

    @app.get("/controller/workers", summary="Every worker with status, ports, layout and keys", dependencies=reads)
    async def workers() -> Response:
        return await _cached("workers", (), views.workers_steps)

    @app.get("/controller/key-stats", summary="Keys held per instance and location", dependencies=reads)
    async def key_stats() -> Response:
        return _json(views.key_stats())

    @app.get("/controller/events", summary="Newest command events first", dependencies=reads)
    async def events(limit: int = 100) -> Response:
        return _json({"events": views.recent_events(limit)})

    # /metrics is rendered at most once per (1/METRICS_LOOP_SHARE - 1) times its last render's
    # duration (as the loop ran it, other work's turns included), and at most once per
    # view_cache_s where that is sooner (0: a render per scrape, as for the views): scrapes in
    # between get the last render's text (header X-View-Age-S), and concurrent ones share a render.
    # At 10,000 ranks a render is ~50 ms of the loop in turns, and four clients scraping back to
    # back kept the loop so busy that heartbeats waited whole iterations for theirs. A client that
    # must see the counters of what it just did sends "Cache-Control: no-cache": it gets a render
    # that started after it asked, waiting for the next one the bound allows.
    rendered: list[tuple[float, float, bytes]] = []  # (when the render started, its seconds, text)
    render_lock = asyncio.Lock()
    controller.metrics.counter(
        "lmcache_controller_metrics_renders_total", "GET /metrics rendered (not the text of a scrape just before)"
    )

    def _next_render_at() -> float:
        """When the bound allows the next render (now or earlier: at once)."""
        if not rendered or settings.view_cache_s <= 0:
            return 0.0
        started, took, _ = rendered[0]
        return started + took + min(took * (1 / METRICS_LOOP_SHARE - 1), settings.view_cache_s)

    async def _render_when_allowed(asked: float, fresh: bool) -> None:
        """Under render_lock: a render unless one started since ``asked``; a plain scrape renders
        only if the bound allows it now, a no-cache one waits until it does."""
        if rendered and rendered[0][0] >= asked:
            return
        wait = _next_render_at() - time.monotonic()
        if wait > 0 and not fresh:
            return  # another render ended while this scrape waited for the lock: it has that one
        if wait > 0:
            await asyncio.sleep(wait)
        started = time.monotonic()
        text = await controller.metrics.render_async()
        rendered[:] = [(started, time.monotonic() - started, text)]
        controller.metrics.inc("lmcache_controller_metrics_renders_total")

    @app.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse, dependencies=reads)
    async def metrics(request: Request) -> Response:
        fresh = "no-cache" in request.headers.get("cache-control", "").lower()
        asked = time.monotonic()
        if fresh or asked >= _next_render_at():
            async with render_lock:
                await _render_when_allowed(asked, fresh)
        started, _, text = rendered[0]
        return Response(
            text, media_type=METRICS_CONTENT_TYPE, headers={"X-View-Age-S": f"{time.monotonic() - started:.3f}"}
        )

    @app.get(
        "/controller/dashboard",
        summary="Everything the WebUI shows: overview, rates, instances, events",
        dependencies=reads,
    )
    async def dashboard(events: int = 50) -> Response:
        limit = max(0, min(events, 1000))
        return await _cached("dashboard", (limit,), _dashboard_steps(limit))

    version = webui.asset_version()
    app.mount("/static", StaticFiles(directory=webui.STATIC_DIR), name="static")
    # The page is its two halves around the dashboard's cached JSON (5 MB at 10,000 ranks), joined
    # once per build of it: rendering it per request held the loop tens of milliseconds each time.
    page_head, page_tail = _page_around_state(webui.environment(), version)
    page: list[bytes] = [b"", b""]  # [the state it was made with, the page]

    @app.get("/", include_in_schema=False, response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        # A browser's navigation cannot carry a bearer token, so the page itself is always served.
        # With protect_reads it carries no data: the script asks for the token and fetches it.
        # Otherwise it carries the dashboard the script polls (the default 50 events).
        state = b"null" if reads_protected else (await _view("dashboard", (50,), _dashboard_steps(50)))[0]
        if page[0] is not state:
            page[:] = [state, page_head + _script_safe(state) + page_tail]
        return HTMLResponse(page[1], headers={"Cache-Control": "no-store"})

    return app
