"""Mutual TLS between M*'s services: one settings object for every internal server and channel.

The internal surfaces (the conductor's internal port with ``WalkEvents``, every node group's
``NodeGroup``) serve TLS and require a client certificate signed by the mesh's CA; every channel
between services presents the mesh's certificate and checks the peer's against the same CA.
A mesh shares one CA; its certificate names ``SERVER_NAME`` (DNS SAN), and channels verify that
name whatever address they dial (``grpc.ssl_target_name_override``): node-group replicas join
with whatever IP their container has, which no certificate made in advance could list.

TLS is the default. ``mstar serve`` makes a CA and the mesh's certificate in memory at start and hands
them to each service it starts through an inherited pipe (``--tls-fd``): no key is ever written to
disk, so a SIGKILLed launcher leaves none behind, and the CA's key never leaves the launcher. A
service started by hand takes ``--tls-dir DIR`` (``mstar tls init DIR``). Plaintext needs
``--insecure-internal``, and even then every internal bind must be loopback (``check_binds``).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

#: the name every mesh certificate carries and every internal channel verifies
SERVER_NAME = "mstar.internal"
FILES = ("ca.pem", "cert.pem", "key.pem")
TLS_DIR_HELP = ("directory with ca.pem (the mesh's CA), cert.pem and key.pem (this service's certificate, for DNS name "
                f"'{SERVER_NAME}', and its key): internal gRPC (WalkEvents, NodeGroup) uses mutual TLS with them")
INSECURE_HELP = ("internal gRPC in PLAINTEXT (development only; loopback binds only): any local process can then join "
                 "the mesh, read requests and send it frames")
#: ``--insecure-internal=quiet``: the launcher already warned about plaintext once for the whole mesh
QUIET = "quiet"


class TLSError(ValueError):
    """A TLS directory that cannot be used, or plaintext on a non-loopback address."""


@dataclass(frozen=True)
class TLSSettings:
    ca: bytes = field(repr=False)
    cert: bytes = field(repr=False)
    key: bytes = field(repr=False)
    source: str = ""  # where they were read (for messages)
    server_name: str = SERVER_NAME

    @classmethod
    def in_memory(cls, hosts: Sequence[str] = (), days: int = 365) -> TLSSettings:
        """A fresh CA and one mesh certificate, never written anywhere: the CA's key is dropped
        once the certificate is signed (nothing else is ever signed by it)."""
        ca_key, ca = make_ca(days=days)
        key, cert = issue(ca_key, ca, hosts, days)
        return cls(ca, cert, _key_pem(key), "made in memory for this mesh")

    def to_bundle(self) -> bytes:
        """What a launcher writes into a service's ``--tls-fd`` pipe."""
        return json.dumps({"ca": self.ca.decode(), "cert": self.cert.decode(), "key": self.key.decode()}).encode()

    @classmethod
    def from_fd(cls, fd: int) -> TLSSettings:
        """Read (to its end) and close the pipe a launcher handed over with ``--tls-fd``."""
        chunks = []
        try:
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
        except OSError as e:
            raise TLSError(f"--tls-fd {fd}: cannot read it: {e.strerror or e}") from None
        finally:
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            d = json.loads(b"".join(chunks))
            return cls(d["ca"].encode(), d["cert"].encode(), d["key"].encode(), "handed over by the launcher")
        except (ValueError, KeyError, TypeError, AttributeError):
            raise TLSError(f"--tls-fd {fd}: not a TLS bundle from `mstar serve`") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> TLSSettings:
        d = Path(path).expanduser()
        if not d.is_dir():
            raise TLSError(f"--tls-dir {path}: not a directory; it must hold {', '.join(FILES)} "
                           f"(`mstar tls init {path}` makes a CA and a certificate there)")
        missing = [f for f in FILES if not (d / f).is_file()]
        if missing:
            raise TLSError(f"--tls-dir {path}: missing {', '.join(missing)} (it must hold {', '.join(FILES)}; "
                           f"`mstar tls init {path}` makes them)")
        ca, cert, key = ((d / f).read_bytes() for f in FILES)
        return cls(ca, cert, key, str(d))

    def server_credentials(self) -> grpc.ServerCredentials:
        """Serve TLS; a client without a certificate signed by the mesh's CA is refused in the handshake."""
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)]


def load(tls_dir: str | None) -> TLSSettings | None:
    return None if not tls_dir else TLSSettings.from_dir(tls_dir)


