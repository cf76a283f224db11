"""Many worker ranks in one process, each with the worker's real controller links and nothing
else: ``python -m lmcache_p2p.testing.link_fleet``. Every rank runs
:class:`~lmcache_p2p.worker.links.ControllerLinks` (one :class:`~lmcache_p2p.worker.link.ControllerLink`
per controller: register, heartbeats, key events, the re-sync after a controller restart, the
peer-lookup failover) over a :class:`HashStore` (chunk hashes, no KV pages) and answers the
controller's probe of its command port. So a benchmark gets hundreds of ranks speaking the
worker's protocol to real controllers for a few MiB each, where a real worker costs a process.

Rank ``r``'s keys are the chunks of its prompts (:func:`prompt_tokens`), so ``/lookup`` and an
engine's peer lookup of those prompts find them. The ranks register with the layout of the
stand-in engine (:mod:`lmcache_p2p.testing.standin`) of ``--model``: a stand-in engine's peer
lookup is answered with these ranks as holders.

Process protocol (:mod:`lmcache_p2p.testing.jsonlines`): ``admit`` (every rank stores its
prompts' chunks: key events to every controller), ``status`` (per controller: ranks
registered, and the links' counters summed), ``quit``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import threading
from collections.abc import Coroutine
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from lmcache_p2p.keys import ChunkKey, LayoutFingerprint, chunk_hash_array
from lmcache_p2p.storage.chunk_store import StorageEventQueue
from lmcache_p2p.testing import jsonlines
from lmcache_p2p.vocab import CPU, StorageEvent
from lmcache_p2p.worker.identity import WorkerIdentity
from lmcache_p2p.worker.link import ControllerLink
from lmcache_p2p.worker.links import ControllerLinks

logger = logging.getLogger(__name__)

VOCAB = 32000


def prompt_tokens(rank: int, prompt: int, chunks: int, chunk_size: int) -> np.ndarray:
    """Rank ``rank``'s prompt number ``prompt``: ``chunks`` full chunks of token ids, the same in
    every process (the benchmark asks about them, this fleet holds them)."""
    return np.random.default_rng([rank, prompt]).integers(0, VOCAB, chunks * chunk_size, dtype=np.int32)


class HashStore:
    """What a ControllerLink reads of a ChunkStore, over chunk hashes alone: its locations,
    the hashes held at one (a re-sync's key set), and a queue of admits per reader."""

    locations = [CPU]

    def __init__(self, fingerprint: int):
        self.fingerprint = fingerprint
        self.keys = np.zeros(0, dtype=np.uint64)
        self._queues: tuple[StorageEventQueue, ...] = ()

    def record_events(self) -> StorageEventQueue:
        queue = StorageEventQueue()
        self._queues = (*self._queues, queue)
        return queue

    def held_hashes(self, location: str) -> np.ndarray:
        if location != CPU:
            raise ValueError(f"no tier {location!r} here")
        return self.keys

    def admit(self, hashes: np.ndarray) -> None:
        """Store ``hashes`` (called on the links' loop, as a store's events are drained there)."""
        self.keys = np.concatenate([self.keys, hashes])
        for h in hashes.tolist():
            event = StorageEvent("admit", CPU, ChunkKey(self.fingerprint, h))
            for queue in self._queues:
                queue.put(event)


class CommandPorts:
    """One ROUTER bound to a port per rank: the controller's probe of a rank's command port
    completes its handshake (the one thing these ranks need of it; commands are not read)."""

    def __init__(self, ctx: zmq.asyncio.Context, ranks: int):
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.ports = [self.sock.bind_to_random_port("tcp://127.0.0.1") for _ in range(ranks)]

    def close(self) -> None:
        self.sock.close(linger=0)


class LinkFleet:
    """``ranks`` ranks (instances ``{prefix}-{n}`` of one rank each), each with links to every
    controller in ``pull_urls``/``reply_urls`` and the chunks of ``prompts`` prompts."""

    def __init__(
        self,
        ranks: int,
        prompts: int,
        chunks: int,
        chunk_size: int,
        layout: LayoutFingerprint,
        pull_urls: list[str],
        reply_urls: list[str],
        heartbeat_s: float,
        flush_s: float,
        prefix: str = "fleet",
    ):
        self.prompts, self.chunks, self.chunk_size = prompts, chunks, chunk_size
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="link-fleet", daemon=True).start()
        self.ctx = zmq.asyncio.Context()
        self.ctx.set(zmq.MAX_SOCKETS, 8 * ranks * len(reply_urls) + 256)
        self.stores = [HashStore(layout.digest) for _ in range(ranks)]
        self.links: list[ControllerLinks] = []

        async def build() -> None:
            self.ports = CommandPorts(self.ctx, ranks)
            for n, store in enumerate(self.stores):
                port = self.ports.ports[n]
                me = WorkerIdentity(
                    instance_id=f"{prefix}-{n}",
                    rank=0,
                    host="127.0.0.1",
                    worker_port=port,
                    layout=layout,
                    chunk_size=chunk_size,
                    # Named so that holders are offered; nothing connects to them in an offer.
                    p2p_init_port=port,
                    p2p_lookup_port=port,
                    transfer_channel="tcp",
                    session=f"{prefix}-{n}-r0",
                )
                links = ControllerLinks(
                    [
                        ControllerLink(self.ctx, me, store, pull, reply, heartbeat_s, flush_interval=flush_s)  # type: ignore[arg-type]
                        for pull, reply in zip(pull_urls, reply_urls, strict=True)
                    ]
                )
                links.start()
                self.links.append(links)

        self.run(build())

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 600.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def admit(self) -> int:
        """Every rank stores its prompts' chunks; the key events go out at the links' next flush."""
        hashes = [
            np.concatenate(
                [
                    chunk_hash_array(prompt_tokens(n, p, self.chunks, self.chunk_size), self.chunk_size)
                    for p in range(self.prompts)
                ]
            )
            for n in range(len(self.stores))
        ]

        async def store() -> None:
            for rank_store, rank_hashes in zip(self.stores, hashes, strict=True):
                rank_store.admit(rank_hashes)
                await asyncio.sleep(0)  # the links' loops run between ranks

        self.run(store())
        return sum(len(h) for h in hashes)

    def status(self) -> dict:
        async def read() -> dict:
            per_controller = []
            for i in range(len(self.links[0].links)):
                links = [rank.links[i] for rank in self.links]
                totals: dict[str, int] = {}
                for link in links:
                    for name, value in link.stats.items():
                        totals[name] = totals.get(name, 0) + value
                per_controller.append(
                    {
                        "reply_url": links[0].reply.address,
                        "registered": sum(link.session.registered for link in links),
                        **totals,
                    }
                )
            return {
                "ranks": len(self.links),
                "keys": int(sum(len(s.keys) for s in self.stores)),
                "controllers": per_controller,
            }

        return self.run(read())

    def close(self) -> None:
        async def stop() -> None:
            for links in self.links:
                links.close(deregister=False)
            self.ports.close()

        self.run(stop())
        self.ctx.destroy(linger=0)
        self.loop.call_soon_threadsafe(self.loop.stop)


