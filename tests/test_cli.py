"""The installed console scripts and the package layout a user relies on."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
BIN = Path(sys.executable).parent


def run(*args, env=None, stdin=None):
    return subprocess.run(
        [str(BIN / args[0]), *args[1:]],
        capture_output=True,
        text=True,
        input=stdin,
        env={**os.environ, **(env or {})},
        timeout=60,
    )


def test_console_scripts_are_installed():
    for name in ("lmcache_controller", "lmcache-p2p"):
        assert shutil.which(name, path=str(BIN)), f"{name} missing from {BIN}"
    assert "--monitor-ports" in run("lmcache_controller", "--help").stdout


def test_config_command_shows_values_and_their_sources():
    out = run(
        "lmcache-p2p",
        "config",
        env={"LMCACHE_CONFIG_FILE": str(CONFIGS / "example2.yaml"), "LMCACHE_CHUNK_SIZE": "512"},
    )
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert shown["chunk_size"] == {"value": 512, "from": "env LMCACHE_CHUNK_SIZE"}
    assert shown["lmcache_instance_id"]["value"] == "lmcache_instance_2"


def test_config_file_flag_reads_the_environment_as_an_engine_does_and_hides_only_the_password():
    """`config --file` shows what an engine given that file gets: LMCACHE_* variables still win.
    A remote URL keeps its user, hosts and database and loses only its password."""
    out = run(
        "lmcache-p2p",
        "config",
        "--file",
        str(CONFIGS / "example1.yaml"),
        env={"LMCACHE_CHUNK_SIZE": "512", "LMCACHE_REMOTE_URL": "redis://cache:s3cr3t-pw@10.0.0.7:6380/2"},
    )
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert shown["chunk_size"] == {"value": 512, "from": "env LMCACHE_CHUNK_SIZE"}
    assert shown["max_local_cpu_size"] == {"value": 20.0, "from": str(CONFIGS / "example1.yaml")}
    assert shown["remote_url"]["value"] == "redis://cache:***@10.0.0.7:6380/2"
    assert "s3cr3t-pw" not in out.stdout + out.stderr


def test_every_console_script_says_its_version():
    import lmcache_p2p

    for name in ("lmcache_controller", "lmcache-p2p", "lmcache_server", "lmcache_router", "lmcache_vllm"):
        out = run(name, "--version")
        assert out.returncode == 0, (name, out.stderr)
        assert out.stdout.startswith(f"{name} (lmcache-p2p) {lmcache_p2p.__version__}"), (name, out.stdout)
    # the launcher also names the engine it would start and whether it is supported
    from lmcache_p2p.integration.vllm.compat import installed_release, range_text

    assert f"; {installed_release()} (supported: {range_text()})" in run("lmcache_vllm", "--version").stdout


def test_the_docs_key_table_is_the_generated_one():
    """docs/configuration.md's key table is `lmcache-p2p config --markdown` (make config-docs writes
    it): a key added, renamed or re-documented in config.py without the docs fails here."""
    from lmcache_p2p.config import MARKDOWN_BEGIN, MARKDOWN_END, LMCacheConfig

    out = run("lmcache-p2p", "config", "--markdown")
    assert out.returncode == 0, out.stderr
    docs = (CONFIGS.parent / "docs" / "configuration.md").read_text()
    block = docs[docs.index(MARKDOWN_BEGIN) : docs.index(MARKDOWN_END) + len(MARKDOWN_END)]
    assert block == out.stdout.rstrip("\n"), "docs/configuration.md differs from config.py: run make config-docs"
    for key in LMCacheConfig.__dataclass_fields__:
        if key != "sources":
            assert f"| `{key}` |" in block, key
    assert "`save_unfull_chunk`" in block and "`remote_server_addr` as `remote_url`" in block


def test_the_example_controller_config_is_secure_and_names_what_it_needs(tmp_path):
    """configs/controller.yaml binds nothing beyond this host and will not start without its two
    secrets: the error names the missing file's key."""
    import pytest

    from lmcache_p2p.controller.settings import SettingsError, build_parser, load_settings

    example = CONFIGS / "controller.yaml"
    with pytest.raises(SettingsError) as e:
        load_settings(build_parser().parse_args(["--config", str(example)]), {})
    assert "mesh_secret_file" in str(e.value) and "/etc/lmcache/mesh.secret" in str(e.value)
    mesh, token = tmp_path / "mesh.secret", tmp_path / "api.token"
    mesh.write_text("m" * 32)
    token.write_text("t" * 32)
    args = ["--config", str(example), "--mesh-secret-file", str(mesh), "--api-token-file", str(token)]
    settings = load_settings(build_parser().parse_args(args), {})
    assert settings.mesh_secret == "m" * 32 and settings.api_token == "t" * 32
    assert settings.host == "localhost" and settings.monitor_host in ("", "localhost")
    assert "0.0.0.0" not in [line.split("#")[0] for line in example.read_text().splitlines() if "host" in line]


def test_config_command_reports_one_clear_line_on_error():
    out = run("lmcache-p2p", "config", "--file", str(CONFIGS / "example1.yaml"), "--tp-size", "2")
    assert out.returncode == 1 and out.stderr.count("\n") == 1
    assert out.stderr.startswith("config error: lmcache_worker_ports=[8500]") and "Traceback" not in out.stderr


