"""LMCacheConfig: the seeds' files load unchanged, env wins, and every bad value names its culprit."""

import logging
import socket
from pathlib import Path

import pytest

from lmcache_p2p import config as config_mod
from lmcache_p2p.config import ConfigError, LMCacheConfig

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def load(env: dict) -> LMCacheConfig:
    return LMCacheConfig.load(env=env)


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


# -- the seeds' files -------------------------------------------------------------------------


def test_seed_004_example_files_load():
    one = LMCacheConfig.from_file(str(CONFIGS / "example1.yaml"))
    two = LMCacheConfig.from_file(str(CONFIGS / "example2.yaml"))
    # the seed's files ask for a 100 GB pool; ours, pinned at start on a CUDA host, for 20 GB
    assert (one.chunk_size, one.local_cpu, one.max_local_cpu_size) == (256, True, 20.0)
    assert one.enable_async_loading and one.enable_p2p and one.enable_controller
    assert one.p2p_host == "localhost" and one.transfer_channel == "nixl"
    assert (one.p2p_init_ports, one.p2p_lookup_ports, one.lmcache_worker_ports) == ([8200], [8201], [8500])
    assert (two.p2p_init_ports, two.p2p_lookup_ports, two.lmcache_worker_ports) == ([8202], [8203], [8501])
    assert one.controller_pull_url == "localhost:8300" and one.controller_reply_url == "localhost:8400"
    assert (one.lmcache_instance_id, two.lmcache_instance_id) == ("lmcache_instance_1", "lmcache_instance_2")
    assert one.extra_config == {"lookup_backoff_time": 0.001}  # accepted (LMCache's), no effect here


def test_seed_003_instance_files_load():
    one = LMCacheConfig.from_file(str(CONFIGS / "instance1.yaml"))
    two = LMCacheConfig.from_file(str(CONFIGS / "instance2.yaml"))
    assert one.max_local_cpu_size == 5.0 and one.enable_p2p and one.transfer_channel == "nixl"
    assert one.lmcache_worker_ports == [8500] and two.lmcache_worker_ports == [8501]
    assert two.lmcache_instance_id == "lmcache_instance_2"


def test_seed_002_offload_file_loads():
    cfg = LMCacheConfig.from_file(str(CONFIGS / "lmcache_config.yaml"))
    assert (cfg.chunk_size, cfg.local_cpu, cfg.max_local_cpu_size) == (256, True, 5.0)
    assert not cfg.enable_controller and not cfg.enable_p2p


# Seed 004 as published lost the indentation under extra_config; users copied it that way.
SEED_004_AS_PUBLISHED = """\
chunk_size: 256
local_cpu: True
max_local_cpu_size: 100
enable_async_loading: True
# P2P configurations
enable_p2p: True
p2p_host: "localhost"
p2p_init_ports: 8200
p2p_lookup_ports: 8201
transfer_channel: "nixl"
# Controller configurations
enable_controller: True
lmcache_instance_id: "lmcache_instance_1"
controller_pull_url: "localhost:8300"
controller_reply_url: "localhost:8400"
lmcache_worker_ports: 8500
extra_config:
lookup_backoff_time: 0.001
"""


