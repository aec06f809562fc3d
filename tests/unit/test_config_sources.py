"""A misspelt key is refused in every configuration source, naming the key, where it came
from and the nearest known key: a TOML section's key, a nested table's key, a
``KVSERVICE_*`` variable, vLLM's ``kv_connector_extra_config`` JSON, and an SGLang rank's
variables and file.  What is not a typo (another tool's variable) passes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvservice import ConfigError, ServiceConfig
from kvservice.integrations.sglang.settings import SGLANG_TIMEOUTS, service_config
from kvservice.integrations.vllm.settings import settings_from
from kvservice.sidecar.settings import load

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "config"


def refused(call: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(ConfigError) as info:
        call(*args, **kwargs)
    return str(info.value)


# -- TOML ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("toml", "message"), [
    ("[service]\ntransfer_timout_s = 1.0\n",
     "service.transfer_timout_s (in PATH): unknown key; did you mean transfer_timeout_s?"),
    ("[layout]\nlayer = 32\n", "layout.layer (in PATH): unknown key; did you mean layers?"),
    ("[sidecar]\nsocket = \"/tmp/x.sock\"\n", "sidecar.socket (in PATH): unknown key; did you mean socket_path?"),
    ("[http]\nprot = 9400\n", "http.prot (in PATH): unknown key; did you mean port?"),
    ("[log]\nlevl = \"debug\"\n", "log.levl (in PATH): unknown key; did you mean level?"),
    ("[servce]\nport = 1\n", "servce (in PATH): unknown section; did you mean service?"),
    ("[service]\netcd_endpoint = [\"e:1\"]\n",  # discovery's keys, held in [service]
     "service.etcd_endpoint (in PATH): unknown key; did you mean etcd_endpoints?"),
])
def test_a_misspelt_key_of_a_file_is_refused_with_the_nearest(tmp_path: Path, toml: str, message: str) -> None:
    path = tmp_path / "typo.toml"
    path.write_text(toml)
    assert refused(load, path, env={}) == message.replace("PATH", str(path))


@pytest.mark.parametrize(("toml", "message"), [
    ("[service.ucx_envv]\nUCX_TLS = \"tcp\"\n", "service.ucx_envv (in PATH): unknown key; did you mean ucx_env?"),
    ("[service.ucx_env]\nnet_devices = \"lo\"\n",
     "service.ucx_env: 'net_devices' is not a UCX variable (UCX_...); did you mean 'UCX_NET_DEVICES'?"),
    ("[service.ucx_env]\nucx_tls = \"tcp\"\n",
     "service.ucx_env: 'ucx_tls' is not a UCX variable (UCX_...); did you mean 'UCX_TLS'?"),
])
def test_a_misspelt_key_of_a_nested_table_is_refused(tmp_path: Path, toml: str, message: str) -> None:
    path = tmp_path / "typo.toml"
    path.write_text(toml)
    assert refused(load, path, env={}) == message.replace("PATH", str(path))


def test_an_unknown_key_far_from_every_key_says_where_they_are_listed(tmp_path: Path) -> None:
    path = tmp_path / "far.toml"
    path.write_text("[service]\nzzzzzz = 1\n")
    assert refused(load, path, env={}).startswith(
        f"service.zzzzzz (in {path}): unknown key; none of its ")
    path.write_text("[http]\nzzzzzz = 1\n")
    assert refused(load, path, env={}) == f"http.zzzzzz (in {path}): unknown key; allowed: host, port"


def test_a_hostile_key_is_quoted_and_cut(tmp_path: Path) -> None:
    path = tmp_path / "hostile.toml"
    path.write_text(f'[service]\n"{"k" * 100_000}" = 1\n"a\\nb" = 2\n')
    message = refused(load, path, env={})
    assert message.startswith("service.'kkk") and "(100000 characters)" in message and len(message) < 1000
    path.write_text('[service]\n"a\\nb" = 2\n')
    assert refused(load, path, env={}).startswith("service.'a\\nb' (in ")  # one line: the newline is quoted


@pytest.mark.parametrize("shipped", sorted(CONFIG.glob("*.toml")), ids=lambda p: p.name)
def test_the_shipped_files_hold_only_known_keys(shipped: Path) -> None:
    load(shipped, env={})


def test_check_config_exits_non_zero_on_a_typo_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "typo.toml"
    path.write_text((CONFIG / "prefill.toml").read_text().replace("transfer_timeout_s", "transfer_timout_s"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVICE_")}
    out = subprocess.run([sys.executable, "-m", "kvservice.cli", "check-config", str(path)], capture_output=True,
                         text=True, env=env, cwd=REPO, timeout=120, check=False)
    assert out.returncode == 2, out
    assert out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        f"kvservice check-config: service.transfer_timout_s (in {path}): unknown key; "
        "did you mean transfer_timeout_s?"]


# -- ServiceConfig(...) in code -------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"transfer_timout_s": 1}, "ServiceConfig.transfer_timout_s: unknown key; did you mean transfer_timeout_s?"),
    ({"port": 1, "etcd_endpoint": ["e:1"]},  # discovery's keys, inherited
     "ServiceConfig.etcd_endpoint: unknown key; did you mean etcd_endpoints?"),
    ({"zzzzzz": 1}, "ServiceConfig.zzzzzz: unknown key; none of its "),
    ({"a\nb": 1}, "ServiceConfig.'a\\nb': unknown key; "),  # one line: the newline is quoted
])
def test_a_misspelt_keyword_of_the_config_object_is_refused_with_the_nearest(kwargs: dict[str, Any],
                                                                             message: str) -> None:
    """What a file, a variable or vLLM's JSON gets, not a dataclass's bare ``TypeError``."""
    assert refused(ServiceConfig, **kwargs).startswith(message)
    assert refused(ServiceConfig().replace, **kwargs).startswith(message)


def test_the_config_object_takes_every_key_it_declares() -> None:
    held = ServiceConfig(transfer_timeout_s=1, etcd_endpoints=["127.0.0.1:2379"])
    assert held.transfer_timeout_s == 1 and held.replace(port=5).port == 5


# -- KVSERVICE_* -----------------------------------------------------------------------------


@pytest.mark.parametrize(("env", "message"), [
    ({"KVSERVICE_SERVICE_TRANSFER_TIMOUT_S": "1"},
     "KVSERVICE_SERVICE_TRANSFER_TIMOUT_S: service.transfer_timout_s is not a key; "
     "did you mean KVSERVICE_SERVICE_TRANSFER_TIMEOUT_S?"),
    ({"KVSERVICE_LAYOUT_LAYER": "32"},
     "KVSERVICE_LAYOUT_LAYER: layout.layer is not a key; did you mean KVSERVICE_LAYOUT_LAYERS?"),
    ({"KVSERVICE_SERVCE_PORT": "1"},
     "KVSERVICE_SERVCE_PORT: servce is not a section; did you mean KVSERVICE_SERVICE_PORT?"),
    ({"KVSERVICE_AUTH_KEYFILE": "/k"},
     "KVSERVICE_AUTH_KEYFILE: not a variable of kvservice; did you mean KVSERVICE_AUTH_KEY_FILE?"),
    ({"KVSERVICE_ETCD_ENDPOINT": "e:1"},
     "KVSERVICE_ETCD_ENDPOINT: not a variable of kvservice; did you mean KVSERVICE_ETCD_ENDPOINTS?"),
])
def test_a_misspelt_variable_is_refused_with_the_nearest(env: dict[str, str], message: str) -> None:
    assert refused(load, CONFIG / "prefill.toml", env=env) == message


def test_other_tools_variables_pass() -> None:
    """The prefix is shared: the test suite's, the benchmarks' and the scripts' own variables
    are none of kvservice's configuration, and no near miss of it."""
    others = ["KVSERVICE_CONFIG", "KVSERVICE_REQUIRE_NETNS", "KVSERVICE_REQUIRE_SGLANG", "KVSERVICE_BENCH_MARKS",
              "KVSERVICE_FAMILIES", "KVSERVICE_PREVIOUS_TREE", "KVSERVICE_TEST_WORKERS", "KVSERVICE_TEST_SLOWDOWN",
              "KVSERVICE_SKIP_VLLM", "KVSERVICE_SIM_SEEDS", "KVSERVICE_ENV_CACHE", "KVSERVICE_DOOR_TICKS_OUT",
              "KVSERVICE_SOAK_SEED", "KVSERVICE_REQUIRE_MOONCAKE"]
    assert load(CONFIG / "prefill.toml", env=dict.fromkeys(others, "1")) == load(CONFIG / "prefill.toml", env={})


