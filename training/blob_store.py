"""Checkpoints straight to Azure Blob Storage (or Azurite), without a filesystem mount.

A checkpoint URI names the account, the container and a prefix inside it:

- ``https://<account>.blob.core.windows.net/<container>/<prefix...>`` (Azure), and
- ``http://127.0.0.1:<port>/<account>/<container>/<prefix...>`` (Azurite's path style:
  when the host is an IP address or ``localhost`` the first path segment is the account).

The URI says *where*; the environment says *who*. With ``AZURE_STORAGE_CONNECTION_STRING``
set (tests, Azurite, a key or SAS) its account key or SAS signs the requests; otherwise
``DefaultAzureCredential`` does, which in the pod is workload identity: the service account
is annotated with the training identity's client id, and that identity holds a data role on
the storage account.

Atomicity: ``put`` is one ``upload_blob(overwrite=True)``; ``put_new`` is the same upload
with ``overwrite=False``, which the SDK sends as ``If-None-Match: *``: the service creates the
blob only if none exists and answers 409 ``BlobAlreadyExists`` otherwise (Put Blob and Put
Block List both honour the condition, so a large object stays create-if-absent too). Up to
``max_single_put_bytes`` either is a single Put Blob, which replaces the blob atomically.
Larger objects are staged as blocks and committed by one Put Block List; staged blocks are
invisible to readers and listings until that commit, so a reader sees the old object or the
new one, never a torn one. All Azure imports live in this module: the file backend must work
without them.
"""

from __future__ import annotations

import ipaddress
import os
import re
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from azure.core.exceptions import (
    AzureError,
    ClientAuthenticationError,
    HttpResponseError,
    ResourceExistsError,
    ResourceModifiedError,
    ResourceNotFoundError,
    ServiceRequestError,
    ServiceResponseError,
)
from azure.storage.blob import BlobPrefix, ContainerClient, LinearRetry

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


def _describe_auth(credential: Any) -> str:
    """How requests are signed, for error messages (never the secret itself)."""
    if isinstance(credential, dict | str):
        return f"the account key or SAS in {CONNECTION_STRING_ENV}"
    return (
        "DefaultAzureCredential (in the pod: workload identity, i.e. the service account's "
        "azure.workload.identity/client-id annotation, and a Storage Blob Data role for that "
        f"identity on the account; elsewhere set {CONNECTION_STRING_ENV})"
    )


def _check_object_name(name: str) -> None:
    # The same rule as FileStore, so both backends accept exactly the same names.
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"invalid object name {name!r}")


