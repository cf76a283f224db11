"""Tenants with real vLLM CPU engines (the offline driver), peers and a controller: the issue's
scenario (engine B with another cache_salt loaded engine A's KV through a peer pull) and its LoRA
twin. What must hold: no KV crosses between requests vLLM's prefix cache would not share, and
KV does cross, with the cold output, where it would."""

from __future__ import annotations

import shutil

import pytest
from conftest import ENGINE_ENV
from instances import InstanceProcess, instance_config
from protocol_client import ControllerProcess, wait_for

from lmcache_p2p.testing import offline_driver

pytestmark = pytest.mark.engine

CHUNK = 256
PROMPT_TOKENS = 700  # two full chunks and a tail vLLM computes itself


@pytest.fixture(scope="module")
def prompt(tiny_model) -> list[int]:
    from lmcache_p2p.testing.tiny_model import sample_prompts

    return sample_prompts(tiny_model, PROMPT_TOKENS, seeds=[31])[0]


def peer_config(name: str, controller: ControllerProcess) -> dict:
    return instance_config(
        name,
        controller,
        chunk_size=CHUNK,
        channel="tcp",
        cpu_gb=0.25,
        enable_async_loading=True,
        extra_config={"lookup_backoff_time": 0.001},
    )


def counts(engine: InstanceProcess) -> tuple[int, int, int]:
    """(retrieved tokens, stored tokens, chunks pulled from peers) so far."""
    status = engine.status()
    return (
        status["engine"]["retrieved_tokens"],
        status["engine"]["stored_tokens"],
        status.get("p2p_client", {}).get("chunks_pulled", 0),  # 0 without peers
    )


def generated(engine: InstanceProcess, prompt: list[int], **identity) -> tuple[list[int], tuple[int, int, int]]:
    """The greedy output for ``prompt`` (with ``cache_salt`` / ``lora``), and what it retrieved,
    stored and pulled."""
    before = counts(engine)
    out = engine.request("generate", prompt_ids=prompt, max_tokens=16, timeout=240, **identity)["token_ids"]
    engine.request("flush")
    after = counts(engine)
    return out, tuple(b - a for a, b in zip(before, after, strict=True))  # type: ignore[return-value]


def lookup_holders(controller: ControllerProcess, prompt: list[int], **identity) -> dict[str, int]:
    answer = controller.api("/lookup", {"tokens": prompt, **identity})
    return {inst: tokens for inst, (_, tokens) in answer["layout_info"].items()}


@pytest.mark.timeout(900)
def test_another_salt_never_loads_a_tenant_s_kv_and_the_same_salt_hits_with_the_cold_output(engine, prompt):
    controller = ControllerProcess().start()
    try:
        a = engine(peer_config("engine-a", controller), name="a")
        b = engine(peer_config("engine-b", controller), name="b")
        cold, (retrieved, stored, _) = generated(a, prompt, cache_salt="tenant-a")
        assert (retrieved, stored) == (0, 2 * CHUNK)
        wait_for(lambda: lookup_holders(controller, prompt, cache_salt="tenant-a"), 15, "A's salted chunks indexed")
        assert lookup_holders(controller, prompt) == {}  # nothing under the plain keys

        # The issue: B serving tenant-b. No KV crosses.
        out_b, (retrieved, stored, pulled) = generated(b, prompt, cache_salt="tenant-b")
        assert (retrieved, pulled, stored) == (0, 0, 2 * CHUNK)
        assert out_b == cold  # the salt does not change the model: B computed the same tokens itself
        wait_for(lambda: lookup_holders(controller, prompt, cache_salt="tenant-b"), 15, "B's salted chunks")
        assert lookup_holders(controller, prompt, cache_salt="tenant-b") == {"engine-b": 2 * CHUNK}
        assert lookup_holders(controller, prompt, cache_salt="tenant-a") == {"engine-a": 2 * CHUNK}
        # A request without a salt finds neither tenant's KV.
        out_plain, (retrieved, _, pulled) = generated(b, prompt)
        assert (retrieved, pulled) == (0, 0) and out_plain == cold

        # The same tenant on B: a peer hit, with A's cold output.
        out_a_on_b, (retrieved, stored, pulled) = generated(b, prompt, cache_salt="tenant-a")
        assert (retrieved, pulled, stored) == (2 * CHUNK, 2, 0)
        assert out_a_on_b == cold
        assert "tenant-a" not in b.log() and "tenant-b" not in b.log()  # salts are never logged
    finally:
        controller.stop()


def _adapter_engine(tmp_path, tiny_model, controller, name: str, adapters: dict[str, str]) -> InstanceProcess:
    """An engine serving LoRA adapters, started in a working directory of its own (its "host")
    whose ``adapters/<name>`` are the given directories' copies."""
    home = tmp_path / f"{name}-host"
    for adapter, source in adapters.items():
        shutil.copytree(source, home / "adapters" / adapter)
    command = offline_driver.command(tiny_model, "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2")
    return InstanceProcess(
        peer_config(name, controller), tmp_path, name=name, command=command, env=dict(ENGINE_ENV), cwd=str(home)
    ).start(timeout=300)


