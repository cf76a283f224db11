"""Instance processes for multi-process tests: ``python -m lmcache_p2p.testing.standin`` (the real cache
engine, worker and P2P on a CPU stand-in for an engine's KV pages) configured by a YAML file the
way users configure an engine (LMCACHE_CONFIG_FILE), driven over JSON lines."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading

import yaml

from lmcache_p2p.testing.ports import free_ports
from lmcache_p2p.testing.processes import freeze


def config_override(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` from a benchmark's ``--set`` (argparse ``type=``): the key and its value read
    as YAML, as a config file would give it."""
    import argparse

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, yaml.safe_load(value)


def instance_config(
    instance_id: str, controller, channel: str = "tcp", tp: int = 1, chunk_size: int = 32, cpu_gb: float = 0.25, **extra
) -> dict:
    """A seed-003/004 style instance config on free loopback ports."""
    ports = free_ports(3 * tp)
    config = {
        "chunk_size": chunk_size,
        "local_cpu": True,
        "max_local_cpu_size": cpu_gb,
        "enable_controller": True,
        "lmcache_instance_id": instance_id,
        "controller_pull_url": f"127.0.0.1:{controller.pull}",
        "controller_reply_url": f"127.0.0.1:{controller.reply}",
        "lmcache_worker_ports": ports[:tp],
        "enable_p2p": True,
        "p2p_host": "127.0.0.1",
        "p2p_init_ports": ports[tp : 2 * tp],
        "p2p_lookup_ports": ports[2 * tp :],
        "transfer_channel": channel,
    }
    config.update(extra)
    return config


class InstanceProcess:
    """One engine rank as a process."""

    def __init__(
        self,
        config: dict,
        tmp_path,
        rank: int = 0,
        tp: int = 1,
        model: str = "llama-3.1-8b",
        num_blocks: int = 64,
        env: dict | None = None,
        name: str | None = None,
        command: list[str] | None = None,
        device: str = "cpu",
        cwd: str | None = None,
    ):
        """``cwd``: the process's working directory (relative paths it is given resolve there: a
        LoRA adapter's ``adapters/sql`` on "another host")."""
        self.config = config
        self.cwd = cwd
        self.name = name or f"{config['lmcache_instance_id']}-r{rank}"
        path = tmp_path / f"{self.name}.yaml"
        path.write_text(yaml.safe_dump(config))
        self.log_path = tmp_path / f"{self.name}.log"
        # The stand-in by default; any process speaking the same JSON lines (the vLLM offline driver).
        self.args = command or [
            sys.executable,
            "-m",
            "lmcache_p2p.testing.standin",
            "--model",
            model,
            "--num-blocks",
            str(num_blocks),
            "--tp-size",
            str(tp),
            "--rank",
            str(rank),
            "--device",
            device,
        ]
        self.env = {**os.environ, "LMCACHE_CONFIG_FILE": str(path), **(env or {})}
        self.proc: subprocess.Popen | None = None
        self._answers: queue.Queue[dict | None] = queue.Queue()

    def start(self, timeout: float = 60.0) -> InstanceProcess:
        self._log = open(self.log_path, "w")  # noqa: SIM115 -- the process writes to it until stop() closes it
        self.proc = subprocess.Popen(
            self.args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=self.env,
            cwd=self.cwd,
        )
        threading.Thread(target=self._read, daemon=True).start()
        ready = self._next(timeout)
        assert ready.get("ready"), f"{self.name} did not start: {ready}\n{self.log()}"
        self.page_bytes = ready.get("page_bytes")
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._answers.put(json.loads(line))
        self._answers.put(None)

    def _next(self, timeout: float) -> dict:
        try:
            answer = self._answers.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.name}: no answer within {timeout}s\n{self.log()[-3000:]}") from None
        if answer is None:
            raise AssertionError(f"{self.name} exited (rc={self.proc.poll()})\n{self.log()[-3000:]}")
        return answer

    def request(self, op: str, timeout: float = 60.0, **fields) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        answer = self._next(timeout)
        assert answer.get("ok"), f"{self.name} {op} failed: {answer.get('error')}\n{self.log()[-3000:]}"
        return answer

    def prefill(self, tokens, **identity) -> int:
        """``identity``: ``cache_salt``, ``lora`` ([name, lora_id]), ``mm`` (the stand-in's; the
        offline driver takes them on ``generate``)."""
        return self.request("prefill", tokens=list(tokens), **identity)["stored"]

    def generate(self, prompt_ids, max_tokens: int = 16) -> list[int]:
        """Greedy token ids (the offline driver's ``generate``)."""
        return self.request("generate", prompt_ids=list(prompt_ids), max_tokens=max_tokens, timeout=120)["token_ids"]

    def lookup(self, tokens, peers: bool = True, timeout: float = 60.0, **identity) -> int:
        return self.request("lookup", tokens=list(tokens), peers=peers, timeout=timeout, **identity)["hit"]

    def retrieve(self, tokens, **identity) -> dict:
        return self.request("retrieve", tokens=list(tokens), **identity)

    def status(self) -> dict:
        return self.request("status")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def signal(self, sig: int) -> None:
        """SIGSTOP returns once the process has stopped (:func:`freeze`)."""
        if sig == signal.SIGSTOP:
            freeze(self.proc.pid)
        else:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.send_signal(signal.SIGCONT)
            self.kill()
        self._log.close()


def tokens(n: int, seed: int = 0) -> list[int]:
    """A deterministic prompt of ``n`` token ids."""
    return [(seed * 7919 + i * 104729) % 32000 for i in range(n)]
