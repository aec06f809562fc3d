"""Key files: ``kvservice keygen`` writes one that ``load_key`` accepts, and
``load_key`` refuses, like ssh with a private key, what others could read or
swap: a group/other-readable copy, another user's file, a short one, a link."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvservice import ConfigError
from kvservice._trust.keys import MIN_KEY_BYTES, load_key

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534


def keygen(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVICE_")}
    return subprocess.run([sys.executable, "-m", "kvservice.cli", "keygen", *args], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=60, check=False)


def test_keygen_writes_a_private_key_that_loads(tmp_path: Path) -> None:
    path = tmp_path / "cluster.key"
    out = keygen(str(path))
    assert out.returncode == 0, out.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert len(text) == 65 and text.endswith("\n")  # 32 random bytes as hex, one line
    int(text, 16)
    assert load_key(path) == text.strip().encode()
    assert str(path) in out.stdout and "auth_key_file" in out.stdout and "KVSERVICE_AUTH_KEY_FILE" in out.stdout
    other = tmp_path / "other.key"
    assert keygen(str(other)).returncode == 0
    assert other.read_text() != text  # random, not a constant


def test_keygen_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    path = tmp_path / "cluster.key"
    assert keygen(str(path)).returncode == 0
    old = path.read_text()
    out = keygen(str(path))
    assert out.returncode == 2
    assert out.stderr.strip() == f"kvservice keygen: {path} exists; pass --force to replace it (peers holding " \
                                 "the old key can no longer link with this one)"
    assert path.read_text() == old
    path.chmod(0o644)  # --force also makes a loosened file private again
    out = keygen(str(path), "--force")
    assert out.returncode == 0, out.stderr
    assert path.read_text() != old and stat.S_IMODE(path.stat().st_mode) == 0o600
    load_key(path)


def test_keygen_refuses_a_missing_directory_and_a_link(tmp_path: Path) -> None:
    out = keygen(str(tmp_path / "nope" / "cluster.key"))
    assert out.returncode == 2 and f"directory {tmp_path / 'nope'} does not exist" in out.stderr
    target = tmp_path / "target"
    target.write_text("x")
    (tmp_path / "link.key").symlink_to(target)
    out = keygen(str(tmp_path / "link.key"), "--force")
    assert out.returncode == 2 and "symbolic link" in out.stderr, out.stderr
    assert target.read_text() == "x"  # not written through the link


@pytest.fixture
def good(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.key"
    assert keygen(str(path)).returncode == 0
    return path


def test_load_key_refuses_a_copy_others_can_read(good: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy.key"
    shutil.copy(good, copy)
    copy.chmod(0o644)
    with pytest.raises(ConfigError, match=r"auth_key_file: .* is accessible by group or others \(mode 0644\)"):
        load_key(copy)
    copy.chmod(0o640)
    with pytest.raises(ConfigError, match="accessible by group or others"):
        load_key(copy)
    copy.chmod(0o600)
    assert load_key(copy) == load_key(good)


def test_load_key_refuses_a_short_key_and_a_link(good: Path, tmp_path: Path) -> None:
    short = tmp_path / "short.key"
    short.write_text("ab" * 15 + "\n")
    short.chmod(0o600)
    with pytest.raises(ConfigError, match=rf"holds 30 bytes; a key has at least {MIN_KEY_BYTES}.*kvservice keygen"):
        load_key(short)
    link = tmp_path / "link.key"
    link.symlink_to(good)
    with pytest.raises(ConfigError, match="cannot open"):
        load_key(link)
    with pytest.raises(ConfigError, match=r"cannot open .*No such file"):
        load_key(tmp_path / "missing.key")
    with pytest.raises(ConfigError, match="not a regular file"):
        load_key(tmp_path)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_load_key_refuses_another_users_file(good: Path) -> None:
    os.chown(good, NOBODY, -1)
    with pytest.raises(ConfigError, match=f"belongs to uid {NOBODY}, not to this user"):
        load_key(good)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_keygen_force_over_another_users_file_says_the_key_would_be_refused(good: Path) -> None:
    os.chown(good, NOBODY, -1)
    out = keygen(str(good), "--force")
    assert out.returncode == 1
    assert out.stderr.startswith(f"kvservice keygen: wrote {good}, but the services would refuse it: ")
    assert f"belongs to uid {NOBODY}" in out.stderr
