"""Tenants at the controller: /lookup, /explain, /route, /move and /pin take a request's identity
(cache_salt, lora, lora_id, mm_features) and find exactly the holders of that identity's keys.

A real ``lmcache_controller`` process and stand-in ranks speaking the real protocol
(protocol_client.FakeWorker): each rank admits the keys an engine would make for a request with
that identity (keys.chunk_hashes with identity and mm), and reports its adapters as an engine's
worker does (Register/Heartbeat.adapters).
"""

from __future__ import annotations

import random

import pytest
from protocol_client import CHUNK, CPU, FAST_CONTROLLER, ControllerProcess, FakeWorker, registered_workers, wait_for

from lmcache_p2p.keys import KeyIdentity, MMPlacement, chunk_hashes, salt_tag
from lmcache_p2p.protocol import CommandReply, MoveCommand, PinCommand, unpack_hashes

PROMPT = [random.Random(11).randrange(32_000) for _ in range(4 * CHUNK + 5)]  # 4 whole chunks
X = "0123456789abcdef0123456789abcdef"  # "sql" on one host
Y = "fedcba9876543210fedcba9876543210"  # "sql" on another: other weights
A_SALT = KeyIdentity(cache_salt="tenant-a")
IMAGE = MMPlacement("img-a", 20, 10)  # inside chunk 1 (tokens 16..31)


@pytest.fixture
def controller():
    c = ControllerProcess(*FAST_CONTROLLER).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def shared_controller():
    c = ControllerProcess(*FAST_CONTROLLER).start()
    yield c
    c.stop()


def holders(answer: dict) -> dict[str, int]:
    return {h["instance_id"]: h["matched_tokens"] for h in answer["holders"]}


def test_a_salted_prompt_is_found_only_under_its_salt_and_the_salt_never_shows(controller):
    with registered_workers(controller) as make:
        a, b = make("a"), make("b")
        a.admit_tokens(PROMPT, identity=A_SALT)
        b.admit_tokens(PROMPT)
        wait_for(lambda: controller.holders(PROMPT), what="b's keys")

        plain = controller.api("/lookup", {"tokens": PROMPT})
        assert set(plain) == {"event_id", "layout_info", "holders"}  # today's answer, exactly
        assert holders(plain) == {"b": 4 * CHUNK}

        salted = wait_for(
            lambda: (r := controller.api("/lookup", {"tokens": PROMPT, "cache_salt": "tenant-a"}))["holders"] and r,
            what="a's salted keys",
        )
        assert holders(salted) == {"a": 4 * CHUNK}
        assert salted["identity"] == {"cache_salt": salt_tag("tenant-a")}
        other = controller.post("/lookup", {"tokens": PROMPT, "cache_salt": "tenant-b"})
        assert other.json()["holders"] == [] and other.json()["layout_info"] == {}
        for response in (other, controller.post("/lookup", {"tokens": PROMPT, "cache_salt": "tenant-a"})):
            assert "tenant-" not in response.text

        explained = controller.api("/explain", {"tokens": PROMPT, "instance_id": "b", "cache_salt": "tenant-a"})
        assert explained["usable_tokens"] == 4 * CHUNK  # a peer of b holds it under that salt
        assert [r["status"] for r in explained["runs"]] == ["peer"] and explained["runs"][0]["detail"] == "a"
        assert explained["identity"] == {"cache_salt": salt_tag("tenant-a")}
        cold = controller.api("/explain", {"tokens": PROMPT, "instance_id": "a", "cache_salt": "tenant-b"})
        assert cold["usable_tokens"] == 0 and [r["status"] for r in cold["runs"]] == ["not_held"]