def standin_layout(model: str) -> LayoutFingerprint:
    """The layout a stand-in engine (:mod:`lmcache_p2p.testing.standin`) of ``model`` registers."""
    from lmcache_p2p.testing.standin import MODEL_SHAPES, StandInKV

    return StandInKV(MODEL_SHAPES[model], num_blocks=1).layout()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lmcache_p2p.testing.link_fleet", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--ranks", type=int, default=200)
    parser.add_argument("--prompts", type=int, default=50, help="prompts per rank")
    parser.add_argument("--chunks", type=int, default=100, help="chunks per prompt")
    parser.add_argument("--chunk-size", type=int, default=16)
    parser.add_argument("--model", default="qwen2.5-0.5b", help="the stand-in engine model whose layout to register")
    parser.add_argument("--pull-urls", required=True, help="the controllers' pull sockets, comma-separated")
    parser.add_argument("--reply-urls", required=True, help="the controllers' reply sockets, same order")
    parser.add_argument("--heartbeat-s", type=float, default=5.0, help="lmcache_worker_heartbeat_time")
    parser.add_argument("--flush-s", type=float, default=0.05, help="how often each link sends its key events")
    parser.add_argument("--prefix", default="fleet", help="instance ids are PREFIX-N")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    answers = jsonlines.claim_stdout()
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    fleet = LinkFleet(
        args.ranks,
        args.prompts,
        args.chunks,
        args.chunk_size,
        standin_layout(args.model),
        args.pull_urls.split(","),
        args.reply_urls.split(","),
        args.heartbeat_s,
        args.flush_s,
        args.prefix,
    )
    ops = {"admit": lambda: {"admitted": fleet.admit()}, "status": fleet.status}
    jsonlines.answer(answers, {"ok": True, "ready": True, "command_ports": fleet.ports.ports})
    try:
        jsonlines.serve(lambda request: ops[request["op"]](), sys.stdin, answers)
    finally:
        fleet.close()


if __name__ == "__main__":
    main()
