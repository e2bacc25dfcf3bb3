"""`infemeral-server certs`: a private CA and a server certificate it signed, for TLS between client and server.

Clients trust the CA (`--tls-ca ca.crt`), the server presents `server.crt` and `server.key`. A server
certificate for another host, or a renewed one, signed by the same CA needs nothing new on the clients.
`self_signed_certificate` makes the single certificate that clients pin instead (scripts/runpod.py).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import secrets
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from infemeral.files import write_private
from infemeral.paths import DATA_HOME

DEFAULT_DAYS = 825         # what browsers and most TLS stacks still accept for a server certificate
LOCAL_NAMES = ("localhost", "127.0.0.1")  # always in the server certificate: a test on the pod itself works
CA_NAME = "infemeral CA"
DEFAULT_OUT = DATA_HOME / "tls"


def _names(hosts: Sequence[str]):
    """The subject alternative names of `hosts`: an IP address as an IPAddress entry, anything else as a DNS name."""
    from cryptography import x509

    names = []
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host.strip("[]"))))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _certificate(common_name: str, hosts: Sequence[str], days: int, *, is_ca: bool = False, issuer=None):
    """A new P-256 key and its certificate, signed by `issuer` (a (certificate, key) pair) or by itself."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    issuer_cert, issuer_key = issuer if issuer is not None else (None, key)
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(subject).issuer_name(issuer_cert.subject if issuer_cert else subject)
               .public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=is_ca, path_length=0 if is_ca else None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, content_commitment=False,
                                            data_encipherment=False, key_agreement=False, key_cert_sign=is_ca,
                                            crl_sign=is_ca, encipher_only=False, decipher_only=False), critical=True))
    if not is_ca:
        builder = (builder.add_extension(x509.SubjectAlternativeName(_names(hosts)), critical=False)
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False))
    return builder.sign(issuer_key, hashes.SHA256()), key


def _pem(certificate, key) -> tuple[bytes, bytes]:
    from cryptography.hazmat.primitives import serialization

    return (certificate.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


def self_signed_certificate(server_name: str, hosts: Sequence[str] = (), days: int = DEFAULT_DAYS) -> tuple[bytes, bytes]:
    """A self-signed server certificate and its key (PEM) for `server_name`, `hosts` and this machine's own
    names; clients pin the certificate itself."""
    return _pem(*_certificate(server_name, [server_name, *hosts, *LOCAL_NAMES], days))


@dataclass(frozen=True)
class CertificateFiles:
    ca_cert: Path      # what clients trust (--tls-ca)
    ca_key: Path       # signs server certificates: keep it off the server if you can
    server_cert: Path  # --tls-cert
    server_key: Path   # --tls-key

    @classmethod
    def in_folder(cls, folder: Path) -> "CertificateFiles":
        return cls(folder / "ca.crt", folder / "ca.key", folder / "server.crt", folder / "server.key")

    def all(self) -> tuple[Path, ...]:
        return (self.ca_cert, self.ca_key, self.server_cert, self.server_key)


def write_certificates(out: Path, hosts: Sequence[str], days: int = DEFAULT_DAYS,
                       force: bool = False) -> CertificateFiles:
    """A new CA and a server certificate it signed for `hosts` (and localhost), in `out`; keys owner-only.
    Files already there are kept unless `force`: clients may trust that CA already."""
    out = Path(out).expanduser()
    files = CertificateFiles.in_folder(out)
    existing = [p for p in files.all() if p.exists()]
    if existing and not force:
        raise FileExistsError(f"{', '.join(str(p) for p in existing)} already there: pass --force to replace them "
                              f"(clients must then trust the new {files.ca_cert.name}), or --out another folder")
    out.mkdir(parents=True, exist_ok=True)
    ca = _certificate(f"{CA_NAME} {secrets.token_hex(4)}", (), days, is_ca=True)  # two CAs never share a name
    server = _certificate(hosts[0] if hosts else "infemeral-server", [*hosts, *LOCAL_NAMES], days, issuer=ca)
    for (cert_pem, key_pem), cert_path, key_path in ((_pem(*ca), files.ca_cert, files.ca_key),
                                                     (_pem(*server), files.server_cert, files.server_key)):
        write_private(key_path, key_pem)
        write_private(cert_path, cert_pem)
        cert_path.chmod(0o644)  # a certificate is public
    return files


def usage(files: CertificateFiles, hosts: Sequence[str]) -> str:
    """The flags (and environment variables) that put the certificates to use on the server and the client."""
    def q(path: Path) -> str:
        return shlex.quote(str(path.resolve()))

    host = hosts[0] if hosts else "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return (f"wrote {q(files.ca_cert.parent)}: ca.crt, ca.key (owner-only), server.crt, server.key (owner-only)\n"
            f"server:  infemeral-server --listen 0.0.0.0:50051 --tls-cert {q(files.server_cert)} "
            f"--tls-key {q(files.server_key)}\n"
            f"         (or INFEMERAL_TLS_CERT and INFEMERAL_TLS_KEY)\n"
            f"client:  infemeral-client chat --server {host}:50051 --tls-ca {q(files.ca_cert)}\n"
            f"         (or INFEMERAL_TLS_CA; copy ca.crt to the laptop, never the keys)\n"
            f"Keep ca.key private (it could sign certificates your clients would trust); the server needs only "
            f"server.crt and server.key.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="infemeral-server certs",
        description="Write a private CA and a server certificate it signed (ca.crt, ca.key, server.crt, server.key) "
                    "for TLS between infemeral-server and its clients, and print the flags that use them.",
        epilog="example:\n  infemeral-server certs gpu.example.org 203.0.113.7 --out ~/infemeral-tls",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hosts", nargs="*", metavar="HOST",
                        help="DNS name or IP address clients reach the server by (repeat for several); "
                             "localhost and 127.0.0.1 are always included")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"folder to write to (default: {DEFAULT_OUT})")
    parser.add_argument("--days", type=int, default=DEFAULT_DAYS,
                        help=f"how long the certificates are valid (default: {DEFAULT_DAYS})")
    parser.add_argument("--force", action="store_true", help="replace certificates and keys already in --out")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.days < 1:
        print("infemeral-server certs: --days must be at least 1", file=sys.stderr)
        return 2
    try:
        files = write_certificates(args.out, args.hosts, args.days, args.force)
    except (OSError, ValueError) as e:
        print(f"infemeral-server certs: {e}", file=sys.stderr)
        return 2
    print(usage(files, args.hosts))
    return 0