def add_args(p: argparse.ArgumentParser) -> None:
    """A service's TLS flags: exactly one of --tls-dir, --tls-fd (the launcher's) and --insecure-internal."""
    p.add_argument("--tls-dir", default=None, help=TLS_DIR_HELP)
    p.add_argument("--tls-fd", type=int, default=None, help=argparse.SUPPRESS)  # a pipe mstar serve writes the keys to
    p.add_argument("--insecure-internal", nargs="?", const="warn", choices=("warn", QUIET), default=None,
                   help=INSECURE_HELP)


def from_args(args: argparse.Namespace, binds: dict[str, str], who: str, required: bool = True) -> TLSSettings | None:
    """The TLS a service was started with (``add_args``), after ``check_binds``. Raise TLSError when
    none was chosen (``required``) or more than one was."""
    given = [f for f, v in (("--tls-dir", args.tls_dir), ("--tls-fd", args.tls_fd),
                            ("--insecure-internal", args.insecure_internal)) if v is not None]
    if len(given) > 1:
        raise TLSError(f"{who}: {' and '.join(given)} exclude each other; pass one")
    tls = None
    if args.tls_fd is not None:
        tls = TLSSettings.from_fd(args.tls_fd)
    elif args.tls_dir:
        tls = TLSSettings.from_dir(args.tls_dir)
    elif required and args.insecure_internal is None:
        raise TLSError(f"{who}: internal gRPC needs mutual TLS: pass --tls-dir DIR (ca.pem, cert.pem, key.pem; "
                       f"`mstar tls init DIR` makes them), or --insecure-internal for plaintext on loopback "
                       f"(development only)")
    check_binds(tls, binds, who, warn=args.insecure_internal != QUIET)
    return tls


def aio_channel(address: str, tls: TLSSettings | None, options=()) -> grpc.aio.Channel:
    """An internal channel: mutual TLS with ``tls``, else plaintext (loopback development)."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=[*options, *tls.channel_options()])


def sync_channel(address: str, tls: TLSSettings | None, options=()) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, tls.channel_credentials(), options=[*options, *tls.channel_options()])


def add_port(server, address: str, tls: TLSSettings | None) -> int:
    """Bind ``address`` on a grpc server, with mutual TLS when ``tls`` is given (0: bind failed)."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials())


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_of(address: str) -> str:
    return address.rsplit(":", 1)[0].strip("[]")


def check_binds(tls: TLSSettings | None, addresses: dict[str, str], who: str, warn: bool = True) -> None:
    """Internal gRPC without TLS only on loopback: raise TLSError naming what binds elsewhere;
    on loopback, warn loudly (any local process can join the mesh or inject frames) unless the
    launcher already did (``warn=False``)."""
    if tls is not None:
        return
    exposed = {what: a for what, a in addresses.items() if not is_loopback(host_of(a))}
    if exposed:
        listed = ", ".join(f"{what} {a}" for what, a in exposed.items())
        raise TLSError(f"{who}: refusing plaintext internal gRPC on a non-loopback address ({listed}): anyone who reaches "
                       f"it could join the mesh and read every request. Drop --insecure-internal (`mstar serve` makes "
                       f"a mesh CA in memory; a service started by hand takes --tls-dir DIR, which `mstar tls init DIR` "
                       f"fills), or bind 127.0.0.1")
    if warn:
        log.warning("%s: internal gRPC WITHOUT TLS (--insecure-internal; development only): any local process can "
                    "join this mesh or send it frames", who)


# -- making a CA and a mesh certificate (the `cryptography` package) -----------------------------
def write_mesh_ca(directory: str | Path, hosts: Sequence[str] = (), days: int = 365) -> Path:
    """Write a fresh CA's certificate and one certificate for the whole mesh into ``directory``
    (ca.pem, cert.pem, key.pem): the certificate names ``SERVER_NAME``, localhost, 127.0.0.1 and
    ``hosts``, and serves as both server and client certificate. The CA's key is never written:
    the folder is what every service reads, and a service holding the CA's key could mint
    certificates. Returns the directory. Files are written owner-only."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tls = TLSSettings.in_memory(hosts, days)
    _write(d / "ca.pem", tls.ca)
    _write(d / "cert.pem", tls.cert)
    _write(d / "key.pem", tls.key)
    return d


def make_ca(name: str = "M* mesh CA", days: int = 365):
    """(private key, certificate PEM) of a new self-signed CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, _cert_pem(cert)


def issue(ca_key, ca_cert_pem: bytes, hosts: Sequence[str] = (), days: int = 365):
    """(private key, certificate PEM) signed by the CA, for ``SERVER_NAME`` + localhost + 127.0.0.1 + ``hosts``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for h in dict.fromkeys([SERVER_NAME, "localhost", "127.0.0.1", *hosts]):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SERVER_NAME)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return key, _cert_pem(cert)


def _cert_pem(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
