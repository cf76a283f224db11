import os
import sys

import pytest

# Test helpers (protocol_client) import as top-level modules.
sys.path.insert(0, os.path.dirname(__file__))

from instances import InstanceProcess  # noqa: E402


@pytest.fixture
def spawn(tmp_path):
    """Start instance processes (``spawn(config, **InstanceProcess kwargs)``); all stopped after the test."""
    started: list[InstanceProcess] = []

    def start(config: dict, **kw) -> InstanceProcess:
        proc = InstanceProcess(config, tmp_path, **kw).start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()
