"""Processes for the end-to-end tests, the benchmarks and ``make demo``: a served vLLM engine
(:class:`ServedProcess`, whose command
:func:`~lmcache_p2p.integration.vllm.launcher.vllm_server_command` builds), the HTTP calls they
make (standard library only, so ``pip install .`` is all they need besides the engine), and the
readers of what an engine logs (:func:`peer_pulls`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib import error as urlerror
from urllib import request as urlrequest

# What a vLLM CPU engine needs on a small machine: one OpenMP thread each (two engines share the
# cores), float32 (what the tiny model is), no torch.compile (start in seconds), a 1 GiB KV cache.
CPU_ENGINE_ARGS = ("--dtype", "float32", "--enforce-eager", "--max-model-len", "8192")
CPU_ENGINE_ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}


def http_status(url: str, timeout: float) -> int:
    """The status of a GET (0 when nothing answered)."""
    try:
        with urlrequest.urlopen(url, timeout=timeout) as response:
            return int(response.status)
    except urlerror.HTTPError as e:
        return int(e.code)
    except (urlerror.URLError, OSError):
        return 0


def _post(url: str, body: dict, timeout: float) -> Any:
    return urlrequest.urlopen(
        urlrequest.Request(
            url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
        ),
        timeout=timeout,
    )


def post_json(url: str, body: dict, timeout: float) -> Any:
    """POST a JSON body, return the decoded JSON answer (raises on an HTTP error)."""
    with _post(url, body, timeout) as response:
        return json.loads(response.read())


def _thread_states(pid: int) -> list[str]:
    """The scheduler state letter of each of ``pid``'s threads (empty once it is gone)."""
    states = []
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                states.append(stat[stat.rindex(")") + 2])  # the name may hold spaces and parentheses
    return states


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat[stat.rindex(")") + 2 :].split()[2]) == pgid:
                    members.append(int(entry))
    return members


def _wait_stopped(pids: list[int], what: str, timeout: float) -> None:
    # kill() returns once SIGSTOP is queued. The stop spreads to a process's threads only as the
    # thread that took the signal runs; on a busy host its other threads run on meanwhile (a
    # stopped worker answering a command sent after the signal is how a test met this).
    deadline = time.monotonic() + timeout
    while True:
        running = [pid for pid in pids if any(s not in "TtZX" for s in _thread_states(pid))]
        if not running:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: threads of pid {running} still not stopped {timeout:g} s after SIGSTOP")
        time.sleep(0.002)