def test_seed_004_as_published_loads_with_backoff_moved_under_extra_config(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        cfg = load({"LMCACHE_CONFIG_FILE": write(tmp_path, SEED_004_AS_PUBLISHED)})
    assert cfg.extra_config == {"lookup_backoff_time": 0.001}
    assert "lookup_backoff_time belongs under extra_config" in caplog.text


def test_defaults_match_lmcache():
    cfg = load({})
    assert (cfg.chunk_size, cfg.local_cpu, cfg.max_local_cpu_size) == (256, True, 5.0)
    assert (cfg.local_disk, cfg.max_local_disk_size) == (None, 0.0)
    assert not cfg.enable_p2p and not cfg.enable_controller and not cfg.enable_async_loading
    assert cfg.max_local_cpu_bytes == 5 * 1024**3


# -- environment ------------------------------------------------------------------------------


def test_env_overrides_the_file(tmp_path):
    path = str(CONFIGS / "example1.yaml")
    cfg = load(
        {
            "LMCACHE_CONFIG_FILE": path,
            "LMCACHE_CHUNK_SIZE": "512",
            "LMCACHE_P2P_INIT_PORTS": "8200,8202",
            "LMCACHE_ENABLE_ASYNC_LOADING": "false",
        }
    )
    assert cfg.chunk_size == 512 and cfg.p2p_init_ports == [8200, 8202] and not cfg.enable_async_loading
    assert cfg.sources["chunk_size"] == "env LMCACHE_CHUNK_SIZE" and cfg.sources["max_local_cpu_size"] == path


def test_env_only_as_in_seeds_000_and_002():
    cfg = load({"LMCACHE_LOCAL_CPU": "True", "LMCACHE_CHUNK_SIZE": "256", "LMCACHE_MAX_LOCAL_CPU_SIZE": "5.0"})
    assert cfg.local_cpu is True and cfg.chunk_size == 256 and cfg.max_local_cpu_size == 5.0


@pytest.mark.parametrize(
    "raw,expected", [("True", True), ("true", True), ("1", True), ("False", False), ("false", False), ("0", False)]
)
def test_env_bools(raw, expected):
    assert load({"LMCACHE_LOCAL_CPU": raw}).local_cpu is expected


def test_env_lists_dicts_and_disk_url():
    cfg = load(
        {
            "LMCACHE_LMCACHE_WORKER_PORTS": "[8500, 8501]",
            "LMCACHE_EXTRA_CONFIG": '{"lookup_backoff_time": 0.01}',
            "LMCACHE_LOCAL_DISK": "file:///tmp/lmcache-disk/",
            "LMCACHE_MAX_LOCAL_DISK_SIZE": "2",
        }
    )
    assert cfg.lmcache_worker_ports == [8500, 8501]
    assert cfg.extra_config == {"lookup_backoff_time": 0.01}  # accepted (LMCache's), no effect here
    assert cfg.local_disk == "/tmp/lmcache-disk/" and cfg.max_local_disk_bytes == 2 * 1024**3


def test_yaml_lists_and_aliases(tmp_path):
    cfg = load({"LMCACHE_CONFIG_FILE": write(tmp_path, "p2p_lookup_ports: [8201, 8203]\nlmcache_worker_port: 8500\n")})
    assert cfg.p2p_lookup_ports == [8201, 8203] and cfg.lmcache_worker_ports == [8500]


def test_controller_urls_read_both_spellings_as_host_port(tmp_path):
    """ZMQ's tcp://host:port is what many users write; the worker puts tcp:// in front itself."""
    cfg = load(
        {
            "LMCACHE_CONFIG_FILE": write(tmp_path, 'controller_pull_url: "tcp://127.0.0.1:8300"\n'),
            "LMCACHE_CONTROLLER_REPLY_URL": "tcp://controller.example:08400",
        }
    )
    assert cfg.controller_pull_url == "127.0.0.1:8300" and cfg.controller_reply_url == "controller.example:8400"
    assert load({"LMCACHE_CONTROLLER_URL": "tcp://localhost:8300"}).controller_pull_url == "localhost:8300"
    assert load({"LMCACHE_CONTROLLER_PULL_URL": "localhost:8300"}).controller_pull_url == "localhost:8300"


@pytest.mark.parametrize(
    "value,why",
    [
        ("http://localhost:8300", "the http:// scheme is not supported"),
        ("ipc:///tmp/controller", "the ipc:// scheme is not supported"),
        ("tcp://localhost", "expected host:port"),
        ("tcp://localhost:0", "port from 1 to 65535"),
        ("localhost:70000", "port from 1 to 65535"),
        ("tcp://:8300", "expected host:port"),
    ],
)
def test_a_bad_controller_url_names_key_value_and_why(value, why):
    with pytest.raises(ConfigError) as e:
        load({"LMCACHE_CONTROLLER_REPLY_URL": value})
    assert e.value.key == "controller_reply_url"
    assert f"controller_reply_url={value!r}" in str(e.value) and why in str(e.value)


def test_lmcache_switches_that_are_not_config_keys_are_left_alone():
    cfg = load(
        {
            "LMCACHE_LOG_LEVEL": "DEBUG",
            "LMCACHE_TRACK_USAGE": "false",
            "LMCACHE_CHUNK_SIZE": "128",
            "LMCACHE_KV_KERNELS": "torch",
            "LMCACHE_KERNEL_CACHE": "/tmp/k",
        }
    )
    assert cfg.chunk_size == 128


def test_the_controllers_and_routers_own_variables_are_not_engine_keys(caplog):
    """An engine started from the shell that runs the controller or lmcache_router inherits their
    variables: the documented token must not stop it as an "unknown configuration key"."""
    from lmcache_p2p.controller.settings import API_TOKEN_ENV as CONTROLLER_TOKEN
    from lmcache_p2p.router.cli import API_TOKEN_ENV as ROUTER_TOKEN

    token = "s3cret-token-of-the-controller"
    with caplog.at_level(logging.DEBUG, logger="lmcache_p2p.config"):
        cfg = load({CONTROLLER_TOKEN: token, ROUTER_TOKEN: token, "LMCACHE_CHUNK_SIZE": "128"})
    assert cfg.chunk_size == 128
    assert len(caplog.records) <= 1 and token not in caplog.text
    with pytest.raises(ConfigError, match="unknown configuration key"):  # a typo of a key still is one
        load({"LMCACHE_API_TOKN": token})


# -- bad values name key, value, source and expectation ---------------------------------------


def test_bad_env_value_names_key_value_and_variable():
    with pytest.raises(ConfigError) as e:
        load({"LMCACHE_CHUNK_SIZE": "big"})
    msg = str(e.value)
    assert "chunk_size='big'" in msg and "env LMCACHE_CHUNK_SIZE" in msg and "integer" in msg
    assert e.value.key == "chunk_size" and e.value.source == "env LMCACHE_CHUNK_SIZE"


def test_bad_file_value_names_the_file(tmp_path):
    path = write(tmp_path, "local_cpu: maybe\n")
    with pytest.raises(ConfigError) as e:
        load({"LMCACHE_CONFIG_FILE": path})
    assert "local_cpu='maybe'" in str(e.value) and path in str(e.value) and "boolean" in str(e.value)


@pytest.mark.parametrize("value", ["0", "-256"])
def test_chunk_size_must_be_positive(value):
    with pytest.raises(ConfigError, match=r"chunk_size=.*env LMCACHE_CHUNK_SIZE.*positive"):
        load({"LMCACHE_CHUNK_SIZE": value})


@pytest.mark.parametrize("value", ["0", "-1", "nan", "26"])
def test_a_pull_timeout_must_be_seconds_the_engine_still_waits_for(value):
    with pytest.raises(ConfigError, match=r"p2p_pull_timeout_s=.*env LMCACHE_P2P_PULL_TIMEOUT_S\): expected"):
        load({"LMCACHE_P2P_PULL_TIMEOUT_S": value})
    assert load({"LMCACHE_P2P_PULL_TIMEOUT_S": "7.5"}).p2p_pull_timeout_s == 7.5


def test_p2p_without_controller(tmp_path):
    path = write(
        tmp_path,
        "enable_p2p: true\np2p_host: localhost\np2p_init_ports: 8200\np2p_lookup_ports: 8201\ntransfer_channel: nixl\n",
    )
    with pytest.raises(ConfigError, match=r"enable_controller.*must be true when enable_p2p"):
        load({"LMCACHE_CONFIG_FILE": path})


def test_p2p_without_ports(tmp_path):
    text = (CONFIGS / "example1.yaml").read_text().replace("p2p_lookup_ports: 8201\n", "")
    with pytest.raises(ConfigError, match=r"p2p_lookup_ports.*required when enable_p2p"):
        load({"LMCACHE_CONFIG_FILE": write(tmp_path, text)})


def test_controller_without_its_urls(tmp_path):
    with pytest.raises(ConfigError, match=r"controller_pull_url.*required when enable_controller"):
        load({"LMCACHE_ENABLE_CONTROLLER": "1"})


def test_instance_id_expands_per_engine():
    """Replicas sharing one config (Ray Serve's num_replicas) get ids of their own from vLLM's
    engine_id; a fixed id stays as written; unset is {hostname}-{engine_id}."""
    base = {"LMCACHE_ENABLE_CONTROLLER": "1", "LMCACHE_CONTROLLER_PULL_URL": "localhost:8300"}
    base |= {"LMCACHE_CONTROLLER_REPLY_URL": "localhost:8400", "LMCACHE_LMCACHE_WORKER_PORTS": "0"}
    host = socket.gethostname()
    assert load(base).for_engine("e-1").lmcache_instance_id == f"{host}-e-1"
    templated = load(base | {"LMCACHE_LMCACHE_INSTANCE_ID": "chat-{engine_id}"})
    assert templated.for_engine("e-1").lmcache_instance_id == "chat-e-1"
    assert templated.for_engine("e-2").lmcache_instance_id == "chat-e-2"
    assert load(base | {"LMCACHE_LMCACHE_INSTANCE_ID": "a1"}).for_engine("e-1").lmcache_instance_id == "a1"
    with pytest.raises(ConfigError, match=r"lmcache_instance_id.*\{pid\}.*only \{hostname\} and \{engine_id\}"):
        load(base | {"LMCACHE_LMCACHE_INSTANCE_ID": "a-{pid}"})
    with pytest.raises(ConfigError, match=r"lmcache_instance_id.*no spaces"):
        load(base | {"LMCACHE_LMCACHE_INSTANCE_ID": "my engine"})


def test_port_zero_covers_every_rank_and_ports_are_checked():
    cfg = LMCacheConfig.from_dict({"lmcache_worker_ports": 0, "p2p_init_ports": 0, "p2p_lookup_ports": [0]})
    cfg.validate_for_tp(4)  # a lone 0 is any free port for each rank
    with pytest.raises(ConfigError, match=r"p2p_init_ports.*70000 is not a TCP port"):
        LMCacheConfig.from_dict({"p2p_init_ports": [8200, 70000]}).validate()


def test_port_lists_must_cover_every_tp_rank():
    cfg = LMCacheConfig.from_file(str(CONFIGS / "example1.yaml"))
    cfg.validate_for_tp(1)
    with pytest.raises(ConfigError) as e:
        cfg.validate_for_tp(2)
    assert "lmcache_worker_ports=[8500]" in str(e.value) and "tensor parallel size is 2" in str(e.value)
    assert str(CONFIGS / "example1.yaml") in str(e.value)


@pytest.mark.parametrize(
    "env,key",
    [
        ({"LMCACHE_TRANSFER_CHANNEL": "mooncake"}, "transfer_channel"),
        ({"LMCACHE_CONTROLLER_PULL_URL": "localhost"}, "controller_pull_url"),
        ({"LMCACHE_LOCAL_DISK": "s3://bucket/x"}, "local_disk"),
        ({"LMCACHE_LOCAL_DISK": "file:///tmp/x"}, "max_local_disk_size"),
        ({"LMCACHE_P2P_INIT_PORTS": "8200,eighty"}, "p2p_init_ports"),
        ({"LMCACHE_EXTRA_CONFIG": "{not json"}, "extra_config"),
        ({"LMCACHE_EXTRA_CONFIG": '{"lookup_backoff_time": "soon"}'}, "extra_config.lookup_backoff_time"),
        ({"LMCACHE_MAX_LOCAL_CPU_SIZE": "-1"}, "max_local_cpu_size"),
        ({"LMCACHE_STORE_CTAS": "-2"}, "store_ctas"),
        ({"LMCACHE_LOAD_STAGING_MB": "-1"}, "load_staging_mb"),
        ({"LMCACHE_LOAD_STAGING_MB": "nan"}, "load_staging_mb"),
        ({"LMCACHE_LOAD_STAGING_MB": "inf"}, "load_staging_mb"),
        ({"LMCACHE_STORE_CTAS": "many"}, "store_ctas"),
        ({"LMCACHE_SWITCH_INTERVAL_MS": "0"}, "switch_interval_ms"),
        ({"LMCACHE_SWITCH_INTERVAL_MS": "nan"}, "switch_interval_ms"),
    ],
)
def test_each_bad_value_is_a_config_error_naming_the_key(env, key):
    with pytest.raises(ConfigError) as e:
        load(env)
    assert e.value.key == key and str(e.value).startswith(key)


def _float_keys() -> list[str]:
    """Every key whose value is a number or a list of numbers (a key added later is covered too)."""
    return [f.name for f in config_mod._config_fields().values() if "float" in str(f.type)]


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "NaN", "Infinity"])
def test_no_number_key_takes_nan_or_infinity(raw):
    """A nan or infinite size, heartbeat or rate passes every "> 0" check and fails later: an
    OverflowError at engine start, a heartbeat loop that spins, every pull skipped."""
    keys = _float_keys()
    assert {"max_local_cpu_size", "lmcache_worker_heartbeat_time", "prefill_tokens_per_s"} <= set(keys), keys
    for key in keys:
        var = f"LMCACHE_{key.upper()}"
        with pytest.raises(ConfigError) as e:
            load({var: raw, "LMCACHE_LOCAL_DISK": "file:///tmp/d"} if key == "max_local_disk_size" else {var: raw})
        assert e.value.key == key, (key, str(e.value))
        assert str(e.value).startswith(f"{key}=") and f"env {var}" in str(e.value), str(e.value)
    with pytest.raises(ConfigError) as e:
        load({"LMCACHE_EXTRA_CONFIG": f'{{"lookup_backoff_time": "{raw}"}}'})
    assert e.value.key == "extra_config.lookup_backoff_time"


