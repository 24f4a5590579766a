"""Generated stubs in mstar/v1 must be what `make proto` produces from proto/."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_stubs_are_fresh(tmp_path):
    protos = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *protos], check=True, timeout=60)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc produced nothing"
    stale = [str(p) for p in generated if (ROOT / p).read_bytes() != (tmp_path / p).read_bytes()]
    assert not stale, f"stale generated stubs (run `make proto`): {stale}"


def test_every_proto_field_is_commented():
    for proto in (ROOT / "proto").rglob("*.proto"):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            s = line.strip()
            is_field = s.endswith(";") and "=" in s and not s.startswith(("option", "syntax", "package", "import", "//"))
            if is_field and not s.split()[0].isupper():  # enum values may be self-explanatory
                prev = lines[i - 1].strip()
                assert prev.startswith("//") or "//" in line, f"{proto.name}:{i + 1}: field without a comment: {s}"