def freeze(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it has stopped."""
    os.kill(pid, signal.SIGSTOP)
    _wait_stopped([pid], f"pid {pid}", timeout)


def freeze_group(pgid: int, timeout: float = 10.0) -> None:
    """SIGSTOP process group ``pgid`` and return once every thread of its members has stopped."""
    os.killpg(pgid, signal.SIGSTOP)
    _wait_stopped(_group_members(pgid), f"process group {pgid}", timeout)


# vLLM's worker start-up line, e.g. "... distributed_init_method=tcp://127.0.0.1:57573 backend=gloo".
_CPU_SHM_INIT_PORT = re.compile(r"distributed_init_method=tcp://\S*:(\d+)(?:\s|$)", re.MULTILINE)
# vLLM draws its workers' rendezvous port from the kernel's ephemeral range and binds it later; any
# outgoing connection on the host may take it in between (CI met this: "EADDRINUSE" at start-up).
# Such a start is tried once more.
_VLLM_PORT_RACE = "EADDRINUSE"


class ServedProcess:
    """A server process with its output in a log file, stopped with its whole process group."""

    def __init__(self, name: str, args: list[str], log_path: Path, env: dict | None = None):
        self.name, self.args, self.log_path = name, args, log_path
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self._started_again = False

    def start(self, mode: str = "w") -> ServedProcess:
        self._log = open(self.log_path, mode)  # noqa: SIM115  (open for the process's life; stop() closes it)
        self.proc = subprocess.Popen(
            self.args,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def last_log_line(self) -> str:
        lines = [line for line in self.log().splitlines() if line.strip()]
        return lines[-1][-140:] if lines else ""

    @property
    def process(self) -> subprocess.Popen:
        if self.proc is None:
            raise RuntimeError(f"{self.name} was not started")
        return self.proc

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def wait_http(self, url: str, timeout: float, progress: bool = False) -> None:
        """Until ``url`` answers 200; raises with the log tail if the process dies or time runs out."""
        started = last_report = time.monotonic()
        while True:
            if self.exited() and not self._started_again and _VLLM_PORT_RACE in self.log():
                self._started_again = True
                print(f"    {self.name}: vLLM's own port was taken while it started; starting it again", flush=True)
                self._log.write(f"\n--- {self.name} started again: its port race above ---\n")
                self._log.close()
                self._unlink_cpu_shm()
                self.start(mode="a")
                continue
            if self.exited():
                raise RuntimeError(
                    f"{self.name} exited with code {self.process.returncode}; "
                    f"its log ({self.log_path}) ends:\n{self.log()[-3000:]}"
                )
            if http_status(url, timeout=2) == 200:
                if progress:
                    print(f"    {self.name} is up ({time.monotonic() - started:.0f} s)", flush=True)
                return
            now = time.monotonic()
            if now - started > timeout:
                raise RuntimeError(
                    f"{self.name} did not answer {url} within {timeout:.0f} s; "
                    f"its log ({self.log_path}) ends:\n{self.log()[-3000:]}"
                )
            if progress and now - last_report >= 5:
                last_report = now
                print(f"    {self.name}: starting ({now - started:.0f} s) ... {self.last_log_line()}", flush=True)
            time.sleep(0.5)

    def terminate(self) -> None:
        """Ask the process group to exit (SIGTERM) without waiting."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                os.killpg(self.proc.pid, signal.SIGTERM)

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None or self._log.closed:
            return
        try:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        except ProcessLookupError:
            pass
        finally:
            self._log.close()
            self._unlink_cpu_shm()

    def _unlink_cpu_shm(self) -> None:
        """Remove the shared-memory segments of a stopped vLLM CPU engine's TP workers.

        They are named after the engine's distributed init port and are not unlinked when the
        workers die by a signal, so they pile up in /dev/shm; a later engine that draws the same
        port fails to start with "create shm in SHMManager failed. errno: 17" (CI met this)."""
        for port in set(_CPU_SHM_INIT_PORT.findall(self.log())):
            for segment in Path("/dev/shm").glob(f"{port}-*-cpushm_*"):
                segment.unlink(missing_ok=True)


def stream_completion(base_url: str, model: str, prompt: str | list[int], max_tokens: int = 16) -> dict:
    """One streamed greedy completion of a text or of token ids: time to first token (None if no
    token came), total time, the text and the response headers (lower-case names)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    t0 = time.perf_counter()
    ttft, pieces = None, []
    with _post(f"{base_url}/v1/completions", body, timeout=600) as response:
        headers = {name.lower(): value for name, value in response.headers.items()}
        for raw in response:
            line = raw.decode().rstrip("\r\n")
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text = json.loads(line[6:])["choices"][0].get("text", "")
            if ttft is None:
                ttft = time.perf_counter() - t0
            pieces.append(text)
    return {"ttft_s": ttft, "total_s": time.perf_counter() - t0, "text": "".join(pieces), "headers": headers}


def wait_indexed(
    engine_url: str, controller_url: str, model: str, prompt: str, timeout: float = 10.0, chunk_size: int = 256
) -> bool:
    """Until the controller knows an instance holding every full chunk of the prompt (workers
    report in batches, so a first answer can be part of it); whether that happened in ``timeout``."""
    tokens = post_json(f"{engine_url}/tokenize", {"model": model, "prompt": prompt}, timeout=30)["tokens"]
    whole = len(tokens) // chunk_size * chunk_size
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        layout = post_json(f"{controller_url}/lookup", {"tokens": tokens}, timeout=5)["layout_info"]
        if any(held >= whole for _, held in layout.values()):
            return True
        time.sleep(0.05)
    return False


# ASK_GAP_WHY: after each step, each vLLM engine's worker and core processes spin on their
# shared-memory queues for 1 s (vLLM's SpinCondition busy_loop_s). Two engines sharing two vCPUs
# is the demo's artefact, not a fleet's: asked at once, engine 2 waited for CPU behind engine 1's
# spinning processes, and so did engine 1's side of the pull (its server thread fights that spin
# for the GIL). Two users asking the same document a couple of seconds apart, as on two hosts,
# is what the demo shows; --gap-s 0 shows the shared-CPU case.
ASK_GAP_S = 2.0

# The line a peer pull logs (p2p_client), as the demo and benchmarks/gpu/e2e.py read it.
P2P_LINE = re.compile(
    r"Retrieved (?P<tokens>\d+) out of total (?P<total>\d+) tokens\. size: (?P<gb>[\d.]+) gb, "
    r"cost (?P<ms>[\d.]+) ms, throughput: (?P<gbps>[\d.]+) GB/s \(from (?P<peer>.+?) "
    r"over (?P<channel>\w+(?: via GPU staging)?)(?:, to rank (?P<to_rank>\d+))?\)"
)
# What vLLM puts before a worker process's output: "(Worker_TP1 pid=..)", "(Worker pid=..)" at TP=1.
_WORKER_PREFIX = re.compile(r"\(Worker(?:_TP(?P<rank>\d+))? pid=\d+\)")


def peer_pulls(log: str) -> list[dict]:
    """Every peer pull in an engine's log: :data:`P2P_LINE`'s fields, plus the rank that pulled
    (``rank``) and the peer instance and rank it pulled from (``peer_instance``, ``peer_rank``)."""
    pulls = []
    for line in log.splitlines():
        match = P2P_LINE.search(line)
        if match is None:
            continue
        pull: dict = match.groupdict()
        to_rank = pull.pop("to_rank")
        if to_rank is not None:  # the line names the rank that pulled
            pull["rank"] = int(to_rank)
        else:  # an older line: vLLM's prefix (wrong where two ranks' lines interleaved)
            worker = _WORKER_PREFIX.search(line)
            pull["rank"] = int(worker["rank"] or 0) if worker else 0
        # The peer reads "engine1 rank 0 (127.0.0.1:8201)".
        pull["peer_instance"], _, rest = pull["peer"].partition(" rank ")
        pull["peer_rank"] = int(rest.split()[0])
        pulls.append(pull)
    return pulls


def wait_peer_pulls(
    read_log: Callable[[], str],
    count: int,
    timeout: float = 30.0,
    holder_log: Callable[[], str] | None = None,
) -> list[dict]:
    """:func:`peer_pulls` of ``read_log()`` once it shows at least ``count`` pulls. Each TP rank's
    worker process writes its own pull line, and the request's answer waits for rank 0's step
    only: another rank's line can reach the log a moment after the answer. On failure the error
    quotes the failed pulls, and with ``holder_log`` the holder's last warnings (its side of it)."""
    deadline = time.monotonic() + timeout
    while len(pulls := peer_pulls(read_log())) < count:
        if time.monotonic() > deadline:
            failed = [line for line in read_log().splitlines() if "peer pull from" in line]
            holder = ""
            if holder_log is not None:
                warnings = [line for line in holder_log().splitlines() if "LMCache WARNING" in line]
                holder = f"; the holder's last warnings: {warnings[-5:] or 'none'}"
            raise AssertionError(
                f"{len(pulls)} peer pull line(s) in the log after {timeout} s, expected {count}; "
                f"failed pulls: {failed or 'none logged'}{holder}"
            )
        time.sleep(0.1)
    return pulls
