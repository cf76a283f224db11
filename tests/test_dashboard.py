"""The Grafana dashboard that ships in dashboards/: every query names metrics a real controller
exports, with the type the query treats it as (rate() of a counter, a gauge read as is)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parent.parent / "dashboards" / "lmcache-p2p-controller.json"
METRIC = re.compile(r"\b(lmcache_[a-z0-9_]+)\b")


def test_every_dashboard_query_names_a_metric_the_controller_exports(controller):
    exported: dict[str, str] = {}
    for family in text_string_to_metric_families(controller.http.get("/metrics").text):
        # a counter family is named without _total; its samples (and queries) carry it
        exported[family.name + ("_total" if family.type == "counter" else "")] = family.type
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert panels
    for panel in panels:
        for target in panel["targets"]:
            expr = target["expr"]
            names = METRIC.findall(expr)
            assert names, (panel["title"], expr)
            for name in names:
                assert name in exported, (
                    f"panel {panel['title']!r} queries {name}, which the controller does not export"
                )
                over_time = re.search(rf"(rate|increase)\(\s*{name}\b", expr) is not None
                assert over_time == (exported[name] == "counter"), (panel["title"], name, exported[name])
