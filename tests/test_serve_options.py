"""`mstar serve` options from the original M*'s docs: what the launcher hands each service, and the
checks made before anything starts (a clear error naming the flag, no traceback)."""

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mstar import cli
from mstar.launcher import LaunchError, LaunchOptions, Mesh
from mstar.ports import PortInUse
from mstar.services.transport import mooncake

TOY_CONFIGS = Path(__file__).resolve().parent.parent / "models" / "toy" / "configs"


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli._serve_args(p)
    return p.parse_args(list(argv))


def mesh(toy_config, **opts) -> Mesh:
    return Mesh(toy_config(), LaunchOptions(TOY_CONFIGS / "default.yaml", port=0, grpc_port=0, **opts))


def test_timeout_is_a_spelling_of_request_timeout():
    assert parse("--timeout", "7").request_timeout == 7.0
    assert parse("--request-timeout", "8").request_timeout == 8.0
    assert parse().request_timeout == 300.0
    with pytest.raises(ValueError, match="--request-timeout/--timeout must be a positive number of seconds, got -1"):
        LaunchOptions(TOY_CONFIGS / "default.yaml", request_timeout_s=-1)


def test_startup_timeout_is_an_option_and_a_slow_service_is_named_while_waited_for(toy_config, monkeypatch, capsys):
    """``--startup-timeout`` reaches the launch; a service not yet healthy is named on stderr
    every WAIT_NOTE_S, and one never healthy fails the start naming it."""
    import mstar.launcher as launcher

    assert parse().startup_timeout == 900.0 and parse("--startup-timeout", "30").startup_timeout == 30.0
    with pytest.raises(ValueError, match="--startup-timeout must be a positive number of seconds, got 0"):
        LaunchOptions(TOY_CONFIGS / "default.yaml", startup_timeout_s=0)
    monkeypatch.setattr(launcher, "WAIT_NOTE_S", 0.2)
    m = mesh(toy_config, startup_timeout_s=0.7)
    slow = launcher.Service("slow", "node_group", "127.0.0.1:9", [], probe=lambda: False)
    with pytest.raises(LaunchError, match="service 'slow' did not become healthy within 0.7 s"):
        m._wait_healthy(slow)
    notes = [x for x in capsys.readouterr().err.splitlines() if "waiting for node_group 'slow' (127.0.0.1:9)" in x]
    assert 2 <= len(notes) <= 4 and notes[0].endswith("0 s of --startup-timeout 0.7 s"), notes


def test_the_options_reach_the_services(toy_config, tmp_path):
    m = mesh(toy_config, nvtx=True, shm_prefix="mstar-opt-", upload_dir=str(tmp_path), upload_spill_mb=0.5,
             upload_dir_max_mb=8, transfer_address="127.0.0.2", request_timeout_s=30)
    assert m.environment() == {"MSTAR_SHM_PREFIX": "mstar-opt-", "MSTAR_NVTX": "1"}
    by = {s.name: s for s in m.services}
    gw = by["gateway"].argv
    assert gw[gw.index("--upload-dir") + 1:gw.index("--upload-dir") + 6] == [
        str(tmp_path), "--upload-spill-mb", "0.5", "--upload-dir-max-mb", "8"]
    assert gw[gw.index("--request-timeout") + 1] == "30"
    assert [by[g].host for g in ("encoder", "decoder", "audio")] == ["127.0.0.2"] * 3  # tensors cross there
    assert by["conductor"].host == by["gateway"].host == "127.0.0.1"  # the public ports stay on --host
    assert mesh(toy_config).environment() == {"MSTAR_SHM_PREFIX": f"mstar-{os.getpid()}-"}  # nvtx off by default
    assert "--upload-dir" not in {s.name: s for s in mesh(toy_config).services}["gateway"].argv


