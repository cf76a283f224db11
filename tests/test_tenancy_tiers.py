"""Tenants through every tier, on instance processes (the real cache engine, worker, P2P and
storage on a CPU stand-in for an engine's KV, testing/standin.py) and a real controller: a
request's chunks (keyed with its cache_salt, keys.py) are found by another instance only under the
same salt: from a peer, from the shared remote store, from the local disk after a restart, and
after /move. And engines of two key formats never exchange chunks (their hellos are refused).
"""

from __future__ import annotations

import pytest
from instances import instance_config, tokens
from protocol_client import wait_for

from lmcache_p2p.keys import KEY_FORMAT, LayoutFingerprint
from lmcache_p2p.protocol import ChannelHello, encode, peer_reply_decoder

CHUNK = 32
CPU = "LocalCPUBackend"
SALT_A = {"cache_salt": "tenant-a"}
SALT_B = {"cache_salt": "tenant-b"}


def held(controller, prompt, instance_id: str, **identity) -> int:
    answer = controller.api("/lookup", {"tokens": prompt, **identity})
    return answer["layout_info"].get(instance_id, [None, 0])[1]


def test_a_salted_prompt_is_pulled_from_a_peer_only_under_its_salt(controller, spawn):
    a = spawn(instance_config("inst-a", controller, chunk_size=CHUNK))
    b = spawn(instance_config("inst-b", controller, chunk_size=CHUNK))
    prompt = tokens(4 * CHUNK + 3, seed=21)
    assert a.prefill(prompt, **SALT_A) == 4 * CHUNK
    wait_for(lambda: held(controller, prompt, "inst-a", **SALT_A) == 4 * CHUNK, what="a's salted keys")
    assert held(controller, prompt, "inst-a") == 0  # not under the plain keys

    assert b.lookup(prompt, **SALT_B) == 0
    assert b.lookup(prompt) == 0
    assert b.retrieve(prompt, **SALT_B)["retrieved"] == 0
    assert b.status()["p2p_client"]["chunks_pulled"] == 0
    # The same tenant on another engine: a peer hit, byte-exact.
    assert b.lookup(prompt, **SALT_A) == 4 * CHUNK
    got = b.retrieve(prompt, **SALT_A)
    assert got["retrieved"] == 4 * CHUNK and got["exact"]
    assert b.status()["p2p_client"]["chunks_pulled"] == 4


def test_the_remote_store_and_the_disk_serve_a_salted_prompt_only_under_its_salt(
    controller, spawn, lm_server, tmp_path
):
    shared = {"remote_url": lm_server.url, "enable_p2p": False}
    a = spawn(
        instance_config(
            "inst-a",
            controller,
            chunk_size=CHUNK,
            local_disk=f"file://{tmp_path}/a/",
            max_local_disk_size=0.1,
            **shared,
        )
    )
    prompt = tokens(3 * CHUNK, seed=22)
    assert a.prefill(prompt, **SALT_A) == 3 * CHUNK
    a.request("flush")
    wait_for(lambda: a.status()["storage"]["remote"]["chunks_written"] == 3, what="a's remote writes")

    b = spawn(instance_config("inst-b", controller, chunk_size=CHUNK, **shared))
    assert b.lookup(prompt, **SALT_B) == 0 and b.lookup(prompt) == 0
    assert b.status()["storage"]["remote"]["chunks_read"] == 0
    assert b.lookup(prompt, **SALT_A) == 3 * CHUNK
    assert b.retrieve(prompt, **SALT_A)["exact"]
    assert b.status()["storage"]["remote"]["legacy_values_read"] == 0

    # a restarts on its disk alone: its salted chunks come back for that salt only.
    a.stop()
    again = spawn(
        instance_config(
            "inst-a", controller, chunk_size=CHUNK, local_disk=f"file://{tmp_path}/a/", max_local_disk_size=0.1
        ),
        name="inst-a-again",
    )
    assert again.lookup(prompt, peers=False) == 0 and again.lookup(prompt, peers=False, **SALT_B) == 0
    assert again.lookup(prompt, peers=False, **SALT_A) == 3 * CHUNK
    assert again.retrieve(prompt, **SALT_A)["exact"]
    assert again.status()["storage"]["disk"]["legacy_files_read"] == 0


