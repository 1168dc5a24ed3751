"""A data source in Blob Storage (or Azurite): every blob under a container's prefix, nested
"folders" too, read in ranges so no file is ever held whole.

The checkpoints' ``BlobStore`` is flat (one folder, no ``/`` in a name), so the dataset reads
the container through the SDK itself: ``list_blobs`` is a flat listing of every blob whose name
starts with the prefix (azure-storage-blob 12.31 ``ContainerClient.list_blobs``), and
``download_blob(offset=...).chunks()`` yields the blob in ``max_chunk_get_size`` pieces, each
asked with the first response's ETag (``If-Match``, the SDK's ``_download.py``), so a blob
replaced mid-copy fails the read (412, an OSError: a new pod) instead of mixing versions. The
URI and the credential follow the checkpoints' rules (``training/checkpoints/blob_location.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from azure.core.exceptions import (
    AzureError,
    ClientAuthenticationError,
    HttpResponseError,
    ResourceNotFoundError,
    ServiceRequestError,
    ServiceResponseError,
)
from azure.storage.blob import ContainerClient, LinearRetry

from training.checkpoints.blob_location import BlobLocation, credential_from_env, parse_blob_uri
from training.data.dataset_marker import CHUNK_BYTES, MARKER

_FOLDER = "hdi_isfolder"
"""Metadata of the empty blobs some tools create as folders (blobfuse2's mkdir): no file."""


class BlobSource:
    """The blobs under ``location``'s prefix, by their path below it."""

    def __init__(self, location: BlobLocation, credential: Any) -> None:
        self.location = location
        self._base = f"{location.prefix}/" if location.prefix else ""
        self._client = ContainerClient(
            location.account_url,
            location.container,
            credential=credential,
            max_single_get_size=CHUNK_BYTES,
            max_chunk_get_size=CHUNK_BYTES,
            # A few quick retries, not the SDK's exponential backoff (a minute and more before
            # an unreachable endpoint is said): the pod exits for a new one instead.
            retry_policy=LinearRetry(backoff=1, retry_total=3, random_jitter_range=1),
            connection_timeout=5,
            read_timeout=30,
        )

    @classmethod
    def from_uri(cls, uri: str, credential: Any = None) -> BlobSource:
        """A source for ``uri``; the environment's credential unless one is given."""
        location = parse_blob_uri(uri)
        return cls(location, credential or credential_from_env(location))

    def marker(self) -> bytes | None:
        with self._errors(MARKER):
            try:
                return bytes(self._client.download_blob(self._base + MARKER).readall())
            except ResourceNotFoundError:  # no marker, or no container yet
                return None

    def files(self) -> dict[str, int]:
        found: dict[str, int] = {}
        with self._errors("the listing"):
            try:
                listing = self._client.list_blobs(
                    name_starts_with=self._base or None, include=["metadata"]
                )
                for blob in listing:
                    path = blob.name[len(self._base) :]
                    if path != MARKER and (blob.metadata or {}).get(_FOLDER) != "true":
                        found[path] = int(blob.size)
            except ResourceNotFoundError:
                return {}
        return found

    def chunks(self, path: str, offset: int) -> Iterator[bytes]:
        with self._errors(path):
            download = self._client.download_blob(
                self._base + path, offset=offset or None, max_concurrency=1
            )
            yield from download.chunks()

    @contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        """The SDK's errors as the OSErrors the copy tells apart: refused, unreachable, other."""
        where = f"{what} in {self.location.uri}"
        try:
            yield
        except ClientAuthenticationError as exc:
            raise PermissionError(f"{where}: not authenticated ({_first(exc)})") from exc
        except HttpResponseError as exc:
            if exc.status_code in (401, 403):
                raise PermissionError(f"{where}: access denied ({_first(exc)})") from exc
            raise OSError(f"{where}: Azure Blob error {exc.status_code} ({_first(exc)})") from exc
        except (ServiceRequestError, ServiceResponseError) as exc:
            raise ConnectionError(f"{where}: cannot reach the endpoint ({_first(exc)})") from exc
        except AzureError as exc:
            raise OSError(f"{where}: {_first(exc)}") from exc


def _first(error: Exception) -> str:
    code = getattr(error, "error_code", None)
    text = str(getattr(code, "value", code) or error).strip()
    return text.splitlines()[0] if text else type(error).__name__
