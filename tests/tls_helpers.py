"""Test certificates made with ``cryptography`` at test time (no key is ever committed): a CA, and certificates it
signs for servers (by DNS name and IP address) and clients."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class CertFiles:
    certfile: str
    keyfile: str


@dataclass(frozen=True)
class TestCA:
    """A self-signed CA whose certificate is ``ca_certs``; ``issue`` writes certificates signed by it."""

    __test__ = False  # not a pytest test class
    directory: Path
    ca_certs: str
    _key: ec.EllipticCurvePrivateKey
    _cert: x509.Certificate

    @classmethod
    def create(cls, directory: Path, name: str = "splitserve test CA") -> TestCA:
        directory.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (
            _builder(subject, subject, key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(key, hashes.SHA256())
        )
        path = directory / "ca.crt"
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return cls(directory, str(path), key, cert)

    def issue(self, name: str, dns_names: tuple[str, ...] = (), ip_addresses: tuple[str, ...] = ()) -> CertFiles:
        """A certificate (for server and client authentication) named ``name``, with those SANs, and its key,
        written to ``<name>.crt`` / ``<name>.key``."""
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns_names]
        sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in ip_addresses]
        builder = _builder(
            x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]), self._cert.subject, key.public_key()
        )
        builder = builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        certfile, keyfile = self.directory / f"{name}.crt", self.directory / f"{name}.key"
        certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        keyfile.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        keyfile.chmod(0o600)
        return CertFiles(str(certfile), str(keyfile))


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )
