"""Issue 18: every ZMQ socket of the mesh is authenticated with CurveZMQ keys derived from one
mesh secret, and bounded in the frames it takes.

Real processes and sockets: a real ``lmcache_controller``, stand-in instance processes (the real
worker, P2P and cache engine on a CPU stand-in for Llama-3.1-8B's pages: 32-token chunks of
4 MiB), and strangers speaking the real protocol: a plain socket, one whose keys come from
another secret, and one that knows the mesh's public key but not its secret (ZAP's case).
"""

from __future__ import annotations

import asyncio
import contextlib
import os

import msgspec
import pytest
import zmq
from instances import instance_config, tokens
from protocol_client import CPU as FAKE_CPU
from protocol_client import FAST_CONTROLLER, ControllerProcess, FakeWorker, register_message, wait_for

from lmcache_p2p.config import ConfigError, LMCacheConfig
from lmcache_p2p.keys import chunk_hashes
from lmcache_p2p.mesh_security import MeshSecurity, client_socket, derive_keys
from lmcache_p2p.protocol import (
    ChannelHello,
    ChunkPull,
    ClearCommand,
    FetchChunks,
    HealthCommand,
    PeerAddress,
    command_reply_decoder,
    encode,
    pack_hashes,
    peer_reply_decoder,
)

SECRET = "correct horse battery staple, issue 18"
WRONG_SECRET = "another mesh altogether, issue 18"
CHUNK = 32
CPU = "LocalCPUBackend"
UNAUTHENTICATED = "the mesh is unauthenticated"
STRANGERS = ["plain", "wrong secret", "public key only"]


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "mesh.secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture
def controller(controllers, secret_file):
    # A short worker timeout makes the controller ask for 0.5 s heartbeats.
    return controllers("--mesh-secret-file", str(secret_file), *FAST_CONTROLLER)


def stranger_socket(ctx: zmq.Context, kind: str, port: int) -> zmq.Socket:
    """A DEALER to ``port`` as a stranger of ``kind`` (or ``"member"``: with the mesh secret)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == "member":
        client_socket(sock, MeshSecurity(SECRET))
    elif kind == "wrong secret":
        client_socket(sock, MeshSecurity(WRONG_SECRET))
    elif kind == "public key only":  # the server's key is right; its own keypair is not the mesh's
        public, secret = zmq.curve_keypair()
        sock.curve_serverkey = derive_keys(SECRET).public
        sock.curve_publickey, sock.curve_secretkey = public, secret
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def ask(kind: str, port: int, message, timeout: float | None = None) -> bytes | None:
    """Send ``message`` as ``kind`` and return the answer's payload, or None when none came."""
    if timeout is None:  # a member's answer may take a while on a busy machine; a stranger's never comes
        timeout = 10.0 if kind == "member" else 1.0
    ctx = zmq.Context()
    try:
        sock = stranger_socket(ctx, kind, port)
        sock.send_multipart([b"\x01" * 8, encode(message)])
        if not sock.poll(int(timeout * 1000)):
            return None
        return sock.recv_multipart()[1]
    finally:
        ctx.destroy(linger=0)


