"""A prefill/decode proxy for vLLM's NIXL P/D flow, in the standard library.

vLLM disaggregates prefill and decode through ``kv_transfer_params``: the client (here, this
proxy) sends the request to the prefill engine first, asking it for one token and to keep the
prompt's KV for a remote decode; the prefill engine's answer carries ``kv_transfer_params`` naming
its blocks (engine id, host and side-channel port, block ids). The proxy then sends the original
request to the decode engine with those parameters, and the decode engine's NixlConnector reads
the prompt's KV from the prefill engine instead of computing it. The decode engine's answer is
the client's.

    python -m lmcache_p2p.testing.pd_proxy --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000

serves ``POST /v1/completions`` and ``POST /v1/chat/completions`` (streamed or not) on port 8000.
:func:`pd_completion` is the same two steps as a function (tests, benchmarks). The same
``X-Request-Id`` goes to both engines, so vLLM names the request ``cmpl-<id>...`` on both and
their logs can be matched up.
"""

from __future__ import annotations

import argparse
import json
import logging
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib import error as urlerror
from urllib import request as urlrequest

logger = logging.getLogger(__name__)

# What the prefill request carries: "decode remotely", nothing to load from anywhere.
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Sampling options vLLM refuses (or that make no sense) on a one-token prefill request.
_PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


def seed_kv_transfer_config(kv_buffer_device: str | None = None, **nixl_extra: Any) -> dict:
    """Seed 000's prefill/decode ``kv_transfer_config``: ``MultiConnector`` with our
    ``LMCacheConnectorV1`` first (local hits) and ``NixlConnector`` second, both ``kv_both``.

    One change vLLM 0.27.1 needs whatever the first connector is: the NIXL entry's ``"backends":
    ["UCX"]`` goes into its ``kv_connector_extra_config``, where vLLM reads it, because
    MultiConnector builds each entry as a strict ``KVTransferConfig`` that refuses a top-level
    ``backends``. ``kv_buffer_device``: NIXL's buffers ("cpu" on CPU engines; None keeps vLLM's
    default, GPU memory on a GPU host); ``nixl_extra``: more of NIXL's extra config
    (``kv_lease_duration``...). ``"kv_load_failure_policy": "recompute"`` is at the top level,
    where vLLM's scheduler reads it: each child gets a fresh copy, so our connector cannot set it."""
    nixl: dict[str, Any] = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"backends": ["UCX"], **nixl_extra},
    }
    if kv_buffer_device is not None:
        nixl["kv_buffer_device"] = kv_buffer_device
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "connectors": [{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}, nixl]
        },
    }


class PDError(RuntimeError):
    """An engine answered with an HTTP error; ``status`` and ``body`` are its answer."""

    def __init__(self, stage: str, status: int, body: bytes):
        super().__init__(f"{stage} engine answered HTTP {status}: {body[:500].decode(errors='replace')}")
        self.stage, self.status, self.body = stage, status, body


@dataclass
class PDResult:
    request_id: str  # the X-Request-Id both engines were sent
    prefill: dict  # the prefill engine's answer: one token and kv_transfer_params
    decode: dict  # the decode engine's answer: what the client gets

    @property
    def kv_transfer_params(self) -> dict | None:
        """What the prefill engine handed to the decode engine (None: it kept no KV for it)."""
        return self.prefill.get("kv_transfer_params")


def prefill_body(body: dict) -> dict:
    """The request as the prefill engine gets it: one token, not streamed, KV kept for a remote decode."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPPED}
    out["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: dict, kv_transfer_params: dict | None) -> dict:
    """The request as the decode engine gets it: the client's, plus the prefill engine's parameters.
    Without them (a prefill engine with no P/D connector) the decode engine computes the prompt."""
    out = dict(body)
    if kv_transfer_params:
        out["kv_transfer_params"] = kv_transfer_params
    else:
        out.pop("kv_transfer_params", None)
    return out


def _request(url: str, body: dict, request_id: str, headers: dict[str, str] | None = None) -> urlrequest.Request:
    return urlrequest.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={**(headers or {}), "Content-Type": "application/json", "X-Request-Id": request_id},
    )


def _open(stage: str, req: urlrequest.Request, timeout: float) -> Any:
    try:
        return urlrequest.urlopen(req, timeout=timeout)
    except urlerror.HTTPError as e:
        raise PDError(stage, e.code, e.read()) from None


def prefill(
    prefill_url: str,
    body: dict,
    request_id: str,
    path: str = "/v1/completions",
    timeout: float = 120.0,
    headers: dict[str, str] | None = None,
) -> dict:
    """Step one: the prefill engine's answer (its ``kv_transfer_params`` are for the decode engine)."""
    req = _request(prefill_url.rstrip("/") + path, prefill_body(body), request_id, headers)
    with _open("prefill", req, timeout) as response:
        return json.loads(response.read())