def test_async_kv_loads_is_auto_unless_set_and_reads_yaml_and_env_spellings(tmp_path):
    assert load({}).async_kv_loads == "auto"
    assert load({"LMCACHE_ASYNC_KV_LOADS": "AUTO"}).async_kv_loads == "auto"
    assert load({"LMCACHE_ASYNC_KV_LOADS": "true"}).async_kv_loads is True
    assert load({"LMCACHE_CONFIG_FILE": write(tmp_path, "async_kv_loads: False\n")}).async_kv_loads is False
    with pytest.raises(ConfigError, match=r"^async_kv_loads='sometimes'.*expected \"auto\" or a boolean") as e:
        load({"LMCACHE_ASYNC_KV_LOADS": "sometimes"})
    assert e.value.key == "async_kv_loads"


def test_unknown_key_suggests_the_right_one(tmp_path):
    path = write(tmp_path, "chunk_sise: 256\n")
    with pytest.raises(ConfigError) as e:
        load({"LMCACHE_CONFIG_FILE": path})
    assert "chunk_sise" in str(e.value) and "did you mean 'chunk_size'" in str(e.value) and path in str(e.value)


def test_unknown_env_key_is_an_error_too():
    with pytest.raises(
        ConfigError, match=r"max_local_cpu_sise.*env LMCACHE_MAX_LOCAL_CPU_SISE.*did you mean 'max_local_cpu_size'"
    ):
        load({"LMCACHE_MAX_LOCAL_CPU_SISE": "5"})


