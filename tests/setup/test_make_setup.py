"""`make setup`'s optional system packages never fail it (run with fake apt-get / ldconfig / id)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def fake_bin(tmp_path: Path, apt_exit: int) -> dict[str, str]:
    """PATH with ldconfig that knows no library, id saying root, apt-get that fails (the lock)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {"ldconfig": "exit 0",
               "id": "echo 0",
               "apt-get": f'echo "apt-get $*" >> {tmp_path}/apt.log; '
                          f'echo "E: Could not get lock /var/lib/dpkg/lock-frontend" >&2; exit {apt_exit}'}
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def make(target: str, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", "-C", str(ROOT), target, *extra], env=env, capture_output=True, text=True,
                          timeout=60)


def test_an_apt_failure_warns_and_setup_goes_on(tmp_path):
    r = make("system-packages", fake_bin(tmp_path, apt_exit=100))
    assert r.returncode == 0, r.stderr
    assert "apt-get install libibverbs1 libnuma1 libcurl4 (optional, for Mooncake)" in r.stdout
    assert "warning: apt-get could not install libibverbs1 libnuma1 libcurl4" in r.stdout
    assert "Lock::Timeout" in (tmp_path / "apt.log").read_text()  # waits a bounded time for the lock


def test_system_packages_can_be_skipped(tmp_path):
    r = make("system-packages", fake_bin(tmp_path, apt_exit=0), "SYSTEM_PACKAGES=no")
    assert r.returncode == 0 and "SYSTEM_PACKAGES=no: not installing libibverbs1 libnuma1 libcurl4" in r.stdout
    assert not (tmp_path / "apt.log").exists()
