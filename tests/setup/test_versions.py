"""The Makefile and pyproject.toml pin the same versions; `make setup`'s GPU branch keeps a
CUDA torch that is there and installs FlashInfer (run with a fake nvidia-smi and python)."""

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAKEFILE = (ROOT / "Makefile").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def make_var(name: str) -> str:
    m = re.search(rf"^{name} [:?]?= (.+)$", MAKEFILE, re.M)
    assert m, f"Makefile defines no {name}"
    return m.group(1).strip()


def test_flashinfer_pins_agree():
    assert sorted(make_var("FLASHINFER").split()) == sorted(PYPROJECT["project"]["optional-dependencies"]["gpu"])


def test_torch_pins_satisfy_the_package():
    from packaging.requirements import Requirement

    (torch_req,) = [Requirement(r) for r in PYPROJECT["project"]["dependencies"] if r.startswith("torch")]
    for var in ("TORCH_CPU", "TORCH_CUDA"):
        pinned = Requirement(make_var(var))
        version = str(pinned.specifier).removeprefix("==")
        assert pinned.name == "torch" and torch_req.specifier.contains(version), (var, version, torch_req)


def test_every_model_family_has_an_extra_and_all_holds_them():
    from mstar.models.registry import known_models, model_class

    extras = PYPROJECT["project"]["optional-dependencies"]
    shipped = [m for m in known_models() if model_class(m).__module__.startswith("mstar.models.")]  # not tests'
    families = [m for m in shipped if m != "toy"]  # the toy needs only the core
    assert all(f in extras for f in families), families
    assert all(f in extras["all"][0] for f in families), extras["all"]


def fake_tools(tmp_path: Path, cuda_torch: bool) -> dict[str, str]:
    """nvidia-smi listing a GPU; a `python` that logs pip calls and answers torch checks."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "pip.log"
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-x)'\n")
    (bin_dir / "python").write_text(f"""#!/bin/sh
if [ "$1" = -m ] && [ "$2" = pip ]; then shift 2; echo "pip $*" >> {log}; exit 0; fi
case "$2" in
  *"torch.version.cuda else 1"*) exit {0 if cuda_torch else 1};;
  *) echo "2.11.0+cu130";;
esac
""")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


@needs_make
@pytest.mark.parametrize("cuda_torch", [True, False])
def test_the_gpu_branch_keeps_a_cuda_torch_and_adds_flashinfer(tmp_path, cuda_torch):
    env = fake_tools(tmp_path, cuda_torch)
    plan = subprocess.run(["make", "-n", "-C", str(ROOT), "setup", "PYTHON=python"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert "torch-gpu" in plan.stdout and "torch==2.13.0" not in plan.stdout, plan.stdout
    r = subprocess.run(["make", "-s", "-C", str(ROOT), "torch-gpu", "PYTHON=python"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    pip = (tmp_path / "pip.log").read_text().splitlines()
    installs_torch = [c for c in pip if "torch==" in c]
    if cuda_torch:
        assert installs_torch == [] and "keeping torch 2.11.0+cu130 (a CUDA build is installed)" in r.stdout
    else:
        assert installs_torch == [f"pip install {make_var('TORCH_CUDA')} --index-url {make_var('TORCH_CUDA_INDEX')}"]
    assert f"pip install --no-deps {make_var('FLASHINFER')}" in pip


@needs_make
def test_without_a_gpu_setup_installs_the_cpu_torch(tmp_path):
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2; exit 9\n")
    (tmp_path / "nvidia-smi").chmod(0o755)
    plan = subprocess.run(["make", "-n", "-C", str(ROOT), "setup"], env=env, capture_output=True, text=True, timeout=60)
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in plan.stdout
    assert "torch-gpu" not in plan.stdout and "cu130" not in plan.stdout
    assert "pip install -e '.[dev,all]'" in plan.stdout  # no triton unless asked (TRITON=yes)
    plan = subprocess.run(["make", "-n", "-C", str(ROOT), "setup", "TRITON=yes"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert "pip install -e '.[dev,all,triton]'" in plan.stdout


def test_only_the_triton_extra_asks_for_triton():
    """A CPU host's `make setup` installs `dev,all`: none of those extras may pull triton (286 MB)."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    with_triton = sorted(name for name, reqs in extras.items() if any(r.startswith("triton") for r in reqs))
    assert with_triton == ["triton"], with_triton