@pytest.mark.timeout(1200)
@pytest.mark.newest_only  # two LoRA engines on two cores: the keys are ours, not vLLM's
def test_two_adapters_and_the_base_model_never_share_and_one_adapter_hits_across_engines(tmp_path, tiny_model, prompt):
    from lmcache_p2p.testing.tiny_model import build_lora

    x, y, z = (build_lora(str(tmp_path / f"lora-{s}"), tiny_model, seed=s) for s in (1, 2, 3))
    sql, chat = {"name": "sql", "id": 1, "path": "adapters/sql"}, {"name": "chat", "id": 2, "path": "adapters/chat"}
    controller = ControllerProcess().start()
    started: list[InstanceProcess] = []
    try:
        # A's sql has X's weights; B's, at the same path string "on another host", Z's. chat is Y on both.
        a = _adapter_engine(tmp_path, tiny_model, controller, "a", {"sql": x, "chat": y})
        started.append(a)
        b = _adapter_engine(tmp_path, tiny_model, controller, "b", {"sql": z, "chat": y})
        started.append(b)

        a_sql, (retrieved_sql, stored_sql, _) = generated(a, prompt, lora=sql)
        a_chat, (retrieved_chat, stored_chat, _) = generated(a, prompt, lora=chat)
        a_base, (retrieved_base, stored_base, _) = generated(a, prompt)
        # Three different outputs, each its own cold run: nothing loaded across adapters.
        assert len({tuple(a_sql), tuple(a_chat), tuple(a_base)}) == 3
        assert (retrieved_sql, retrieved_chat, retrieved_base) == (0, 0, 0)
        assert (stored_sql, stored_chat, stored_base) == (2 * CHUNK,) * 3
        wait_for(lambda: lookup_holders(controller, prompt, lora="chat"), 20, "A's chat chunks and adapter report")

        # B's sql: the same name and path string, other weights. Nothing crosses.
        b_sql, (retrieved, _, pulled) = generated(b, prompt, lora=sql)
        assert (retrieved, pulled) == (0, 0) and b_sql != a_sql
        # B's chat: the same files at the same path: A's chunks are B's to pull, with A's output.
        b_chat, (retrieved, stored, pulled) = generated(b, prompt, lora=chat)
        assert (retrieved, pulled, stored) == (2 * CHUNK, 2, 0) and b_chat == a_chat
        # The base model: A's base chunks, never an adapter's.
        b_base, (retrieved, _, pulled) = generated(b, prompt)
        assert (retrieved, pulled) == (2 * CHUNK, 2) and b_base == a_base
        # Within one engine: a local hit for the adapter that stored it.
        again, (retrieved, _, pulled) = generated(a, prompt, lora=sql)
        assert (retrieved, pulled) == (2 * CHUNK, 0) and again == a_sql

        # The controller knows both sql adapters apart by their ids.
        wait_for(
            lambda: (
                len(controller.api("/lookup", {"tokens": prompt, "lora": "sql"})["identity"]["lora"]["lora_ids"]) == 2
            ),
            20,
            "both sql adapters reported",
        )
        answer = controller.api("/lookup", {"tokens": prompt, "lora": "sql"})
        assert {h["instance_id"] for h in answer["holders"]} == {"a", "b"}
    finally:
        for proc in started:
            proc.stop(timeout=60)
        controller.stop()


# -- images: a tiny vision-language model ------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_vlm(tiny_model, tmp_path_factory) -> str:
    from lmcache_p2p.testing.tiny_model import build_vlm

    return build_vlm(str(tmp_path_factory.mktemp("tiny-idefics3")), tiny_model)


@pytest.mark.timeout(900)
@pytest.mark.newest_only  # the multimodal keys are ours; the floor's vLLM places images alike
def test_an_image_keys_the_chunks_from_its_own_on_and_another_image_never_loads_them(engine, tiny_vlm, prompt):
    """One text, two images at one place, and the first image at another place: only the chunk
    before the image is shared; every run's output is its cold output."""
    import json

    with open(f"{tiny_vlm}/config.json") as f:
        image = json.load(f)["image_token_id"]
    at_300 = [*prompt[:300], image, *prompt[300:699]]  # 700 ids; the image's 7 tokens start in chunk 1
    at_400 = [*prompt[:400], image, *prompt[400:699]]
    config = {"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.25}
    eng = engine(config, name="vlm", model=tiny_vlm, args=("--images", "2"))

    def run(prompt_ids: list[int], seed: int) -> tuple[list[int], int, int]:
        out, (retrieved, stored, _) = generated(eng, prompt_ids, images=[seed])
        return out, retrieved, stored

    first, retrieved, stored = run(at_300, 1)
    assert (retrieved, stored) == (0, 2 * CHUNK)
    second, retrieved, stored = run(at_300, 2)  # another image at the same place
    assert (retrieved, stored) == (CHUNK, CHUNK) and second != first  # the text before it only
    moved, retrieved, stored = run(at_400, 1)  # the first image elsewhere
    assert (retrieved, stored) == (CHUNK, CHUNK)
    again, retrieved, _ = run(at_300, 1)
    assert retrieved == 2 * CHUNK and again == first
    again, retrieved, _ = run(at_300, 2)
    assert retrieved == 2 * CHUNK and again == second
    assert "1 multimodal item(s)" in eng.log()

    cold = engine(config, name="vlm-cold", model=tiny_vlm, args=("--images", "2"), connector=False)
    for prompt_ids, seed, out in ((at_300, 2, second), (at_400, 1, moved)):
        assert cold.request("generate", prompt_ids=prompt_ids, max_tokens=16, images=[seed])["token_ids"] == out
