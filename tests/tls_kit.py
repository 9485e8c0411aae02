"""A self-signed certificate for 127.0.0.1, made by a test (the ``cryptography`` package)."""

from __future__ import annotations

import datetime
import ipaddress
import pathlib

from hicache.server.app import TlsFiles

LOOPBACK = ipaddress.ip_address("127.0.0.1")


def self_signed(directory: pathlib.Path) -> TlsFiles:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(LOOPBACK)]), critical=False)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    certfile, keyfile = directory / "cert.pem", directory / "key.pem"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ))  # fmt: skip
    return TlsFiles(str(certfile), str(keyfile))