class BlobStore:
    """An ObjectStore over one container prefix in Azure Blob Storage (or Azurite)."""

    def __init__(
        self,
        location: BlobLocation,
        credential: Any,
        *,
        retries: int = 3,
        connect_timeout_s: float = 5.0,
        max_single_put_bytes: int = 64 * 1024 * 1024,
        max_single_get_bytes: int = 32 * 1024 * 1024,
    ) -> None:
        if (
            retries < 0
            or connect_timeout_s <= 0
            or max_single_put_bytes < 1
            or max_single_get_bytes < 1
        ):
            raise ValueError(
                "BlobStore needs retries >= 0, connect_timeout_s > 0, max_single_put_bytes >= 1"
                f" and max_single_get_bytes >= 1; got {retries}, {connect_timeout_s}, "
                f"{max_single_put_bytes}, {max_single_get_bytes}"
            )
        self.location = location
        self._auth = _describe_auth(credential)
        self._container = ContainerClient(
            account_url=location.account_url,
            container_name=location.container,
            credential=credential,
            # The eviction notice is ~30 s: a few quick retries, not the SDK's 15 s backoff.
            retry_policy=LinearRetry(backoff=1, retry_total=retries, random_jitter_range=1),
            connection_timeout=connect_timeout_s,
            max_single_put_size=max_single_put_bytes,
            max_block_size=min(max_single_put_bytes, 8 * 1024 * 1024),
            # Larger objects download in ranges, each pinned to the first one's ETag.
            max_single_get_size=max_single_get_bytes,
            max_chunk_get_size=min(max_single_get_bytes, 4 * 1024 * 1024),
        )

    @classmethod
    def from_uri(cls, uri: str, **options: Any) -> BlobStore:
        """A store for a checkpoint URI, with the credential the environment provides."""
        location = parse_blob_uri(uri)
        return cls(location, credential_from_env(location), **options)

    def put(self, name: str, data: bytes) -> None:
        """Replace ``name`` with ``data`` atomically; create the container on first use."""
        _check_object_name(name)
        blob = self.location.blob_name(name)
        with self._errors(f"put {name!r}"):
            try:
                self._upload(blob, data)
            except ResourceNotFoundError as e:
                if e.error_code != "ContainerNotFound":
                    raise
                self._create_container()
                self._upload(blob, data)

    def put_new(self, name: str, data: bytes) -> None:
        """Create ``name`` only if absent; FileExistsError when another writer has it."""
        _check_object_name(name)
        blob = self.location.blob_name(name)
        with self._errors(f"create {name!r}"):
            try:
                try:
                    self._upload(blob, data, overwrite=False)
                except ResourceNotFoundError as e:
                    if e.error_code != "ContainerNotFound":
                        raise
                    self._create_container()
                    self._upload(blob, data, overwrite=False)
            except ResourceExistsError as e:
                raise FileExistsError(f"{name!r} already exists in {self.describe()}") from e

    def _upload(self, blob: str, data: bytes, overwrite: bool = True) -> None:
        self._container.upload_blob(blob, data, overwrite=overwrite, max_concurrency=4)

    def _create_container(self) -> None:
        with suppress(ResourceExistsError):  # another rank created it first
            self._container.create_container()

    def get(self, name: str) -> bytes:
        """The object's bytes; FileNotFoundError when the blob (or container) is missing."""
        _check_object_name(name)
        with self._errors(f"get {name!r}"):
            try:
                return self._container.download_blob(
                    self.location.blob_name(name), max_concurrency=4
                ).readall()
            except ResourceNotFoundError as e:
                raise FileNotFoundError(f"no object {name!r} in {self.describe()}") from e
            except ResourceModifiedError as e:
                # A ranged download is pinned to the first range's ETag; objects are never
                # rewritten, so a mismatch means the object was deleted while being read.
                raise FileNotFoundError(
                    f"object {name!r} in {self.describe()} went away during its download"
                ) from e

    def delete(self, name: str) -> None:
        """Delete the object; a missing blob or container is not an error."""
        _check_object_name(name)
        with self._errors(f"delete {name!r}"), suppress(ResourceNotFoundError):
            self._container.delete_blob(self.location.blob_name(name))

    def list(self, prefix: str = "") -> list[str]:
        """Object names under this store's prefix that start with ``prefix``, sorted.

        Only direct children: a store at ``runs`` does not see objects of a store at
        ``runs/a``, just as FileStore does not descend into subdirectories.
        """
        return sorted(self.list_modified(prefix))

    def list_modified(self, prefix: str = "") -> dict[str, float]:
        """Like ``list``, each name with its Last-Modified time (the service's clock)."""
        base = self.location.blob_name("")
        found: dict[str, float] = {}
        with self._errors("list"):
            try:
                for item in self._container.walk_blobs(name_starts_with=base + prefix):
                    if not isinstance(item, BlobPrefix):
                        found[item.name[len(base) :]] = item.last_modified.timestamp()
            except ResourceNotFoundError:
                return {}  # no container yet: nothing was ever written
        return dict(sorted(found.items()))

    def now(self) -> float:
        """This node's clock: AKS nodes and the service both keep NTP time, far within the
        checkpoint protocol's grace period."""
        return time.time()

    def describe(self) -> str:
        """The checkpoint URI (never credentials), for logs and errors."""
        return self.location.uri

    def __repr__(self) -> str:
        return f"BlobStore({self.describe()!r})"

    @contextmanager
    def _errors(self, operation: str) -> Iterator[None]:
        """Turn every Azure SDK error into an OSError that names the URI and the auth in use."""
        where = f"{operation} in {self.describe()}"
        try:
            yield
        except ClientAuthenticationError as e:
            raise PermissionError(
                f"{where}: not authenticated ({_summary(e)}) using {self._auth}"
            ) from e
        except (ServiceRequestError, ServiceResponseError) as e:
            raise ConnectionError(
                f"{where}: cannot reach the blob endpoint {self.location.account_url} "
                f"(wrong account or port, no network, or Azurite not running): {_summary(e)}"
            ) from e
        except HttpResponseError as e:
            if e.status_code in (401, 403):
                raise PermissionError(
                    f"{where}: access denied ({_summary(e)}) using {self._auth}"
                ) from e
            raise OSError(f"{where}: Azure Blob error {e.status_code} ({_summary(e)})") from e
        except AzureError as e:  # e.g. a stream cut mid-download: callers handle only OSError
            raise OSError(f"{where}: Azure SDK error ({_summary(e)})") from e


def _summary(error: Exception) -> str:
    """The storage error code, else the first line of the message: SDK messages run long."""
    code = getattr(error, "error_code", None)
    if code:
        return str(getattr(code, "value", code))
    text = str(getattr(error, "message", None) or error)
    return text.strip().splitlines()[0] if text.strip() else type(error).__name__
