"""Where bytes stop being UTF-8, in our words.

JSON decoders report invalid UTF-8 in their own ways (msgspec raised UnicodeDecodeError up to
0.22 and a DecodeError since 0.23), so the services that say "not valid UTF-8" check the bytes
themselves once a decode has failed, whatever the decoder raised.
"""

from __future__ import annotations


def utf8_fault(raw: bytes) -> str | None:
    """The first bytes of ``raw`` that are not UTF-8, with their offset and why; None when all are."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"{e.object[e.start : e.end]!r} at byte {e.start} ({e.reason})"
    return None
