"""Prometheus text exposition for the controller, without a client library (no extra import)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable


class Metrics:
    """Counters with labels, plus gauges read at scrape time."""

    def __init__(self) -> None:
        self._counters: dict[str, dict[tuple[tuple[str, str], ...], float]] = defaultdict(lambda: defaultdict(float))
        self._help: dict[str, tuple[str, str]] = {}
        self._gauges: list[tuple[str, str, Callable[[], list[tuple[dict[str, str], float]]]]] = []

    def counter(self, name: str, help_text: str) -> None:
        self._help[name] = ("counter", help_text)
        self._counters[name]  # create, so it is exported at 0

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        self._counters[name][tuple(sorted(labels.items()))] += value

    def total(self, name: str) -> float:
        """A counter summed over all its labels."""
        return sum(self._counters.get(name, {}).values())

    def gauge(self, name: str, help_text: str, read: Callable[[], list[tuple[dict[str, str], float]]]) -> None:
        self._gauges.append((name, help_text, read))

    def render(self) -> str:
        lines = []
        for name, series in self._counters.items():
            kind, help_text = self._help.get(name, ("counter", ""))
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            if not series:
                lines.append(f"{name} 0")
            for label_items, value in series.items():
                lines.append(f"{name}{_labels(dict(label_items))} {value:g}")
        for name, help_text, read in self._gauges:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
            for labels, value in read():
                lines.append(f"{name}{_labels(labels)} {value:g}")
        return "\n".join(lines) + "\n"


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{_escape(str(v))}"' for k, v in sorted(labels.items()))
    return "{" + body + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
