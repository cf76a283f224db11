"""A request body read with a bound: what the controller's API and ``lmcache_router`` both use.

A declared Content-Length over the limit is refused before a byte is read; a chunked body is read
chunk by chunk and refused as soon as it passes the limit, so a 100 MB body costs at most the
limit in memory. (What the client still sends after the refusal is read and dropped by uvicorn.)
Each server turns the two refusals below into its own error shape: 413 for :class:`BodyTooLarge`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the router's flags import the default without loading Starlette
    from starlette.requests import Request

# Why 4 MiB: controller/api.py (MAX_BODY_BYTES). A router's OpenAI body is a prompt as text or ids
# plus sampling fields: the same order of size as the controller's largest, a long prompt's ids.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


class BodyRefused(ValueError):
    """A body not read; ``field`` names the header at fault (None: the body itself)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class BodyTooLarge(BodyRefused):
    """Over the limit, declared (Content-Length) or streamed. ``limit`` is the limit in bytes."""

    def __init__(self, message: str, limit: int, field: str | None = None):
        super().__init__(message, field)
        self.limit = limit


class BadContentLength(BodyRefused):
    """A Content-Length header that is not a number."""


async def read_bounded_body(request: Request, limit: int) -> bytes:
    """``request``'s body, never more than ``limit`` bytes of it in memory."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            length = int(declared)
        except ValueError:
            raise BadContentLength(f"Content-Length {declared!r} is not a number", "Content-Length") from None
        if length > limit:
            raise BodyTooLarge(
                f"body of {length} bytes (Content-Length) is over the limit of {limit} bytes", limit, "Content-Length"
            )
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"body is over the limit of {limit} bytes (stopped reading there)", limit)
        chunks.append(chunk)
    return b"".join(chunks)