def test_every_started_service_gets_the_mesh_environment(toy_config, monkeypatch):
    """start() hands each process the launcher's environment plus the mesh's (MSTAR_NVTX, the
    shm prefix, the launcher's pid for lifetime.adopt) plus its own (its Mooncake ports), and
    starts it without a preexec_fn (a real fork() in a process using gRPC can deadlock)."""
    import mstar.launcher as launcher

    started, handed = {}, {}

    class FakeProc:
        returncode = 0

        def __init__(self, argv, env, stdin, pass_fds=()):
            self.argv = argv
            name = argv[argv.index("--group") + 1] if "--group" in argv else argv[2]
            started[name] = env
            # the mesh's TLS (made in memory) reaches the services that serve internal gRPC through a pipe
            handed[name] = pass_fds == (int(argv[argv.index("--tls-fd") + 1]),) if "--tls-fd" in argv else pass_fds

        def poll(self):
            return 0

    monkeypatch.setattr(launcher.subprocess, "Popen", FakeProc)
    monkeypatch.setattr(Mesh, "_wait_healthy", lambda self, s: None)
    # nothing binds (the processes are fakes), and these fixed ports lie in the ephemeral range, where a
    # concurrent test's client socket may hold one (a CI run failed so); the check has tests of its own
    monkeypatch.setattr(launcher, "taken_ports", lambda host, ports: [])
    monkeypatch.setenv("MSTAR_TEST_INHERITED", "yes")
    m = mesh(toy_config, nvtx=True, mooncake_port=41000, shm_prefix=f"mstar-envtest{os.getpid()}-")
    m.start()
    m.stop()
    assert set(started) == {"encoder", "decoder", "audio", "mstar.conductor", "mstar.gateway"}
    for name, env in started.items():
        assert env["MSTAR_NVTX"] == "1" and env["MSTAR_SHM_PREFIX"] == m.shm_prefix, name
        assert env["MSTAR_TEST_INHERITED"] == "yes" and env["MSTAR_PARENT_PID"] == str(os.getpid()), name
    ports = [(started[n]["MC_MIN_RPC_PORT"], started[n]["MC_MAX_RPC_PORT"])
             for n in ("encoder", "decoder", "audio", "mstar.conductor")]
    assert ports == [("41000", "41001"), ("41002", "41003"), ("41004", "41005"), ("41006", "41007")]
    assert "MC_MIN_RPC_PORT" not in started["mstar.gateway"]
    assert handed == {"encoder": True, "decoder": True, "audio": True, "mstar.conductor": True, "mstar.gateway": ()}


def test_mooncake_ports_are_checked_before_anything_starts(toy_config):
    with pytest.raises(LaunchError, match=r"--mooncake-port 65530: this mesh's 4 services need ports 65530-65537; "
                                          r"pass a port from 1 to 65528"):
        mesh(toy_config, mooncake_port=65530)
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        m = mesh(toy_config, mooncake_port=port - 2)
        with pytest.raises(PortInUse, match=rf"node_group 'decoder' Mooncake #1 \(--mooncake-port\) \(0.0.0.0:{port}\)"):
            m.check_ports()


