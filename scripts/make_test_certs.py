#!/usr/bin/env python3
"""Writes a private CA and certificates signed by it, for trying TLS and mTLS between Tandem's processes:

    .venv/bin/python scripts/make_test_certs.py certs/ --server-name localhost --server-name 127.0.0.1

certs/ca.pem (the CA: --tls-client-ca of the servers, --executor-tls-ca of the scheduler, grpcurl -cacert),
certs/server.pem + server.key (--tls-cert/--tls-key: valid for every --server-name, DNS names or IP
addresses), certs/client.pem + client.key (a client certificate for mTLS: the scheduler's --executor-tls-cert
and --executor-tls-key, grpcurl -cert/-key). Keys are ECDSA P-256, written mode 0600; certificates are valid
for --days days. For tests and trials: a real deployment takes its certificates from its own CA (cert-manager,
a company PKI). Needs the `cryptography` package (the test extra).
"""
from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Issued:
    """A certificate and its key, PEM-encoded."""
    cert_pem: bytes
    key_pem: bytes
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Tandem test"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Issued:
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return Issued(cert.public_bytes(serialization.Encoding.PEM), key_pem, cert, key)


def _builder(subject: str, issuer: x509.Name, public_key, days: float) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))  # clocks a little apart
            .not_valid_after(now + datetime.timedelta(days=days)))


def make_ca(common_name: str = "Tandem test CA", days: float = 30) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (_builder(common_name, _name(common_name), key.public_key(), days)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return _pem(cert, key)


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def issue(ca: Issued, common_name: str, names: list[str] | None = None, client: bool = False,
          days: float = 30) -> Issued:
    """A leaf certificate signed by `ca`: a server certificate valid for `names` (DNS names or IP
    addresses), or with client=True a client certificate (extended key usage clientAuth)."""
    key = ec.generate_private_key(ec.SECP256R1())
    usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
    builder = (_builder(common_name, ca.cert.subject, key.public_key(), days)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False))
    sans = names or ([] if client else [common_name])
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName([_san(n) for n in sans]), critical=False)
    return _pem(builder.sign(ca.key, hashes.SHA256()), key)


def write(directory: Path, stem: str, issued: Issued, with_key: bool = True) -> Path:
    """<stem>.pem (and <stem>.key, mode 0600) under directory; returns the certificate's path."""
    directory.mkdir(parents=True, exist_ok=True)
    cert_path = directory / f"{stem}.pem"
    cert_path.write_bytes(issued.cert_pem)
    if with_key:
        key_path = directory / f"{stem}.key"
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(issued.key_pem)
    return cert_path


def make_all(directory: Path, server_names: list[str], client_name: str = "tandem-client",
             days: float = 30) -> None:
    """ca.pem (+ ca.key), server.pem/.key, client.pem/.key under directory."""
    ca = make_ca(days=days)
    write(directory, "ca", ca)
    write(directory, "server", issue(ca, server_names[0], server_names, days=days))
    write(directory, "client", issue(ca, client_name, client=True, days=days))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="directory to write ca.pem, server.pem/.key, client.pem/.key into")
    ap.add_argument("--server-name", action="append", default=[],
                    help="a DNS name or IP address the server certificate is valid for (repeatable; default: "
                         "localhost and 127.0.0.1)")
    ap.add_argument("--client-name", default="tandem-client", help="the client certificate's common name")
    ap.add_argument("--days", type=float, default=30, help="validity in days (default 30)")
    args = ap.parse_args(argv)
    make_all(args.out, args.server_name or ["localhost", "127.0.0.1"], args.client_name, args.days)
    print(f"wrote ca.pem, server.pem, server.key, client.pem, client.key to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