def test_original_lmcache_keys_we_do_not_implement_warn_once_and_load(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(config_mod, "_warned_ignored", set())
    path = write(tmp_path, "chunk_size: 256\nsave_decode_cache: false\nsave_unfull_chunk: false\nuse_layerwise: true\n")
    with caplog.at_level(logging.WARNING):
        cfg = load({"LMCACHE_CONFIG_FILE": path})
        load({"LMCACHE_CONFIG_FILE": path})
    assert cfg.chunk_size == 256
    assert caplog.text.count("save_decode_cache") == 1 and "does not implement" in caplog.text
    assert cfg.use_layerwise and "use_layerwise" not in caplog.text  # implemented (issue 21)


def test_missing_or_malformed_file(tmp_path):
    with pytest.raises(ConfigError, match="LMCACHE_CONFIG_FILE.*file not found"):
        load({"LMCACHE_CONFIG_FILE": str(tmp_path / "nope.yaml")})
    with pytest.raises(ConfigError, match="not valid YAML"):
        load({"LMCACHE_CONFIG_FILE": write(tmp_path, "chunk_size: [256\n")})
    with pytest.raises(ConfigError, match="mapping"):
        load({"LMCACHE_CONFIG_FILE": write(tmp_path, "- 1\n- 2\n")})


# -- the mesh secret (issue 18) ------------------------------------------------------------------


MESH_SECRET = "a mesh secret of the tests"


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda d: str(d / "missing"), "file not found"),
        (lambda d: str(d), "is a directory"),
        (lambda d: write(d, "\n  \n", "empty.secret"), "is empty"),
        (lambda d: write(d, "short\n", "short.secret"), "is 5 character"),
    ],
    ids=["missing", "directory", "empty", "too short"],
)
def test_a_bad_mesh_secret_file_is_an_error_naming_the_key(tmp_path, make, why):
    path = make(tmp_path)
    with pytest.raises(ConfigError) as e:
        load({"LMCACHE_MESH_SECRET_FILE": path})
    assert e.value.key == "mesh_secret_file" and str(e.value).startswith(f"mesh_secret_file={path!r}")
    assert why in str(e.value) and "env LMCACHE_MESH_SECRET_FILE" in str(e.value)


