"""A container registry on loopback that answers as Docker Hub does, replaying recorded manifests.

Anonymous requests get a 401 with a ``WWW-Authenticate: Bearer realm=...`` challenge whose
realm is this server's ``/token``; the token it hands out opens every public repository
(distribution/distribution ``docs/spec/auth/token.md``). Manifests answer ``HEAD`` with their
``Content-Type``, ``Docker-Content-Digest`` and length and no body, ``GET`` with the body, and
404 ``MANIFEST_UNKNOWN`` for a tag or digest the registry does not hold
(opencontainers/distribution-spec ``spec.md``). The recordings are in
``tests/recordings/registry``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from lab.azure.preflight import command
from lab.azure.preflight.image_registry import Registry
from tests.support.loopback import loopback_server, reply

RECORDINGS = Path(__file__).parents[1] / "recordings" / "registry"
TORCH = ("pytorch/pytorch", "2.13.0-cuda12.6-cudnn9-runtime")
PYTHON = ("library/python", "3.11-slim-bookworm")
SERVICE = "registry.docker.io"
_MANIFEST_PATH = re.compile(r"^/v2/(?P<name>.+)/manifests/(?P<reference>[^/]+)$")


def registry_recording(name: str) -> dict[str, Any]:
    return json.loads((RECORDINGS / name).read_text())


def recorded_tag(repository: str, tag: str) -> dict[str, Any]:
    """The recorded answer for ``repository:tag``: ``{"headers": ..., "body": ...}``."""
    return registry_recording(f"{repository.replace('/', '_')}__{tag}.json")


@dataclass
class Seen:
    method: str
    path: str
    query: dict[str, list[str]]
    authorization: str | None
    accept: str | None


@dataclass
class FakeRegistry:
    """Manifests by (repository, tag or digest); anything else is unknown (404)."""

    url: str = ""
    manifests: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    token: str = ""
    refused: dict[str, int] = field(default_factory=dict)
    """Repositories answered with this status whatever the token (401: private or absent)."""
    seen: list[Seen] = field(default_factory=list)

    def add(self, repository: str, reference: str, answer: dict[str, Any]) -> None:
        """Serve ``answer`` for the tag, and for its digest and its images' digests too."""
        self.manifests[(repository, reference)] = answer
        self.manifests[(repository, answer["headers"]["Docker-Content-Digest"])] = answer
        for image in answer["body"].get("manifests", []):
            headers = {"Content-Type": image["mediaType"], "Docker-Content-Digest": image["digest"]}
            self.manifests[(repository, image["digest"])] = {"headers": headers, "body": {}}

    def client(self, host: str) -> Registry:
        """The lab's client for ``host``, pointed here (the name is kept for messages)."""
        return Registry(self.url, name="Docker Hub" if host == "registry-1.docker.io" else host)

    def requests(self, method: str) -> list[Seen]:
        return [s for s in self.seen if s.method == method]


def _handler(fake: FakeRegistry) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
            headers = {"Content-Type": "application/json", **(headers or {})}
            reply(self, status, json.dumps(body).encode(), headers)

        def _answer(self) -> None:
            url = urlsplit(self.path)
            auth = self.headers["Authorization"]
            query = parse_qs(url.query)
            fake.seen.append(Seen(self.command, url.path, query, auth, self.headers["Accept"]))
            if url.path == "/token" and self.command == "GET":
                return self._reply(200, registry_recording("token.json"))
            found = _MANIFEST_PATH.match(url.path)
            if found is None:
                return self._reply(404, {"errors": [{"code": "NOT_FOUND", "message": "no route"}]})
            name, reference = found["name"], found["reference"]
            if auth != f"Bearer {fake.token}":
                challenge = (
                    f'Bearer realm="{fake.url}/token",service="{SERVICE}",'
                    f'scope="repository:{name}:pull"'
                )
                error = {"code": "UNAUTHORIZED", "message": "authentication required"}
                return self._reply(401, {"errors": [error]}, {"WWW-Authenticate": challenge})
            if name in fake.refused:
                status = fake.refused[name]
                return self._reply(status, {"errors": [{"code": "DENIED", "message": "refused"}]})
            answer = fake.manifests.get((name, reference))
            if answer is None:
                error = {"code": "MANIFEST_UNKNOWN", "message": "manifest unknown"}
                return self._reply(404, {"errors": [error]})
            # The manifest's own media type, not JSON's.
            return reply(self, 200, json.dumps(answer["body"]).encode(), answer["headers"])

        do_GET = do_HEAD = _answer

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


def serve_registry() -> Iterator[FakeRegistry]:
    """Docker Hub with the Dockerfiles' two bases, on a free loopback port (a fixture body)."""
    fake = FakeRegistry(token=registry_recording("token.json")["token"])
    for repository, tag in (TORCH, PYTHON):
        fake.add(repository, tag, recorded_tag(repository, tag))
    with loopback_server(_handler(fake)) as url:
        fake.url = url
        yield fake


@pytest.fixture(name="hub")
def hub_for_preflight(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeRegistry]:
    """The ``hub`` fixture: ``serve_registry``, and ``lab preflight`` pointed at it, so no
    preflight reaches Docker Hub (a preflight test module uses it for every test)."""
    for fake in serve_registry():
        monkeypatch.setattr(command, "registry_for", fake.client)
        yield fake
