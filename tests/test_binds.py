"""Nothing binds every interface unless told to: the controller's ZMQ sockets bind where its HTTP
API does (or --monitor-host), a worker's command and P2P sockets bind its advertised host."""

from __future__ import annotations

from instances import instance_config
from protocol_client import ControllerProcess


def listening_addresses(port: int) -> set[str]:
    """Local IPv4 addresses with a socket listening on ``port`` (from /proc/net/tcp)."""
    found = set()
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                found.add(".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


def test_controller_and_worker_sockets_bind_only_their_configured_host(spawn):
    controller = ControllerProcess().start()
    try:
        for port in (controller.pull, controller.reply, controller.heartbeat):
            assert listening_addresses(port) == {"127.0.0.1"}, port
        config = instance_config("lmcache_instance_1", controller)
        spawn(config)
        for port in (*config["lmcache_worker_ports"], *config["p2p_init_ports"], *config["p2p_lookup_ports"]):
            assert listening_addresses(port) == {"127.0.0.1"}, port
    finally:
        controller.stop()


def test_the_controller_binds_every_interface_only_when_asked():
    controller = ControllerProcess("--monitor-host", "0.0.0.0").start()
    try:
        assert listening_addresses(controller.pull) == {"0.0.0.0"}
    finally:
        controller.stop()
