"""Which key a service uses (``resolve_key``), and the per-user key behind the default.

The directories come from the environment given (``HOME``, ``XDG_*``) pointing into
``tmp_path``; the process's own are left alone.  Several threads and processes creating
the key at once end with one key that all of them read whole; a key file or directory
that others could read or swap is refused with a ``ConfigError`` naming it, and so is a
directory the key cannot be written to, saying what to do instead.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvservice import ConfigError, ServiceConfig, TransferService
from kvservice._trust.keys import MIN_KEY_BYTES, generate_key, resolve_key, user_key, user_key_dir

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
WAY_OUT = "set auth_key_file (kvservice keygen PATH) to use a key elsewhere, or allow_unauthenticated = true"


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """A user whose runtime directory is set (and theirs) and whose home is empty."""
    runtime, home = tmp_path / "run", tmp_path / "home"
    runtime.mkdir(mode=0o700)
    home.mkdir()
    return {"XDG_RUNTIME_DIR": str(runtime), "HOME": str(home)}


def user(env: dict[str, str]) -> bytes:
    return resolve_key(None, allow_unauthenticated=False, loopback=True, env=env).key or b""


# -- where ------------------------------------------------------------------------------------------


def test_the_runtime_directory_first_then_the_config_directory(env: dict[str, str], tmp_path: Path) -> None:
    assert user_key_dir(env) == f"{env['XDG_RUNTIME_DIR']}/kvservice"
    assert user_key_dir({**env, "XDG_RUNTIME_DIR": str(tmp_path / "missing")}) == f"{env['HOME']}/.config/kvservice"
    no_runtime = {"HOME": env["HOME"]}
    assert user_key_dir(no_runtime) == f"{env['HOME']}/.config/kvservice"
    assert user_key_dir({**no_runtime, "XDG_CONFIG_HOME": str(tmp_path / "cfg")}) == f"{tmp_path}/cfg/kvservice"
    # relative paths are to be ignored (the XDG base directory spec)
    assert user_key_dir({**no_runtime, "XDG_RUNTIME_DIR": "run", "XDG_CONFIG_HOME": "cfg"}) == \
        f"{env['HOME']}/.config/kvservice"


@as_root
def test_a_runtime_directory_of_another_user_is_passed_over(env: dict[str, str]) -> None:
    os.chown(env["XDG_RUNTIME_DIR"], NOBODY, -1)
    assert user_key_dir(env) == f"{env['HOME']}/.config/kvservice"


def test_resolve_key_by_configuration(env: dict[str, str], tmp_path: Path) -> None:
    cluster = tmp_path / "cluster.key"
    generate_key(cluster)
    keyed = resolve_key(str(cluster), allow_unauthenticated=True, loopback=False, env=env)
    assert (keyed.source, keyed.path) == ("auth_key_file", str(cluster))
    assert keyed.key == cluster.read_bytes().strip()
    keyless = resolve_key(None, allow_unauthenticated=True, loopback=True, env=env)
    assert (keyless.key, keyless.source, keyless.path) == (None, "none", None)
    with pytest.raises(ConfigError, match="auth_key_file: required off loopback"):
        resolve_key(None, allow_unauthenticated=False, loopback=False, env=env)
    mine = resolve_key(None, allow_unauthenticated=False, loopback=True, env=env)
    assert (mine.source, mine.path) == ("user", f"{env['XDG_RUNTIME_DIR']}/kvservice/key")
    assert not (Path(env["HOME"]) / ".config").exists()


# -- created on first use ---------------------------------------------------------------------------


def test_created_once_private_and_then_reused(env: dict[str, str]) -> None:
    key = user(env)
    directory = Path(env["XDG_RUNTIME_DIR"]) / "kvservice"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    path = directory / "key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.stat().st_uid == os.geteuid()
    assert len(key) == 2 * MIN_KEY_BYTES and int(key, 16) >= 0  # 32 random bytes, hex
    assert user(env) == key == path.read_bytes().strip()
    assert os.listdir(directory) == ["key"]  # no temporary file left behind
    assert user({"HOME": env["HOME"]}) != key  # another directory, another key


def test_under_a_restrictive_umask_too(env: dict[str, str]) -> None:
    old = os.umask(0o777)
    try:
        key = user(env)
    finally:
        os.umask(old)
    assert user(env) == key


def _race(env: dict[str, str], threads: int, processes: int) -> list[bytes]:
    """``threads`` threads here and ``processes`` processes, released together, each resolving
    the user's key; what each read."""
    code = ("import sys; from kvservice._trust.keys import resolve_key; sys.stdin.read(); "
            "print(resolve_key(None, allow_unauthenticated=False, loopback=True, env={'HOME': sys.argv[1], "
            "'XDG_RUNTIME_DIR': sys.argv[2]}).key.decode())")
    procs = [subprocess.Popen([sys.executable, "-c", code, env["HOME"], env["XDG_RUNTIME_DIR"]], cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(processes)]
    gate = threading.Barrier(threads + 1, timeout=30)
    got: list[bytes] = []
    errors: list[BaseException] = []

    def one() -> None:
        gate.wait()
        try:
            got.append(user(env))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    workers = [threading.Thread(target=one) for _ in range(threads)]
    try:
        for w in workers:
            w.start()
        for p in procs:  # they have imported kvservice by now or soon; all wait for this end of input
            assert p.stdin is not None
            p.stdin.close()
        gate.wait()
        for w in workers:
            w.join(timeout=30)
        for p in procs:
            assert p.stdout is not None
            got.append(p.stdout.read().strip().encode())
            assert p.wait(timeout=60) == 0
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)
            if p.stdout is not None:
                p.stdout.close()
    assert not errors, errors
    return got