def test_move_carries_a_salted_prompt_s_chunks_and_they_hit_only_under_the_salt(controller, spawn):
    a = spawn(instance_config("inst-a", controller, chunk_size=CHUNK))
    b = spawn(instance_config("inst-b", controller, chunk_size=CHUNK))
    prompt = tokens(3 * CHUNK, seed=23)
    a.prefill(prompt, **SALT_A)
    wait_for(lambda: held(controller, prompt, "inst-a", **SALT_A) == 3 * CHUNK, what="a's salted keys")
    plain = controller.api(
        "/copy", {"old_position": ["inst-a", CPU], "new_position": ["inst-b", CPU], "tokens": prompt}
    )
    assert plain["num_tokens"] == 0  # without its salt the prompt names chunks nobody holds
    answer = controller.api(
        "/copy", {"old_position": ["inst-a", CPU], "new_position": ["inst-b", CPU], "tokens": prompt, **SALT_A}
    )
    assert answer["num_tokens"] == 3 * CHUNK
    assert controller.finish(answer["event_id"])["status"] == "done"
    assert b.lookup(prompt, peers=False) == 0 and b.lookup(prompt, peers=False, **SALT_B) == 0
    assert b.lookup(prompt, peers=False, **SALT_A) == 3 * CHUNK
    assert b.retrieve(prompt, **SALT_A)["exact"]


@pytest.mark.parametrize("old_side", ["holder", "requester"])
def test_engines_of_two_key_formats_refuse_each_other(controller, spawn, old_side):
    """An engine from before key format 2 and an upgraded one never exchange chunks, whichever
    holds them: the controller offers neither to the other, and their hellos are refused."""
    import zmq

    old_env = {"LMCACHE_TEST_KEY_FORMAT": "1"}
    holder_config = instance_config("holder", controller, chunk_size=CHUNK)
    holder = spawn(holder_config, env=old_env if old_side == "holder" else None)
    requester = spawn(
        instance_config("requester", controller, chunk_size=CHUNK), env=old_env if old_side == "requester" else None
    )
    prompt = tokens(2 * CHUNK, seed=24)
    holder.prefill(prompt)  # a plain prompt: the same keys under both formats
    wait_for(lambda: held(controller, prompt, "holder") == 2 * CHUNK, what="the holder's keys")
    offer = requester.request("offer", tokens=prompt)
    assert offer["offered"] == 0 and offer["miss"] == "layout_mismatch" and "key_format" in offer["detail"]
    assert requester.lookup(prompt) == 0 and requester.status()["p2p_client"]["chunks_pulled"] == 0

    # The data plane refuses too, by itself: a hello with the other format's digest of one layout.
    workers = controller.http.get("/controller/workers").json()["workers"]
    holder_digest = int(next(w["fingerprint"] for w in workers if w["instance_id"] == "holder"), 16)
    requester_digest = int(next(w["fingerprint"] for w in workers if w["instance_id"] == "requester"), 16)
    assert holder_digest != requester_digest
    ctx = zmq.Context()
    try:
        hello = ctx.socket(zmq.DEALER)
        hello.connect(f"tcp://127.0.0.1:{holder_config['p2p_init_ports'][0]}")
        hello.send_multipart(
            [
                b"1",
                encode(
                    ChannelHello(
                        instance_id="requester", rank=0, fingerprint=requester_digest, channel="tcp", session="s"
                    )
                ),
            ]
        )
        assert hello.poll(5000)
        _, payload = hello.recv_multipart()
        reply = peer_reply_decoder.decode(payload)
        assert not reply.ok and "layout mismatch" in reply.error
        hello.close(linger=0)
    finally:
        ctx.term()


def test_the_stand_in_s_layouts_of_both_formats_share_their_storage_namespace():
    from lmcache_p2p.testing.standin import MODEL_SHAPES, StandInKV

    kv = StandInKV(MODEL_SHAPES["qwen2.5-0.5b"], 4)
    layout = kv.layout()
    assert layout.key_format == KEY_FORMAT
    old = LayoutFingerprint(**{**{f: getattr(layout, f) for f in layout.__struct_fields__}, "key_format": 1})
    assert old.storage_digest == layout.storage_digest and old.digest != layout.digest
