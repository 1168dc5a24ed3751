"""Reading a container registry anonymously: does a manifest exist, and what is its digest.

The calls are the OCI distribution spec's (opencontainers/distribution-spec ``spec.md``):
``HEAD /v2/<name>/manifests/<reference>`` answers 200 with ``Docker-Content-Digest`` when the
tag or digest exists and 404 when it does not; ``GET`` of the same URL returns the manifest,
for an image index the list of its images (``manifests[]``, each with ``digest`` and
``platform``). The ``Accept`` header names every manifest type we take, so a multi-platform
tag answers with its index rather than being refused or converted.

A registry that wants a token answers 401 with ``WWW-Authenticate: Bearer realm=...,
service=...``; the client asks the realm for a token with ``scope=repository:<name>:pull`` and
sends it as ``Authorization: Bearer`` (Docker's token authentication spec,
distribution/distribution ``docs/spec/auth/token.md``; Docker Hub's realm is
``https://auth.docker.io/token``). Anonymously, as here, Docker Hub hands out a pull token for
any public repository. A HEAD does not count as a pull against Docker Hub's anonymous rate
limit; a GET of a manifest does (docs.docker.com, Docker Hub usage and limits), so a GET is
sent only when the HEAD alone cannot answer.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import requests

from catalog.base_images import DOCKER_HUB
from lab.azure.clients import Unreachable, reach

INDEX_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
"""Manifests that list one image per platform."""
MANIFEST_TYPES = (
    *INDEX_TYPES,
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
TIMEOUT_S = 15.0
_CHALLENGE_PARAM = re.compile(r'(\w+)="([^"]*)"')


class RegistryError(Exception):
    """A registry that could not answer; ``str()`` is one line for the user."""


@dataclass(frozen=True)
class ManifestHead:
    """What a HEAD of a manifest tells: its digest and its media type."""

    digest: str
    media_type: str

    @property
    def is_index(self) -> bool:
        return self.media_type.split(";")[0].strip() in INDEX_TYPES


@dataclass
class Registry:
    """Anonymous reads of one registry's manifests; ``base_url`` is injectable for tests."""

    base_url: str
    """e.g. ``https://registry-1.docker.io``."""
    name: str = ""
    """How messages call it (Docker Hub); the host when empty."""
    _tokens: dict[str, str] = field(default_factory=dict)
    """Pull tokens by repository (a token's scope is one repository)."""

    @property
    def label(self) -> str:
        return self.name or urlsplit(self.base_url).hostname or self.base_url

    def probe(self) -> None:
        """``RegistryError`` unless a connection to the registry opens (in seconds)."""
        try:
            reach(self.base_url, service=self.label)
        except Unreachable as err:
            raise RegistryError(str(err)) from None

    def head(self, repository: str, reference: str) -> ManifestHead | None:
        """The manifest's digest and type; None when the registry does not know it (404)."""
        response = self._manifest("HEAD", repository, reference)
        if response.status_code == 404:
            return None
        self._raise_for(response, repository)
        digest = response.headers.get("Docker-Content-Digest", "")
        if not digest:
            # The header is optional in the spec; the digest is that of the manifest's bytes.
            body = self._manifest("GET", repository, reference)
            self._raise_for(body, repository)
            digest = f"sha256:{hashlib.sha256(body.content).hexdigest()}"
        return ManifestHead(digest, response.headers.get("Content-Type", ""))

    def get(self, repository: str, reference: str) -> dict[str, Any]:
        """The manifest itself (for an index: its ``manifests``)."""
        response = self._manifest("GET", repository, reference)
        self._raise_for(response, repository)
        try:
            body = response.json()
        except ValueError:
            raise RegistryError(f"{self.label} sent a manifest that is not JSON") from None
        return body if isinstance(body, dict) else {}

    def _manifest(self, method: str, repository: str, reference: str) -> requests.Response:
        url = f"{self.base_url.rstrip('/')}/v2/{repository}/manifests/{reference}"
        response = self._send(method, url, repository)
        challenge = response.headers.get("WWW-Authenticate", "")
        if response.status_code == 401 and challenge.lower().startswith("bearer"):
            self._tokens[repository] = self._token(challenge, repository)
            response = self._send(method, url, repository)
        return response

    def _send(self, method: str, url: str, repository: str) -> requests.Response:
        headers = {"Accept": ", ".join(MANIFEST_TYPES)}
        if repository in self._tokens:
            headers["Authorization"] = f"Bearer {self._tokens[repository]}"
        return self._request(method, url, headers=headers)

    def _token(self, challenge: str, repository: str) -> str:
        """A pull token from the realm the 401 named (anonymous: no credentials sent)."""
        params = dict(_CHALLENGE_PARAM.findall(challenge))
        realm = params.get("realm", "")
        if not realm:
            raise RegistryError(f"{self.label} asked for a token but named no realm")
        query = {"scope": f"repository:{repository}:pull"}
        if params.get("service"):
            query["service"] = params["service"]
        response = self._request("GET", realm, params=query)
        if response.status_code != 200:
            raise RegistryError(
                f"{self.label}'s token service ({urlsplit(realm).hostname}) answered "
                f"{response.status_code}"
            )
        try:
            body = response.json()
        except ValueError:
            body = None
        # The spec allows either name for the token (token.md, "Token Response Fields").
        token = (body.get("token") or body.get("access_token")) if isinstance(body, dict) else ""
        if not token:
            raise RegistryError(f"{self.label}'s token service sent no token")
        return str(token)

    def _request(self, method: str, url: str, **kwargs: Any) -> requests.Response:
        try:
            return requests.request(method, url, timeout=TIMEOUT_S, allow_redirects=True, **kwargs)
        except requests.RequestException as err:
            reason = _reason(err)
            raise RegistryError(
                f"cannot reach {self.label} ({urlsplit(url).hostname}): {reason}"
            ) from None

    def _raise_for(self, response: requests.Response, repository: str) -> None:
        status = response.status_code
        if status == 200:
            return
        if status == 401:
            raise RegistryError(
                f"{self.label} refused anonymous access to {repository} (401): it does not "
                "exist, or it is private"
            )
        if status == 429:
            raise RegistryError(
                f"{self.label} limits anonymous requests and refused this one (429); try again "
                "later"
            )
        raise RegistryError(f"{self.label} answered {status} for {repository}")


def _reason(err: requests.RequestException) -> str:
    """The innermost reason of a connection error, in a few words."""
    text = str(err)
    found = re.search(r"\[Errno -?\d+\] ([^'\")]+)", text)
    if found:
        return found.group(1).strip()
    return type(err).__name__


def registry_for(host: str) -> Registry:
    """The registry an image name's host names (``registry-1.docker.io`` is Docker Hub)."""
    return Registry(f"https://{host}", name="Docker Hub" if host == DOCKER_HUB else "")
