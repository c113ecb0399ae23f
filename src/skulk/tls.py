"""The node's TLS files: `skulk tls self-signed` makes a certificate and key for a LAN, and `check_pair` tells an
operator at start-up, in one line, why a pair cannot be served (rather than a handshake failing later).

A self-signed pair is its own CA: every node of a cluster can share it (peers verify each other against it,
peer_tls.py), and a client is pointed at cert.pem (`verify=` in the openai client, `--cacert` in curl).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import ssl
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

VALID_DAYS = 365
ALWAYS_NAMES = ("localhost", "127.0.0.1", "::1")
"""Every pair names these, so a node is reachable on its own machine."""


class TlsError(ValueError):
    """A TLS file that cannot be used; the message names the file and why."""


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def self_signed(hosts: list[str], days: int = VALID_DAYS) -> tuple[bytes, bytes]:
    """(cert PEM, key PEM): a P-256 key and a certificate for `hosts` plus ALWAYS_NAMES, valid `days` from now
    (an hour back, for clocks a little apart); a CA certificate, so it can be the trust anchor it is."""
    key = ec.generate_private_key(ec.SECP256R1())
    names = list(dict.fromkeys([*hosts, *ALWAYS_NAMES]))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0]),
                         x509.NameAttribute(NameOID.ORGANIZATION_NAME, "skulk")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([_san(n) for n in names]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def write_pair(out: Path, hosts: list[str]) -> tuple[Path, Path]:
    """cert.pem (0644) and key.pem (0600, created so: never readable by others, not even for a moment)."""
    cert_pem, key_pem = self_signed(hosts)
    out.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = out / "cert.pem", out / "key.pem"
    cert_path.write_bytes(cert_pem)
    key_path.unlink(missing_ok=True)
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(key_pem)
    return cert_path, key_path


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise TlsError(f"cannot read the TLS {what} {path}: {exc.strerror or exc}") from exc


def check_pair(cert: Path, key: Path) -> None:
    """TlsError unless `cert` is a PEM certificate, `key` a PEM private key (unencrypted) and they match."""
    try:
        certificate = x509.load_pem_x509_certificate(_read(cert, "certificate"))
    except ValueError as exc:
        raise TlsError(f"the TLS certificate {cert} is not a PEM certificate: {exc}") from exc
    try:
        private = serialization.load_pem_private_key(_read(key, "key"), password=None)
    except (ValueError, TypeError) as exc:
        raise TlsError(f"the TLS key {key} is not an unencrypted PEM private key: {exc}") from exc
    der = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if private.public_key().public_bytes(*der) != certificate.public_key().public_bytes(*der):
        raise TlsError(f"the TLS key {key} does not match the certificate {cert}")


def check_ca(ca: Path) -> None:
    """TlsError unless `ca` holds at least one PEM certificate."""
    try:
        x509.load_pem_x509_certificates(_read(ca, "CA file"))
    except ValueError as exc:
        raise TlsError(f"the TLS CA file {ca} holds no PEM certificate: {exc}") from exc


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """What the model store's file server wraps its socket in (uvicorn builds the API's own from the same files)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context


def main(argv: list[str]) -> None:
    """`skulk tls self-signed --out DIR [--host NAME ...]`."""
    parser = argparse.ArgumentParser(prog="skulk tls", description="TLS files for a node's API.")
    commands = parser.add_subparsers(dest="command", required=True)
    made = commands.add_parser("self-signed", help="write cert.pem and key.pem for a LAN (one pair for every node)")
    made.add_argument("--out", required=True, type=Path, help="directory to write cert.pem and key.pem into")
    made.add_argument("--host", dest="hosts", action="append", default=[],
                      help="a name or address clients and peers use for a node, repeatable (localhost, "
                      "127.0.0.1 and ::1 are always included)")
    args = parser.parse_args(argv)
    cert_path, key_path = write_pair(args.out.expanduser(), args.hosts)
    print(f"wrote {cert_path} and {key_path} (valid {VALID_DAYS} days)")
    print(f"# start every node with: skulk --tls-cert {cert_path} --tls-key {key_path}", file=sys.stderr)
    print(f"# clients verify with it: curl --cacert {cert_path} https://localhost:52415/v1/models", file=sys.stderr)
