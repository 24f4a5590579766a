"""Mooncake transport over TCP on loopback: round trips across processes and inside one,
pooled buffers reused only after an ack, close() deregistering, the protocol choice logged,
and reads from a dead or silent session failing fast with the session named."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from mstar.services.transport import mooncake
from mstar.services.transport.base import LinkSender, Protocol, TensorReceiver, pool_id
from mstar.v1 import tensor_pb2 as pb
from mstar.wire import WireError

pytestmark = [
    pytest.mark.skipif(not mooncake.available(), reason=f"Mooncake is not installed: {mooncake.unavailable_reason()}"),
    pytest.mark.timeout(30),
]

KIB, MIB = 1 << 10, 1 << 20
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64, "bool": torch.bool}
SIZES = (64 * KIB, 1 * MIB, 16 * MIB)


def make(dtype: str, nbytes: int, seed: int) -> torch.Tensor:
    """The same tensor in every process: ``nbytes`` of ``dtype`` from ``seed``, 64 columns."""
    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(seed)
    n = nbytes // torch.empty((), dtype=dt).element_size()
    if dt.is_floating_point:
        t = torch.randn(n, generator=g).to(dt)
    elif dt is torch.bool:
        t = torch.randint(0, 2, (n,), generator=g).bool()
    else:
        t = torch.randint(-(1 << 40), 1 << 40, (n,), generator=g, dtype=dt)
    return t.view(-1, 64)


def serve_peer() -> None:
    """The sending process: a LinkSender forced to Mooncake, driven by JSON lines on stdin."""
    logging.basicConfig(level=logging.INFO)
    mooncake.configure("127.0.0.1")
    link = LinkSender(Protocol.RDMA, "peer")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "send":
            msg = pb.Tensor()
            kind = link.encode_into(msg, "x", make(cmd["dtype"], cmd["nbytes"], cmd["seed"]))
            out = {"msg": msg.SerializeToString().hex(), "kind": kind}
        elif cmd["op"] == "release":
            link.release(cmd["ids"])
            sub = link._subs["mooncake"]
            out = {"free": [sub.is_free(pool_id(i)) for i in cmd["ids"]], "registrations": sub.registrations}
        print(json.dumps(out), flush=True)


PEER = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('mooncake_peer', sys.argv[1]); "
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); m.serve_peer()")


class Peer:
    def __init__(self) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="mooncake-peer-", suffix=".log")
        self.proc = subprocess.Popen([sys.executable, "-c", PEER, __file__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)

    def call(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            raise AssertionError(f"the sending process died:\n{self.log.read()}")
        return json.loads(line)

    def close(self) -> str:
        self.proc.kill()  # nothing to flush; an engine takes a second to shut down cleanly
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()
        self.log.seek(0)
        text = self.log.read()
        self.log.close()
        return text


@pytest.fixture(scope="module")
def peer():
    p = Peer()
    yield p
    p.close()


def test_a_ref_never_starts_an_engine(peer):
    """Finding 5 of issue 30: a forged MooncakeRef once started this process's engine (and its
    listeners). A service reads refs only with the engine it advertised when it started."""
    if mooncake.running() is not None:
        pytest.skip("this test process already runs an engine (an earlier test started it)")
    r = peer.call(op="send", dtype="float32", nbytes=1 * MIB, seed=0)
    msg = pb.Tensor.FromString(bytes.fromhex(r["msg"]))
    with pytest.raises(WireError, match="offers no Mooncake session"):
        TensorReceiver().decode(msg, [])
    assert mooncake.running() is None
    peer.call(op="release", ids=[msg.mooncake.buffer_id])


def test_round_trip_across_processes_through_link_sender_and_receiver(peer):
    mooncake.engine()  # this process offers a session, as a service that advertised one
    receiver = TensorReceiver()
    try:
        for nbytes in SIZES:
            for seed, dtype in enumerate(DTYPES):
                r = peer.call(op="send", dtype=dtype, nbytes=nbytes, seed=seed)
                assert r["kind"] == "mooncake", r
                msg = pb.Tensor.FromString(bytes.fromhex(r["msg"]))
                assert msg.WhichOneof("payload") == "mooncake" and msg.ByteSize() < 200  # a reference, not the bytes
                assert msg.mooncake.session.startswith("127.0.0.1:") and msg.mooncake.nbytes == nbytes
                acks: list[int] = []
                got = receiver.decode(msg, acks)
                want = make(dtype, nbytes, seed)
                assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), (dtype, nbytes)
                assert acks == [msg.mooncake.buffer_id]
                assert peer.call(op="release", ids=acks)["free"] == [True]
        # small tensors stay inline even when Mooncake is forced
        r = peer.call(op="send", dtype="float32", nbytes=4 * KIB, seed=0)
        assert r["kind"] == "inline"
        msg = pb.Tensor.FromString(bytes.fromhex(r["msg"]))
        assert torch.equal(receiver.decode(msg, []), make("float32", 4 * KIB, 0))
    finally:
        receiver.close()


def test_in_process_round_trip_of_odd_tensors(monkeypatch):
    monkeypatch.setattr(mooncake, "READ_CHUNK_BYTES", 16 * MIB)  # 40 MiB: three reads through one staging slot
    sender, reader = mooncake.MooncakeSender("t"), mooncake.MooncakeReader()
    try:
        base = torch.arange(3 * 1024 * 64, dtype=torch.float64).view(3, 1024, 64)
        cases = [base.transpose(0, 2),  # not contiguous
                 base[:, ::2],  # strided
                 torch.randn(100_000).to(torch.float16),  # not a power of two bytes
                 torch.randint(0, 255, (40 * MIB + 3,), dtype=torch.uint8)]  # several read chunks
        for i, t in enumerate(cases):
            msg, acks = pb.Tensor(), []
            sender.encode_into(msg, f"t{i}", t)
            assert msg.WhichOneof("payload") == "mooncake" and msg.name == f"t{i}"
            got = reader.read(msg, acks)
            assert torch.equal(got, t) and got.is_contiguous() and acks == [msg.mooncake.buffer_id]
            assert 0 < msg.mooncake.buffer_id < 2**48
            got.add_(1)  # the result is the caller's own memory
            assert not torch.equal(got, t)
            sender.release(acks)
    finally:
        sender.close()
        reader.close()


def test_buffers_reused_after_release_and_not_before():
    s = mooncake.MooncakeSender("t")
    try:
        def send(nbytes: int) -> pb.MooncakeRef:
            msg = pb.Tensor()
            s.encode_into(msg, "x", torch.zeros(nbytes, dtype=torch.uint8))
            return msg.mooncake

        a = send(1 * MIB)
        assert s.registrations == 1
        b = send(1 * MIB)  # a is not acknowledged: b gets another slot of the same registered arena
        assert (b.buffer_id, b.address) != (a.buffer_id, a.address) and s.registrations == 1
        assert not s.is_free(a.buffer_id)
        s.release([a.buffer_id])
        assert s.is_free(a.buffer_id)
        c = send(1 * MIB - 5)  # same size class: a's slot again, nothing registered
        assert (c.buffer_id, c.address) == (a.buffer_id, a.address) and s.registrations == 1

        big1 = send(16 * MIB)  # a class as big as an arena: one arena per slot
        big2 = send(16 * MIB)
        assert big2.address != big1.address and s.registrations == 3
        s.release([big1.buffer_id, big2.buffer_id, big2.buffer_id, 12345])  # repeated and unknown ids are ignored
        big3 = send(16 * MIB)
        assert big3.address in (big1.address, big2.address) and s.registrations == 3
    finally:
        s.close()


def test_close_deregisters_and_later_reads_fail():
    s, r = mooncake.MooncakeSender("t"), mooncake.MooncakeReader()
    msg, msg2 = pb.Tensor(), pb.Tensor()
    s.encode_into(msg, "x", torch.ones(2 * MIB, dtype=torch.uint8))
    s.encode_into(msg2, "y", torch.ones(4 * MIB, dtype=torch.uint8))
    for m in (msg, msg2):  # read, but the sender never sees these acks
        assert torch.equal(r.read(m, []), torch.ones(m.mooncake.nbytes, dtype=torch.uint8))
    eng = mooncake.engine()
    senders, readers = s.registered_addresses, r._pool.registered_addresses
    assert len(senders) == 2 and len(readers) == 2 and all(a in eng.registered for a in senders + readers)
    s.close()  # frees every buffer, acknowledged or not
    assert s.registered_addresses == [] and not any(a in eng.registered for a in senders)
    assert not s.is_free(msg2.mooncake.buffer_id)  # gone, not back in the pool
    acks: list[int] = []
    with pytest.raises(mooncake.MooncakeError, match=f"from session {msg2.mooncake.session} failed"):
        r.read(msg2, acks)
    assert acks == [msg2.mooncake.buffer_id]  # acknowledged even so: nothing more will come of it
    r.close()
    assert r._pool.registered_addresses == [] and not any(a in eng.registered for a in readers)


def test_protocol_choice_is_logged_once_and_advertised(monkeypatch, caplog):
    monkeypatch.setattr(mooncake, "_engine", None)
    monkeypatch.setattr(mooncake, "_config", None)
    assert mooncake.advertise() == ("", "")  # not configured: nothing offered, nothing started
    assert mooncake._engine is None
    with pytest.raises(ValueError, match="one of auto, rdma, tcp"):
        mooncake.configure("127.0.0.1", "carrier-pigeon")
    if not mooncake.rdma_devices():
        with pytest.raises(mooncake.MooncakeError, match="no RDMA devices"):
            mooncake.configure("127.0.0.1", "rdma")
    mooncake.configure("127.0.0.1")
    assert mooncake._engine is None  # lazy
    with caplog.at_level(logging.INFO, logger="mstar.services.transport.mooncake"):
        session, protocol = mooncake.advertise()
        mooncake.engine()
        mooncake.advertise()
    expected = "rdma" if mooncake.rdma_devices() else "tcp"
    assert protocol == expected and session == mooncake.engine().session and session.startswith("127.0.0.1:")
    lines = [r.getMessage() for r in caplog.records if "transfer engine up" in r.getMessage()]
    assert lines == [f"mooncake transfer engine up: protocol {expected}, session {session}"]
    mooncake.configure("127.0.0.1", "auto")  # the same again: fine
    with pytest.raises(mooncake.MooncakeError, match="must come before"):
        mooncake.configure("127.0.0.2")


def ref_to(session: str, nbytes: int = 256 * KIB, buffer_id: int = 7) -> pb.Tensor:
    msg = pb.Tensor(name="x", datatype="UINT8", shape=[nbytes])
    msg.mooncake.session, msg.mooncake.address, msg.mooncake.nbytes = session, 0x7F0000001000, nbytes
    msg.mooncake.buffer_id = buffer_id
    return msg


def test_reads_from_dead_or_silent_sessions_fail_fast_naming_them(monkeypatch):
    monkeypatch.setattr(mooncake, "READ_TIMEOUT_S", 1.0)  # the deadline for a silent peer (default 5 s)
    r = mooncake.MooncakeReader()
    silent = socket.socket()  # accepts connections (the kernel does) and never answers
    try:
        with socket.socket() as s:  # a port nobody listens on any more
            s.bind(("127.0.0.1", 0))
            dead = f"127.0.0.1:{s.getsockname()[1]}"
        for session in (dead, "no-such-host.invalid:15001"):
            acks: list[int] = []
            t0 = time.monotonic()
            with pytest.raises(mooncake.MooncakeError, match=session):
                r.read(ref_to(session), acks)
            assert time.monotonic() - t0 < 3 and acks == [7]

        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        session = f"127.0.0.1:{silent.getsockname()[1]}"
        acks = []
        t0 = time.monotonic()
        with pytest.raises(mooncake.ReadTimedOut, match=f"{session} did not finish within 1.0 s"):
            r.read(ref_to(session), acks)
        assert time.monotonic() - t0 < 3 and acks == [7]
        t0 = time.monotonic()  # while that read is still stuck in the engine, the session fails at once
        with pytest.raises(mooncake.MooncakeError, match=f"{session} does not answer"):
            r.read(ref_to(session, buffer_id=8), acks)
        assert time.monotonic() - t0 < 0.5 and acks == [7, 8]
        # the silent peer goes: its reset ends the stuck native call (Mooncake logs "Socket read
        # failed" for it here, inside this test, not between later tests' dots)
        silent.close()
        deadline = time.monotonic() + 5
        while mooncake.engine()._stuck.get(session) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not mooncake.engine()._stuck.get(session)
    finally:
        silent.close()
        r.close()


def test_link_sender_in_process_end_to_end():
    link, receiver = LinkSender(Protocol.RDMA, "front"), TensorReceiver()
    try:
        big, small = torch.randn(512, 1024), torch.arange(10)
        msgs = [pb.Tensor(), pb.Tensor()]
        assert link.encode_into(msgs[0], "big", big) == "mooncake"
        assert link.encode_into(msgs[1], "small", small) == "inline"
        acks: list[int] = []
        got = [receiver.decode(m, acks) for m in msgs]
        assert torch.equal(got[0], big) and torch.equal(got[1], small)
        assert len(acks) == 1 and acks[0] >> 48 == 2  # the transport bits LinkSender adds: mooncake
        sub = link._subs["mooncake"]
        assert not sub.is_free(pool_id(acks[0]))
        link.release(acks)
        assert sub.is_free(pool_id(acks[0]))
        addresses = sub.registered_addresses
    finally:
        link.close()
        receiver.close()
    assert not any(a in mooncake.engine().registered for a in addresses)


def test_unconfigured_engine_is_loopback_only(monkeypatch):
    monkeypatch.setattr(mooncake, "_engine", None)
    monkeypatch.setattr(mooncake, "_config", None)
    e = mooncake.engine()
    assert e.session.startswith("127.0.0.1:") and not e.configured
    assert mooncake.advertise() == ("", "")
    assert os.environ.get("MC_TCP_PROGRESS_TIMEOUT_SEC")  # a silent peer is bounded by M*'s timeout


def test_configure_resolves_wildcards_and_warns_about_foreign_addresses(monkeypatch, caplog):
    monkeypatch.setattr(mooncake, "_engine", None)
    monkeypatch.setattr(mooncake, "_config", None)
    mooncake.configure("0.0.0.0", "tcp")  # what a service bound to every interface passes
    host, protocol = mooncake._config
    assert host not in ("0.0.0.0", "") and protocol == "tcp"
    with caplog.at_level(logging.WARNING, logger="mstar.services.transport.mooncake"):
        mooncake.configure("192.0.2.77", "tcp")  # TEST-NET-1: not this host's
    assert "192.0.2.77 is not an address of this host" in caplog.text
    assert mooncake._engine is None  # configure() never starts the engine
