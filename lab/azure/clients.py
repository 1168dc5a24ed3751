"""Reading Azure for the lab's tools: who signs in, which clients, and errors in one line.

``lab preflight`` and ``lab prices`` only read. They sign in as ``pulumi up`` would:
pulumi-azure-native uses a service principal when ``ARM_CLIENT_ID``, ``ARM_CLIENT_SECRET``
and ``ARM_TENANT_ID`` are set, a managed identity with ``ARM_USE_MSI=true``, and the Azure
CLI's login otherwise. That is also why this does not use ``DefaultAzureCredential``: its
managed-identity step probes the instance metadata address on a laptop.

Every expected failure becomes an ``AzureError`` whose message is one line: no network, not
signed in, a refusal (401/403), a service error. Tests hand in a fake credential and a
transport that replays recorded answers, so the SDKs' own paging, retries and error mapping run.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from azure.core import PipelineClient
from azure.core.credentials import TokenCredential
from azure.core.exceptions import (
    ClientAuthenticationError,
    HttpResponseError,
    ServiceRequestError,
    ServiceResponseError,
)
from azure.core.pipeline.policies import (
    ContentDecodePolicy,
    HttpLoggingPolicy,
    ProxyPolicy,
    RedirectPolicy,
    RetryPolicy,
    UserAgentPolicy,
)
from azure.core.pipeline.transport import HttpTransport
from azure.core.rest import HttpRequest
from azure.identity import (
    AzureCliCredential,
    ClientSecretCredential,
    CredentialUnavailableError,
    ManagedIdentityCredential,
)

ARM = "https://management.azure.com"
ARM_SCOPE = f"{ARM}/.default"
RETAIL_PRICES = "https://prices.azure.com"
# A handful of retries with backoff: a throttled (429) or briefly failing API is retried,
# a persistent failure is reported within seconds rather than after the SDK default of 10.
RETRIES = 3
PROBE_TIMEOUT_S = 3.0


class AzureError(Exception):
    """An expected failure reading Azure; ``str()`` is one line for the user."""


class Unreachable(AzureError):
    """No network path to an Azure endpoint."""


class NotSignedIn(AzureError):
    """No usable credentials."""


class Refused(AzureError):
    """Azure answered with an error (401, 403, 404, 5xx after retries)."""

    def __init__(self, message: str, status: int | None, code: str | None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def first_line(text: object) -> str:
    """The first non-empty line of an SDK message (they often carry a JSON dump below)."""
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "")


def reach(url: str, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Raise ``Unreachable`` unless a TCP connection to ``url``'s host (or its proxy) opens.

    Checked once before signing in, so no network fails in seconds with one message instead
    of a credential's or an SDK's retries. An https proxy the environment names is what
    would be connected to, so that is what is probed.
    """
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or 443
    proxy = urllib.request.getproxies().get("https")
    if proxy and not urllib.request.proxy_bypass(host):
        proxy_parts = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = proxy_parts.hostname or host, proxy_parts.port or 80
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise Unreachable(f"cannot reach Azure ({urlsplit(url).hostname}): {reason}") from None


def credential_from_env(environ: Mapping[str, str]) -> TokenCredential:
    """The identity ``pulumi up`` would deploy as (see the module docstring)."""
    client_id = environ.get("ARM_CLIENT_ID", "")
    secret, tenant = environ.get("ARM_CLIENT_SECRET", ""), environ.get("ARM_TENANT_ID", "")
    if client_id and secret and tenant:
        return ClientSecretCredential(tenant, client_id, secret)
    if environ.get("ARM_USE_MSI", "").lower() == "true":
        return ManagedIdentityCredential(client_id=client_id or None)
    return AzureCliCredential(process_timeout=30)


def signed_in_as(environ: Mapping[str, str]) -> str:
    """How ``credential_from_env`` signs in, for messages."""
    if environ.get("ARM_CLIENT_ID") and environ.get("ARM_CLIENT_SECRET"):
        return f"service principal {environ['ARM_CLIENT_ID']} (ARM_CLIENT_ID)"
    if environ.get("ARM_USE_MSI", "").lower() == "true":
        return "managed identity (ARM_USE_MSI)"
    return "the Azure CLI's login (az login)"