# -- vLLM's kv_connector_extra_config ----------------------------------------------------------


@pytest.mark.parametrize(("extra", "message"), [
    ({"kvservice": {"prot": 7100}}, "kv_connector_extra_config.kvservice.prot: unknown key; did you mean port?"),
    ({"kvservice": {"transfer_timout_s": 1.0}},
     "kv_connector_extra_config.kvservice.transfer_timout_s: unknown key; did you mean transfer_timeout_s?"),
    ({"kvservce": {"port": 7100}}, "kv_connector_extra_config.kvservce: unknown key; did you mean kvservice?"),
    ({"decode_tp": 2}, "kv_connector_extra_config.decode_tp: unknown key; did you mean decode_tp_size?"),
    ({"kvservice": {"layout": {}}}, "kv_connector_extra_config.kvservice.layout: unknown key; none of its "),
    ({"kvservice": {"port": 70000}}, "kv_connector_extra_config.kvservice.port: must be 0..65535, got 70000"),
    ({"kvservice": [1]}, "kv_connector_extra_config.kvservice: must be a table of keys, got [1]"),
    ({"decode_tp_size": 0}, "kv_connector_extra_config.decode_tp_size: must be a positive int, got 0"),
    ({"handoff_skew_s": True}, "kv_connector_extra_config.handoff_skew_s: must be seconds in 0..3600, got True"),
    ("text", "kv_connector_extra_config: expected an object, got 'text'"),
])
def test_vllms_extra_config_refuses_a_typo_naming_where_it_is(extra: Any, message: str) -> None:
    assert refused(settings_from, extra).startswith(message)


