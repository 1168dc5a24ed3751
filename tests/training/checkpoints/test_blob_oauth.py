"""The Blob backend with Entra ID tokens and no account key, as the pods use it.

The storage account takes no shared key, so in the pod every request carries a bearer token
from workload identity. Azurite checks bearer tokens with ``--oauth basic`` over HTTPS
(``dist/src/blob/authentication/BlobTokenAuthenticator.js``): the lifetime (iat, nbf, exp), an
Entra ID issuer and a storage audience, not the signature. So a test credential can mint them.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from azure.core.credentials import AccessToken
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from lab.local import azurite_server as azurite_emulator
from tests.conftest import DEV_ACCOUNT
from training.checkpoints.blob_store import BlobStore, parse_blob_uri
from training.checkpoints.checkpoint import CheckpointRepository

TENANT = "11111111-1111-1111-1111-111111111111"


def _b64(data: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


class FakeEntraCredential:
    """Tokens shaped like Entra ID's for Blob Storage; unsigned, which Azurite accepts."""

    def __init__(self, lifetime_s: int = 3600, audience: str = "https://storage.azure.com") -> None:
        self.lifetime_s = lifetime_s
        self.audience = audience
        self.scopes: list[str] = []

    def get_token(self, *scopes: str, **kwargs: object) -> AccessToken:
        self.scopes.extend(scopes)
        now = int(time.time())
        claims = {
            "aud": self.audience,
            "iss": f"https://sts.windows.net/{TENANT}/",
            "iat": now - 300,
            "nbf": now - 300,
            "exp": now + self.lifetime_s,
            "oid": str(uuid.uuid4()),
        }
        token = f"{_b64({'alg': 'RS256', 'typ': 'JWT'})}.{_b64(claims)}.c2ln"
        return AccessToken(token, now + self.lifetime_s)


def _self_signed(root: Path) -> tuple[Path, Path]:
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
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = root / "cert.pem", root / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@pytest.fixture(scope="module")
def azurite_oauth(
    tmp_path_factory: pytest.TempPathFactory, processes: None
) -> Iterator[tuple[str, Path]]:
    """Azurite over HTTPS with bearer-token checks; yields (account URL, its certificate)."""
    workspace = tmp_path_factory.mktemp("azurite-oauth")
    cert, key = _self_signed(workspace)
    tls = ["--oauth", "basic", "--cert", str(cert), "--key", str(key)]
    with azurite_emulator.serve(workspace, tls) as port:
        yield f"https://127.0.0.1:{port}/{DEV_ACCOUNT}", cert


@pytest.fixture
def token_store(
    azurite_oauth: tuple[str, Path], monkeypatch: pytest.MonkeyPatch
) -> tuple[BlobStore, FakeEntraCredential]:
    account_url, cert = azurite_oauth
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING", raising=False)  # no key anywhere
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(cert))  # trust the test certificate only
    credential = FakeEntraCredential()
    uri = f"{account_url}/t{uuid.uuid4().hex[:20]}/run"
    return BlobStore(parse_blob_uri(uri), credential), credential


def test_every_operation_works_with_a_token_and_no_key(
    token_store: tuple[BlobStore, FakeEntraCredential],
) -> None:
    store, credential = token_store
    store.put("a", b"one")  # creates the container too
    assert store.get("a") == b"one"
    store.put_new("b", b"two")
    with pytest.raises(FileExistsError):
        store.put_new("b", b"again")
    assert store.list() == ["a", "b"] and set(store.list_modified()) == {"a", "b"}
    store.delete("a")
    assert store.list() == ["b"]
    assert credential.scopes and all(
        s.startswith("https://storage.azure.com") for s in credential.scopes
    )


def test_the_checkpoint_protocol_runs_on_tokens(
    token_store: tuple[BlobStore, FakeEntraCredential],
) -> None:
    store, _ = token_store
    repository = CheckpointRepository(store)
    for step in (1, 2):
        repository.commit(step, f"state {step}".encode())
    loaded = repository.load_latest()
    assert loaded is not None and loaded.entry.step == 2 and loaded.data == b"state 2"


@pytest.mark.parametrize(
    ("credential", "why"),
    [
        (FakeEntraCredential(lifetime_s=-600), "expired"),
        (FakeEntraCredential(audience="https://vault.azure.net"), "another service's token"),
    ],
)
def test_a_bad_token_is_a_clear_permission_error(
    azurite_oauth: tuple[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    credential: FakeEntraCredential,
    why: str,
) -> None:
    account_url, cert = azurite_oauth
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING", raising=False)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(cert))
    store = BlobStore(parse_blob_uri(f"{account_url}/t{uuid.uuid4().hex[:20]}/run"), credential)
    with pytest.raises(PermissionError, match="DefaultAzureCredential|not authenticated|denied"):
        store.put("a", b"x")
