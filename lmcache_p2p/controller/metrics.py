"""The controller's Prometheus metrics, exposed with prometheus-client.

Two kinds of series: counters the controller increments as things happen (labels given at each
increment: ``inc("..._total", kind="move")``), and series read at scrape time from the state
that owns them (the registry's totals, the fleet's traffic, gauges). A counter is typed as a
counter whether it is incremented here or read at scrape time; every name ends in ``_total``.
docs/controller.md lists them.

``GET /metrics`` is rendered on the event loop a family at a time (:meth:`Metrics.render_async`):
at 10,000 ranks the whole text took ~50 ms in one go (the key holders' walk over every rank and
the formatting of a series per instance), a pause every heartbeat and lookup waited out; a family
at a time, they take their turns in between (FairShare, as the views do). A reader that walks
every rank returns a generator instead of its list (:data:`StepReader`): it yields between parts of
its walk, and the render takes turns there too; a plain :meth:`render` runs it through at once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from lmcache_p2p.rpc import FairShare

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (labels, value) per series, read at scrape time
Series = list[tuple[dict[str, str], float]]
# A reader of a long walk: yields (None) between parts of it, returns the series.
StepReader = Generator[None, None, Series]
Reader = Callable[[], "Series | StepReader"]

# The loop's slice for /metrics between other work's turns (as the views' builds), and the series
# of one family written between two offers of a turn.
RENDER_SLICE_S = 0.0005
FORMAT_STEP = 200


_STEP = object()  # where the render may take a turn within a reader's walk


@dataclass
class _One:
    """One family, as prometheus-client's text writer takes a registry: a collect()."""

    family: Metric

    def collect(self) -> Iterator[Metric]:
        yield self.family


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

    async def render_async(self) -> bytes:
        """What :meth:`render` gives, made a family (or a step of a reader's walk) at a time with
        the loop's other work between."""
        fair = FairShare(RENDER_SLICE_S)
        parts = []
        for item in self._families():
            if isinstance(item, Metric):  # else a step of a reader's walk
                for part in _text_in_parts(item):
                    parts.append(part)
                    await fair.turn()
            await fair.turn()
        return b"".join(parts)

    # prometheus-client's Collector interface
    def collect(self) -> Iterator[Metric]:
        for item in self._families():
            if isinstance(item, Metric):
                yield item

    def _families(self) -> Iterator[Metric | object]:
        # Copies: render_async lets other work (which counts) run between the families.
        for name, series in list(self._counters.items()):
            items = list(series.items())
            counter = _family(CounterMetricFamily, name, self._help.get(name, ""), [dict(k) for k, _ in items])
            for label_items, value in items:
                counter.add_metric([v for _, v in label_items], value)
            if not items:
                counter.add_metric([], 0.0)
            yield counter
        for kind, name, help_text, read in list(self._read):
            values = read()
            if isinstance(values, Generator):
                values = yield from _walk(values)
            family = _family(
                CounterMetricFamily if kind == "counter" else GaugeMetricFamily,
                name,
                help_text,
                [labels for labels, _ in values],
            )
            for labels, value in values:
                family.add_metric([labels[k] for k in sorted(labels)], value)
            yield family


def _text_in_parts(family: Metric) -> Iterator[bytes]:
    """A family's text, :data:`FORMAT_STEP` series at a time (a series per instance made 5-10 ms
    of text in one go at 10,000 ranks); each part after the first without the family's header
    (its # HELP and # TYPE lines), so the parts joined are the family's text."""
    samples = family.samples
    for start in range(0, max(1, len(samples)), FORMAT_STEP):
        part = Metric(family.name, family.documentation, family.type, family.unit)
        part.samples = samples[start : start + FORMAT_STEP]
        text = generate_latest(_One(part))
        yield text if start == 0 else text.split(b"\n", 2)[2]


def _walk(steps: StepReader) -> Generator[object, None, Series]:
    """A step reader's series, with a turn offered at each of its steps."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        yield _STEP


def _family(kind, name: str, help_text: str, label_sets: list[dict[str, str]]):
    names = sorted(label_sets[0]) if label_sets else []
    return kind(name, help_text, labels=names)


def _check_counter_name(name: str) -> None:
    if not name.endswith("_total"):
        raise ValueError(f"counter {name!r}: counter names end in _total")
