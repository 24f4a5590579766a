"""`python -m mstar...` from a checkout that is not installed: the package layout works, and a
missing dependency says to run `make setup` (python -S: no site-packages, so neither the
editable install's finder nor any dependency is there)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_checkout_maps_its_top_level_folders_into_the_package():
    code = ("import mstar.services, mstar.models, mstar.conductor, mstar.gateway; "
            "print(mstar.services.__file__, mstar.models.__file__)")
    r = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(ROOT / "services" / "__init__.py"), str(ROOT / "models" / "__init__.py")]


def test_the_cli_without_dependencies_says_to_run_make_setup():
    r = subprocess.run([sys.executable, "-S", "-m", "mstar.cli", "models"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "mstar: No module named" in r.stderr and "Run `make setup` in the checkout" in r.stderr