def test_hash_command_matches_the_library():
    from lmcache_p2p.keys import chunk_hashes

    tokens = list(range(600))
    out = run("lmcache-p2p", "hash", "--chunk-size", "256", stdin=json.dumps(tokens))
    assert [int(s["hash"], 16) for s in json.loads(out.stdout)] == chunk_hashes(tokens, 256)


def test_hash_command_keys_salted_adapter_and_multimodal_requests_as_engines_do(tmp_path):
    from lmcache_p2p.adapter_id import lora_id_of
    from lmcache_p2p.keys import KeyIdentity, MMPlacement, chunk_hashes

    tokens = json.dumps(list(range(600)))
    adapter = tmp_path / "sql"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"weights" * 100)
    lora_id = lora_id_of(str(adapter), str(adapter))[0]
    out = run(
        "lmcache-p2p",
        "hash",
        "--cache-salt",
        "tenant-a",
        "--lora",
        "sql",
        "--adapter",
        str(adapter),
        "--mm",
        "sha256:abc:300:100",
        stdin=tokens,
    )
    expected = chunk_hashes(
        list(range(600)),
        256,
        identity=KeyIdentity(cache_salt="tenant-a", lora_name="sql", lora_id=lora_id),
        mm=[MMPlacement("sha256:abc", 300, 100)],
    )
    assert out.returncode == 0, out.stderr
    assert [int(s["hash"], 16) for s in json.loads(out.stdout)] == expected
    by_id = run("lmcache-p2p", "hash", "--cache-salt", "tenant-a", "--lora", "sql", "--lora-id", lora_id, stdin=tokens)
    assert [int(s["hash"], 16) for s in json.loads(by_id.stdout)] == chunk_hashes(
        list(range(600)), 256, identity=KeyIdentity(cache_salt="tenant-a", lora_name="sql", lora_id=lora_id)
    )
    bad = run("lmcache-p2p", "hash", "--lora", "sql", stdin=tokens)
    assert bad.returncode == 1 and bad.stderr.strip() == (
        "hash: --lora needs --adapter PATH (as the engine was given it) or --lora-id"
    )
    assert run("lmcache-p2p", "hash", "--mm", "no-offset", stdin=tokens).returncode == 2


def test_adapter_id_command_prints_what_an_engine_computes(tmp_path):
    from lmcache_p2p.adapter_id import lora_id_of

    adapter = tmp_path / "adapters" / "sql"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"weights" * 100)
    out = json.loads(run("lmcache-p2p", "adapter-id", str(adapter)).stdout)
    assert out["lora_id"] == lora_id_of(str(adapter), str(adapter))[0] and out["bytes"] == 708
    # An engine given the relative path "adapters/sql" from its working directory.
    relative = json.loads(run("lmcache-p2p", "adapter-id", str(adapter), "--as", "adapters/sql").stdout)
    assert relative["lora_id"] == lora_id_of("adapters/sql", str(adapter))[0] != out["lora_id"]
    missing = run("lmcache-p2p", "adapter-id", str(tmp_path / "nowhere"))
    assert missing.returncode == 1 and missing.stderr.startswith("adapter-id: ")


def test_controller_package_never_imports_torch_or_vllm():
    code = (
        "import sys, lmcache_p2p.controller.cli, lmcache_p2p.keys, lmcache_p2p.config; "
        "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_controller_secrets_come_from_a_file_or_the_environment_and_bad_ones_are_one_line(tmp_path):
    """--mesh-secret-file / LMCACHE_MESH_SECRET and --api-token-file / LMCACHE_API_TOKEN: a bad one
    stops the controller before it binds anything, with one line naming the flag or variable."""
    from lmcache_p2p.controller.settings import build_parser, load_settings

    secret = tmp_path / "mesh.secret"
    secret.write_text("a mesh secret for the cli test\n")
    missing = tmp_path / "missing.secret"
    cases = [
        (["--mesh-secret-file", str(missing)], {}, f"--mesh-secret-file {missing} file not found"),
        ([], {"LMCACHE_MESH_SECRET": "short"}, "LMCACHE_MESH_SECRET is 5 character(s) long"),
        (["--mesh-secret-file", str(secret)], {"LMCACHE_MESH_SECRET": "x" * 20}, "given 2 times"),
        (["--api-token-file", str(missing)], {}, f"--api-token-file {missing} file not found"),
        (["--protect-reads"], {}, "--protect-reads needs an API token"),
    ]
    for flags, env, says in cases:
        out = run("lmcache_controller", "--port", "1", *flags, env=env)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and says in out.stderr, (flags, out.stderr)
        assert "Traceback" not in out.stderr and "x" * 20 not in out.stderr and "short" not in out.stderr

    config = tmp_path / "controller.yaml"
    config.write_text(f"mesh_secret_file: {secret}\nprotect_reads: true\n")
    settings = load_settings(build_parser().parse_args(["--config", str(config)]), {"LMCACHE_API_TOKEN": "t" * 16})
    assert settings.mesh_secret == "a mesh secret for the cli test" and settings.mesh_secret_file == str(secret)
    assert settings.api_token == "t" * 16 and settings.protect_reads is True
    assert "a mesh secret" not in repr(settings) and "t" * 16 not in repr(settings)
    plain = load_settings(build_parser().parse_args([]), {})
    assert (plain.mesh_secret, plain.api_token, plain.protect_reads) == (None, None, False)