def test_many_at_once_make_one_key_and_all_read_it_whole(env: dict[str, str]) -> None:
    directory = Path(env["XDG_RUNTIME_DIR"]) / "kvservice"
    for processes in (4, 0, 0, 0, 0, 0, 0, 0):  # processes are slow to start: once, then threads alone
        keys = _race(env, threads=16, processes=processes)
        assert len(keys) == 16 + processes and len(set(keys)) == 1, set(keys)
        assert len(keys[0]) == 2 * MIN_KEY_BYTES
        assert os.listdir(directory) == ["key"]  # and no temporary file left behind
        assert (directory / "key").read_bytes().strip() == keys[0]
        (directory / "key").unlink()  # the next race starts from nothing again
        directory.rmdir()


# -- refusals ---------------------------------------------------------------------------------------


def _first_use(env: dict[str, str]) -> Path:
    user(env)
    return Path(env["XDG_RUNTIME_DIR"]) / "kvservice" / "key"


def test_a_key_others_can_read_is_refused_naming_it(env: dict[str, str]) -> None:
    path = _first_use(env)
    path.chmod(0o644)
    with pytest.raises(ConfigError, match=rf"per-user key: '{path}' is accessible by group or others \(mode 0644\)") \
            as info:
        user(env)
    assert str(info.value).endswith(f"chmod 600 {path}; or {WAY_OUT} to run without one")


@as_root
def test_a_key_of_another_user_is_refused_naming_it(env: dict[str, str]) -> None:
    path = _first_use(env)
    os.chown(path, NOBODY, -1)
    with pytest.raises(ConfigError, match=rf"per-user key: '{path}' belongs to uid {NOBODY}"):
        user(env)


def test_a_short_key_or_a_link_is_refused_never_replaced(env: dict[str, str], tmp_path: Path) -> None:
    path = _first_use(env)
    path.write_text("short\n")
    with pytest.raises(ConfigError, match=rf"per-user key: '{path}' holds 5 bytes"):
        user(env)
    assert path.read_text() == "short\n"
    path.unlink()
    target = tmp_path / "elsewhere.key"
    generate_key(target)
    path.symlink_to(target)
    with pytest.raises(ConfigError, match=rf"per-user key: cannot open '{path}'"):
        user(env)


def test_a_directory_others_can_write_or_a_link_is_refused(env: dict[str, str], tmp_path: Path) -> None:
    directory = Path(env["XDG_RUNTIME_DIR"]) / "kvservice"
    directory.mkdir(mode=0o700)
    directory.chmod(0o777)
    with pytest.raises(ConfigError, match=rf"'{directory}' is writable by group or others \(mode 0777\)"):
        user(env)
    directory.rmdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    directory.symlink_to(elsewhere)
    with pytest.raises(ConfigError, match=rf"'{directory}' is not a directory \(or is a symbolic link\)"):
        user(env)
    assert not list(elsewhere.iterdir())


@as_root
def test_a_directory_of_another_user_is_refused(env: dict[str, str]) -> None:
    directory = Path(env["XDG_RUNTIME_DIR"]) / "kvservice"
    directory.mkdir(mode=0o700)
    os.chown(directory, NOBODY, -1)
    with pytest.raises(ConfigError, match=rf"'{directory}' belongs to uid {NOBODY}"):
        user(env)


def test_a_directory_that_cannot_be_written_says_what_to_do(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    env = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(blocker)}  # kvservice/ cannot be made under a file
    with pytest.raises(ConfigError, match=rf"per-user key: cannot create '{blocker}/kvservice/key': .*; "
                                          + WAY_OUT.replace("(", r"\(").replace(")", r"\)")):
        user(env)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory anyway")
def test_a_read_only_directory_says_what_to_do(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match=r"Permission denied.*allow_unauthenticated = true"):
            user_key(str(ro / "kvservice" / "key"))
    finally:
        ro.chmod(0o700)


async def test_a_service_that_cannot_have_its_key_does_not_start(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The ConfigError comes out of ``async with``, before any memory or NIXL agent."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(blocker))
    with pytest.raises(ConfigError, match=r"per-user key: cannot create .*allow_unauthenticated = true"):
        async with TransferService(ServiceConfig()):
            pass
