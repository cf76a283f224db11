"""``lmcache-p2p``: operator tools that need no engine.

lmcache-p2p config [--tp-size N]     validate the LMCACHE_CONFIG_FILE / LMCACHE_* settings
lmcache-p2p config --markdown        the documentation's table of every key
lmcache-p2p hash [--chunk-size N]    chunk hashes of a JSON token-id list (stdin or argument);
                                     --cache-salt, --lora NAME --adapter PATH (or --lora-id), --mm:
                                     the keys of a salted, adapter or multimodal request
lmcache-p2p adapter-id PATH          a LoRA adapter's lora_id (compare it across hosts)
lmcache-p2p explain --instance B ... chunk by chunk: who holds a prompt, why B would miss it
lmcache-p2p ray-register [--address A]
                                     make Ray Serve LLM set LMCacheConnectorV1 up as lmcache-p2p
                                     in a Ray cluster (once per cluster; docs/ray_serve.md)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from lmcache_p2p import version_line
from lmcache_p2p.config import MARKDOWN_BEGIN, MARKDOWN_END, ConfigError, LMCacheConfig, key_table_markdown
from lmcache_p2p.keys import KeyIdentity, MMPlacement, chunk_spans


def _config(args: argparse.Namespace) -> int:
    if args.markdown:
        return _config_markdown(args.into)
    try:
        # What an engine started here gets: the file (--file or LMCACHE_CONFIG_FILE), then LMCACHE_*.
        cfg = LMCacheConfig.load(file=args.file)
        if args.tp_size:
            cfg.validate_for_tp(args.tp_size)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 1
    shown = {k: {"value": v, "from": cfg.sources.get(k, "default")} for k, v in cfg.to_dict().items()}
    print(json.dumps(shown, indent=2))
    return 0


def _config_markdown(into: str | None) -> int:
    table = key_table_markdown()
    if into is None:
        print(table)
        return 0
    with open(into, encoding="utf-8") as fh:
        text = fh.read()
    begin, end = text.find(MARKDOWN_BEGIN), text.find(MARKDOWN_END)
    if begin < 0 or end < begin:
        print(f"config --into: {into} has no {MARKDOWN_BEGIN!r} ... {MARKDOWN_END!r} block", file=sys.stderr)
        return 1
    with open(into, "w", encoding="utf-8") as fh:
        fh.write(text[:begin] + table + text[end + len(MARKDOWN_END) :])
    print(f"config --into: wrote the key table into {into}", file=sys.stderr)
    return 0


def _hash(args: argparse.Namespace) -> int:
    text = args.tokens if args.tokens is not None else sys.stdin.read()
    try:
        tokens = json.loads(text)
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ValueError
    except ValueError:
        print("hash: expected a JSON list of token ids, e.g. [128000, 849, 21435]", file=sys.stderr)
        return 1
    try:
        identity = _identity(args)
    except ValueError as e:
        print(f"hash: {e}", file=sys.stderr)
        return 1
    spans = chunk_spans(tokens, args.chunk_size, identity=identity, mm=args.mm or ())
    print(json.dumps([{"start": s.start, "end": s.end, "hash": f"{s.chunk_hash:016x}"} for s in spans]))
    return 0


def _identity(args: argparse.Namespace) -> KeyIdentity | None:
    """--cache-salt, --lora with --adapter (its files, to compute the id) or --lora-id."""
    from lmcache_p2p.adapter_id import AdapterIds, AdapterUnreadable

    lora_id = args.lora_id
    if args.lora is None and (args.adapter or lora_id):
        raise ValueError("--adapter and --lora-id need --lora (the adapter's name)")
    if args.lora is not None and lora_id is None:
        if not args.adapter:
            raise ValueError("--lora needs --adapter PATH (as the engine was given it) or --lora-id")
        try:
            lora_id = AdapterIds().get(args.lora, args.adapter).lora_id
        except AdapterUnreadable as e:
            raise ValueError(f"--adapter {args.adapter}: {e}") from None
    ident = KeyIdentity(cache_salt=args.cache_salt or None, lora_name=args.lora, lora_id=lora_id)
    return None if ident.plain else ident


def _mm(text: str) -> MMPlacement:
    """``--mm IDENTIFIER:OFFSET:LENGTH`` (argparse ``type=``); the identifier may hold colons."""
    ident, _, rest = text.rpartition(":")
    identifier, _, offset = ident.rpartition(":")
    try:
        if not identifier:
            raise ValueError
        return MMPlacement(identifier, int(offset), int(rest))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected IDENTIFIER:OFFSET:LENGTH, got {text!r}") from None


def _adapter_id(args: argparse.Namespace) -> int:
    """The lora_id an engine computes for the adapter in ``path`` given to vLLM as ``--as``."""
    import os

    from lmcache_p2p.adapter_id import AdapterUnreadable, adapter_directory, lora_id_of

    given = args.as_path or args.path
    try:
        directory = adapter_directory(args.path) if args.as_path is None else os.path.abspath(args.path)
        lora_id, hashed = lora_id_of(given, directory)
    except AdapterUnreadable as e:
        print(f"adapter-id: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"lora_id": lora_id, "path": given, "directory": directory, "bytes": hashed}))
    return 0


def _explain(args: argparse.Namespace) -> int:
    import httpx

    base = args.controller_url.rstrip("/")
    headers = {}
    if args.api_token_file:
        with open(args.api_token_file, encoding="utf-8") as fh:
            headers["Authorization"] = f"Bearer {fh.read().strip()}"
    try:
        with httpx.Client(base_url=base, headers=headers, timeout=30) as http:
            tokens = _explain_tokens(args, http)
            if tokens is None:
                return 1
            body: dict = {"tokens": tokens}
            if args.instance:
                body["instance_id"] = args.instance
            if args.chunk_size:
                body["chunk_size"] = args.chunk_size
            if args.cache_salt:
                body["cache_salt"] = args.cache_salt
            if args.lora:
                body["lora"] = args.lora
            reply = http.post("/explain", json=body)
    except httpx.HTTPError as e:
        print(f"explain: the controller at {base} did not answer: {e}", file=sys.stderr)
        return 1
    if reply.status_code != 200:
        print(f"explain: {reply.status_code} {reply.text}", file=sys.stderr)
        return 1
    answer = reply.json()
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    print(_explain_table(answer))
    return 0


def _explain_tokens(args: argparse.Namespace, http) -> list[int] | None:
    """The prompt's token ids: given as JSON, or text tokenized by the instance's own engine (its
    serve_url's /tokenize), so that the ids are the ones that engine hashes."""
    if args.text is None:
        text = args.tokens if args.tokens is not None else sys.stdin.read()
        try:
            tokens = json.loads(text)
        except ValueError:
            tokens = None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            print("explain: expected a JSON list of token ids (or --text with --instance)", file=sys.stderr)
            return None
        return tokens
    if not args.instance:
        print("explain: --text needs --instance: its engine tokenizes the text", file=sys.stderr)
        return None
    workers = http.get("/controller/workers").json()["workers"]
    found = [w for w in workers if w["instance_id"] == args.instance]
    serve_url = next((w["serve_url"] for w in found if w.get("serve_url")), None)
    if serve_url is None:
        print(
            f"explain: instance {args.instance!r} registered no serve_url to tokenize with; pass token ids instead",
            file=sys.stderr,
        )
        return None
    import httpx

    tokenized = httpx.post(f"{serve_url}/tokenize", json={"model": found[0]["model"], "prompt": args.text}, timeout=30)
    tokenized.raise_for_status()
    return tokenized.json()["tokens"]


def _explain_table(answer: dict) -> str:
    target = answer["instance_id"]
    lines = []
    if target:
        lines.append(
            f"instance {target}, chunk size {answer['chunk_size']}: {answer['usable_tokens']} of "
            f"{answer['prompt_tokens']} prompt tokens would be reused ({answer['whole_chunks']} whole chunks)"
        )
    else:
        lines.append(f"chunk size {answer['chunk_size']}: {answer['whole_chunks']} whole chunks")
    rows = [("tokens", "chunks", f"for {target}" if target else "status", "held by")]
    for run in answer["runs"]:
        held = "; ".join(
            f"{h['instance_id']} rank{'s' if len(h['ranks']) > 1 else ''} {','.join(map(str, h['ranks']))} "
            f"({', '.join(h['locations'])})"
            for h in run["holders"]
        )
        status = run["status"] + (f": {run['detail']}" if run["detail"] and run["status"] != "own" else "")
        rows.append((f"{run['start_token']}-{run['end_token']}", str(run["chunks"]), status, held or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines += ["  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3] for r in rows]
    for other, why in answer.get("cannot_share_with", {}).items():
        lines.append(f"{target} can never share KV with {other}: {'; '.join(why)}")
    return "\n".join(lines)


def _ray_register(args: argparse.Namespace) -> int:
    try:
        import ray

        from lmcache_p2p.integration import ray as ray_integration
    except ImportError as e:
        print(
            f"ray-register: Ray Serve LLM is not importable here ({e}); install it as docs/ray_serve.md says",
            file=sys.stderr,
        )
        return 1
    try:
        ray.init(address=args.address, logging_level=logging.WARNING, log_to_driver=False)
    except ConnectionError as e:
        print(f"ray-register: no Ray cluster at --address {args.address}: {e}", file=sys.stderr)
        return 1
    try:
        ray_integration.register()
        backend = ray_integration.registered_backend()
    finally:
        ray.shutdown()
    print(json.dumps({"address": args.address, ray_integration.CONNECTOR_NAME: backend}))
    return 0 if backend == ray_integration.BACKEND_PATH else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lmcache-p2p", description="lmcache-p2p operator tools (no engine needed)")
    parser.add_argument("--version", action="version", version=version_line("lmcache-p2p"))
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("config", help="validate and show the effective configuration and where each value came from")
    p.add_argument(
        "--file", help="a YAML file instead of LMCACHE_CONFIG_FILE's (LMCACHE_* variables still win, as in an engine)"
    )
    p.add_argument("--markdown", action="store_true", help="print the documentation's table of every key instead")
    p.add_argument("--into", metavar="FILE", help="with --markdown: replace the table's marked block in FILE")
    p.add_argument("--tp-size", type=int, default=0, help="also check per-rank port lists for this TP size")
    p.set_defaults(run=_config)
    p = sub.add_parser("hash", help="chained chunk hashes of a token-id list")
    p.add_argument("tokens", nargs="?", help="JSON list of token ids (default: read stdin)")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--cache-salt", help="the request's cache_salt (vLLM's)")
    p.add_argument("--lora", help="the request's LoRA adapter name")
    p.add_argument("--adapter", metavar="PATH", help="with --lora: its path, as the engine was given it")
    p.add_argument("--lora-id", help="with --lora: its id (adapter-id prints it) instead of --adapter")
    p.add_argument("--mm", action="append", type=_mm, metavar="ID:OFFSET:LENGTH", help="a multimodal item (repeatable)")
    p.set_defaults(run=_hash)
    p = sub.add_parser("adapter-id", help="a LoRA adapter's lora_id, to compare hosts' adapters")
    p.add_argument("path", help="the adapter's directory")
    p.add_argument(
        "--as",
        dest="as_path",
        metavar="PATH",
        help="the path string the engine is given for it, if not PATH (the id covers that string)",
    )
    p.set_defaults(run=_adapter_id)
    p = sub.add_parser("explain", help="chunk by chunk: who holds a prompt, and why an instance would miss it")
    p.add_argument("tokens", nargs="?", help="JSON list of token ids (default: read stdin)")
    p.add_argument("--controller-url", default="http://localhost:9000", help="the controller's HTTP API")
    p.add_argument("--instance", help="the instance to explain (its chunk size is used)")
    p.add_argument("--text", help="the prompt as text, tokenized by --instance's engine (its serve_url)")
    p.add_argument("--chunk-size", type=int, default=0, help="without --instance: the chunk size to cut at")
    p.add_argument("--api-token-file", help="the controller's API token, with protect_reads")
    p.add_argument("--json", action="store_true", help="print the controller's answer as JSON")
    p.add_argument("--cache-salt", help="the request's cache_salt: keyed as that tenant's")
    p.add_argument("--lora", help="the request's LoRA adapter (the OpenAI model name of an adapter request)")
    p.set_defaults(run=_explain)
    p = sub.add_parser("ray-register", help="make Ray Serve LLM's LMCacheConnectorV1 set up as lmcache-p2p")
    p.add_argument("--address", default="auto", help="the Ray cluster (HOST:PORT of the head; default: auto)")
    p.set_defaults(run=_ray_register)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
