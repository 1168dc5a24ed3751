"""Where a Blob checkpoint store is and who may use it: the URI's parts and the credential.

A checkpoint URI names the account, the container and a prefix inside it:

- ``https://<account>.blob.core.windows.net/<container>/<prefix...>`` (Azure), and
- ``http://127.0.0.1:<port>/<account>/<container>/<prefix...>`` (Azurite's path style:
  when the host is an IP address or ``localhost`` the first path segment is the account).

The URI says *where*; the environment says *who*. With ``AZURE_STORAGE_CONNECTION_STRING``
set (tests, Azurite, a key or SAS) its account key or SAS signs the requests; otherwise
``DefaultAzureCredential`` does, which in the pod is workload identity: the service account
is annotated with the training identity's client id, and that identity holds a data role on
the storage account. Nothing here imports the storage SDK.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

CONNECTION_STRING_ENV = "AZURE_STORAGE_CONNECTION_STRING"
# Azurite's well-known development account (public, documented; not a secret).
DEV_ACCOUNT = "devstoreaccount1"
DEV_ACCOUNT_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)

_ACCOUNT_RE = re.compile(r"^[a-z0-9]{3,24}$")
# Container names: 3-63 of [a-z0-9-], starting and ending alphanumeric, no "--".
_CONTAINER_RE = re.compile(r"^(?!.*--)[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$")
_URI_FORMS = (
    "https://<account>.blob.core.windows.net/<container>/<prefix>, or Azurite's "
    "http://127.0.0.1:<port>/<account>/<container>/<prefix>"
)


@dataclass(frozen=True)
class BlobLocation:
    """Where a store's objects live: ``<account_url>/<container>/<prefix>/<name>``."""

    account_url: str
    """Scheme, host and (for path-style endpoints) the account: what the SDK calls account_url."""
    account: str
    """Storage account name."""
    container: str
    """Container name; created on first write when missing."""
    prefix: str
    """Slash-separated folder inside the container, without leading/trailing slash; may be ""."""

    @property
    def uri(self) -> str:
        """The checkpoint URI this location was parsed from, normalised."""
        return "/".join(p for p in (self.account_url, self.container, self.prefix) if p)

    def blob_name(self, name: str) -> str:
        """The full blob name for an object name (object names never contain "/")."""
        return f"{self.prefix}/{name}" if self.prefix else name


def _is_path_style_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def parse_blob_uri(uri: str) -> BlobLocation:
    """Parse a checkpoint URI into a BlobLocation; ValueError names the accepted forms."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"checkpoint URI {uri!r} is not a blob URL; expected {_URI_FORMS}")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(
            f"checkpoint URI {uri!r} must not carry a query, fragment or user info: "
            f"put credentials in {CONNECTION_STRING_ENV} (a SAS there works too)"
        )
    host = parts.hostname
    segments = parts.path.strip("/").split("/") if parts.path.strip("/") else []
    if _is_path_style_host(host):
        if not segments:
            raise ValueError(f"checkpoint URI {uri!r} names no account; expected {_URI_FORMS}")
        account, *segments = segments
        account_url = f"{parts.scheme}://{parts.netloc}/{account}"
    else:
        labels = host.split(".")
        if len(labels) < 3 or labels[1] != "blob":
            raise ValueError(f"checkpoint URI {uri!r} has no blob host; expected {_URI_FORMS}")
        if parts.scheme != "https":
            raise ValueError(f"checkpoint URI {uri!r}: Azure Blob endpoints need https")
        account = labels[0]
        account_url = f"https://{parts.netloc}"
    if not segments:
        raise ValueError(f"checkpoint URI {uri!r} names no container; expected {_URI_FORMS}")
    container, *prefix = segments
    _check_names(uri, account, container, prefix)
    return BlobLocation(account_url, account, container, "/".join(prefix))


def _check_names(uri: str, account: str, container: str, prefix: list[str]) -> None:
    if not _ACCOUNT_RE.match(account):
        raise ValueError(
            f"checkpoint URI {uri!r}: account {account!r} must be 3-24 lowercase letters/digits"
        )
    if not _CONTAINER_RE.match(container):
        raise ValueError(
            f"checkpoint URI {uri!r}: container {container!r} must be 3-63 lowercase "
            "letters, digits and single hyphens, starting and ending with a letter or digit"
        )
    if any(seg in ("", ".", "..") for seg in prefix):
        raise ValueError(f"checkpoint URI {uri!r}: the prefix has an empty, '.' or '..' segment")


def _parse_connection_string(text: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for part in text.split(";"):
        if part.strip():
            key, sep, value = part.partition("=")  # values (keys, SAS) contain "=" themselves
            if not sep:
                raise ValueError(f"{CONNECTION_STRING_ENV} has a field without '=': {key!r}")
            fields[key.strip().lower()] = value.strip()
    return fields


def credential_from_env(location: BlobLocation, env: Mapping[str, str] | None = None) -> Any:
    """The credential for ``location``: the connection string's key or SAS, else Azure AD.

    Only the connection string's credential is used; the endpoint always comes from the URI,
    so a connection string for another account is rejected rather than silently ignored.
    """
    text = (os.environ if env is None else env).get(CONNECTION_STRING_ENV, "")
    if not text.strip():
        if location.account_url.startswith("http://"):
            raise ValueError(
                f"{location.uri} is plain http, where Azure AD tokens are not allowed: "
                f"set {CONNECTION_STRING_ENV} (Azurite: account {DEV_ACCOUNT} and its key)"
            )
        from azure.identity import DefaultAzureCredential  # workload identity in the pod

        return DefaultAzureCredential()
    fields = _parse_connection_string(text)
    if fields.get("usedevelopmentstorage", "").lower() == "true":
        fields = {"accountname": DEV_ACCOUNT, "accountkey": DEV_ACCOUNT_KEY}
    if "sharedaccesssignature" in fields:
        return fields["sharedaccesssignature"]
    if "accountname" in fields and "accountkey" in fields:
        if fields["accountname"] != location.account:
            raise ValueError(
                f"{CONNECTION_STRING_ENV} is for account {fields['accountname']!r} "
                f"but the checkpoint URI {location.uri} is in account {location.account!r}"
            )
        return {"account_name": fields["accountname"], "account_key": fields["accountkey"]}
    raise ValueError(
        f"{CONNECTION_STRING_ENV} has neither AccountName+AccountKey nor SharedAccessSignature"
    )


def describe_auth(credential: Any) -> str:
    """How requests are signed, for error messages (never the secret itself)."""
    if isinstance(credential, dict | str):
        return f"the account key or SAS in {CONNECTION_STRING_ENV}"
    return (
        "DefaultAzureCredential (in the pod: workload identity, i.e. the service account's "
        "azure.workload.identity/client-id annotation, and a Storage Blob Data role for that "
        f"identity on the account; elsewhere set {CONNECTION_STRING_ENV})"
    )
