"""The README's install commands for a host without an engine, run as a user would: in a fresh
virtual environment, from a copy of the repository (``pip install .``), checking what each says.

A controller, router or ``lmcache_server`` host must get no torch, every console script must say
its version, and ``lmcache-p2p config --markdown`` there must print the table that
docs/configuration.md holds.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import urllib.request
import venv
from pathlib import Path

from lmcache_p2p.testing.ports import free_ports

ROOT = Path(__file__).resolve().parent.parent


def readme_install_commands() -> list[tuple[str, str]]:
    """The first bash block under README's "## Install": (command, its comment) per line."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n## Install\n") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README's Install section has no bash block"
    lines = []
    for line in block.group(1).splitlines():
        command, _, comment = line.partition("#")
        if command.strip():
            lines.append((command.strip(), comment.strip()))
    return lines


def test_the_readme_install_for_a_controller_host_gives_no_torch_and_what_it_says(tmp_path):
    from lmcache_p2p import __version__
    from lmcache_p2p.config import MARKDOWN_BEGIN, MARKDOWN_END

    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    repo = tmp_path / "lmcache-p2p"
    for name in tracked.splitlines():
        if (ROOT / name).is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, repo / name)
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    bin_dir = env_dir / "bin"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(env_dir)}
    env.pop("PYTHONPATH", None)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"

    commands = readme_install_commands()
    assert commands[0][0] == "pip install .", commands
    outputs = {}
    for command, comment in commands:
        argv = shlex.split(command)
        argv[0] = str(bin_dir / argv[0])
        if argv[1:2] == ["install"]:
            argv.insert(2, "--quiet")
        done = subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, (command, done.stderr[-3000:])
        outputs[command] = done.stdout
        if "--version" in argv:
            assert done.stdout.strip() == comment.replace("0.1.0", __version__), (command, done.stdout)

    python = str(bin_dir / "python")
    # Asked of the import system, not read from ImportError's wording (Python's).
    find_torch = "import importlib.util; print(importlib.util.find_spec('torch') is None)"
    no_torch = subprocess.run([python, "-c", find_torch], env=env, capture_output=True, text=True)
    assert no_torch.returncode == 0 and no_torch.stdout.strip() == "True", (no_torch.stdout, no_torch.stderr)
    for script in ("lmcache_controller", "lmcache_server", "lmcache_router", "lmcache-p2p"):
        done = subprocess.run([str(bin_dir / script), "--version"], env=env, capture_output=True, text=True)
        assert done.returncode == 0 and done.stdout.startswith(f"{script} (lmcache-p2p) {__version__}"), done
    docs = (ROOT / "docs" / "configuration.md").read_text()
    block = docs[docs.index(MARKDOWN_BEGIN) : docs.index(MARKDOWN_END) + len(MARKDOWN_END)]
    assert outputs["lmcache-p2p config --markdown"].rstrip("\n") == block
    # a controller serves from there (its HTTP API up and saying so), torch nowhere in that venv
    http, pull, reply, heartbeat = free_ports(4)
    monitor = json.dumps({"pull": pull, "reply": reply, "heartbeat": heartbeat})
    argv = [str(bin_dir / "lmcache_controller"), "--host", "127.0.0.1", "--port", str(http), "--monitor-ports", monitor]
    serve = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert serve.stdout is not None
        seen = []
        for line in serve.stdout:  # until it says it serves (or exits: the loop ends)
            seen.append(line)
            if "HTTP API on" in line:
                break
        assert seen and f"HTTP API on http://127.0.0.1:{http}" in seen[-1], seen
        health = urllib.request.urlopen(f"http://127.0.0.1:{http}/controller/workers", timeout=10)
        assert json.loads(health.read())["workers"] == []
    finally:
        serve.terminate()
        serve.wait(timeout=30)