@pytest.mark.parametrize("argv,env,words", [
    (["--tcp-transfer-device", "nosuch0"], {}, "--tcp-transfer-device nosuch0: no network interface named 'nosuch0' "
                                               "on this host; its interfaces: "),
    (["--tcp-transfer-device", "10.255.255.254"], {}, "--tcp-transfer-device 10.255.255.254: not an address of this host"),
    (["--socket-path-prefix", "/tmp/mstar_alice/"], {}, "M* has no Unix sockets; the prefix names this mesh's "
                                                        "shared-memory segments in /dev/shm"),
    (["--mooncake-port", "40000", "--tensor-comm-protocol", "TCP"], {}, "--mooncake-port: --tensor-comm-protocol TCP "
                                                                         "never uses Mooncake"),
    (["--upload-dir", "/proc/mstar-uploads"], {}, "--upload-dir /proc/mstar-uploads: cannot create it"),
    (["--enable-nvtx"], {}, "--enable-nvtx needs a CUDA build of torch and a GPU"),
    ([], {"MSTAR_NVTX": "1"}, "--enable-nvtx needs a CUDA build of torch and a GPU"),
])
def test_a_bad_option_is_a_clear_error_before_anything_starts(argv, env, words):
    if "CUDA" in words:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this host has CUDA: NVTX ranges are allowed")
    r = subprocess.run([sys.executable, "-m", "mstar.cli", "serve", "toy", "--port", "0", "--grpc-port", "0", *argv],
                       capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert words in r.stderr and "M* ready" not in r.stdout, r.stderr[-2000:]


def test_mooncake_port_needs_mooncake(monkeypatch):
    monkeypatch.setattr(mooncake, "available", lambda: False)
    with pytest.raises(ValueError, match="--mooncake-port: cannot import mooncake.engine"):
        cli._serve_settings(parse("--mooncake-port", "40000"))


@pytest.fixture()
def own_signal_handlers():
    """run_forever installs SIGTERM / SIGINT handlers: the test process gets its own back."""
    import signal

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def test_a_stop_signal_during_start_stops_what_runs(own_signal_handlers, capsys):
    """SIGTERM inside start() (here, once every service runs) ends run_forever with exit 0 and
    the mesh stopped."""
    import signal
    import time

    import mstar.launcher as launcher

    class StartingMesh:
        stopped = False

        def start(self):
            os.kill(os.getpid(), signal.SIGTERM)  # the handler raises at the next bytecode
            time.sleep(5)
            raise AssertionError("the signal did not stop the start")

        def running(self):
            return True

        def stop(self):
            self.stopped = True

    m = StartingMesh()
    assert launcher.run_forever(lambda: m) == 0 and m.stopped
    assert "mstar: stopped during startup" in capsys.readouterr().err


def test_a_port_taken_between_choice_and_bind_fails_the_start_as_port_taken(toy_config, monkeypatch):
    """Another process binds a node group's chosen port after the launcher checked it and before
    the group binds it: the group exits EXIT_PORT_IN_USE, start() raises PortTaken naming it, and
    nothing is left running."""
    import socket

    from mstar.launcher import PortTaken

    m = mesh(toy_config)
    decoder = next(s for s in m.services if s.name == "decoder")
    checked = m.check_ports
    with socket.socket() as thief:
        def check_then_take():
            checked()
            thief.bind(("127.0.0.1", int(decoder.address.rsplit(":", 1)[1])))
            thief.listen()
        monkeypatch.setattr(m, "check_ports", check_then_take)
        with pytest.raises(PortTaken, match="service 'decoder' could not listen on a port chosen for it"):
            m.start()
    assert not m.running()


def test_a_start_that_found_a_port_taken_is_made_again_on_other_ports(toy_config, monkeypatch, own_signal_handlers,
                                                                      capsys):
    """run_forever: a start that fails with PortTaken is made again on a new Mesh (its ports chosen
    again), up to ``tries`` starts; past them the PortTaken is the caller's (`mstar serve`: exit 2)."""
    from types import SimpleNamespace

    import mstar.launcher as launcher

    meshes, fail = [], 2

    def start(self):
        meshes.append(self)
        if len(meshes) <= fail:
            raise launcher.PortTaken("service 'decoder' could not listen on a port chosen for it: another process "
                                     "took it meanwhile")

    gone = SimpleNamespace(name="decoder", kind="node_group", address="-", proc=SimpleNamespace(returncode=-9))
    monkeypatch.setattr(Mesh, "start", start)
    monkeypatch.setattr(Mesh, "dead", lambda self: gone)  # serving ends at once: a service "died"
    monkeypatch.setattr(Mesh, "stop", lambda self: None)
    assert launcher.run_forever(lambda: mesh(toy_config)) == 1 and len(meshes) == 3
    assert len({next(s.address for s in m.services if s.name == "decoder") for m in meshes}) == 3  # ports chosen again
    err = capsys.readouterr().err
    assert "starting the mesh again on other ports (try 2 of 3)" in err and "(try 3 of 3)" in err
    meshes.clear()
    fail = 3
    with pytest.raises(launcher.PortTaken, match="service 'decoder' could not listen"):
        launcher.run_forever(lambda: mesh(toy_config))
    assert len(meshes) == 3