def test_an_adapter_is_resolved_by_what_engines_reported_and_each_instance_by_its_own(controller):
    sql_x = KeyIdentity(lora_name="sql", lora_id=X)
    sql_y = KeyIdentity(lora_name="sql", lora_id=Y)
    with registered_workers(controller) as make:
        a = make("a", adapters={"sql": X})
        b = make("b")  # reports its adapter with a heartbeat, as a worker does after serving it
        make("c", adapters={"sql": X})
        base = make("base")
        assert b.heartbeat(adapters={"sql": Y}).status == "ok"
        a.admit_tokens(PROMPT, identity=sql_x)
        b.admit_tokens(PROMPT, identity=sql_y)
        base.admit_tokens(PROMPT)
        wait_for(lambda: len(controller.api("/lookup", {"tokens": PROMPT, "lora": "sql"})["holders"]) == 2, what="keys")

        answer = controller.api("/lookup", {"tokens": PROMPT, "lora": "sql"})
        assert holders(answer) == {"a": 4 * CHUNK, "b": 4 * CHUNK}
        assert answer["identity"] == {"lora": {"name": "sql", "known": True, "lora_ids": [X, Y]}}  # most common first
        only_x = controller.api("/lookup", {"tokens": PROMPT, "lora": "sql", "lora_id": X})
        assert holders(only_x) == {"a": 4 * CHUNK}
        assert holders(controller.api("/lookup", {"tokens": PROMPT})) == {"base": 4 * CHUNK}

        # c serves sql with X's files: a's chunks are its to pull; b's (same name, other weights) never.
        explained = controller.api("/explain", {"tokens": PROMPT, "instance_id": "c", "lora": "sql"})
        assert [r["status"] for r in explained["runs"]] == ["peer"] and explained["runs"][0]["detail"] == "a"
        on_b = controller.api("/explain", {"tokens": PROMPT, "instance_id": "b", "lora": "sql"})
        assert [r["status"] for r in on_b["runs"]] == ["own"]

        # An adapter nobody reported: nothing can be found, and the answer says why.
        unknown = controller.api("/lookup", {"tokens": PROMPT, "lora": "chat"})
        assert unknown["holders"] == []
        assert unknown["identity"]["lora"] == {"name": "chat", "known": False, "lora_ids": []}
        assert unknown["identity"]["note"] == "adapter 'chat' not reported by any engine"
        unknown_explained = controller.api("/explain", {"tokens": PROMPT, "instance_id": "a", "lora": "chat"})
        assert unknown_explained["usable_tokens"] == 0
        assert unknown_explained["runs"][0]["detail"] == "adapter 'chat' not reported by any engine"

        # A rank that leaves takes its report along.
        b.deregister()
        wait_for(
            lambda: controller.api("/lookup", {"tokens": PROMPT, "lora": "sql"})["identity"]["lora"]["lora_ids"] == [X],
            what="b's adapter forgotten",
        )


def test_multimodal_items_key_the_chunks_from_the_first_image_on(controller):
    with registered_workers(controller) as make:
        a = make("a")
        a.admit_tokens(PROMPT, mm=(IMAGE,))
        body = {"tokens": PROMPT, "mm_features": [{"identifier": "img-a", "offset": 20, "length": 10}]}
        answer = wait_for(lambda: (r := controller.api("/lookup", body))["holders"] and r, what="a's keys")
        assert holders(answer) == {"a": 4 * CHUNK} and answer["identity"] == {"mm_features": 1}
        # The text before the image is keyed as text alone: the first chunk matches a plain prompt.
        assert holders(controller.api("/lookup", {"tokens": PROMPT})) == {"a": CHUNK}
        other_image = {**body, "mm_features": [{"identifier": "img-b", "offset": 20, "length": 10}]}
        assert holders(controller.api("/lookup", other_image)) == {"a": CHUNK}
        moved = {**body, "mm_features": [{"identifier": "img-a", "offset": 22, "length": 10}]}
        assert holders(controller.api("/lookup", moved)) == {"a": CHUNK}


