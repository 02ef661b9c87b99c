#!/usr/bin/env python3
"""Generate the TLS material for a fedfuse deployment: a private CA and a SuperLink server certificate.

    python deploy/gen_certs.py --out deploy/certs [--host superlink.example.org] [--ip 10.0.0.5] [--days 365]

Writes ``ca.crt`` / ``ca.key`` (keep ``ca.key`` offline) and ``server.pem`` / ``server.key`` for the
SuperLink. The server certificate's subjectAltName always covers ``localhost`` and ``127.0.0.1``; add the
SuperLink machine's DNS names with ``--host`` and IP addresses with ``--ip`` (repeatable) so SuperNodes
and the ``flwr`` CLI on other machines can verify it. SuperNodes and the CLI only need ``ca.crt``.

Uses ``cryptography`` (installed with flwr); no openssl binary needed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _write_key(path: Path, key) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    os.chmod(path, 0o600)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedfuse"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def generate(out: str | Path, hosts: list[str] | None = None, ips: list[str] | None = None,
             days: int = 365) -> dict[str, Path]:
    """Create CA + server certificate in ``out``; returns the paths (``ca``, ``cert``, ``key``, ``ca_key``)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)
    until = now + dt.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (x509.CertificateBuilder().subject_name(_name("fedfuse test CA")).issuer_name(_name("fedfuse test CA"))
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now).not_valid_after(until)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, encipher_only=False,
                                            decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
               .sign(ca_key, hashes.SHA256()))

    dns = ["localhost"] + [h for h in (hosts or []) if h and h != "localhost"]
    addrs = ["127.0.0.1", "::1"] + [i for i in (ips or []) if i and i not in ("127.0.0.1", "::1")]
    san = [x509.DNSName(h) for h in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in addrs]
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(_name(dns[-1])).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(until)
            .add_extension(x509.SubjectAlternativeName(san), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))

    paths = {"ca": out / "ca.crt", "ca_key": out / "ca.key", "cert": out / "server.pem", "key": out / "server.key"}
    paths["ca"].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    _write_key(paths["ca_key"], ca_key)
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(paths["key"], key)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "certs"))
    ap.add_argument("--host", action="append", default=[], help="extra DNS name of the SuperLink (repeatable)")
    ap.add_argument("--ip", action="append", default=[], help="extra IP address of the SuperLink (repeatable)")
    ap.add_argument("--days", type=int, default=365)
    a = ap.parse_args()
    paths = generate(a.out, a.host, a.ip, a.days)
    for k, p in paths.items():
        print(f"{k:7s} {p}")


if __name__ == "__main__":
    main()
