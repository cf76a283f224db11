import os
import sys

import pytest

# Test helpers (protocol_client) import as top-level modules.
sys.path.insert(0, os.path.dirname(__file__))

from instances import InstanceProcess  # noqa: E402
from protocol_client import FAST_CONTROLLER, ControllerProcess  # noqa: E402

from lmcache_p2p.testing import offline_driver  # noqa: E402
from lmcache_p2p.testing.processes import CPU_ENGINE_ENV  # noqa: E402

# vLLM CPU engines in tests: one OpenMP thread each, quiet logs.
ENGINE_ENV = {**CPU_ENGINE_ENV, "VLLM_LOGGING_LEVEL": "WARNING"}


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


@pytest.fixture
def controllers():
    """Start ``lmcache_controller`` processes (``controllers(*flags, env=...)``); all stopped after
    the test. A module whose tests want other flags defines its ``controller`` with this."""
    started: list[ControllerProcess] = []

    def start(*flags: str, env: dict | None = None) -> ControllerProcess:
        proc = ControllerProcess(*flags, env=env).start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
def controller(controllers):
    """A controller with :data:`FAST_CONTROLLER`'s flags."""
    return controllers(*FAST_CONTROLLER)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A tiny random-weight Llama with its own tokenizer, built once per test session."""
    from lmcache_p2p.testing.tiny_model import build

    return build(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    """The tiny model's shape as a Qwen3 (per-head q/k norms before RoPE): blending's other family."""
    from lmcache_p2p.testing.tiny_model import build

    return build(str(tmp_path_factory.mktemp("tiny-qwen3")), family="qwen3")


@pytest.fixture
def engine(tmp_path, tiny_model):
    """Start real vLLM CPU engines (the offline driver) with a config dict; stopped after the test."""
    started: list[InstanceProcess] = []

    def start(
        config: dict,
        name: str = "engine",
        connector: bool = True,
        args: tuple = (),
        env: dict | None = None,
        model: str | None = None,
    ) -> InstanceProcess:
        command = offline_driver.command(model or tiny_model, *args, connector=connector)
        env = {**ENGINE_ENV, **(env or {})}
        proc = InstanceProcess(config, tmp_path, name=name, command=command, env=env).start(timeout=240)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop(timeout=60)


# The remote tier's stores (issue 20), one of each per test module that asks (test_redis_store
# uses redis_servers' per-test fixtures instead).


@pytest.fixture(scope="module")
def lm_server():
    from remote_stores import LmServer

    with LmServer() as server:
        yield server


@pytest.fixture(scope="module")
def shared_redis(tmp_path_factory):
    from redis_servers import RedisServer

    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def shared_redis_cluster(tmp_path_factory):
    from redis_servers import RedisCluster

    with RedisCluster(tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


def _v1_runner_missing() -> str | None:
    """Why engines cannot start here when the run asks for vLLM's Model Runner V1
    (``VLLM_USE_V2_MODEL_RUNNER=0``, run_gpu_paths.sh tests-v1): vLLM 0.34 removed it and stops at
    start-up. None where the run does not ask for it, or this vLLM has it."""
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") != "0":
        return None
    from lmcache_p2p.integration.vllm import compat

    try:
        release = compat.installed_release()
    except ImportError:
        return None
    if compat.has_v1_model_runner(release):
        return None
    return f"VLLM_USE_V2_MODEL_RUNNER=0 asks for Model Runner V1, which {release} does not have"


def pytest_collection_modifyitems(config, items):
    """Under ``pytest -n 2 --dist loadgroup`` (make test), tests that share a module-scoped
    fixture run on one worker: spread over both, each worker set the fixture up for itself (two
    pairs of TP=2 engines at once on two cores starved a holder past its pull timeout; the modules
    that start TP engines share one group, ``tensor_parallel``, for the same reason). Tests that
    start engines are skipped where the run asks for a model runner this vLLM does not have."""
    no_v1 = _v1_runner_missing()
    for item in items:
        if no_v1 is not None and (item.get_closest_marker("engine") or item.get_closest_marker("gpu")):
            item.add_marker(pytest.mark.skip(reason=no_v1))
        fixtures = getattr(item, "_fixtureinfo", None)
        if fixtures is None:
            continue
        shared = any(defs[-1].scope == "module" for defs in fixtures.name2fixturedefs.values() if defs)
        if shared and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


def pytest_configure(config):
    """``--dist loadgroup`` (make test) sends each ``xdist_group`` to one worker by suffixing the
    tests' node ids (``…@group``), which pytest-xdist 3.8 does by setting ``item._nodeid``. Where
    pytest's node id no longer reads that attribute (9.2), the groups are dropped silently: the
    engine modules then start their fleets on both workers at once, and two TP=2 fleets on two
    cores starved a holder past its pull timeout. Stop before any test runs instead."""
    if config.getoption("dist", None) != "loadgroup":
        return
    import xdist
    from _pytest.nodes import Node
    from packaging.version import Version

    if Version(xdist.__version__) > Version("3.8.0"):  # a later xdist may group another way
        return
    reads = getattr(getattr(Node, "nodeid", None), "fget", None)
    if reads is None or "_nodeid" not in reads.__code__.co_names:
        raise pytest.UsageError(
            f"pytest {pytest.__version__} and this pytest-xdist do not group tests under --dist loadgroup "
            "(the node id ignores xdist's group suffix); install the versions in locks/ (make install)"
        )
