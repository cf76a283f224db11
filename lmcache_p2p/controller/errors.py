"""The controller's typed errors: why a request could not be carried out.

The core (monitor, orchestration, views) raises these and knows nothing of HTTP; api.py maps
each kind to its status code and renders ``{"error": message, "field": field}``.
"""

from __future__ import annotations


class ControllerError(Exception):
    """A request the controller cannot carry out. ``message`` names what was wrong; ``field`` is the
    request field to blame, where there is one."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.message, self.field = message, field


class InvalidRequest(ControllerError):
    """The request itself is wrong: a body that does not decode, or a value no state could accept."""


class UnknownInstance(ControllerError):
    """No worker of the named instance (or from the named host) is registered."""


class UnknownEvent(ControllerError):
    """An event id this controller never handed out, or has forgotten."""


class Conflict(ControllerError):
    """A valid request that the mesh as it is cannot carry out (layouts differ, a rank is missing)."""


class CommandRefused(ControllerError):
    """A worker answered a command with a refusal; the message carries the worker's own error."""


class WorkerUnreachable(ControllerError):
    """A worker gave no answer to a command in time, or there is no channel to it."""