def test_an_unreadable_mesh_secret_file_is_an_error_naming_the_key(tmp_path):
    import os

    if os.geteuid() == 0:
        pytest.skip("root reads any file")
    path = write(tmp_path, MESH_SECRET, "locked.secret")
    os.chmod(path, 0)
    with pytest.raises(ConfigError, match=r"^mesh_secret_file=.*cannot be read"):
        LMCacheConfig.from_dict({"mesh_secret_file": path})


def test_the_mesh_secret_from_a_file_or_the_environment_never_shows(tmp_path):
    path = write(tmp_path, f"{MESH_SECRET}\n", "mesh.secret")
    from_file = LMCacheConfig.from_file(write(tmp_path, f"mesh_secret_file: {path}\n"))
    assert from_file.resolved_mesh_secret() == MESH_SECRET  # the trailing newline is not part of it
    from_env = load({"LMCACHE_MESH_SECRET": f"  {MESH_SECRET} "})
    assert from_env.resolved_mesh_secret() == MESH_SECRET
    assert MESH_SECRET not in repr(from_env) and from_env.to_dict()["mesh_secret"] == "<set>"
    assert load({}).resolved_mesh_secret() is None and load({}).to_dict()["mesh_secret"] is None
    with pytest.raises(ConfigError, match=r"^mesh_secret \(from env LMCACHE_MESH_SECRET\): is 3 character") as e:
        load({"LMCACHE_MESH_SECRET": "abc"})
    assert "abc" not in str(e.value)
    with pytest.raises(ConfigError, match="set either mesh_secret .* or mesh_secret_file .*, not both"):
        load({"LMCACHE_MESH_SECRET": MESH_SECRET, "LMCACHE_MESH_SECRET_FILE": path})
