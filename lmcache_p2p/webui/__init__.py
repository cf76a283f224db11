"""The controller's dashboard (installed as ``lmcache_p2p.webui``): one jinja2 template and a few
static files, no CDN and no build step, so it works in an air-gapped cluster.

The page renders the first state server-side (embedded as JSON), then polls
``GET /controller/dashboard`` every 2 s. Every string from a worker reaches the DOM as text
(``textContent``), never as markup.

A controller started with an API token answers 401 to the page's actions (and, with
protect_reads, to its reads; the page then embeds no data). The script asks for the token once in
a dialog, keeps it in the tab's sessionStorage and sends it as ``Authorization: Bearer`` from then on.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import jinja2

HERE = Path(__file__).resolve().parent
STATIC_DIR = HERE / "static"
TEMPLATES_DIR = HERE / "templates"


def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES_DIR), autoescape=True, undefined=jinja2.StrictUndefined
    )


def asset_version() -> str:
    """A digest of the static files, appended to their URLs so a browser never runs a stale
    script against a newer controller."""
    digest = hashlib.sha256()
    for path in sorted(STATIC_DIR.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:12]