def vm_kib(pid: int, field: str) -> int:
    """A /proc/<pid>/status memory figure (VmRSS, VmHWM: the peak RSS) in KiB."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def keys_at(controller, instance_id: str) -> int:
    return controller.http.get("/controller/key-stats").json()["instances"].get(instance_id, {}).get(CPU, 0)


# -- the controller -----------------------------------------------------------------------------------


def test_strangers_cannot_register_heartbeat_or_report_keys(secret_file):
    # The default worker timeout (30 s): the member is silent while the strangers try.
    controller = ControllerProcess("--mesh-secret-file", str(secret_file)).start()
    member = FakeWorker(controller, "member", security=MeshSecurity(SECRET))
    strangers: list[FakeWorker] = []
    try:
        assert member.register().ok
        held = tokens(4 * 16, seed=1)
        member.admit_tokens(held)
        wait_for(lambda: controller.holders(held).get("member") == [FAKE_CPU, 64], what="the member's keys")

        for kind in ("plain", "wrong secret"):
            # It claims to be the member: without the mesh secret, the claim never arrives.
            stranger = FakeWorker(
                controller, "member", security=MeshSecurity(WRONG_SECRET) if kind == "wrong secret" else None
            )
            strangers.append(stranger)
            for sock in (stranger.req, stranger.hb, stranger.push):
                # No handshake, no connection: a send would wait for one for ever.
                sock.setsockopt(zmq.SNDTIMEO, 1500)
            assert unanswered(stranger.register, timeout=1.5)
            stranger.epoch = member.epoch
            assert unanswered(stranger.heartbeat, timeout=1.5)
            stranger.seq = dict(member.seq)
            with contextlib.suppress(zmq.Again):  # queued, or refused at once: either way it must not land
                stranger.events(
                    FAKE_CPU, admitted=chunk_hashes(tokens(2 * 16, seed=2), 16), evicted=chunk_hashes(held, 16)
                )
        assert (
            ask("public key only", controller.reply, register_message("intruder", worker_port=1, locations=[FAKE_CPU]))
            is None
        )

        # The member's next batch arrives and is applied; the strangers' (same worker, same
        # sequence number) never did: its keys are all there, and none of theirs.
        fresh = tokens(3 * 16, seed=3)
        member.admit_tokens(fresh)
        wait_for(lambda: controller.holders(fresh).get("member") == [FAKE_CPU, 48], what="the member's next batch")
        assert controller.holders(held).get("member") == [FAKE_CPU, 64]
        assert "member" not in controller.holders(tokens(2 * 16, seed=2))
        assert member.heartbeat().status == "ok"
        assert controller.metric("lmcache_controller_bad_frames_total", socket="reply") == 0
    finally:
        for worker in [member, *strangers]:
            worker.close()
        log = controller.stop()
    assert UNAUTHENTICATED not in log
    assert "ZMQ sockets authenticated: CurveZMQ, mesh key" in log
    # Rate-limited: each stranger retried its handshake every 0.1 s for seconds; one line a socket.
    assert log.count("on controller reply socket") == 1, log
    assert log.count("on controller heartbeat socket") == 1, log
    assert "on controller pull socket" in log
    assert "connection(s) from 127.0.0.1" in log and "ZAP refused its client key" in log


def unanswered(call, **kw) -> bool:
    """True when ``call(**kw)`` (a FakeWorker request) got no reply: its send found no connection
    to go out on (zmq.Again), or no answer came (the FakeWorker's AssertionError)."""
    try:
        call(**kw)
    except zmq.Again:
        return True
    except AssertionError as e:
        return "no reply" in str(e)
    return False


@pytest.mark.parametrize("secured", [True, False], ids=["secured", "plain"])
def test_an_oversized_frame_is_refused_without_growing_the_controller(tmp_path, secured):
    """64 MiB to the reply socket (bound: 4 MiB): ZMQ drops the connection before allocating it."""
    flags = ("--mesh-secret-file", str(_write(tmp_path / "s", SECRET))) if secured else ()
    controller = ControllerProcess(*flags).start()
    ctx = zmq.Context()
    worker = None
    try:
        peak = vm_kib(controller.proc.pid, "VmHWM")
        sock = stranger_socket(ctx, "member" if secured else "plain", controller.reply)
        sock.send_multipart([b"\x01" * 8, bytes(64 * 2**20)])
        assert not sock.poll(2000), "the controller answered a 64 MiB request"
        grew = vm_kib(controller.proc.pid, "VmHWM") - peak
        assert grew < 16 * 1024, f"the controller's peak RSS grew by {grew} KiB"
        # It goes on answering, the sender included once it sends what fits.
        worker = FakeWorker(controller, "after", security=MeshSecurity(SECRET) if secured else None)
        assert worker.register().ok
        sock.send_multipart([b"\x02" * 8, b"\xc1 not msgpack"])
        assert sock.poll(5000), "no answer to a small request after the big one"
        assert controller.metric("lmcache_controller_bad_frames_total", socket="reply") == 1  # the small one
    finally:
        if worker is not None:
            worker.close()
        ctx.destroy(linger=0)
        controller.stop()


def _write(path, text: str):
    path.write_text(text)
    return path


# -- workers ------------------------------------------------------------------------------------------


def test_a_worker_takes_commands_hellos_and_pulls_from_members_only(controller, spawn, secret_file):
    config = instance_config(
        "lmcache_instance_1", controller, "tcp", chunk_size=CHUNK, mesh_secret_file=str(secret_file)
    )
    a = spawn(config)
    prompt = tokens(3 * CHUNK, seed=11)
    a.prefill(prompt)
    wait_for(lambda: keys_at(controller, "lmcache_instance_1") == 3, what="A's keys")
    worker_port, init_port, lookup_port = (
        config[key][0] for key in ("lmcache_worker_ports", "p2p_init_ports", "p2p_lookup_ports")
    )
    hashes = pack_hashes(chunk_hashes(prompt, CHUNK))
    source = PeerAddress(
        instance_id="lmcache_instance_1", rank=0, location=CPU, host="127.0.0.1", p2p_init_port=1, p2p_lookup_port=2
    )
    for kind in STRANGERS:
        assert ask(kind, worker_port, ClearCommand(event_id="x", location=CPU)) is None, kind
        hello = ChannelHello(instance_id="x", rank=0, fingerprint=1, channel="tcp", session=f"stranger {kind}")
        assert ask(kind, init_port, hello) is None, kind
        assert ask(kind, lookup_port, ChunkPull(session="s", fingerprint=1, hashes=hashes)) is None, kind
        fetch = FetchChunks(event_id="x", source=source, location=CPU, hashes=hashes, fingerprint=1)
        assert ask(kind, lookup_port, fetch) is None, kind
    assert a.status()["storage"]["cpu"]["chunks"] == 3  # the ClearCommands never arrived

    # A member is answered on every socket (the hello with its layout's refusal: it reached A).
    health = ask("member", worker_port, HealthCommand(event_id="h"))
    assert health is not None and command_reply_decoder.decode(health).ok
    reply = ask("member", init_port, ChannelHello(instance_id="m", rank=0, fingerprint=1, channel="tcp", session="m"))
    assert reply is not None and "layout mismatch" in peer_reply_decoder.decode(reply).error
    reply = ask("member", lookup_port, ChunkPull(session="unknown", fingerprint=1, hashes=hashes))
    assert reply is not None and "unknown session" in peer_reply_decoder.decode(reply).error
    # So is the controller, whose command clients take the keys from their context.
    assert controller.api("/health", {"instance_id": "lmcache_instance_1"})["error_codes"] == {"0": 0}
    cleared = controller.api("/clear", {"instance_id": "lmcache_instance_1", "location": CPU})
    assert cleared["num_tokens"] == 3 * CHUNK and a.status()["storage"]["cpu"]["chunks"] == 0

    mesh = a.status()["mesh"]
    assert mesh["authenticated"] and mesh["refused"] >= 2 * len(STRANGERS), mesh
    log = a.log()
    assert UNAUTHENTICATED not in log and "CurveZMQ with mesh key" in log
    assert "the CURVE handshake failed" in log and "ZAP refused its client key" in log


@pytest.mark.parametrize("channel", ["tcp", "nixl"])
def test_members_with_the_secret_pull_from_each_other(controller, spawn, secret_file, channel):
    a, b = (
        spawn(
            instance_config(
                f"lmcache_instance_{i}",
                controller,
                channel,
                chunk_size=CHUNK,
                mesh_secret_file=str(secret_file),
                p2p_pull_policy="always",
            )
        )
        for i in (1, 2)
    )
    prompt = tokens(4 * CHUNK, seed=12)
    a.prefill(prompt)
    wait_for(lambda: controller.holders(prompt).get("lmcache_instance_1") == [CPU, 4 * CHUNK], what="A's keys")
    assert b.lookup(prompt) == 4 * CHUNK
    assert b.retrieve(prompt)["exact"]
    status = b.status()
    assert status["effective_channel"] == channel and status["p2p_client"]["pull_failures"] == 0
    assert status["mesh"]["authenticated"] and status["mesh"]["refused"] == 0
    assert a.status()["mesh"]["key"] == status["mesh"]["key"]


@pytest.mark.parametrize(
    ("secret", "says"),
    [
        (None, "it requires a mesh secret and this process has none"),
        (WRONG_SECRET, "it runs with another mesh secret than this process"),
    ],
    ids=["no secret", "another secret"],
)
def test_an_instance_with_another_secret_or_none_is_refused_and_says_so(controller, spawn, tmp_path, secret, says):
    extra = {"mesh_secret_file": str(_write(tmp_path / "other.secret", secret))} if secret else {}
    a = spawn(instance_config("lmcache_instance_1", controller, "tcp", chunk_size=CHUNK, **extra))
    wait_for(lambda: "handshake(s) with" in a.log(), 15, "the instance to report the refused handshake")
    log = a.log()
    assert says in log and "controller pull socket" in log
    assert log.count(UNAUTHENTICATED) == (0 if secret else 1)
    assert not a.status()["registered"]
    assert "lmcache_instance_1" not in controller.http.get("/controller/workers").text


# -- without a secret ---------------------------------------------------------------------------------


def test_without_a_secret_the_mesh_runs_as_before_and_says_so_once(spawn):
    controller = ControllerProcess("--worker-timeout", "3", "--health-check-interval", "0.5").start()
    fake = None
    try:
        a, b = (
            spawn(
                instance_config(f"lmcache_instance_{i}", controller, "tcp", chunk_size=CHUNK, p2p_pull_policy="always")
            )
            for i in (1, 2)
        )
        prompt = tokens(2 * CHUNK, seed=13)
        a.prefill(prompt)
        wait_for(lambda: keys_at(controller, "lmcache_instance_1") == 2, what="A's keys")
        assert b.lookup(prompt) == 2 * CHUNK and b.retrieve(prompt)["exact"]
        fake = FakeWorker(controller, "plain")  # plain sockets, as before
        assert fake.register().ok and fake.heartbeat().status == "ok"
        for proc in (a, b):
            assert proc.log().count(UNAUTHENTICATED) == 1
            assert proc.status()["mesh"] == {"authenticated": False}
    finally:
        if fake is not None:
            fake.close()
        log = controller.stop()
    assert log.count(UNAUTHENTICATED) == 1, log
    assert "--mesh-secret-file PATH" in log


# -- bounded hellos -------------------------------------------------------------------------------------


def _hello(page_bytes: int, metadata: bytes, **fields) -> ChannelHello:
    values = dict(
        instance_id="requester",
        rank=0,
        fingerprint=1,
        channel="nixl",
        session="requester-session",
        agent_metadata=metadata,
        page_bytes=page_bytes,
        num_pages=16,
    )
    values.update(fields)
    return ChannelHello(**values)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"num_pages": 2**24}, "num_pages=16777216"),
        ({"num_pages": -1}, "num_pages=-1"),
        ({"staging_slots": 2**20}, "staging_slots=1048576"),
        ({"agent_metadata": bytes(5 * 2**20)}, f"agent_metadata={5 * 2**20}"),
        ({"pool_base": 2**64 - 4096}, "pool_base="),
    ],
    ids=["2^24 pages", "negative pages", "2^20 slots", "5 MiB metadata", "pool past 2^64"],
)
def test_a_nixl_hello_beyond_any_real_pool_is_refused_naming_the_field(fields, named):
    """A holder refuses before it sizes anything by the hello: 2^24 pages once cost +885 MB."""
    pytest.importorskip("nixl._api")
    from lmcache_p2p.storage.memory import PagePool
    from lmcache_p2p.transfer import TransferError
    from lmcache_p2p.transfer.nixl_transport import NixlTransport

    page = 64 * 1024
    holder = NixlTransport(PagePool(page, 16 * page, pin_memory=False), f"holder-{os.getpid()}")
    requester = NixlTransport(PagePool(page, 16 * page, pin_memory=False), f"requester-{os.getpid()}")
    try:
        real = requester.hello("requester", 0, 1)  # its agent's metadata and its pool, as sent
        peak = vm_kib(os.getpid(), "VmHWM")
        with pytest.raises(TransferError, match=named):
            asyncio.run(holder.accept(msgspec.structs.replace(real, **fields)))
        assert vm_kib(os.getpid(), "VmHWM") - peak < 32 * 1024
        assert asyncio.run(holder.accept(real)) is False  # the same requester as it is: accepted
    finally:
        holder.close()
        requester.close()


