"""The controller's loop stays free at scale (issue 61, item 4): ``/metrics`` is rendered a family
at a time with the loop's other work in between, and the heap is frozen out of the garbage
collector's walks after start-up and after the registry changed size a lot.
benchmarks/bench_controller_scale.py measures what that does to heartbeats at 10,000 ranks."""

from __future__ import annotations

import asyncio
import threading

from fake_fleet import FakeFleet
from prometheus_client.parser import text_string_to_metric_families
from protocol_client import ControllerProcess, wait_for

from lmcache_p2p.controller.heap import FREEZE_CHANGE_MIN
from lmcache_p2p.controller.metrics import Metrics


def _families(text: bytes) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(text.decode())}


def test_metrics_rendered_a_family_at_a_time_give_the_same_text_and_let_other_work_run_between():
    metrics = Metrics()
    metrics.counter("lmcache_test_counted_total", "counted while rendering")
    for i in range(40):
        metrics.counter(f"lmcache_test_c{i}_total", "a counter")
        metrics.inc(f"lmcache_test_c{i}_total", kind="a")

    # A family as big as the key holders' at 10,000 ranks (a series per instance), read as they
    # are: a walk in steps.
    def holders():
        series = []
        for n in range(1250):
            series.append(({"instance_id": f"i{n}"}, n))
            if n % 100 == 99:
                yield
        return series

    metrics.gauge("lmcache_test_holders", "big", holders)

    async def main() -> tuple[bytes, int, bytes]:
        counted = 0

        async def count() -> None:
            nonlocal counted
            while True:  # new series appear while the render walks the counters
                metrics.inc("lmcache_test_counted_total", kind=f"k{counted % 500}")
                counted += 1
                await asyncio.sleep(0)

        task = asyncio.ensure_future(count())
        await asyncio.sleep(0)
        text = await metrics.render_async()
        during = counted
        task.cancel()
        return text, during, await metrics.render_async()

    text, counted_during, quiet = asyncio.run(main())
    # The other task had turns while the text was made (a render in one go leaves it none).
    assert counted_during > 1, counted_during
    families = _families(text)
    assert len(families["lmcache_test_holders"]) == 1250
    assert all(families[f"lmcache_test_c{i}"] for i in range(40))
    # Nothing counting: the same bytes as prometheus-client's whole-registry writer.
    assert quiet == metrics.render()


def test_the_heap_is_frozen_after_start_up_and_again_after_the_registry_grew():
    controller = ControllerProcess("--log-level", "info").start()
    # Read as it comes: 600 registrations at INFO would fill the pipe and stall the controller.
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(controller.proc.stdout), daemon=True)
    reader.start()
    fleet = FakeFleet(controller, FREEZE_CHANGE_MIN + 100, tp=4, prefix="gc")
    try:
        assert controller.metric("lmcache_controller_gc_freezes_total") == 1
        frozen = controller.metric("lmcache_controller_gc_frozen_objects")
        assert frozen > 0
        replies = fleet.register_all(timeout=30)
        assert all(r.ok for r in replies.values())
        # Checked every FREEZE_CHECK_S (5 s): the registry grew by more than FREEZE_CHANGE_MIN.
        wait_for(lambda: controller.metric("lmcache_controller_gc_freezes_total") == 2, 12, "a second freeze")
        assert controller.metric("lmcache_controller_gc_frozen_objects") > frozen
    finally:
        fleet.close()
        controller.stop()
        reader.join(5)
    lines = [line for line in lines if "gc: froze" in line]
    assert len(lines) == 2, lines
    assert "after start-up, 0 ranks registered" in lines[0], lines[0]
    # The check may have come in the middle of the registrations, past FREEZE_CHANGE_MIN of them.
    registered = int(lines[1].split("after the registry changed size, ")[1].split(" ranks registered")[0])
    assert FREEZE_CHANGE_MIN <= registered <= FREEZE_CHANGE_MIN + 100, lines[1]
