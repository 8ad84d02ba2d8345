"""The Kernel Gateway API service on its own (``python -m services.http_gateway``): TLS when
configured, and a token file that others can read is refused (#19). No cluster is needed for
what is checked here: the kernelspecs route answers without one."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _self_signed(directory: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "http.crt", directory / "http.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    key_path.chmod(0o600)
    return cert_path, key_path


def _serve(state_dir: Path, *settings: str) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "services.http_gateway", "--log-format", "json"]
    for setting in settings:
        argv += ["--set", setting]
    env = {**os.environ, "TANDEM_STATE_DIR": str(state_dir)}
    with open(state_dir / "service.err", "w") as err:  # a file: a pipe nobody drains could fill up
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT, env=env)


def _address(process: subprocess.Popen[str], state_dir: Path) -> str:
    assert process.stdout is not None
    for line in process.stdout:  # the announcement is its one line on stdout
        if '"listening"' in line:
            return str(json.loads(line)["address"])
    pytest.fail(f"the API service exited with {process.wait()}: {_errors(state_dir)}")


def _errors(state_dir: Path) -> str:
    return (state_dir / "service.err").read_text()


@pytest.fixture
def tls_service(tmp_path: Path) -> Iterator[tuple[str, Path, str]]:
    cert, key = _self_signed(tmp_path)
    process = _serve(tmp_path, f"http.certfile={cert}", f"http.keyfile={key}")
    try:
        url = _address(process, tmp_path)
        yield url, cert, (tmp_path / "keys" / "http.token").read_text().strip()
    finally:
        process.terminate()
        process.wait(timeout=20)


def test_the_api_speaks_tls_when_a_certificate_is_configured(tls_service: tuple[str, Path, str]) -> None:
    url, cert, token = tls_service
    assert url.startswith("https://127.0.0.1:")
    specs = requests.get(
        f"{url}/api/kernelspecs", headers={"Authorization": f"token {token}"}, verify=cert, timeout=10
    )
    assert specs.status_code == 200 and list(specs.json()["kernelspecs"]) == ["tandem"]
    with pytest.raises(requests.ConnectionError):
        requests.get(url.replace("https", "http", 1) + "/api/kernelspecs", timeout=10)


def test_a_token_file_others_can_read_is_refused_at_start(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("shared-secret\n")
    token_file.chmod(0o644)
    process = _serve(tmp_path, f"http.token_file={token_file}")
    assert process.wait(timeout=60) == 2
    assert f"{token_file} is readable by others" in _errors(tmp_path)


def test_half_a_tls_configuration_is_refused_at_start(tmp_path: Path) -> None:
    cert, _key = _self_signed(tmp_path)
    process = _serve(tmp_path, f"http.certfile={cert}")
    assert process.wait(timeout=60) == 2
    assert "http.certfile and http.keyfile go together" in _errors(tmp_path)
