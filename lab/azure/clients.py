"""Reading Azure for the lab's tools: who signs in, which clients, and errors in one line.

``lab preflight`` and ``lab prices`` only read. They sign in as ``pulumi up`` would, by the
one rule of ``catalog/deployer.py`` (pulumi-azure-native's precedence): a service
principal with a secret or a certificate, a managed identity with ``ARM_USE_MSI=true``, and
the Azure CLI's login otherwise. That is also why this does not use
``DefaultAzureCredential``: its managed-identity step probes the instance metadata address on
a laptop.

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
    BearerTokenCredentialPolicy,
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
    CertificateCredential,
    ClientSecretCredential,
    CredentialUnavailableError,
    ManagedIdentityCredential,
)

from catalog.deployer import (
    AZURE_CLI_LOGIN,
    MANAGED_IDENTITY_LOGIN,
    DeployerSignIn,
    deployer_sign_in,
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


def reach(url: str, timeout: float = PROBE_TIMEOUT_S, service: str = "Azure") -> None:
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
        raise Unreachable(f"cannot reach {service} ({urlsplit(url).hostname}): {reason}") from None


def deployer(
    environ: Mapping[str, str], provider: Mapping[str, str] | None = None
) -> DeployerSignIn:
    """How ``pulumi up`` signs in, from the ``ARM_*`` environment and the stack's
    ``azure-native:*`` settings; ``NotSignedIn`` for a sign-in the lab cannot mirror (OIDC)."""
    try:
        return deployer_sign_in(environ, provider or {})
    except ValueError as err:
        raise NotSignedIn(str(err)) from None


def _setting(environ: Mapping[str, str], provider: Mapping[str, str], var: str, key: str) -> str:
    # The same precedence as the catalog's: the provider's setting wins over its variable.
    return (provider.get(key) or environ.get(var) or "").strip()


def credential_from_env(
    environ: Mapping[str, str], provider: Mapping[str, str] | None = None
) -> TokenCredential:
    """A credential for the identity ``pulumi up`` would deploy as (see the module docstring)."""
    provider = provider or {}
    who = deployer(environ, provider)
    if who.login == MANAGED_IDENTITY_LOGIN:
        return ManagedIdentityCredential(client_id=who.client_id or None)
    if who.login == AZURE_CLI_LOGIN:
        return AzureCliCredential(tenant_id=who.tenant_id, process_timeout=30)
    if not who.tenant_id:
        raise NotSignedIn(
            f"service principal {who.client_id} has no tenant: set ARM_TENANT_ID "
            "(or azure-native:tenantId), as pulumi up needs it too"
        )
    if who.certificate:
        path = _setting(environ, provider, "ARM_CLIENT_CERTIFICATE_PATH", "clientCertificatePath")
        password = environ.get("ARM_CLIENT_CERTIFICATE_PASSWORD") or None
        return CertificateCredential(
            who.tenant_id, who.client_id, certificate_path=path, password=password
        )
    secret = _setting(environ, provider, "ARM_CLIENT_SECRET", "clientSecret")
    return ClientSecretCredential(who.tenant_id, who.client_id, secret)


def storage_credential(account_uri: str, environ: Mapping[str, str]) -> Any:
    """Who signs Blob requests of the lab's storage commands: the account key or SAS of
    ``AZURE_STORAGE_CONNECTION_STRING`` when it is set (Azurite), else the deployer's sign-in,
    which holds the data roles ``pulumi up`` gave it (``infra/storage.py``)."""
    from training.checkpoints.blob_location import (
        CONNECTION_STRING_ENV,
        parse_blob_uri,
    )
    from training.checkpoints.blob_location import (
        credential_from_env as key_credential,
    )

    if environ.get(CONNECTION_STRING_ENV, "").strip():
        return key_credential(parse_blob_uri(account_uri), environ)
    return credential_from_env(environ)


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
    provider: Mapping[str, str] = field(default_factory=dict)
    """The stack's ``azure-native:*`` settings (without the namespace); they choose the sign-in."""

    def _kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"retry_total": RETRIES}
        if self.transport is not None:
            kwargs["transport"] = self.transport()
        return kwargs

    def signed_in(self) -> TokenCredential:
        if self.credential is None:
            self.credential = credential_from_env(self.environ, self.provider)
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
        return self._pipeline(base_url, [])

    def arm(self) -> PipelineClient:
        """A signed-in client for ARM operations no installed SDK covers (use ``get_json`` with
        the operation's path and its ``api-version``)."""
        return self._pipeline(ARM, [BearerTokenCredentialPolicy(self.signed_in(), ARM_SCOPE)])

    def _pipeline(self, base_url: str, auth: list[Any]) -> PipelineClient:
        policies = [
            UserAgentPolicy(sdk_moniker="spot-lab"),
            ProxyPolicy(),
            ContentDecodePolicy(),
            RedirectPolicy(),
            RetryPolicy(retry_total=RETRIES),
            *auth,
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
