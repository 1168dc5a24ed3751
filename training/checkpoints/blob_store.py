"""Checkpoints straight to Azure Blob Storage (or Azurite), without a filesystem mount.

Which URIs name a store and which credential signs its requests is
``training/checkpoints/blob_location.py``.

Atomicity: ``put`` is one ``upload_blob(overwrite=True)``; ``put_new`` is the same upload
with ``overwrite=False``, which the SDK sends as ``If-None-Match: *``: the service creates the
blob only if none exists and answers 409 ``BlobAlreadyExists`` otherwise (Put Blob and Put
Block List both honour the condition, so a large object stays create-if-absent too). Up to
``max_single_put_bytes`` either is a single Put Blob, which replaces the blob atomically.
Larger objects are staged as blocks and committed by one Put Block List; staged blocks are
invisible to readers and listings until that commit, so a reader sees the old object or the
new one, never a torn one.

The receipt: every upload request carries the Content-MD5 of its bytes (``validate_content``),
which the service checks before it keeps them and refuses with 400 ``Md5Mismatch`` otherwise;
once the blob is committed, one HEAD reads its size. So ``put`` returns only when the service
holds exactly the bytes given, and the checkpoint protocol needs no read-back.

Timeouts: every call has a connect and a read timeout, and a few quick retries, rather than the
SDK's 60 s read timeout with its backoff. ``bounded(deadline)`` gives a view of the store whose
calls each fit the deadline: the server-side ``timeout``, the transport's
``connection_timeout``/``read_timeout`` and ``retry_total`` are set per call (argument names
from azure-storage-blob 12.31 ``_shared/policies.py`` ``StorageRetryPolicy.configure_retries``
and azure-core's ``RequestsTransport.send``). All Azure imports live in this module and the
SDK's: the file backend must work without them.
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, BinaryIO

from azure.core.exceptions import (
    AzureError,
    ClientAuthenticationError,
    HttpResponseError,
    ResourceExistsError,
    ResourceModifiedError,
    ResourceNotFoundError,
    ServiceRequestError,
    ServiceRequestTimeoutError,
    ServiceResponseError,
    ServiceResponseTimeoutError,
)
from azure.storage.blob import BlobPrefix, ContainerClient, LinearRetry

from training.checkpoints.blob_location import (
    CONNECTION_STRING_ENV,
    DEV_ACCOUNT,
    DEV_ACCOUNT_KEY,
    BlobLocation,
    credential_from_env,
    describe_auth,
    parse_blob_uri,
)
from training.checkpoints.deadline import Deadline, DeadlineExceeded

# Re-exported: callers find the store and its URI rules in one place.
__all__ = [
    "CONNECTION_STRING_ENV",
    "DEV_ACCOUNT",
    "DEV_ACCOUNT_KEY",
    "BlobLocation",
    "BlobStore",
    "credential_from_env",
    "parse_blob_uri",
]

RETRY_FLOOR_S = 3.0
"""Below this much time left before a deadline, a call gets no retry: the linear retry's own
backoff (1 s, jittered by up to 1 s) would spend what is left."""


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
        read_timeout_s: float = 15.0,
        max_single_put_bytes: int = 64 * 1024 * 1024,
        max_single_get_bytes: int = 32 * 1024 * 1024,
    ) -> None:
        if (
            retries < 0
            or connect_timeout_s <= 0
            or read_timeout_s <= 0
            or max_single_put_bytes < 1
            or max_single_get_bytes < 1
        ):
            raise ValueError(
                "BlobStore needs retries >= 0, connect_timeout_s > 0, read_timeout_s > 0, "
                "max_single_put_bytes >= 1 and max_single_get_bytes >= 1; got "
                f"{retries}, {connect_timeout_s}, {read_timeout_s}, {max_single_put_bytes}, "
                f"{max_single_get_bytes}"
            )
        self.location = location
        self.retries = retries
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._deadline: Deadline | None = None
        self._auth = describe_auth(credential)
        self._container = ContainerClient(
            account_url=location.account_url,
            container_name=location.container,
            credential=credential,
            # The eviction notice is ~30 s: a few quick retries, not the SDK's 15 s backoff.
            retry_policy=LinearRetry(backoff=1, retry_total=retries, random_jitter_range=1),
            connection_timeout=connect_timeout_s,
            # The SDK's default read timeout is 60 s per attempt: half the notice and more.
            read_timeout=read_timeout_s,
            max_single_put_size=max_single_put_bytes,
            max_block_size=min(max_single_put_bytes, 8 * 1024 * 1024),
            # Larger objects download in ranges, each pinned to the first one's ETag.
            max_single_get_size=max_single_get_bytes,
            max_chunk_get_size=min(max_single_get_bytes, 4 * 1024 * 1024),
        )

    def bounded(self, deadline: Deadline) -> BlobStore:
        """This store with every call's timeouts and retries cut to fit ``deadline``."""
        view = copy.copy(self)  # shares the client and its connections
        view._deadline = deadline
        return view

    def _call_options(self) -> dict[str, Any]:
        """Per-call SDK options: none without a deadline (the client's own apply)."""
        if self._deadline is None:
            return {}
        left = self._deadline.remaining()
        if left <= 0:
            raise DeadlineExceeded(f"no time left for a call to {self.describe()}")
        return {
            "timeout": max(1, math.ceil(left)),  # server side, whole seconds
            "connection_timeout": min(self.connect_timeout_s, left),
            "read_timeout": min(self.read_timeout_s, left),
            "retry_total": self.retries if left > RETRY_FLOOR_S else 0,
        }

    @classmethod
    def from_uri(cls, uri: str, **options: Any) -> BlobStore:
        """A store for a checkpoint URI, with the credential the environment provides."""
        location = parse_blob_uri(uri)
        return cls(location, credential_from_env(location), **options)

    def put(self, name: str, data: bytes | Path) -> int:
        """Replace ``name`` with ``data`` (bytes, or a local file's) atomically; its size as
        stored. Creates the container on first use."""
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
            properties = self._container.get_blob_client(blob).get_blob_properties(
                **self._call_options()
            )
            return int(properties.size)

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

    def _upload(self, blob: str, data: bytes | Path, overwrite: bool = True) -> None:
        options = {"overwrite": overwrite, "max_concurrency": 4, "validate_content": "md5"}
        if isinstance(data, Path):
            with open(data, "rb") as f:  # streamed in blocks: never all in memory
                size = os.fstat(f.fileno()).st_size
                self._container.upload_blob(blob, f, length=size, **options, **self._call_options())
        else:
            self._container.upload_blob(blob, data, **options, **self._call_options())

    def _create_container(self) -> None:
        with suppress(ResourceExistsError):  # another rank created it first
            self._container.create_container(**self._call_options())

    def get(self, name: str) -> bytes:
        """The object's bytes; FileNotFoundError when the blob (or container) is missing."""
        _check_object_name(name)
        with self._errors(f"get {name!r}"):
            try:
                return self._container.download_blob(
                    self.location.blob_name(name), max_concurrency=4, **self._call_options()
                ).readall()
            except ResourceNotFoundError as e:
                raise FileNotFoundError(f"no object {name!r} in {self.describe()}") from e
            except ResourceModifiedError as e:
                # A ranged download is pinned to the first range's ETag; objects are never
                # rewritten, so a mismatch means the object was deleted while being read.
                raise FileNotFoundError(
                    f"object {name!r} in {self.describe()} went away during its download"
                ) from e

    def get_into(self, name: str, sink: BinaryIO) -> int:
        """Stream the object into ``sink``, its ranges in order (one at a time: ``sink`` need
        not seek); FileNotFoundError as ``get``."""
        _check_object_name(name)
        with self._errors(f"get {name!r}"):
            try:
                download = self._container.download_blob(
                    self.location.blob_name(name), max_concurrency=1, **self._call_options()
                )
                return int(download.readinto(sink))
            except ResourceNotFoundError as e:
                raise FileNotFoundError(f"no object {name!r} in {self.describe()}") from e
            except ResourceModifiedError as e:  # see ``get``
                raise FileNotFoundError(
                    f"object {name!r} in {self.describe()} went away during its download"
                ) from e

    def size(self, name: str) -> int:
        """The blob's size from Get Blob Properties, a HEAD request that returns the blob's
        properties and not its content (learn.microsoft.com/rest/api/storageservices/
        get-blob-properties); FileNotFoundError when the blob (or container) is missing."""
        _check_object_name(name)
        blob = self._container.get_blob_client(self.location.blob_name(name))
        with self._errors(f"size {name!r}"):
            try:
                return int(blob.get_blob_properties(**self._call_options()).size)
            except ResourceNotFoundError as e:
                raise FileNotFoundError(f"no object {name!r} in {self.describe()}") from e

    def delete(self, name: str) -> None:
        """Delete the object; a missing blob or container is not an error."""
        _check_object_name(name)
        with self._errors(f"delete {name!r}"), suppress(ResourceNotFoundError):
            self._container.delete_blob(self.location.blob_name(name), **self._call_options())

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
                listing = self._container.walk_blobs(
                    name_starts_with=base + prefix, **self._call_options()
                )
                for item in listing:
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
        except (ServiceRequestTimeoutError, ServiceResponseTimeoutError) as e:
            raise TimeoutError(
                f"{where}: the blob endpoint {self.location.account_url} did not answer in "
                f"time ({_summary(e)})"
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
