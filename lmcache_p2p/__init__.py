"""lmcache-p2p: a peer-to-peer KV-cache mesh for vLLM."""

__version__ = "0.1.0"  # the one place the version is written (pyproject.toml reads it)


def version_line(prog: str) -> str:
    """What every console script's ``--version`` prints."""
    return f"{prog} (lmcache-p2p) {__version__}"
