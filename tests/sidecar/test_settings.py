"""The sidecar's config: the shipped files load, overrides apply, bad values name
the key, the value and what is allowed, and the docs describe every key."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvservice import ConfigError
from kvservice.sidecar.settings import SECTIONS, keys, load, to_toml

from .daemons import CONFIG, REPO


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_shipped_configs_load(role: str) -> None:
    cfg = load(CONFIG / f"{role}.toml", env={})
    assert cfg.sidecar.roles == (role,)
    assert cfg.http.host == "127.0.0.1"  # loopback by default
    assert cfg.service.ucx_env == {"UCX_NET_DEVICES": "lo"}


def test_prefill_and_decode_layouts_are_compatible() -> None:
    p, d = load(CONFIG / "prefill.toml", env={}), load(CONFIG / "decode.toml", env={})
    assert p.layout.compatible_with(d.layout) is None
    assert p.sidecar.socket_path != d.sidecar.socket_path and p.sidecar.shm_name != d.sidecar.shm_name
    assert p.http.port != d.http.port and p.service.port != d.service.port


def test_environment_overrides_every_kind_of_key() -> None:
    cfg = load(CONFIG / "prefill.toml", env={
        "KVSERVICE_HTTP_PORT": "0",
        "KVSERVICE_SERVICE_DRAIN_GRACE_S": "2.5",
        "KVSERVICE_SERVICE_PROGRESS_THREAD": "yes",
        "KVSERVICE_SIDECAR_ROLES": "prefill, decode",
        "KVSERVICE_SIDECAR_READY_FILE": "",
        "KVSERVICE_LAYOUT_NUM_PAGES": "32",
        "KVSERVICE_LOG_LEVEL": "debug",
        "KVSERVICE_BENCH_WHATEVER": "ignored: not a config section",
        "OTHER": "ignored",
    })
    assert cfg.http.port == 0
    assert cfg.service.drain_grace_s == 2.5
    assert cfg.service.progress_thread is True
    assert cfg.sidecar.roles == ("prefill", "decode")
    assert cfg.sidecar.ready_file is None
    assert cfg.layout.num_pages == 32
    assert cfg.log.level == "debug"
    assert cfg.sources["http.port"] == "KVSERVICE_HTTP_PORT"


@pytest.mark.parametrize(("toml", "message"), [
    ("[http]\nport = 70000", "http.port: must be 0..65535, got 70000"),
    ("[http]\nport = \"9400\"", "http.port: must be 0..65535, got '9400'"),
    ("[http]\nprot = 1", "http.prot (in PATH): unknown key; did you mean port?"),
    ("[http]\nxyz = 1", "http.xyz (in PATH): unknown key; allowed: host, port"),
    ("[htp]\nport = 1", "htp (in PATH): unknown section; did you mean http?"),
    ("[ab]\nport = 1", "ab (in PATH): unknown section; allowed: sidecar, http, log, service, layout"),
    ("[sidecar]\nroles = [\"router\"]", "sidecar.roles: must be a non-empty list of distinct ['prefill', 'decode']"),
    ("[sidecar]\nroles = []", "sidecar.roles"),
    ("[sidecar]\nshm_name = \"a/b\"", "sidecar.shm_name: letters, digits"),
    ("[sidecar]\nsocket_path = \"/" + "x" * 120 + "\"", "sidecar.socket_path: must be 1..107 bytes"),
    ("[sidecar]\nloop = \"trio\"", "sidecar.loop: must be one of auto, asyncio, uvloop, got 'trio'"),
    ("[log]\nformat = \"xml\"", "log.format: must be one of auto, json, console, got 'xml'"),
    ("[service]\ndrain_grace_s = -1", "service.drain_grace_s: must be >= 0, got -1"),
    ("[service]\npeer_timeout_s = 0.1", "service.peer_timeout_s: must exceed heartbeat_interval_s"),
    ("[service]\nprogress_thread = 1", "service.progress_thread: expected true or false, got 1"),
    ("[service]\nlayout = 1", "service.layout (in PATH): not a key of [service]; the layout is its own section"),
    ("[service.ucx_env]\nUCX_TLS = 1", "service.ucx_env: expected a table of strings"),
    ("[layout]\nnum_pages = 0", "layout.num_pages must be a positive int, got 0"),
    ("[layout]\ndtype = \"float64\"", "layout.dtype must be one of"),
    ("sidecar = 1", "sidecar: must be a table"),
])
def test_bad_values_name_key_value_and_allowed(tmp_path: Path, toml: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load(path, env={})
    assert message.replace("PATH", str(path)) in str(info.value)


@pytest.mark.parametrize(("env", "message"), [
    ({"KVSERVICE_HTTP_PORT": "abc"}, "http.port (from KVSERVICE_HTTP_PORT='abc'): expected an integer"),
    ({"KVSERVICE_HTTP_PROT": "1"}, "KVSERVICE_HTTP_PROT: http.prot is not a key; did you mean KVSERVICE_HTTP_PORT?"),
    ({"KVSERVICE_SERVICE_PROGRESS_THREAD": "maybe"}, "expected true or false"),
    ({"KVSERVICE_SERVICE_UCX_ENV": "x"}, "service.ucx_env (from KVSERVICE_SERVICE_UCX_ENV='x'): cannot be set"),
    ({"KVSERVICE_LAYOUT_NUM_PAGES": "-3"}, "layout.num_pages must be a positive int, got -3"),
])
def test_bad_environment_values_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(CONFIG / "prefill.toml", env=env)
    assert message in str(info.value)


def test_unreadable_and_broken_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load(tmp_path / "missing.toml", env={})
    broken = tmp_path / "broken.toml"
    broken.write_text("[http\nport = 1")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load(broken, env={})


def test_effective_config_round_trips() -> None:
    cfg = load(CONFIG / "decode.toml", env={"KVSERVICE_HTTP_PORT": "0", "KVSERVICE_SIDECAR_READY_FILE": ""})
    text = to_toml(cfg)
    assert "port = 0  # from KVSERVICE_HTTP_PORT" in text
    from kvservice.sidecar.settings import from_mapping

    assert from_mapping(tomllib.loads(text), {}) == cfg


def test_the_reference_describes_every_key() -> None:
    """docs/configuration.md is generated from the declarations (tests/unit/test_config_reference.py)."""
    doc = (REPO / "docs" / "configuration.md").read_text()
    missing = [f"{section}.{key}" for section in SECTIONS for key in keys(section)
               if f"| `{key}` |" not in doc.partition(f"## [{section}]")[2]]
    assert not missing, f"docs/configuration.md lacks {missing}"


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVICE_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "kvservice.cli", *args], capture_output=True, text=True,
                          env=full_env, cwd=REPO, timeout=60, check=False)


def test_check_config_prints_effective_config() -> None:
    out = _cli("check-config", "config/prefill.toml", env={"KVSERVICE_HTTP_PORT": "0"})
    assert out.returncode == 0, out.stderr
    assert "port = 0  # from KVSERVICE_HTTP_PORT" in out.stdout
    assert tomllib.loads(out.stdout)["sidecar"]["roles"] == ["prefill"]


def test_check_config_and_serve_refuse_bad_config_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[http]\nport = -1\n")
    for args in (("check-config", str(bad)), ("serve", "--config", str(bad))):
        out = _cli(*args)
        assert out.returncode == 2, out
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "http.port: must be 0..65535, got -1" in lines[0], out.stderr
    out = _cli("serve", "--config", "config/prefill.toml", env={"KVSERVICE_SERVICE_PORT": "http"})
    assert out.returncode == 2 and "service.port (from KVSERVICE_SERVICE_PORT='http')" in out.stderr


# -- trust settings ---------------------------------------------------------------------------


@pytest.fixture
def key(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.key"
    path.write_text("ab" * 32 + "\n")
    path.chmod(0o600)
    return path


def test_key_file_from_the_file_or_either_variable(tmp_path: Path, key: Path) -> None:
    conf = tmp_path / "keyed.toml"
    conf.write_text(f'[service]\nhost = "0.0.0.0"\nadvertise_host = "10.0.0.7"\nauth_key_file = "{key}"\n')
    assert load(conf, env={}).service.auth_key_file == str(key)
    for var in ("KVSERVICE_AUTH_KEY_FILE", "KVSERVICE_SERVICE_AUTH_KEY_FILE"):
        cfg = load(CONFIG / "prefill.toml", env={var: str(key), "KVSERVICE_SERVICE_HOST": "0.0.0.0",
                                                  "KVSERVICE_SERVICE_ADVERTISE_HOST": "10.0.0.7"})
        assert cfg.service.auth_key_file == str(key) and cfg.sources["service.auth_key_file"] == var
        assert f"auth_key_file = \"{key}\"  # from {var}" in to_toml(cfg)
    both = {"KVSERVICE_AUTH_KEY_FILE": str(key), "KVSERVICE_SERVICE_AUTH_KEY_FILE": str(key)}
    assert load(CONFIG / "prefill.toml", env=both).service.auth_key_file == str(key)  # agreeing: fine
    with pytest.raises(ConfigError, match=r"service\.auth_key_file: KVSERVICE_AUTH_KEY_FILE and "
                                          r"KVSERVICE_SERVICE_AUTH_KEY_FILE disagree"):
        load(CONFIG / "prefill.toml", env={**both, "KVSERVICE_SERVICE_AUTH_KEY_FILE": str(tmp_path / "other")})
    cfg = load(CONFIG / "prefill.toml", env={"KVSERVICE_ALLOW_UNAUTHENTICATED": "yes",
                                             "KVSERVICE_SERVICE_HOST": "0.0.0.0",
                                             "KVSERVICE_SERVICE_ADVERTISE_HOST": "10.0.0.7"})
    assert cfg.service.allow_unauthenticated is True and cfg.service.auth_key_file is None


def test_a_bad_key_file_names_the_key_and_the_problem(tmp_path: Path, key: Path) -> None:
    key.chmod(0o644)
    conf = tmp_path / "loose.toml"
    conf.write_text(f'[service]\nauth_key_file = "{key}"\n')
    with pytest.raises(ConfigError) as info:
        load(conf, env={})
    assert str(info.value).startswith(f"service.auth_key_file: '{key}' is accessible by group or others")
    with pytest.raises(ConfigError) as info:
        load(CONFIG / "prefill.toml", env={"KVSERVICE_AUTH_KEY_FILE": str(tmp_path / "missing.key")})
    assert str(info.value) == (f"service.auth_key_file (from KVSERVICE_AUTH_KEY_FILE='{tmp_path}/missing.key'): "
                               f"cannot open '{tmp_path}/missing.key': No such file or directory")
    with pytest.raises(ConfigError, match=r"service\.auth_key_file: required when host is '0\.0\.0\.0'"):
        load(CONFIG / "prefill.toml", env={"KVSERVICE_SERVICE_HOST": "0.0.0.0",
                                           "KVSERVICE_SERVICE_ADVERTISE_HOST": "10.0.0.7"})


def test_check_config_reports_a_bad_key_file_in_one_line(tmp_path: Path, key: Path) -> None:
    short = tmp_path / "short.key"
    short.write_text("abc\n")
    short.chmod(0o600)
    out = _cli("check-config", "config/decode.toml", env={"KVSERVICE_AUTH_KEY_FILE": str(short)})
    assert out.returncode == 2, out
    assert out.stderr.splitlines() == [
        f"kvservice check-config: service.auth_key_file (from KVSERVICE_AUTH_KEY_FILE='{short}'): '{short}' "
        f"holds 3 bytes; a key has at least 32 (write one with: kvservice keygen {short})"]
    out = _cli("check-config", "config/decode.toml", env={"KVSERVICE_AUTH_KEY_FILE": str(key)})
    assert out.returncode == 0, out.stderr
    assert f'auth_key_file = "{key}"  # from KVSERVICE_AUTH_KEY_FILE' in out.stdout
    assert "ab" * 32 not in out.stdout  # the path is printed, never the key


def test_allowed_uids_and_group(tmp_path: Path) -> None:
    conf = tmp_path / "shared.toml"
    conf.write_text('[sidecar]\nallowed_uids = [1001, 1002]\ngroup = "0"\n')
    cfg = load(conf, env={})
    assert cfg.sidecar.allowed_uids == (1001, 1002) and cfg.sidecar.gid == 0
    assert load(conf, env={"KVSERVICE_SIDECAR_ALLOWED_UIDS": "7, 8"}).sidecar.allowed_uids == (7, 8)
    assert load(CONFIG / "prefill.toml", env={}).sidecar.allowed_uids == ()
    assert load(CONFIG / "prefill.toml", env={}).sidecar.gid is None
    from kvservice.sidecar.settings import from_mapping

    assert from_mapping(tomllib.loads(to_toml(cfg)), {}) == cfg
    for toml, message in [
        ('[sidecar]\nallowed_uids = ["root"]', "sidecar.allowed_uids: expected a list of integers, got ['root']"),
        ("[sidecar]\nallowed_uids = [-1]", "sidecar.allowed_uids: each must be 0..4294967294, got -1"),
        ("[sidecar]\nallowed_uids = [true]", "sidecar.allowed_uids: expected a list of integers"),
        ('[sidecar]\ngroup = "no-such-group-here"', "sidecar.group: no such group on this host: "
                                                     "'no-such-group-here'"),
    ]:
        conf.write_text(toml)
        with pytest.raises(ConfigError) as info:
            load(conf, env={})
        assert message in str(info.value)
    with pytest.raises(ConfigError, match=r"sidecar.allowed_uids \(from KVSERVICE_SIDECAR_ALLOWED_UIDS='x'\): "
                                          "expected a list of integers"):
        load(CONFIG / "prefill.toml", env={"KVSERVICE_SIDECAR_ALLOWED_UIDS": "x"})