def test_route_ranks_holders_of_the_salted_prefix_only_and_logs_the_salt_as_a_digest():
    controller = ControllerProcess(*FAST_CONTROLLER).start()
    try:
        with registered_workers(controller) as make:
            a, b = make("a"), make("b")
            a.admit_tokens(PROMPT, identity=A_SALT)
            b.admit_tokens(PROMPT)
            wait_for(lambda: controller.holders(PROMPT), what="b's keys")
            wait_for(
                lambda: controller.api("/lookup", {"tokens": PROMPT, "cache_salt": "tenant-a"})["holders"],
                what="a's salted keys",
            )

            def local(answer: dict) -> dict[str, int]:
                return {r["instance_id"]: r["local_tokens"] for r in answer["ranked"]}

            plain = controller.api("/route", {"tokens": PROMPT})
            assert plain["chosen"] == "b" and local(plain) == {"a": 0, "b": 4 * CHUNK} and "identity" not in plain
            salted = controller.api("/route", {"tokens": PROMPT, "cache_salt": "tenant-a"})
            assert salted["chosen"] == "a" and local(salted) == {"a": 4 * CHUNK, "b": 0}
            assert salted["identity"] == {"cache_salt": salt_tag("tenant-a")}
            # Another tenant's request: neither is a holder of its prefix, nor a peer of it.
            other = controller.api("/route", {"tokens": PROMPT, "cache_salt": "tenant-b"})
            assert local(other) == {"a": 0, "b": 0}
            assert all(r["peer_tokens"] == 0 and r["pull_from"] == [] for r in other["ranked"])
            unknown = controller.api("/route", {"tokens": PROMPT, "lora": "chat"})
            assert local(unknown) == {"a": 0, "b": 0} and unknown["identity"]["lora"]["known"] is False
    finally:
        output = controller.stop()
    routed = [line for line in output.splitlines() if "route " in line and "tokens ->" in line]
    assert any(f"identity {salt_tag('tenant-a')}" in line for line in routed), output[-3000:]
    assert any(f"identity {salt_tag('tenant-b')}" in line for line in routed)
    assert any("identity lora=chat (unknown)" in line and "ranked by load" in line for line in routed)
    assert "tenant-a" not in output and "tenant-b" not in output


def test_move_and_pin_name_the_identity_s_chunks_as_the_instance_keys_them(controller):
    sql_x = KeyIdentity(cache_salt="tenant-a", lora_name="sql", lora_id=X)
    with registered_workers(controller) as make:
        a = make("a", adapters={"sql": X})
        b = make("b")
        salted = a.admit_tokens(PROMPT, identity=sql_x)
        wait_for(
            lambda: controller.api("/lookup", {"tokens": PROMPT, "cache_salt": "tenant-a", "lora": "sql"})["holders"],
            what="a's keys",
        )
        a.command_reply = lambda c: CommandReply(event_id=c.event_id, ok=True, pending=isinstance(c, MoveCommand))
        body = {
            "old_position": ["a", CPU],
            "new_position": ["b", CPU],
            "tokens": PROMPT,
            "cache_salt": "tenant-a",
            "lora": "sql",
        }
        moved = controller.api("/copy", body)
        assert moved["num_tokens"] == 4 * CHUNK
        command = wait_for(lambda: next((c for c in a.commands if isinstance(c, MoveCommand)), None), what="move")
        assert unpack_hashes(command.hashes).tolist() == salted
        # Without the salt the same tokens name other keys, which a does not hold.
        plain = controller.api("/copy", {**body, "cache_salt": None, "lora": None})
        assert plain["num_tokens"] == 0
        # b never served sql: its chunks of it cannot be named.
        refused = controller.post("/copy", {**body, "old_position": ["b", CPU], "new_position": ["a", CPU]})
        assert refused.status_code == 409 and "b has not served adapter 'sql'" in refused.json()["error"]

        pinned = controller.api(
            "/pin", {"instance_id": "a", "location": CPU, "tokens": PROMPT, "cache_salt": "tenant-a", "lora": "sql"}
        )
        assert pinned["event_id"]
        pin = wait_for(lambda: next((c for c in a.commands if isinstance(c, PinCommand)), None), what="pin")
        assert unpack_hashes(pin.hashes).tolist() == salted
        explicit = controller.api(
            "/pin", {"instance_id": "b", "location": CPU, "tokens": PROMPT, "lora": "sql", "lora_id": X}
        )
        assert explicit["event_id"]
        pin_b = wait_for(lambda: next((c for c in b.commands if isinstance(c, PinCommand)), None), what="pin on b")
        assert unpack_hashes(pin_b.hashes).tolist() == chunk_hashes(
            PROMPT, CHUNK, identity=KeyIdentity(lora_name="sql", lora_id=X)
        )