def test_vllms_extra_config_decodes_what_it_holds() -> None:
    settings = settings_from({"kvservice": {"host": "127.0.0.2", "port": 7100, "etcd_endpoints": ["e:1"]},
                              "decode_tp_size": 2, "handoff_skew_s": 3})
    assert (settings.service.host, settings.service.port, settings.service.etcd_endpoints) == (
        "127.0.0.2", 7100, ("e:1",))
    assert (settings.decode_tp_size, settings.handoff_skew_s) == (2, 3.0)
    assert settings_from(None) == settings_from({})


# -- SGLang ------------------------------------------------------------------------------------


def sglang(name: str) -> int:
    """SGLang's defaults for its two timeouts (what ``envs.<NAME>.get()`` answers unset)."""
    assert name in SGLANG_TIMEOUTS
    return 300


def test_an_sglang_rank_refuses_a_misspelt_variable() -> None:
    message = refused(service_config, 0, env={"KVSERVICE_SERVICE_ARIVAL_TIMEOUT_S": "3"}, read=sglang)
    assert message == ("KVSERVICE_SERVICE_ARIVAL_TIMEOUT_S: service.arival_timeout_s is not a key; "
                       "did you mean KVSERVICE_SERVICE_ARRIVAL_TIMEOUT_S?")


def test_an_sglang_rank_refuses_a_misspelt_key_of_its_file(tmp_path: Path) -> None:
    path = tmp_path / "kvservice.toml"
    path.write_text("[service]\nbootstrap_timeout = 7.0\n")
    message = refused(service_config, 0, env={"KVSERVICE_CONFIG": str(path)}, read=sglang)
    assert message == f"service.bootstrap_timeout (in {path}): unknown key; did you mean bootstrap_timeout_s?"


def test_sglangs_values_are_checked_as_the_keys_they_stand_for() -> None:
    message = refused(service_config, 0, env={}, read=lambda name: "soon")
    assert message == ("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT='soon': the kvservice backend takes it as its "
                       "bootstrap_timeout_s: must be a positive number, got 'soon'")


def test_an_sglang_rank_refuses_a_near_miss_of_sglangs_timeouts() -> None:
    """SGLang ignores a variable it does not declare: its timeout would silently stay at the
    default.  A variable SGLang declares passes, however near."""
    env = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMOUT": "600"}
    message = refused(service_config, 0, env=env, read=sglang, names=lambda: {"SGLANG_DISAGGREGATION_QUEUE_SIZE"})
    assert message == ("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMOUT: not a variable of SGLang; did you mean "
                       "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT (the kvservice backend's bootstrap_timeout_s)?")
    assert service_config(0, env=env, read=sglang, names=lambda: set(env)).bootstrap_timeout_s == 300.0
    unrelated = {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "5", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "90"}
    assert service_config(0, env=unrelated, read=sglang, names=lambda: pytest.fail("not asked")) is not None
