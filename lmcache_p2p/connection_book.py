"""Who holds a listener's connections, and whom a newcomer may displace (issue 61).

A cap on open connections alone lets whoever fills it first hold the door: a client that keeps
reopening every connection the server closes kept a legitimate client's ``/health`` unanswered
99% of the time. So a listener keeps a :class:`ConnectionBook`: how many connections each client
address has open, and which connections have not yet proved anything (sent a complete request,
or, on ``lmcache_server`` with a mesh secret, completed the handshake), oldest first. A newcomer
is then judged by :meth:`ConnectionBook.admit`:

* its address already holds ``per_address`` connections: the oldest of *that address's*
  unproved connections makes room for it, or, when all of them are busy, it is refused. One
  address can never take more than its share, whatever else is open;
* the listener holds ``cap`` connections: the oldest unproved connection of anyone makes room,
  or, when every open connection has proved itself, it is refused.

A connection that has sent a request (or authenticated) is never displaced: the room a stranger
takes is always a stranger's, so a flood of connections that say nothing costs the clients that
speak nothing but a reconnect, and a client that connects and speaks at once is served.

:meth:`ConnectionBook.make_room` acts on a verdict for a listener: it names the cap a verdict
meets (the setting that sets it, for the log line) and hands the connection to displace to the
listener's own eviction, so every listener reports a displacement in the same words.

Imports only the standard library: ``lmcache_server`` uses it on a box without the rest.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

C = TypeVar("C", bound=Hashable)
C_contra = TypeVar("C_contra", bound=Hashable, contravariant=True)

# Why a newcomer was refused, or why the connection it displaced was closed.
PER_ADDRESS = "per_address"
AT_CAP = "at_cap"


@dataclass(frozen=True)
class Verdict(Generic[C]):
    """:meth:`ConnectionBook.admit`'s answer. ``reason`` is None when there was room; otherwise
    :data:`PER_ADDRESS` or :data:`AT_CAP`, and ``victim`` the connection to close for the newcomer
    (None: nothing may be displaced, the newcomer is refused)."""

    reason: str | None = None
    victim: C | None = None


class Evict(Protocol[C_contra]):
    """A listener's eviction: closes ``victim``, counts it under ``reason`` (``evicted_at_cap``,
    ``evicted_per_address``) and logs ``why % args``. ``why`` ends inside an open parenthesis (at
    the cap it names) that the listener's line closes with its count, e.g.
    ``"...(--max-connections 1024; 311 closed so far)"``."""

    def __call__(self, victim: C_contra, reason: str, why: str, /, *args: object) -> None: ...


class ConnectionBook(Generic[C]):
    """Open connections by client address; the unproved ones in order of arrival."""

    def __init__(
        self,
        cap: int,
        per_address: int,
        *,
        cap_flag: str = "--max-connections",
        per_address_flag: str = "--max-connections-per-address",
        counted_as: str = "open",
    ):
        if cap < 1 or per_address < 1:
            raise ValueError(f"caps must be >= 1, got cap {cap}, per_address {per_address}")
        self.cap = cap
        self.per_address = per_address
        # For log lines: the settings that set the caps (the one to raise), and the word after the
        # count of open connections ("64 open, the cap ...", "1024 clients, the cap ...").
        self.cap_flag = cap_flag
        self.per_address_flag = per_address_flag
        self.counted_as = counted_as
        self._address: dict[C, str] = {}
        self._open_from: dict[str, int] = {}
        # Insertion-ordered: the first key is the oldest unproved connection.
        self._unproved: dict[C, None] = {}
        self._unproved_from: dict[str, dict[C, None]] = {}

    def __len__(self) -> int:
        return len(self._address)

    def __contains__(self, conn: object) -> bool:
        return conn in self._address

    @property
    def unproved(self) -> int:
        return len(self._unproved)

    def open_from(self, address: str) -> int:
        return self._open_from.get(address, 0)

    def address_of(self, conn: C) -> str | None:
        return self._address.get(conn)

    def admit(self, address: str) -> Verdict[C]:
        """Whether a newcomer from ``address`` may be added, and whom it displaces. Changes
        nothing: the caller closes the victim (:meth:`remove`) and then :meth:`add`\\ s the newcomer."""
        # A per-address cap at or past the whole cap never binds: the whole cap speaks for itself.
        if self.per_address < self.cap and self.open_from(address) >= self.per_address:
            own = self._unproved_from.get(address)
            return Verdict(PER_ADDRESS, next(iter(own)) if own else None)
        if len(self._address) >= self.cap:
            return Verdict(AT_CAP, self.oldest_unproved())
        return Verdict()

    def bound(self, reason: str, address: str) -> tuple[int, str, int]:
        """The cap a verdict's ``reason`` names for a newcomer from ``address``: how many
        connections count against it, the setting that sets it, and its value."""
        if reason == PER_ADDRESS:
            return self.open_from(address), self.per_address_flag, self.per_address
        return len(self._address), self.cap_flag, self.cap

    def make_room(self, address: str, evict: Evict[C]) -> str | None:
        """Judge a newcomer from ``address`` (:meth:`admit`) and act on the verdict: None when it
        may be :meth:`add`\\ ed, after ``evict`` has closed the connection it displaces, if any;
        otherwise the reason it is refused (:data:`PER_ADDRESS` or :data:`AT_CAP`), for the
        caller to close it, count and log."""
        verdict = self.admit(address)
        if verdict.reason is None:
            return None
        if verdict.victim is None:
            return verdict.reason
        held, flag, cap = self.bound(verdict.reason, address)
        if verdict.reason == PER_ADDRESS:
            why = "to admit another from it: the address holds %d, its cap (%s %d"
            evict(verdict.victim, "evicted_per_address", why, held, flag, cap)
        else:
            why = "to admit one from %s: %d " + self.counted_as + ", the cap (%s %d"
            evict(verdict.victim, "evicted_at_cap", why, address, held, flag, cap)
        return None

    def oldest_unproved(self) -> C | None:
        return next(iter(self._unproved), None)

    def add(self, conn: C, address: str) -> None:
        """A new connection: unproved until :meth:`proved`."""
        if conn in self._address:
            return
        self._address[conn] = address
        self._open_from[address] = self._open_from.get(address, 0) + 1
        self._unproved[conn] = None
        self._unproved_from.setdefault(address, {})[conn] = None

    def proved(self, conn: C) -> None:
        """``conn`` sent a request (or authenticated): never displaced from now on."""
        if conn in self._unproved:
            self._forget_unproved(conn, self._address[conn])

    def is_proved(self, conn: C) -> bool:
        return conn in self._address and conn not in self._unproved

    def remove(self, conn: C) -> None:
        """``conn`` is closed (calling it again is harmless)."""
        address = self._address.pop(conn, None)
        if address is None:
            return
        left = self._open_from[address] - 1
        if left:
            self._open_from[address] = left
        else:
            del self._open_from[address]  # no entry kept for an address with nothing open
        if conn in self._unproved:
            self._forget_unproved(conn, address)

    def _forget_unproved(self, conn: C, address: str) -> None:
        del self._unproved[conn]
        own = self._unproved_from[address]
        del own[conn]
        if not own:
            del self._unproved_from[address]
