"""The control image (``make image``; ``make test-deploy`` runs these) as the Helm chart runs it:
podman, user 10001, a read-only root filesystem. A controller in it answers HTTP from the host and
a worker on the host registers and reports chunks over its ZMQ ports; the image carries no torch.
"""

from __future__ import annotations

import subprocess
import uuid

import pytest
from protocol_client import CHUNK, CPU, ControllerProcess, FakeWorker, wait_for

from lmcache_p2p import __version__
from lmcache_p2p.testing.ports import free_ports

pytestmark = pytest.mark.deploy

IMAGE = f"localhost/lmcache-p2p-control:{__version__}"
# As deploy/image/build.sh runs podman here: no systemd for cgroups or a journal, and runc, which
# runs on this VM's hybrid cgroups (crun refuses them). Limits at or below the host's own: without
# CAP_SYS_RESOURCE a container cannot be given podman's default 1M descriptors.
PODMAN = ["podman", "--cgroup-manager=cgroupfs", "--events-backend=file", "--runtime", "runc"]
LIMITS = ["--ulimit", "nofile=16384:16384", "--ulimit", "nproc=4096:4096"]


def in_image(*command: str) -> str:
    """``command`` run in a throw-away container of the image, as the chart runs it; its output."""
    done = subprocess.run(
        [*PODMAN, "run", "--rm", *LIMITS, "--read-only", "--user", "10001", IMAGE, *command],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"{command}: rc {done.returncode}\n{done.stderr[-2000:]}"
    return done.stdout


def test_the_control_image_runs_each_control_process_and_has_no_torch():
    for script in ("lmcache_controller", "lmcache_router", "lmcache_server"):
        assert in_image(script, "--version").strip() == f"{script} (lmcache-p2p) {__version__}"
    found = in_image("python", "-c", "import importlib.util as u; print(u.find_spec('torch'), u.find_spec('vllm'))")
    assert found.split() == ["None", "None"]
    assert in_image("id", "-u").strip() == "10001"


def test_a_controller_in_the_image_serves_the_host_over_http_and_zmq():
    name = f"lmcache-p2p-test-{uuid.uuid4().hex[:8]}"
    http, pull, reply, heartbeat = free_ports(4)
    argv = [
        *PODMAN,
        "run",
        "--rm",
        *LIMITS,
        "--name",
        name,
        "--network",
        "host",
        "--read-only",
        "--user",
        "10001",
        IMAGE,
        "lmcache_controller",
        "--host",
        "127.0.0.1",
        "--port",
        str(http),
        "--monitor-ports",
        f'{{"pull": {pull}, "reply": {reply}, "heartbeat": {heartbeat}}}',
    ]
    controller = ControllerProcess(argv=argv, ports=[http, pull, reply, heartbeat])
    worker = None
    try:
        controller.start()  # (its HTTP port answered: /controller/workers)
        worker = FakeWorker(controller, "inst-on-the-host")
        assert worker.register().ok  # the reply socket
        doc = list(range(100, 100 + 4 * CHUNK))
        worker.admit_tokens(doc)  # the pull socket: the controller indexes what the worker reports
        wait_for(lambda: controller.holders(doc).get("inst-on-the-host") == [CPU, 4 * CHUNK], 15, "the chunks")
        assert worker.heartbeat().status == "ok"  # the heartbeat socket: the controller knows it
        listed = controller.http.get("/controller/workers").json()
        assert "inst-on-the-host" in str(listed)
    finally:
        if worker is not None:
            worker.close()
        controller.stop()
        subprocess.run([*PODMAN, "rm", "--force", "--ignore", name], capture_output=True, timeout=60)
