"""Azure answers replayed on a loopback server, through the SDKs' own transport.

The real clients (their pipelines, auth policy, paging, retries and error mapping) talk HTTP
to 127.0.0.1: ``LoopbackTransport`` rewrites only the host of what they address to Azure,
because the SDK refuses bearer tokens over plain http to any other URL. Credentials are
fakes, so azure-identity never probes the instance metadata address.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from azure.core.credentials import AccessToken
from azure.core.pipeline.transport import RequestsTransport
from azure.identity import CredentialUnavailableError

from tests.support.loopback import loopback_server, reply

RECORDINGS = Path(__file__).parents[1] / "recordings" / "azure"
HOSTS = ("https://management.azure.com", "https://prices.azure.com:443", "https://prices.azure.com")

# (status, JSON body) or (status, body, headers); a list is answered in order, the last
# one again and again.
Answer = tuple[Any, ...]


def recording(name: str) -> Any:
    """A recorded answer's body from tests/recordings/azure."""
    return json.loads((RECORDINGS / name).read_text())


@dataclass
class Seen:
    method: str
    path: str
    query: dict[str, list[str]]
    authorization: str | None
    body: Any = None


@dataclass
class FakeAzure:
    """Canned answers by (method, path) or (method, path, text in the decoded query); anything
    else is a 404 like ARM's."""

    url: str = ""
    routes: dict[tuple[str, ...], Answer | list[Answer]] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    slept: list[float] = field(default_factory=list)
    """The waits the SDK's retry policy asked its transport for (LoopbackTransport.sleep)."""

    def posts(self) -> list[str]:
        return [s.path for s in self.seen if s.method == "POST"]

    def paths(self, method: str = "GET") -> list[str]:
        return [s.path for s in self.seen if s.method == method]

    def answer(self, method: str, path: str, query: str) -> Answer:
        keys = [k for k in self.routes if k[0] == method and k[1].lower() == path.lower()]
        key = next((k for k in keys if len(k) == 3 and k[2] in query), None)
        key = key or next((k for k in keys if len(k) == 2), None)
        if key is None:
            return 404, {"error": {"code": "NotFound", "message": f"no {path}"}}
        answers = self.routes[key]
        if isinstance(answers, list):
            return answers.pop(0) if len(answers) > 1 else answers[0]
        return answers


def _handler(fake: FakeAzure) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            url = urlsplit(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            auth = self.headers["Authorization"]
            fake.seen.append(Seen(self.command, url.path, parse_qs(url.query), auth, body))
            status, payload_body, *rest = fake.answer(self.command, url.path, unquote(url.query))
            payload = b"" if payload_body is None else json.dumps(payload_body).encode()
            headers = {"Content-Type": "application/json", **(rest[0] if rest else {})}
            reply(self, status, payload, headers)

        do_GET = do_POST = _answer

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


def serve() -> Iterator[FakeAzure]:
    """A running fake on a free loopback port (use as a pytest fixture body)."""
    fake = FakeAzure()
    with loopback_server(_handler(fake)) as url:
        fake.url = url
        yield fake


class LoopbackTransport(RequestsTransport):
    """Sends what the client addresses to Azure's hosts to the fake instead.

    The SDK's retry policy waits through its transport (``HttpTransport.sleep``): here the
    wait is only recorded in ``slept``, so a test of retries does not wait out the backoff.
    """

    def __init__(self, base: str, slept: list[float] | None = None) -> None:
        super().__init__()
        self._base = base
        self.slept = [] if slept is None else slept

    def sleep(self, duration: float) -> None:
        self.slept.append(duration)

    def send(self, request: Any, **kwargs: Any) -> Any:
        # Only for this send: a retry passes the request through the auth policy again,
        # which must still see the https URL.
        original = request.url
        host = next((h for h in HOSTS if original.startswith(h)), None)
        if host is not None:
            request.url = self._base + original[len(host) :]
        try:
            return super().send(request, **kwargs)
        finally:
            request.url = original


def fake_jwt(claims: dict[str, Any]) -> str:
    """An unsigned token with these claims (the tools only read who it was issued to)."""

    def part(value: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).decode().rstrip("=")

    return f"{part({'alg': 'none', 'typ': 'JWT'})}.{part(claims)}.sig"


class StaticToken:
    """A credential that always has a token; ``claims`` go into it as a JWT payload."""

    def __init__(self, claims: dict[str, Any] | None = None) -> None:
        self.token = fake_jwt(claims) if claims else "test-token"

    def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        return AccessToken(self.token, int(time.time()) + 3600)


class NoSignIn:
    """A credential like ``AzureCliCredential`` before ``az login``."""

    def get_token(self, *scopes: str, **kwargs: Any) -> AccessToken:
        raise CredentialUnavailableError(message="Please run 'az login' to set up an account")