def explain(err: Exception) -> AzureError:
    """An SDK or credential exception as an ``AzureError`` with a one-line message."""
    if isinstance(err, AzureError):
        return err
    if isinstance(err, CredentialUnavailableError):
        return NotSignedIn(f"not signed in to Azure: {first_line(err.message)}")
    if isinstance(err, HttpResponseError) and err.status_code is not None:
        code = err.error.code if err.error is not None else None
        message = first_line(err.error.message if err.error is not None else err.message)
        label = f"{err.status_code} {code}" if code else str(err.status_code)
        return Refused(f"{label}: {message}", err.status_code, code)
    if isinstance(err, ClientAuthenticationError):
        return NotSignedIn(f"Azure refused the sign-in: {first_line(err.message)}")
    if isinstance(err, (ServiceRequestError, ServiceResponseError)):
        return Unreachable(f"cannot reach Azure: {first_line(err.message)}")
    raise err


@contextmanager
def azure_errors() -> Iterator[None]:
    """Turn the SDKs' exceptions inside the block into ``AzureError``."""
    try:
        yield
    except (
        ClientAuthenticationError,
        HttpResponseError,
        ServiceRequestError,
        ServiceResponseError,
    ) as err:
        raise explain(err) from None


def token_claims(token: str) -> dict[str, Any]:
    """The payload of a JWT access token, unverified: only to read who it was issued to."""
    try:
        payload = token.split(".")[1]
        return json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (IndexError, ValueError):
        return {}


@dataclass
class Azure:
    """Azure clients for one credential; ``transport`` and ``probe`` are for tests."""

    credential: TokenCredential | None = None
    """None: signs in lazily with ``credential_from_env``."""
    transport: Callable[[], HttpTransport] | None = None
    """Makes each client's transport (a client closes its own when it closes)."""
    probe: Callable[[str], None] = reach
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))

    def _kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"retry_total": RETRIES}
        if self.transport is not None:
            kwargs["transport"] = self.transport()
        return kwargs

    def signed_in(self) -> TokenCredential:
        if self.credential is None:
            self.credential = credential_from_env(self.environ)
        return self.credential

    def caller(self) -> dict[str, Any]:
        """Claims of an ARM token for the signed-in identity (``oid``, ``tid``, ``upn``...)."""
        with azure_errors():
            token = self.signed_in().get_token(ARM_SCOPE)
        return token_claims(token.token)

    def compute(self, subscription: str) -> Any:
        from azure.mgmt.compute import ComputeManagementClient

        return ComputeManagementClient(self.signed_in(), subscription, **self._kwargs())

    def resources(self, subscription: str) -> Any:
        from azure.mgmt.resource.resources import ResourceManagementClient

        return ResourceManagementClient(self.signed_in(), subscription, **self._kwargs())

    def subscriptions(self) -> Any:
        from azure.mgmt.resource.subscriptions import SubscriptionClient

        return SubscriptionClient(self.signed_in(), **self._kwargs())

    def authorization(self, subscription: str) -> Any:
        from azure.mgmt.authorization import AuthorizationManagementClient

        return AuthorizationManagementClient(self.signed_in(), subscription, **self._kwargs())

    def resource_graph(self) -> Any:
        from azure.mgmt.resourcegraph import ResourceGraphClient

        return ResourceGraphClient(self.signed_in(), **self._kwargs())

    def public(self, base_url: str) -> PipelineClient:
        """A client for a public, unauthenticated JSON API (the Retail Prices API)."""
        policies = [
            UserAgentPolicy(sdk_moniker="spot-lab"),
            ProxyPolicy(),
            ContentDecodePolicy(),
            RedirectPolicy(),
            RetryPolicy(retry_total=RETRIES),
            HttpLoggingPolicy(),
        ]
        if self.transport is not None:
            return PipelineClient(base_url, policies=policies, transport=self.transport())
        return PipelineClient(base_url, policies=policies)


def get_json(client: PipelineClient, url: str) -> Any:
    """GET ``url`` through ``client`` and decode its JSON, errors as ``AzureError``."""
    with azure_errors():
        # A path is relative to the client's base URL; a next-page link is absolute.
        absolute = client.format_url(url) if url.startswith("/") else url
        response = client.send_request(HttpRequest("GET", absolute))
        response.raise_for_status()
        return response.json()
