"""Our tiers in the engine's own KV event stream (issue 22, item 4): a router that subscribes to a
vLLM engine's ``--kv-events-config`` ZMQ publisher, as vllm-router's ``kv_aware`` policy and
llm-d's indexer do, sees the chunks we store in the CPU tier and on disk (medium ``CPU`` and
``STORAGE``) as blocks it already knows from the engine's GPU events (the same block hashes and
tokens), and sees them leave when the CPU pool evicts them. A real vLLM CPU OpenAI server, a real
subscriber."""

from __future__ import annotations

import threading

import httpx
import msgspec
import pytest
import zmq
from conftest import ENGINE_ENV
from protocol_client import wait_for

from lmcache_p2p.testing.served_fleet import ServedFleet
from lmcache_p2p.testing.tiny_model import sample_text

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.engine]

CHUNK = 256
KV_BYTES_PER_CHUNK = 2 * 2 * 128 * 4 * CHUNK  # the tiny model: 2 layers, K and V, 128 wide, fp32


class Subscriber:
    """Every KV event batch an engine publishes, decoded with vLLM's own types."""

    def __init__(self, endpoint: str):
        from vllm.distributed.kv_events import KVEventBatch

        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        # Watched until the ZMTP handshake with the publisher is done: the subscription goes out
        # right behind it (a PUB drops whatever it sends before a subscriber has joined).
        self._monitor = self.sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.sub.connect(endpoint)
        self.events: list = []
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        while not self._stop:
            if poller.poll(100):
                *_, payload = self.sub.recv_multipart()
                self.events.extend(self.decoder.decode(payload).events)

    def wait_joined(self, timeout: float = 30.0) -> None:
        """Until the SUB socket has completed its handshake with the engine's publisher."""
        from zmq.utils.monitor import recv_monitor_message

        if not self._monitor.poll(int(timeout * 1000)):
            raise AssertionError(f"the SUB socket did not join the engine's publisher within {timeout} s")
        assert recv_monitor_message(self._monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED

    def of(self, kind: str, medium: str) -> list:
        return [e for e in list(self.events) if type(e).__name__ == kind and e.medium == medium]

    def close(self) -> None:
        self._stop = True
        self.thread.join(5)
        self.sub.disable_monitor()  # on this thread only once the reader's is done with the socket
        self._monitor.close(0)
        self.sub.close(0)
        self.ctx.term()


def test_cpu_and_disk_chunks_are_published_as_the_engines_own_blocks_and_evictions_follow(tiny_model, tmp_path):
    fleet = ServedFleet(
        tmp_path / "fleet",
        tiny_model,
        engines=1,
        # Room for 6 chunks in the CPU pool, so a few more prompts evict the first one's.
        cpu_gb=6 * KV_BYTES_PER_CHUNK / 2**30,
        engine_env=ENGINE_ENV,
        kv_events=True,
        engine_extra={"local_disk": f"file://{tmp_path / 'disk'}/", "max_local_disk_size": 1.0},
    )
    subscriber = None
    try:
        fleet.start()
        subscriber = Subscriber(fleet.kv_event_endpoints[0])
        subscriber.wait_joined()  # before anything is published: a PUB does not queue for latecomers
        url = fleet.engine_urls[0]

        def complete(prompt: str) -> None:
            body = {"model": tiny_model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code == 200

        first = sample_text(700, seed=41)  # 2 full chunks
        tokens = httpx.post(f"{url}/tokenize", json={"model": tiny_model, "prompt": first}, timeout=30).json()["tokens"]
        complete(first)
        stored = wait_for(
            lambda: len(subscriber.of("BlockStored", "CPU")) >= 2 and subscriber.of("BlockStored", "CPU"),
            20,
            "CPU BlockStored events",
        )
        gpu = subscriber.of("BlockStored", "GPU")
        gpu_hashes = [h for e in gpu for h in e.block_hashes]
        blocks_per_chunk = CHUNK // stored[0].block_size
        for i, event in enumerate(stored[:2]):
            # The chunk's blocks are the engine's own: same hashes as its GPU events, same tokens.
            assert event.token_ids == tokens[i * CHUNK : (i + 1) * CHUNK]
            assert len(event.block_hashes) == blocks_per_chunk
            assert event.block_hashes == gpu_hashes[i * blocks_per_chunk : (i + 1) * blocks_per_chunk]
            assert event.parent_block_hash == (gpu_hashes[i * blocks_per_chunk - 1] if i else None)
        # Written behind to disk: the same blocks, on medium STORAGE.
        on_disk = wait_for(
            lambda: len(subscriber.of("BlockStored", "STORAGE")) >= 2 and subscriber.of("BlockStored", "STORAGE"),
            20,
            "STORAGE BlockStored events",
        )
        assert {tuple(e.block_hashes) for e in on_disk[:2]} == {tuple(e.block_hashes) for e in stored[:2]}

        # More prompts than the pool holds: the first prompt's chunks leave the CPU tier.
        for seed in range(5):
            complete(sample_text(700, seed=100 + seed))
        first_blocks = set(stored[0].block_hashes)
        removed = wait_for(
            lambda: [e for e in subscriber.of("BlockRemoved", "CPU") if first_blocks & set(e.block_hashes)],
            20,
            "the first chunk's CPU BlockRemoved",
        )
        assert set(removed[0].block_hashes) == first_blocks
        # ... and not from disk, where they still are.
        assert not [e for e in subscriber.of("BlockRemoved", "STORAGE") if first_blocks & set(e.block_hashes)]
    finally:
        if subscriber is not None:
            subscriber.close()
        fleet.stop()


def test_with_tp_a_chunk_is_stored_once_every_rank_holds_it_and_removed_once_any_rank_evicts_it():
    """The mapper alone, with two TP ranks whose admits arrive in different steps, and a chunk
    the scheduler forgets while it is published (routers must not keep counting it)."""
    from types import SimpleNamespace

    from lmcache_p2p.integration.vllm.kv_events import BlockEventMapper, ChunkStorageEvents

    chunk, block = 4, 2  # 2 blocks per chunk
    mapper = BlockEventMapper(chunk_size=chunk, block_size=block, tp_size=2, max_chunks=2)
    request = SimpleNamespace(
        request_id="r", prompt_token_ids=list(range(100, 112)), block_hashes=[bytes([b]) * 32 for b in range(6)]
    )
    mapper.remember([11, 12, 13], request)  # 3 chunks, room for 2: chunk 11 is forgotten at once
    assert mapper.stats["unknown_chunk"] == 0

    def step(*events):
        carrier = None
        for rank, kind, location, chunk_hash in events:
            part = ChunkStorageEvents([(kind, location, chunk_hash)], rank)
            carrier = part if carrier is None else carrier.merge(part)
        if carrier is not None:
            mapper.take_rank_events(carrier)
        return list(mapper.take_events())

    assert step((0, "admit", "LocalCPUBackend", 12)) == []  # rank 1 has not got it yet
    stored = step((1, "admit", "LocalCPUBackend", 12))
    assert [(type(e).__name__, e.medium, e.token_ids) for e in stored] == [("BlockStored", "CPU", [104, 105, 106, 107])]
    assert stored[0].parent_block_hash is not None and len(stored[0].block_hashes) == 2
    removed = step((1, "evict", "LocalCPUBackend", 12))  # one rank's eviction is enough
    assert [(type(e).__name__, e.block_hashes) for e in removed] == [("BlockRemoved", stored[0].block_hashes)]
    assert step((0, "evict", "LocalCPUBackend", 12)) == []  # already removed: said once

    step((0, "admit", "LocalCPUBackend", 13), (1, "admit", "LocalCPUBackend", 13))
    # A newer prompt pushes chunk 13 out of memory while it is stored: removed, not left behind.
    mapper.remember(
        [21, 22], SimpleNamespace(request_id="s", prompt_token_ids=list(range(8)), block_hashes=[b"x" * 32] * 4)
    )
    assert [type(e).__name__ for e in mapper.take_events()] == ["BlockRemoved"]


def test_a_token_buffer_prompt_is_published_with_its_token_ids_as_a_plain_list():
    """vLLM 0.34 hands the scheduler a TokenBuffer (an array('i'), which msgspec cannot encode):
    a chunk's BlockStored still carries its tokens as a list, the event encodes as vLLM's
    publisher encodes it, and vLLM may grow the buffer after the mapper read it."""
    from types import SimpleNamespace

    from vllm.distributed.kv_events import KVEventBatch
    from vllm034_shapes import TokenBufferLike

    from lmcache_p2p.integration.vllm.kv_events import BlockEventMapper, ChunkStorageEvents

    prompt = TokenBufferLike(range(100, 112))
    request = SimpleNamespace(request_id="r", prompt_token_ids=prompt, block_hashes=[bytes([b]) * 32 for b in range(6)])
    mapper = BlockEventMapper(chunk_size=4, block_size=2, tp_size=1)
    mapper.remember([11, 12, 13], request)
    prompt.extend([1, 2])  # the mapper kept its own copy of the ids, no view of vLLM's buffer
    mapper.take_rank_events(ChunkStorageEvents([("admit", "LocalCPUBackend", 12)], 0))
    (stored,) = mapper.take_events()
    assert stored.token_ids == [104, 105, 106, 107] and type(stored.token_ids) is list
    encoded = msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=[stored]))
    assert msgspec.msgpack.decode(encoded, type=KVEventBatch).events[0].token_ids == [104, 105, 106, 107]