def test_a_tcp_hello_is_bounded_the_same_way():
    from lmcache_p2p.storage.memory import PagePool
    from lmcache_p2p.transfer import TcpTransport, TransferError

    holder = TcpTransport(PagePool(4096, 4 * 4096, pin_memory=False), "holder")
    try:
        with pytest.raises(TransferError, match="num_pages=16777216"):
            asyncio.run(holder.accept(_hello(4096, b"", channel="tcp", num_pages=2**24)))
    finally:
        holder.close()


# -- configuration ----------------------------------------------------------------------------------------


def test_a_missing_secret_file_is_a_config_error_naming_the_key(tmp_path):
    missing = tmp_path / "nowhere.secret"
    with pytest.raises(ConfigError, match=r"^mesh_secret_file='.*nowhere\.secret' \(from .*\): file not found") as e:
        LMCacheConfig.load({"LMCACHE_MESH_SECRET_FILE": str(missing)})
    assert e.value.key == "mesh_secret_file"
    short = _write(tmp_path / "short.secret", "too short\n")
    with pytest.raises(ConfigError, match="mesh_secret_file=.*at least 16"):
        LMCacheConfig.from_dict({"mesh_secret_file": str(short)})
    with pytest.raises(ConfigError, match=r"^mesh_secret \(from env LMCACHE_MESH_SECRET\): is 9 character") as e:
        LMCacheConfig.load({"LMCACHE_MESH_SECRET": "too short"})
    assert "too short" not in str(e.value)  # a secret is never shown, even a bad one
    config = LMCacheConfig.load({"LMCACHE_MESH_SECRET": f" {SECRET}\n"})
    assert config.resolved_mesh_secret() == SECRET and SECRET not in repr(config)
    assert config.to_dict()["mesh_secret"] == "<set>"
