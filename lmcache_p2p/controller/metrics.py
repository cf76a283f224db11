"""The controller's Prometheus metrics, exposed with prometheus-client.

Two kinds of series: counters the controller increments as things happen (labels given at each
increment: ``inc("..._total", kind="move")``), and series read at scrape time from the state
that owns them (the registry's totals, the fleet's traffic, gauges). A counter is typed as a
counter whether it is incremented here or read at scrape time; every name ends in ``_total``.
docs/controller.md lists them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (labels, value) per series, read at scrape time
Reader = Callable[[], list[tuple[dict[str, str], float]]]


class Metrics:
    """The controller's series, collected into a registry of their own (never the process-global
    one: a test or a second controller in one process gets its own)."""

    def __init__(self) -> None:
        self._counters: dict[str, dict[tuple[tuple[str, str], ...], float]] = defaultdict(lambda: defaultdict(float))
        self._help: dict[str, str] = {}
        self._read: list[tuple[str, str, str, Reader]] = []  # (kind, name, help, read)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def counter(self, name: str, help_text: str) -> None:
        """Declare a counter incremented with :meth:`inc`; exported at 0 until then."""
        _check_counter_name(name)
        self._help[name] = help_text
        self._counters[name]  # create, so it is exported

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        self._counters[name][tuple(sorted(labels.items()))] += value

    def total(self, name: str) -> float:
        """A counter summed over all its labels."""
        return sum(self._counters.get(name, {}).values())

    def gauge(self, name: str, help_text: str, read: Reader) -> None:
        """A value that goes up and down, read at scrape time."""
        self._read.append(("gauge", name, help_text, read))

    def read_counter(self, name: str, help_text: str, read: Reader) -> None:
        """A total kept elsewhere (it only grows), read at scrape time."""
        _check_counter_name(name)
        self._read.append(("counter", name, help_text, read))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # prometheus-client's Collector interface
    def collect(self) -> Iterator[Metric]:
        for name, series in self._counters.items():
            counter = _family(CounterMetricFamily, name, self._help.get(name, ""), [dict(k) for k in series])
            for label_items, value in series.items():
                counter.add_metric([v for _, v in label_items], value)
            if not series:
                counter.add_metric([], 0.0)
            yield counter
        for kind, name, help_text, read in self._read:
            values = read()
            family = _family(
                CounterMetricFamily if kind == "counter" else GaugeMetricFamily,
                name,
                help_text,
                [labels for labels, _ in values],
            )
            for labels, value in values:
                family.add_metric([labels[k] for k in sorted(labels)], value)
            yield family


def _family(kind, name: str, help_text: str, label_sets: list[dict[str, str]]):
    names = sorted(label_sets[0]) if label_sets else []
    return kind(name, help_text, labels=names)


def _check_counter_name(name: str) -> None:
    if not name.endswith("_total"):
        raise ValueError(f"counter {name!r}: counter names end in _total")