def open_pd(
    prefill_url: str,
    decode_url: str,
    body: dict,
    request_id: str,
    path: str = "/v1/completions",
    timeout: float = 120.0,
    headers: dict[str, str] | None = None,
) -> tuple[dict, Any]:
    """Both steps, up to the decode engine's open response: (the prefill engine's answer, the
    decode response to read or stream). Raises :class:`PDError` for an engine's HTTP error."""
    first = prefill(prefill_url, body, request_id, path, timeout, headers)
    decode = decode_body(body, first.get("kv_transfer_params"))
    return first, _open("decode", _request(decode_url.rstrip("/") + path, decode, request_id, headers), timeout)


def pd_completion(
    prefill_url: str,
    decode_url: str,
    body: dict,
    path: str = "/v1/completions",
    timeout: float = 120.0,
    request_id: str | None = None,
) -> PDResult:
    """One request through prefill then decode (not streamed: the proxy server streams)."""
    if body.get("stream"):
        raise ValueError("pd_completion does not stream; use the proxy server for stream=true")
    request_id = request_id or uuid.uuid4().hex
    first, response = open_pd(prefill_url, decode_url, body, request_id, path, timeout)
    with response:
        return PDResult(request_id, first, json.loads(response.read()))


class _Handler(BaseHTTPRequestHandler):
    prefill_url = ""
    decode_url = ""
    engine_timeout = 600.0

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (the base class's name)
        logger.debug("pd_proxy %s: " + format, self.address_string(), *args)

    def _reply(self, status: int, payload: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._reply(200, b'{"status": "ok"}')
        else:
            self._reply(404, b'{"error": "not found"}')

    def do_POST(self) -> None:
        if self.path not in ENDPOINTS:
            self._reply(404, b'{"error": "not found"}')
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        except (ValueError, json.JSONDecodeError) as e:
            self._reply(400, json.dumps({"error": f"invalid JSON body: {e}"}).encode())
            return
        request_id = self.headers.get("X-Request-Id") or uuid.uuid4().hex
        auth = {"Authorization": self.headers["Authorization"]} if self.headers.get("Authorization") else {}
        try:
            _, response = open_pd(
                self.prefill_url, self.decode_url, body, request_id, self.path, self.engine_timeout, auth
            )
        except PDError as e:
            self._reply(e.status, e.body)
            return
        except (urlerror.URLError, OSError) as e:
            self._reply(502, json.dumps({"error": f"an engine did not answer: {e}"}).encode())
            return
        with response:
            content_type = response.headers.get("Content-Type", "application/json")
            if not body.get("stream"):
                self._reply(response.status, response.read(), content_type)
                return
            # Server-sent events as the decode engine writes them; the connection closes at the end.
            self.send_response(response.status)
            self.send_header("Content-Type", content_type)
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            while chunk := response.read1(65536):
                self.wfile.write(chunk)
                self.wfile.flush()


def make_server(prefill_url: str, decode_url: str, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """The proxy, bound but not serving yet (``serve_forever()``, ``shutdown()``)."""
    handler = type("PDHandler", (_Handler,), {"prefill_url": prefill_url, "decode_url": decode_url})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lmcache_p2p.testing.pd_proxy", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--prefill", required=True, help="the prefill engine's base URL, e.g. http://127.0.0.1:8100")
    parser.add_argument("--decode", required=True, help="the decode engine's base URL, e.g. http://127.0.0.1:8200")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    server = make_server(args.prefill, args.decode, args.host, args.port)
    print(f"pd_proxy: http://{args.host}:{args.port} -> prefill {args.prefill}, decode {args.decode}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
