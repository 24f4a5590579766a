"""The services' grpc settings (mstar.grpc_env) are in force before grpc is imported."""

import ast
import os
import subprocess
import sys
from pathlib import Path

from mstar import grpc_env

ROOT = Path(__file__).resolve().parent.parent


def test_apply_sets_defaults_but_an_operator_value_wins(monkeypatch):
    monkeypatch.delenv("GRPC_EXPERIMENTS", raising=False)
    grpc_env.apply()
    assert os.environ["GRPC_EXPERIMENTS"] == grpc_env.DEFAULTS["GRPC_EXPERIMENTS"]
    monkeypatch.setenv("GRPC_EXPERIMENTS", "")  # the operator turns the tuning off
    grpc_env.apply()
    assert os.environ["GRPC_EXPERIMENTS"] == ""


def test_every_service_entry_point_applies_them_before_any_other_import():
    for main in ("conductor/__main__.py", "services/node_group/__main__.py", "gateway/__main__.py"):
        body = ast.parse((ROOT / main).read_text()).body
        first_import, calls = body[0], [ast.unparse(x) for x in body[1:3]]
        assert isinstance(first_import, ast.ImportFrom) and first_import.module == "mstar", main
        assert [a.name for a in first_import.names] == ["grpc_env", "lifetime"], main
        assert calls == ["lifetime.adopt()", "grpc_env.apply()"], main  # adopt: die with the launcher


def test_grpc_reads_them_at_import():
    """What makes the order matter: an experiment named after grpc's import is ignored, one
    named before it is parsed (an unknown name is reported)."""
    code = ("import os; {before}import grpc; {after}"
            "import grpc.aio, asyncio; asyncio.run(grpc.aio.insecure_channel('127.0.0.1:9').close())")
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    set_it = "os.environ['GRPC_EXPERIMENTS'] = 'no_such_experiment_xyz'; "
    before = subprocess.run([sys.executable, "-c", code.format(before=set_it, after="")], env=env,
                            capture_output=True, text=True, timeout=60)
    after = subprocess.run([sys.executable, "-c", code.format(before="", after=set_it)], env=env,
                           capture_output=True, text=True, timeout=60)
    assert "Unknown experiment: no_such_experiment_xyz" in before.stderr
    assert "no_such_experiment_xyz" not in after.stderr
