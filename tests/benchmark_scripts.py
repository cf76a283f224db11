"""A benchmark script loaded as a module, for tests of the parts its figures rest on: the scripts
are not a package (they run as files), so a test imports one by its path."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(path: str) -> ModuleType:
    """``benchmarks/<path>`` (``"bench_blend.py"``, ``"gpu/e2e.py"``) run afresh as a module whose
    name is not ``__main__``, so its ``main()`` does not run."""
    file = BENCHMARKS / path
    spec = importlib.util.spec_from_file_location(file.stem, file)
    assert spec is not None and spec.loader is not None, file
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
