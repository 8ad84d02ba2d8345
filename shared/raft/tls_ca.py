"""The cluster's Raft CA: mints the certificates ``shared.raft.tls`` checks (its docstring has the
scheme). Used by the global scheduler and by tests; replicas do not import it."""

from __future__ import annotations

import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shared.private_files import private_dir, write_private
from shared.raft.tls import IdentityError, MemberIdentity, member_of, member_uri

CA_CERT_FILE = "raft-ca.pem"
CA_KEY_FILE = "raft-ca-key.pem"  # not *.key: that names CurveZMQ principals
CA_DAYS = 3650
MEMBER_DAYS = 3650  # a kernel may run for months; a replaced member gets a new certificate
_CLOCK_SKEW = datetime.timedelta(hours=1)  # certificates valid from a little before they are made


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


class ClusterCA:
    """The certificate authority every Raft link of the cluster trusts (held by the global scheduler)."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        self._key = key
        self.cert = cert
        self.cert_pem = cert.public_bytes(serialization.Encoding.PEM)

    @classmethod
    def create(cls, name: str = "Tandem Raft CA") -> ClusterCA:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = _now()
        ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _CLOCK_SKEW)
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(ski, critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False
            )
            .sign(key, hashes.SHA256())
        )
        return cls(key, cert)

    @classmethod
    def load_or_create(cls, directory: Path) -> ClusterCA:
        """The CA kept in ``directory`` (0700; the key file 0600), created there if absent."""
        private_dir(directory)
        cert_path, key_path = directory / CA_CERT_FILE, directory / CA_KEY_FILE
        if key_path.exists() or cert_path.exists():
            try:
                key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
                cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
            except (OSError, ValueError) as exc:
                raise IdentityError(
                    f"the Raft CA in {directory} cannot be read ({exc}); restore {CA_CERT_FILE} and "
                    f"{CA_KEY_FILE}, or remove both to create a new CA (running kernels then keep "
                    "their links but cannot get replacement replicas)"
                ) from None
            if not isinstance(key, ec.EllipticCurvePrivateKey):
                raise IdentityError(f"{key_path} is not an EC private key")
            return cls(key, cert)
        ca = cls.create()
        write_private(key_path, _pem_key(ca._key))
        write_private(cert_path, ca.cert_pem)
        return ca

    def issue(self, group: str, member: str, *, days: int = MEMBER_DAYS) -> MemberIdentity:
        """A new key and certificate for ``member`` of ``group`` (a kernel id)."""
        uri = member_uri(group, member)
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(
                x509.Name(
                    [
                        x509.NameAttribute(NameOID.COMMON_NAME, member),
                        x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, group),
                    ]
                )
            )
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _CLOCK_SKEW)
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri)]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False
            )
            .sign(self._key, hashes.SHA256())
        )
        return MemberIdentity(
            group, member, self.cert_pem, cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)
        )


def member_of_pem(pem: bytes) -> tuple[str, str] | None:
    """``member_of`` for a PEM certificate: what a peer's check finds in it."""
    try:
        cert = x509.load_pem_x509_certificate(pem)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return None
    subject = tuple(
        (("commonName", a.value),) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    )
    uris = tuple(("URI", uri) for uri in sans.get_values_for_type(x509.UniformResourceIdentifier))
    return member_of({"subject": subject, "subjectAltName": uris})
