"""The interface every remote backend implements (:mod:`.connect` picks one for a URL).

A store maps opaque byte keys to opaque byte values. It knows nothing of layouts, checksums or
pages (:mod:`.tier` does). Every call is a batch and costs one round trip per server touched:
a prefix lookup of 40 chunks is one pipelined ``exists``, not 40.

Failures of any kind (refused, reset, timed out, a protocol error) raise
:class:`RemoteUnavailable` with the reason; the tier turns that into a miss and backs off. A
store reconnects by itself on the next call after a failure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from lmcache_p2p.remote.url import RemoteUrl


class RemoteUnavailable(Exception):
    """The store could not answer: the message says why (address, the error, the timeout)."""


class RemoteRefused(RemoteUnavailable):
    """The store is up and answered, but refused the request (a value over its capacity, Redis
    out of memory under ``noeviction``, a value over ``proto-max-bulk-len``): retrying at once
    will not help, and there is no outage to back off from (reads still work)."""


class RemoteStore(Protocol):
    url: RemoteUrl

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Which ``keys`` are held, in order; one round trip (per server touched)."""
        ...

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Each key's value (None where absent), in order; one round trip (per server touched)."""
        ...

    def put(self, items: Sequence[tuple[bytes, bytes | bytearray | memoryview]]) -> None:
        """Store every (key, value); one round trip (per server touched). A store may evict."""
        ...

    def ping(self) -> float:
        """Seconds one round trip took; raises :class:`RemoteUnavailable` when down."""
        ...

    def close(self) -> None: ...
