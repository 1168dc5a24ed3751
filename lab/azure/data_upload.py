"""``python -m lab data upload --stack NAME DIR``: a dataset into the stack's ``data`` container,
as the workers copy it (``training/data/fetch_data.py``).

Every file under DIR, nested folders too, goes to the same path under the container (or under
``--prefix``), signed in as the deployer (``az login``: ``pulumi up`` gave that identity
Storage Blob Data Contributor on ``data``). The old marker goes first, so no worker copies
a dataset half old and half new; each file is hashed, then uploaded in blocks (the SDK streams
it, never whole in memory) with its SHA-256 in the blob's metadata, which Blob Storage commits
with the blob; the marker, listing every file with its size and SHA-256, goes last. A file
whose blob holds its size and digest is not uploaded again, so an upload cut off (its marker
already gone) goes on where it stopped.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.live.status_line import StatusLine
from training.data.dataset_marker import MARKER, DataFile, local_file, marker_body
from training.elastic.exit_codes import BAD_INPUT, OK

DIGEST_METADATA = "sha256"
"""The blob metadata holding a file's SHA-256, set with its upload."""


@dataclass(frozen=True)
class Upload:
    source: Path
    container_uri: str
    """``https://ACCOUNT.blob.core.windows.net/data`` (or Azurite's), with ``prefix`` inside."""
    prefix: str = ""


def local_files(root: Path) -> list[Path]:
    """Every regular file under ``root``, sorted; symbolic links are followed to files."""
    found = []
    for folder, _, names in os.walk(root):
        found += [Path(folder) / n for n in names if (Path(folder) / n).is_file()]
    return sorted(p for p in found if p.relative_to(root).as_posix() != MARKER)


def progress_text(done: int, total: int, files: tuple[int, int], elapsed_s: float) -> str:
    """``[########------------]  40% 1.2/3.0 GiB  25 MB/s  file 3/10``."""
    fraction = done / total if total else 1.0
    bar = "#" * round(20 * fraction)
    rate = done / elapsed_s / 1e6 if elapsed_s > 0 else 0.0
    return (
        f"[{bar:<20}] {100 * fraction:3.0f}% {done / 2**30:.1f}/{total / 2**30:.1f} GiB "
        f"{rate:5.0f} MB/s  file {files[0]}/{files[1]}"
    )


def upload(plan: Upload, credential: Any, status: StatusLine | None = None) -> list[DataFile]:
    """Upload ``plan.source``; the files the marker lists. OSError names what failed."""
    from azure.storage.blob import ContainerClient

    from training.checkpoints.blob_location import parse_blob_uri

    location = parse_blob_uri(plan.container_uri)
    base = "/".join(p for p in (location.prefix, plan.prefix.strip("/")) if p)

    def name(path: str) -> str:
        return f"{base}/{path}" if base else path

    client = ContainerClient(location.account_url, location.container, credential=credential)
    paths = local_files(plan.source)
    if not paths:
        raise ValueError(f"{plan.source} holds no file to upload")
    status = status or StatusLine(sys.stderr, interval_s=10.0)
    with _errors(location.uri):
        had_marker, kept = _uploaded(client, name)
        if had_marker:
            client.delete_blob(name(MARKER))
        total, done, started = sum(p.stat().st_size for p in paths), 0, time.monotonic()
        listed: list[DataFile] = []
        for index, path in enumerate(paths, 1):
            file = local_file(plan.source, path)
            listed.append(file)
            if kept.get(file.path) != file:  # new, changed, or cut off before its end

                def moved(current: int, _: int | None, before: int = done, n: int = index) -> None:
                    shown = progress_text(before + current, total, (n, len(paths)), _since(started))
                    status.update(shown)

                with open(path, "rb") as data:
                    client.upload_blob(
                        name(file.path), data, length=file.size, overwrite=True,
                        metadata={DIGEST_METADATA: file.sha256}, max_concurrency=4,
                        progress_hook=moved,
                    )  # fmt: skip
            done += file.size
            status.update(progress_text(done, total, (index, len(paths)), _since(started)))
        client.upload_blob(
            name(MARKER), marker_body(listed, source="lab data upload"), overwrite=True
        )
    final = progress_text(total, total, (len(paths), len(paths)), _since(started))
    status.message(f"{final}: uploaded {len(paths)} files ({total / 1e6:.1f} MB)")
    return listed


def _since(started: float) -> float:
    return time.monotonic() - started


def _uploaded(client: Any, name: Any) -> tuple[bool, dict[str, DataFile]]:
    """Whether a marker is there, and the blobs that say their digest (an upload of this
    command's, also one cut off): what need not go again when the local file matches."""
    prefix, had_marker, found = name(""), False, {}
    for blob in client.list_blobs(name_starts_with=prefix or None, include=["metadata"]):
        path = blob.name[len(prefix) :]
        digest = (blob.metadata or {}).get(DIGEST_METADATA)
        had_marker = had_marker or path == MARKER
        if digest and path != MARKER:
            found[path] = DataFile(path, int(blob.size), digest)
    return had_marker, found


class _errors:
    """The SDK's errors as one OSError line naming the container and the role it needs."""

    def __init__(self, uri: str) -> None:
        self.uri = uri

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, error: BaseException | None, tb: object) -> None:
        from azure.core.exceptions import AzureError, ClientAuthenticationError, HttpResponseError

        if error is None or not isinstance(error, AzureError):
            return
        if isinstance(error, ClientAuthenticationError) or (
            isinstance(error, HttpResponseError) and error.status_code in (401, 403)
        ):
            raise PermissionError(
                f"{self.uri}: refused ({_first(error)}): sign in as the identity that ran "
                "`pulumi up` (`az login`), which holds Storage Blob Data Contributor on it"
            ) from None
        raise OSError(f"{self.uri}: {_first(error)}") from None


def _first(error: BaseException) -> str:
    code = getattr(error, "error_code", None)
    text = str(getattr(code, "value", code) or getattr(error, "message", None) or error)
    return (text.strip().splitlines() or [type(error).__name__])[0]


def main(args: Any, environ: Mapping[str, str]) -> int:
    """``lab data upload``, its flags parsed; the exit status."""
    from lab.azure.clients import storage_credential
    from lab.azure.stack_outputs import data_uri, stack_uri, storage_exit

    if not args.dir.is_dir():
        print(f"error: DIR {args.dir} is not a directory", file=sys.stderr)
        return BAD_INPUT
    plan: list[Upload] = []

    def run() -> None:
        uri = stack_uri(args.container_uri, args.stack, data_uri)
        plan.append(Upload(args.dir, uri, args.prefix or ""))
        upload(plan[0], storage_credential(uri, environ))

    code = storage_exit(run)
    if code == OK:
        where = "/".join(p for p in (plan[0].container_uri, plan[0].prefix) if p)
        print(f"{where} holds the dataset and its marker: waiting workers start copying it")
    return code
