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


def fake_python(tmp_path: Path, *, index_reachable: bool = True, pip_fails: bool = False) -> dict[str, str]:
    """A `python` with no torch that logs pip calls (failing them as pip does without an index) and
    answers the CPU index probe; no nvidia-smi on PATH is needed (the targets are run directly)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "pip.log"
    pip_error = ("echo 'ERROR: Could not find a version that satisfies the requirement "
                 "mooncake-transfer-engine>=0.3.13 (from mstar[mooncake]) (from versions: none)' >&2; "
                 "echo 'ERROR: No matching distribution found for mooncake-transfer-engine>=0.3.13' >&2; exit 1"
                 if pip_fails else "echo 'Successfully installed x-1.0'; exit 0")
    (bin_dir / "python").write_text(f"""#!/bin/sh
if [ "$1" = -m ] && [ "$2" = pip ]; then shift 2; echo "pip $*" >> {log}; {pip_error}; fi
case "$2" in
  *urllib*) exit {0 if index_reachable else 1};;
  *) exit 1;;
esac
""")
    (bin_dir / "python").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_a_cpu_host_takes_torch_from_the_cpu_index(tmp_path):
    r = make("torch-cpu", fake_python(tmp_path), "PYTHON=python")
    assert r.returncode == 0 and "note" not in r.stdout, r.stdout + r.stderr
    assert (tmp_path / "pip.log").read_text().splitlines() == [
        "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"]


def test_without_the_cpu_index_one_note_then_the_default_index(tmp_path):
    r = make("torch-cpu", fake_python(tmp_path, index_reachable=False), "PYTHON=python")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "note: https://download.pytorch.org/whl/cpu cannot be reached; torch==2.13.0 comes from pip's default "
        "index instead (PyPI's Linux torch is the CUDA build, ~3 GB more)", "Successfully installed x-1.0"]
    assert (tmp_path / "pip.log").read_text().splitlines() == ["pip install torch==2.13.0"]


def test_no_mooncake_wheel_is_one_note_not_pips_error(tmp_path):
    env = fake_python(tmp_path, pip_fails=True)
    (tmp_path / "bin" / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")  # a GPU host: the CUDA wheel
    (tmp_path / "bin" / "nvidia-smi").chmod(0o755)
    r = make("mooncake", env, "PYTHON=python")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.splitlines() == [
        "note: no Mooncake wheel installed (mooncake; pip: No matching distribution found for "
        "mooncake-transfer-engine>=0.3.13); tensors cross hosts inline"]
