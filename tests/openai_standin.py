"""A small, real OpenAI-like engine for the router's tests: a FastAPI app served by uvicorn on a
loopback port, in a thread of the test process.

It speaks the part of vLLM's HTTP API the router touches: ``/tokenize`` (completions' prompt, or
chat messages through a fixed template), ``/v1/completions`` and ``/v1/chat/completions``
(streamed as ``data: {...}`` events ending in ``data: [DONE]``, or whole), ``/v1/models`` and
``/health``. Everything it answers is deterministic (ids and text depend only on the engine's
name and the prompt), so a stream through the router can be compared byte for byte with one
asked directly, and the text says which engine wrote it.

Tokens: one id per whitespace-separated word (a CRC of the word), the same on every engine, as
one model's tokenizer is. :func:`standin_tokens` gives the ids a test must register as chunks.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import zlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lmcache_p2p.testing.ports import free_ports

if TYPE_CHECKING:
    from typing import Self


def standin_tokens(text: str) -> list[int]:
    """The stand-in tokenizer: one id (1000..40999) per whitespace-separated word."""
    return [1000 + zlib.crc32(word.encode()) % 40000 for word in text.split()]


def chat_text(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The stand-in chat template: ``<|role|> content`` per message, then ``<|assistant|>``
    when a generation prompt is asked for. A content list (OpenAI's parts) renders as vLLM's
    "string" format does: one ``<image>`` placeholder per non-text part first, then the texts."""
    text = " ".join(f"<|{m['role']}|> {_content_text(m['content'])}" for m in messages)
    return f"{text} <|assistant|>" if add_generation_prompt else text


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    placeholders = [f"<{p.get('type', 'part')}>" for p in content if p.get("type") != "text"]
    texts = [p.get("text", "") for p in content if p.get("type") == "text"]
    return " ".join([*placeholders, *texts])


class ServedApp:
    """An ASGI app on 127.0.0.1:``port`` (a free one by default), served from a thread."""

    def __init__(self, app: Any, port: int | None = None, lifespan: Literal["on", "off"] = "off"):
        self.port = port or free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            access_log=False,
            lifespan=lifespan,
            timeout_graceful_shutdown=1,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True, name=f"served-{self.port}")

    def start(self, timeout: float = 10.0) -> Self:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise AssertionError(f"server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class StandinEngine(ServedApp):
    """One engine named ``name`` serving ``model``. Knobs a test may set while it runs:
    ``fail_status`` (answer every completion with this status, as an overloaded engine's 503),
    ``api_key`` (require ``Authorization: Bearer <key>`` on /v1/*). ``requests`` records what
    came: (path, JSON body, headers)."""

    def __init__(
        self,
        name: str,
        model: str = "tiny-llama",
        api_key: str | None = None,
        port: int | None = None,
        adapters: tuple[str, ...] = (),
    ):
        """``adapters``: LoRA adapters it serves besides ``model`` (listed in /v1/models with the
        model as their parent, as vLLM lists them)."""
        self.name, self.model, self.api_key = name, model, api_key
        self.adapters = adapters
        self.fail_status: int | None = None
        self.streams_ended: list[str] = []  # per stream: "done", or "cancelled" (the client went away)
        self.requests: list[tuple[str, dict, dict[str, str]]] = []
        super().__init__(self._app(), port)

    def paths(self, path: str) -> list[dict]:
        return [body for p, body, _ in self.requests if p == path]

    def _app(self) -> FastAPI:
        app = FastAPI()
        engine = self

        async def recorded(request: Request) -> dict:
            body = await request.json()
            engine.requests.append((request.url.path, body, dict(request.headers)))
            return body

        def refused(request: Request) -> Response | None:
            if engine.api_key and request.headers.get("authorization") != f"Bearer {engine.api_key}":
                return JSONResponse({"error": {"message": "bad api key", "type": "auth", "code": 401}}, 401)
            return None

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/v1/models")
        async def models(request: Request) -> Response:
            refusal = refused(request)
            if refusal is not None:
                return refusal
            cards = [
                {"id": engine.model, "object": "model", "owned_by": engine.name, "root": engine.model, "parent": None}
            ]
            cards += [
                {"id": a, "object": "model", "owned_by": engine.name, "root": f"/adapters/{a}", "parent": engine.model}
                for a in engine.adapters
            ]
            return JSONResponse({"object": "list", "data": cards})

        @app.post("/tokenize")
        async def tokenize(request: Request) -> Response:
            body = await recorded(request)
            if body.get("model") not in (engine.model, *engine.adapters):
                return JSONResponse({"error": {"message": f"model {body.get('model')!r} not served"}}, 404)
            if "messages" in body:
                text = chat_text(body["messages"], body.get("add_generation_prompt", True))
            else:
                text = body["prompt"]
            tokens = standin_tokens(text)
            return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": 4096})

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await generate(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            return await generate(request, chat=True)

        async def generate(request: Request, chat: bool) -> Response:
            refusal = refused(request)
            if refusal is not None:
                return refusal
            body = await recorded(request)
            if engine.fail_status is not None:
                return JSONResponse({"error": {"message": f"{engine.name} is overloaded"}}, engine.fail_status)
            if body.get("model") not in (engine.model, *engine.adapters):
                return JSONResponse({"error": {"message": f"model {body.get('model')!r} not served"}}, 404)
            text = chat_text(body["messages"]) if chat else body["prompt"]
            if not isinstance(text, str):
                text = json.dumps(text)
            n = int(body.get("max_tokens") or 4)
            words = [f" {engine.name}"] + [f" w{i}" for i in range(1, n)]
            ident = f"{'chatcmpl' if chat else 'cmpl'}-{zlib.crc32(text.encode()):08x}"
            usage = {"prompt_tokens": len(standin_tokens(text)), "completion_tokens": n}
            if not body.get("stream"):
                answer = "".join(words)
                choice: dict[str, Any] = (
                    {"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "length"}
                    if chat
                    else {"index": 0, "text": answer, "finish_reason": "length"}
                )
                return JSONResponse(
                    {
                        "id": ident,
                        "object": "chat.completion" if chat else "text_completion",
                        "created": 0,
                        "model": engine.model,
                        "choices": [choice],
                        "usage": usage,
                    }
                )
            delay = float(body.get("standin_delay_s") or 0.0)

            async def events() -> AsyncIterator[bytes]:
                try:
                    async for event in stream_events():
                        yield event
                except asyncio.CancelledError:
                    engine.streams_ended.append("cancelled")
                    raise
                engine.streams_ended.append("done")

            async def stream_events() -> AsyncIterator[bytes]:
                for word in words:
                    part = {"index": 0, "delta": {"content": word}} if chat else {"index": 0, "text": word}
                    event = {
                        "id": ident,
                        "object": "chat.completion.chunk" if chat else "text_completion",
                        "created": 0,
                        "model": engine.model,
                        "choices": [part],
                    }
                    yield f"data: {json.dumps(event)}\n\n".encode()
                    if delay:
                        await asyncio.sleep(delay)
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        return app
