"""The ``lm://`` protocol between ``lmcache_server`` (:mod:`.server`) and its client (:mod:`.lm_store`).

One TCP connection carries requests and their replies in turn: the client sends a request frame,
the server answers it with one reply frame, in the order the requests came. Every frame, request
or reply, is a fixed header and two length-prefixed sections. Integers are unsigned, network
byte order (``struct``'s ``!``).

Header (24 bytes, :data:`HEADER`)::

    offset  size  field
    ------  ----  -----------------------------------------------------------------------
         0     4  magic     b"LMKV" in every frame: a stray client (HTTP, a port scanner) or a
                            connection out of step is caught at its first frame
         4     1  version   1
         5     1  kind      request: op (1 PUT, 2 GET, 3 EXISTS, 4 HEALTH, 5 CLEAR, 6 AUTH)
                            reply: status (0 OK, 1 ERROR, 2 REFUSED)
         6     2  reserved  0
         8     4  count     items in the batch (see below)
        12     4  meta_len  bytes of the meta section that follows the header
        16     8  data_len  bytes of the data section that follows the meta section
        24        meta      meta_len bytes
                  data      data_len bytes

Per op (``n`` is ``count``; ``u16[n]`` is n u16s back to back; keys are opaque bytes)::

    op      request meta                                request data       OK reply: count, meta, data
    ------  ------------------------------------------  -----------------  ---------------------------------
    PUT     u16[n] key lengths, u64[n] value lengths,   the n values,      items stored; -; -
            the n keys back to back                     back to back
    GET     u16[n] key lengths, the n keys              -                  n; u64[n] value lengths
                                                                           (ABSENT = 2**64-1 where not held);
                                                                           the held values back to back (at
                                                                           most MAX_DATA: past it, absent)
    EXISTS  as GET                                      -                  n; u8[n], 1 where held; -
    HEALTH  - (count 0)                                 -                  fields; u64[fields] in the order of
                                                                           HEALTH_FIELDS (a newer server may
                                                                           append fields; readers ignore them)
    CLEAR   - (count 0)                                 -                  chunks dropped; -; -
    AUTH    count 1 (hello): the client's 32-byte nonce  -                  0; the server's 32-byte nonce; -
            count 2 (proof): the client's 32-byte proof  -                  0; the server's 32-byte proof; -

AUTH (:class:`~lmcache_p2p.remote.auth.LmAuth`): a server started with the mesh secret serves
nothing but AUTH until the connection has proved it holds the secret: hello, then proof, each
answered OK; any other op first, or a proof that does not match, is answered ERROR (a message
naming the mesh secret) and the connection closed. The client checks the server's proof in
turn. A server without a secret answers AUTH with ERROR ("runs without a mesh secret"); a
server older than AUTH, with "unknown op 6". A client without a secret sends no AUTH.

Other replies: ERROR (the request was not served; meta is a UTF-8 message; the server closes
the connection after it, as the stream may be out of step) and REFUSED (PUT only: ``count``
values were stored, the others were larger than the server's whole capacity; meta says which;
the connection stays usable).

Bounds (checked by both sides before anything is allocated, so a bad peer cannot make the other
allocate more than them): a key 1 to :data:`MAX_KEY` bytes, a batch at most :data:`MAX_BATCH`
items, a value at most :data:`MAX_VALUE` bytes, the data section at most :data:`MAX_DATA`, the
meta section no more than its ``count`` can need (:data:`MAX_META` at most), a message at most
:data:`MAX_MESSAGE`. A frame that breaks any of them, or whose sections disagree with each other
(key lengths that do not add up to ``meta_len``, value lengths that do not add up to
``data_len``), raises :class:`ProtocolError`.

Why this shape: the lengths come before the bytes they describe, so a reader can receive each
value straight into memory of its own (``recv_into`` a buffer of that size, ``recv`` with
``MSG_WAITALL``) and a writer can hand the kernel its values as they are (``sendmsg`` of
memoryviews), with no framing copy on either side; 32 MiB chunks are the common case.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MAGIC = b"LMKV"
VERSION = 1
HEADER = struct.Struct("!4sBBHIIQ")

MAX_KEY = 1024
MAX_BATCH = 4096
MAX_VALUE = 1 << 30
# A batch larger than this is split by the client; the server refuses the frame.
MAX_DATA = 16 << 30
MAX_META = MAX_BATCH * (2 + 8 + MAX_KEY)
MAX_MESSAGE = 4096
ABSENT = (1 << 64) - 1

HEALTH_FIELDS = (
    "chunks",
    "bytes",
    "capacity",
    "evictions",
    "clients",
    "hits",
    "misses",
    "puts",
    "refused",
    "malformed",
    "uptime_s",
    "auth_refused",
    # The listener's bounds (issue 61): connections refused on accept (a cap full of connections
    # past their handshake, or no descriptor), closed to admit a newcomer, closed for no handshake
    # in time, closed for an upload under the minimum rate.
    "connections_refused",
    "connections_evicted",
    "handshake_timeouts",
    "slow_uploads",
)


class Op(enum.IntEnum):
    PUT = 1
    GET = 2
    EXISTS = 3
    HEALTH = 4
    CLEAR = 5
    AUTH = 6


# AUTH's count says which step of the handshake a frame is.
AUTH_HELLO = 1
AUTH_PROOF = 2
AUTH_BYTES = 32  # a nonce or a proof (an HMAC-SHA256)


class Status(enum.IntEnum):
    OK = 0
    ERROR = 1
    REFUSED = 2


class ProtocolError(Exception):
    """A frame that breaks the protocol: the connection it came on can no longer be trusted."""


@dataclass(frozen=True)
class Header:
    kind: int  # an Op in a request, a Status in a reply
    count: int
    meta_len: int
    data_len: int


def pack_header(kind: int, count: int = 0, meta_len: int = 0, data_len: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, 0, count, meta_len, data_len)


def unpack_header(buf: bytes | bytearray | memoryview) -> Header:
    """The header in ``buf`` (exactly :data:`HEADER` ``.size`` bytes), bounds checked."""
    magic, version, kind, _reserved, count, meta_len, data_len = HEADER.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): not an lm:// peer")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} is not supported (this side speaks {VERSION})")
    if count > MAX_BATCH:
        raise ProtocolError(f"a batch of {count} items, more than {MAX_BATCH}")
    if meta_len > MAX_META:
        raise ProtocolError(f"a meta section of {meta_len} bytes, more than {MAX_META}")
    if data_len > MAX_DATA:
        raise ProtocolError(f"a data section of {data_len} bytes, more than {MAX_DATA}")
    return Header(kind, count, meta_len, data_len)


def check_request(h: Header) -> Op:
    """The request's op, once the header's sizes fit it (before its sections are read)."""
    try:
        op = Op(h.kind)
    except ValueError:
        raise ProtocolError(f"unknown op {h.kind}") from None
    n = h.count
    if op is Op.PUT:
        low, high = n * (2 + 8 + 1), n * (2 + 8 + MAX_KEY)
    elif op in (Op.GET, Op.EXISTS):
        low, high = n * (2 + 1), n * (2 + MAX_KEY)
    elif op is Op.AUTH:
        if n not in (AUTH_HELLO, AUTH_PROOF):
            raise ProtocolError(f"AUTH step {n} (expected {AUTH_HELLO}, hello, or {AUTH_PROOF}, proof)")
        low = high = AUTH_BYTES
    else:
        low = high = 0
        if n:
            raise ProtocolError(f"{op.name} takes no items (count {n})")
    if not low <= h.meta_len <= high:
        raise ProtocolError(f"{op.name} of {n} items with a meta section of {h.meta_len} bytes (not {low}-{high})")
    if op is not Op.PUT and h.data_len:
        raise ProtocolError(f"{op.name} with a data section ({h.data_len} bytes)")
    return op


def check_key(key: bytes) -> None:
    if not isinstance(key, bytes):
        raise TypeError(f"keys are bytes, not {type(key).__name__}")
    if not 1 <= len(key) <= MAX_KEY:
        raise ValueError(f"a key of {len(key)} bytes (keys are 1-{MAX_KEY} bytes)")


def encode_keys(keys: Sequence[bytes]) -> bytes:
    """GET/EXISTS request meta."""
    for key in keys:
        check_key(key)
    return struct.pack(f"!{len(keys)}H", *map(len, keys)) + b"".join(keys)


def _split_keys(meta: memoryview, count: int, lens: Sequence[int], offset: int) -> list[bytes]:
    if any(not 1 <= n <= MAX_KEY for n in lens):
        raise ProtocolError(f"a key length outside 1-{MAX_KEY}")
    if offset + sum(lens) != len(meta):
        raise ProtocolError(f"{count} keys of {sum(lens)} bytes in all do not fill a meta section of {len(meta)}")
    keys = []
    for n in lens:
        keys.append(bytes(meta[offset : offset + n]))
        offset += n
    return keys


def decode_keys(meta: bytes | bytearray | memoryview, count: int) -> list[bytes]:
    """The keys in GET/EXISTS request meta."""
    view = memoryview(meta)
    if len(view) < 2 * count:
        raise ProtocolError(f"a meta section of {len(view)} bytes cannot hold {count} key lengths")
    return _split_keys(view, count, struct.unpack_from(f"!{count}H", view), 2 * count)


def encode_put_meta(keys: Sequence[bytes], value_lens: Sequence[int]) -> bytes:
    for key in keys:
        check_key(key)
    n = len(keys)
    return struct.pack(f"!{n}H{n}Q", *map(len, keys), *value_lens) + b"".join(keys)


def decode_put_meta(meta: bytes | bytearray | memoryview, count: int, data_len: int) -> tuple[list[bytes], list[int]]:
    """(keys, value lengths) in PUT request meta; the lengths add up to ``data_len``."""
    view = memoryview(meta)
    if len(view) < 10 * count:
        raise ProtocolError(f"a meta section of {len(view)} bytes cannot hold {count} key and value lengths")
    lens = struct.unpack_from(f"!{count}H{count}Q", view)
    key_lens, value_lens = lens[:count], list(lens[count:])
    if any(n > MAX_VALUE for n in value_lens):
        raise ProtocolError(f"a value of {max(value_lens)} bytes, more than {MAX_VALUE}")
    if sum(value_lens) != data_len:
        raise ProtocolError(f"values of {sum(value_lens)} bytes in all in a data section of {data_len}")
    return _split_keys(view, count, key_lens, 10 * count), value_lens


def encode_value_lengths(lens: Sequence[int | None]) -> bytes:
    """GET reply meta."""
    return struct.pack(f"!{len(lens)}Q", *(ABSENT if n is None else n for n in lens))


def decode_value_lengths(meta: bytes, count: int, data_len: int) -> list[int | None]:
    if len(meta) != 8 * count:
        raise ProtocolError(f"a GET reply for {count} keys with a meta section of {len(meta)} bytes")
    lens: list[int | None] = [None if n == ABSENT else n for n in struct.unpack(f"!{count}Q", meta)]
    held = [n for n in lens if n is not None]
    if any(n > MAX_VALUE for n in held):
        raise ProtocolError(f"a value of {max(held)} bytes, more than {MAX_VALUE}")
    if sum(held) != data_len:
        raise ProtocolError(f"values of {sum(held)} bytes in all in a data section of {data_len}")
    return lens


def encode_flags(flags: Sequence[bool]) -> bytes:
    """EXISTS reply meta."""
    return bytes(map(int, flags))


def decode_flags(meta: bytes, count: int) -> list[bool]:
    if len(meta) != count:
        raise ProtocolError(f"an EXISTS reply for {count} keys with a meta section of {len(meta)} bytes")
    if meta.strip(b"\x00\x01"):
        raise ProtocolError("an EXISTS reply with a flag other than 0 or 1")
    return [b == 1 for b in meta]


def encode_health(stats: Mapping[str, int]) -> tuple[int, bytes]:
    """(count, meta) of a HEALTH reply."""
    return len(HEALTH_FIELDS), struct.pack(f"!{len(HEALTH_FIELDS)}Q", *(int(stats[f]) for f in HEALTH_FIELDS))


def decode_health(meta: bytes, count: int) -> dict[str, int]:
    if len(meta) != 8 * count:
        raise ProtocolError(f"a HEALTH reply of {count} fields with a meta section of {len(meta)} bytes")
    # A newer server's extra fields are ignored; an older one's missing ones are absent.
    return dict(zip(HEALTH_FIELDS, struct.unpack(f"!{count}Q", meta), strict=False))


def encode_message(text: str) -> bytes:
    return text.encode("utf-8", "replace")[:MAX_MESSAGE]


def decode_message(meta: bytes) -> str:
    return meta.decode("utf-8", "replace")


def message_frame(status: Status, text: str, count: int = 0) -> bytes:
    """An ERROR or REFUSED reply, whole."""
    body = encode_message(text)
    return pack_header(status, count, len(body)) + body