@pytest.mark.parametrize(
    "extra, field, says",
    [
        ({"cache_salt": ""}, "cache_salt", "cache_salt is empty"),
        ({"cache_salt": "s" * 1025}, "cache_salt", "invalid"),
        ({"lora": "sql", "lora_id": "not-hex"}, "lora_id", "32 lowercase hex"),
        ({"lora_id": X}, "lora_id", "lora_id needs lora"),
        ({"lora": ""}, "lora", "invalid"),
        ({"mm_features": [{"identifier": "i", "offset": -1, "length": 3}]}, "mm_features", "invalid"),
        ({"mm_features": [{"offset": 1, "length": 3}]}, "mm_features", "invalid"),
        ({"mm_features": [{"identifier": "i", "offset": 1, "length": 3, "extra": 1}]}, "mm_features", "invalid"),
    ],
)
def test_a_bad_identity_field_is_a_422_naming_it_on_every_route(shared_controller, extra, field, says):
    controller = shared_controller
    for path, body in (
        ("/lookup", {"tokens": PROMPT}),
        ("/explain", {"tokens": PROMPT}),
        ("/route", {"tokens": PROMPT}),
        ("/pin", {"instance_id": "a", "location": CPU, "tokens": PROMPT}),
        ("/move", {"old_position": ["a", CPU], "new_position": ["b", CPU], "tokens": PROMPT}),
    ):
        response = controller.post(path, {**body, **extra})
        assert response.status_code == 422, (path, response.text)
        assert response.json()["field"] == field, (path, response.text)
        assert says in response.json()["error"], (path, response.text)


def test_engines_of_two_key_formats_are_told_apart_and_never_paired(controller):
    with registered_workers(controller) as make:
        new = make("new", max_warm_peers=4)
        old = make("old", key_format=1, max_warm_peers=4)
        newer = FakeWorker(controller, "newer", max_warm_peers=4)
        try:
            reply = newer.register()
            assert [p.instance_id for p in reply.peers or []] == ["new"]  # never the old one
            old.admit_tokens(PROMPT)
            wait_for(lambda: controller.holders(PROMPT), what="old's keys")
            explained = controller.api("/explain", {"tokens": PROMPT, "instance_id": "new"})
            assert [r["status"] for r in explained["runs"]] == ["layout_mismatch"]
            assert "key_format 2 vs 1" in explained["runs"][0]["detail"]
            assert "old runs an lmcache-p2p from before key format 2" in explained["runs"][0]["detail"]
            assert explained["cannot_share_with"]["old"][0].startswith("key_format 2 vs 1")
            refused = controller.post(
                "/move", {"old_position": ["old", CPU], "new_position": ["new", CPU], "tokens": PROMPT}
            )
            assert refused.status_code == 409 and "key_format 1 vs 2" in refused.json()["error"]
            offered = new.p2p_lookup(chunk_hashes(PROMPT, CHUNK))
            assert offered.holders == [] and offered.miss_reason == "layout_mismatch"
            assert "key_format" in offered.miss_detail
        finally:
            newer.close()


def test_a_register_with_an_adapters_map_out_of_bounds_is_refused_naming_it(controller):
    for adapters, says in (
        ({"sql": "not-an-id"}, "is not 32 lowercase hex"),
        ({f"a{i}": X for i in range(65)}, "at most 64 adapters"),
        ({"": X}, "printable"),
    ):
        worker = FakeWorker(controller, "bad", adapters=adapters)
        try:
            reply = worker.register()
            assert not reply.ok and "adapters refused" in reply.error and says in reply.error
        finally:
            worker.close()
    with registered_workers(controller) as make:
        ok = make("ok", adapters={"sql": X})
        # A bad map in a heartbeat is dropped; the heartbeat counts and the last good map stays.
        assert ok.heartbeat(adapters={"sql": "bad"}).status == "ok"
        lookup = controller.api("/lookup", {"tokens": PROMPT, "lora": "sql"})
        assert lookup["identity"]["lora"]["lora_ids"] == [X]
