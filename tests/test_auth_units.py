"""API keys (mstar/auth.py) and the plaintext-bind rule (mstar/tls.py), without a mesh."""

import logging

import pytest

from mstar import auth
from mstar import tls as mtls

KEY = "k" * 16 + "-first"


def test_keys_from_a_file_and_the_environment(tmp_path):
    f = tmp_path / "keys"
    f.write_text(f"# comment\n\n{KEY}   # trailing comment\n")
    keys = auth.ApiKeys.load(str(f), env_value="second-key-0123456789, ")
    assert keys.enabled and len(keys.keys) == 2
    assert keys.identify(KEY) == auth.key_id(KEY) and keys.identify("second-key-0123456789")
    assert keys.identify("k" * 16) is None and keys.identify("") is None and keys.identify(None) is None
    assert KEY not in repr(keys) and "second-key" not in repr(keys), "keys never show in a repr (or a log line)"
    assert not auth.ApiKeys.load(None, env_value="").enabled


def test_weak_or_unreadable_keys_are_refused_naming_where(tmp_path):
    f = tmp_path / "keys"
    f.write_text("short\n")
    with pytest.raises(auth.ApiKeyError, match=r"keys, line 1: an API key must be at least 16"):
        auth.ApiKeys.load(str(f), env_value="")
    with pytest.raises(auth.ApiKeyError, match="MSTAR_API_KEYS, entry 2"):
        auth.ApiKeys.load(None, env_value=f"{KEY},has space inside it")
    with pytest.raises(auth.ApiKeyError, match="cannot read it"):
        auth.ApiKeys.load(str(tmp_path / "missing"), env_value="")


def test_bearer_and_the_per_key_limit():
    assert auth.bearer("Bearer abc") == "abc" and auth.bearer("bearer  abc ") == "abc"
    assert auth.bearer("Basic abc") is None and auth.bearer("Bearer ") is None and auth.bearer(None) is None
    lim = auth.KeyLimiter(2)
    assert lim.acquire("a") and lim.acquire("a") and not lim.acquire("a") and lim.acquire("b")
    lim.release("a")
    assert lim.acquire("a")
    for _ in range(3):
        lim.release("a")
    assert "a" not in lim.inflight
    assert all(auth.KeyLimiter(0).acquire("x") for _ in range(100)), "0: no limit"


def test_plaintext_internal_grpc_only_on_loopback(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        mtls.check_binds(None, {"--address": "127.0.0.1:7000", "other": "[::1]:1", "l": "localhost:2"}, "svc")
    assert "WITHOUT TLS" in caplog.text
    for exposed in ("0.0.0.0:7000", "10.0.0.1:7000", "[::]:7000", "node-a:7000"):
        with pytest.raises(mtls.TLSError, match=r"svc: refusing plaintext .*--tls-dir"):
            mtls.check_binds(None, {"--address": exposed}, "svc")
    tls = mtls.TLSSettings.from_dir(mtls.write_mesh_ca(tmp_path / "tls"))
    mtls.check_binds(tls, {"--address": "0.0.0.0:7000"}, "svc")  # with TLS anything goes
    assert "BEGIN" not in repr(tls), "key material never shows in a repr"
    with pytest.raises(mtls.TLSError, match="missing cert.pem"):
        (tmp_path / "tls" / "cert.pem").unlink()
        mtls.TLSSettings.from_dir(tmp_path / "tls")


def _pipe_with(data: bytes) -> int:
    import os

    r, w = os.pipe()
    os.write(w, data)
    os.close(w)
    return r


def test_the_launchers_tls_pipe_and_its_refusals(tmp_path):
    """--tls-fd: the bundle a launcher writes comes back whole, and the pipe is closed; anything
    else is refused naming the flag. A service given two TLS choices, or none, is refused too."""
    import argparse
    import os

    made = mtls.TLSSettings.in_memory(["10.0.0.7"])
    fd = _pipe_with(made.to_bundle())
    got = mtls.TLSSettings.from_fd(fd)
    assert (got.ca, got.cert, got.key) == (made.ca, made.cert, made.key)
    with pytest.raises(OSError):
        os.fstat(fd)  # read to its end and closed
    with pytest.raises(mtls.TLSError, match=r"--tls-fd \d+: not a TLS bundle"):
        mtls.TLSSettings.from_fd(_pipe_with(b'{"ca": "x"}'))
    with pytest.raises(mtls.TLSError, match=r"--tls-fd 12345: cannot read it"):
        mtls.TLSSettings.from_fd(12345)
    p = argparse.ArgumentParser()
    mtls.add_args(p)
    both = p.parse_args(["--tls-dir", str(tmp_path), "--insecure-internal"])
    with pytest.raises(mtls.TLSError, match="--tls-dir and --insecure-internal exclude each other"):
        mtls.from_args(both, {}, "svc")
    with pytest.raises(mtls.TLSError, match="svc: internal gRPC needs mutual TLS"):
        mtls.from_args(p.parse_args([]), {}, "svc")
    assert mtls.from_args(p.parse_args([]), {}, "xds", required=False) is None
