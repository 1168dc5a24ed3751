"""Stage a task's data into the ``data`` container: download, check the checksum, upload.

Two formats (training/data/sources.py): CIFAR-10's binary archive, whose batch files are
checked and uploaded, and a UTF-8 text corpus (the character LM's), uploaded as ``input.txt``.

``pulumi up`` runs this in a Kubernetes Job on the system pool (``workloads/data_staging.py``)
and creates the PyTorchJob only once it has succeeded, so GPU nodes never start on an empty
container. The archive's URL and checksum are stack config: the official archive by default,
or a mirror, or the user's own data in the same format.

It is idempotent: a marker blob records what was staged (source and checksum), and a second
run with the same checksum finds every file there and uploads nothing. Every file is checked
as CIFAR-10 binary (record size, labels) before anything is uploaded, and the marker is
written last, so a half-staged container is never taken for a staged one.

Exit codes: 0 staged (or already there); 2 the input is wrong and no retry fixes it (bad
checksum syntax, a checksum mismatch, an archive without the batch files); 1 the network or
storage failed, which the Job's own retries may fix.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from training.checkpoints.blob_store import credential_from_env, parse_blob_uri
from training.data.dataset_marker import MARKER, local_file, marker_body
from training.data.sources import CHECKSUM, CIFAR10, CORPUS_FILE, FORMATS, TEXT
from training.elastic.exit_codes import BAD_INPUT, PERMANENT

# CIFAR-10's files in its archive (training/data/cifar10.py reads them).
BATCH_FILE = re.compile(r"^(data_batch_\d+\.bin|test_batch\.bin)$")
CHUNK = 1 << 20
RBAC_WAIT_S = 15 * 60
"""How long a refused read of the container is tried again. On the first `pulumi up` the Job
starts as soon as its identity's role and federated credential exist, and neither is honoured at
once: a token request right after a federated credential is added "might fail until the cache is
refreshed" (AKS, "Deploy and configure workload identity"), and "Azure role assignments may take
up to 30 minutes to propagate" (Azure Storage, "Assign an Azure role for access to blob data");
minutes are the usual."""
REFUSED = (401, 403)
"""401: the token was refused (its federated credential is not known yet); 403: the role is not
applied yet (AuthorizationPermissionMismatch)."""
T = TypeVar("T")


class StagingError(Exception):
    """Staging cannot go on; ``retry`` says whether trying again may help."""

    def __init__(self, message: str, *, retry: bool) -> None:
        super().__init__(message)
        self.retry = retry


def parse_checksum(text: str) -> tuple[str, str]:
    """``md5:<hex>`` or ``sha256:<hex>`` as (algorithm, lowercase hex digest)."""
    value = text.strip().lower()
    if not CHECKSUM.match(value):
        raise StagingError(
            f"checksum must be md5:<32 hex digits> or sha256:<64 hex digits> (the official "
            f"CIFAR-10 page publishes an MD5), got {text!r}",
            retry=False,
        )
    algorithm, digest = value.split(":", 1)
    return algorithm, digest


def download(url: str, dest: Path, checksum: str, timeout_s: float = 60.0) -> None:
    """Fetch ``url`` into ``dest`` and check its digest while the bytes stream in."""
    algorithm, expected = parse_checksum(checksum)
    digest = hashlib.new(algorithm)
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response, open(dest, "wb") as out:
            while chunk := response.read(CHUNK):
                digest.update(chunk)
                out.write(chunk)
    except urllib.error.HTTPError as exc:
        # 4xx: the URL is wrong and stays wrong; 5xx may pass.
        raise StagingError(
            f"download of {url} failed: HTTP {exc.code}", retry=exc.code >= 500
        ) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise StagingError(f"download of {url} failed: {reason}", retry=True) from None
    if digest.hexdigest() != expected:
        raise StagingError(
            f"{url} has {algorithm} {digest.hexdigest()}, but the config expects {expected}: "
            "a corrupt download or the wrong archive; check dataSourceUrl and dataSourceChecksum",
            retry=False,
        )


def extract_batches(archive: Path, out_dir: Path) -> list[Path]:
    """The archive's CIFAR-10 batch files, written flat into ``out_dir`` and checked.

    Members are picked by their base name and written by this code, never extracted by path,
    so an archive cannot write outside ``out_dir``.
    """
    # Imported here: the stack config imports this module for the checksum rule, without torch.
    from training.data.cifar10 import TEST_FILE, DatasetError, load_cifar10_binary

    written: list[Path] = []
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar.getmembers():
                name = Path(member.name).name
                if not member.isfile() or not BATCH_FILE.match(name):
                    continue
                source = tar.extractfile(member)
                if source is None:
                    continue
                target = out_dir / name
                target.write_bytes(source.read())
                written.append(target)
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise StagingError(
            f"{archive.name} is not a readable tar archive: {exc}", retry=False
        ) from None
    names = {p.name for p in written}
    if TEST_FILE not in names or names == {TEST_FILE}:
        raise StagingError(
            f"the archive holds {sorted(p.name for p in written) or 'no batch files'}; "
            "CIFAR-10's binary version has data_batch_1.bin ... data_batch_5.bin and "
            "test_batch.bin (is it the python or matlab version?)",
            retry=False,
        )
    try:  # the loader's own checks: record size and labels
        load_cifar10_binary(out_dir, "train")
        load_cifar10_binary(out_dir, "test")
    except DatasetError as exc:
        raise StagingError(
            f"the archive's batch files are not CIFAR-10 binary: {exc}", retry=False
        ) from None
    return sorted(written)


def check_corpus(download: Path, out_dir: Path) -> list[Path]:
    """The downloaded text as ``CORPUS_FILE`` in ``out_dir``, checked to be UTF-8 text."""
    raw = download.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise StagingError(
            f"the download is not UTF-8 text ({exc}): is dataSourceUrl the corpus's raw file, "
            "not a web page or an archive?",
            retry=False,
        ) from None
    if not text.strip():
        raise StagingError("the downloaded corpus is empty", retry=False)
    target = out_dir / CORPUS_FILE
    target.write_bytes(raw)
    return [target]


def _container(container_uri: str) -> Any:
    """The SDK's ContainerClient: workload identity in the pod, a connection string in tests."""
    from azure.storage.blob import ContainerClient

    location = parse_blob_uri(container_uri)
    if location.prefix:
        raise StagingError(
            f"{container_uri} must name a container, with no folder after it", retry=False
        )
    return ContainerClient(
        location.account_url, location.container, credential=credential_from_env(location)
    )


def _refused(exc: Exception) -> bool:
    """Whether Azure turned the request down for want of a token or a role, not for the data."""
    from azure.core.exceptions import ClientAuthenticationError, HttpResponseError

    if isinstance(exc, ClientAuthenticationError):  # the token request itself, or a 401
        return True
    return isinstance(exc, HttpResponseError) and exc.status_code in REFUSED


def retry_refused(
    read: Callable[[], T],
    what: str,
    *,
    wait_s: float = RBAC_WAIT_S,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> T:
    """``read()``, tried again with backoff (5 s doubling to 60 s) while Azure refuses it (401,
    403) for up to ``wait_s``, each wait said in the log; any other error is raised as it is, a
    refusal past the budget as a permanent ``StagingError`` (exit 2) naming what is missing."""
    deadline, delay = clock() + wait_s, 5.0
    while True:
        try:
            return read()
        except Exception as exc:
            if not _refused(exc):
                raise
            left = deadline - clock()
            if left <= 0:
                raise StagingError(
                    f"{what} was still refused after {wait_s:.0f} s ({_first_line(exc)}): the "
                    "stager identity needs its role on the container (Storage Blob Data "
                    "Contributor) and its federated credential; `pulumi up` again retries",
                    retry=False,
                ) from None
            pause = min(delay, left)
            log(
                f"stage-data: {what} refused ({_first_line(exc)}); a new role or federated "
                f"credential takes minutes to apply: trying again in {pause:.0f} s, for "
                f"{left:.0f} s more"
            )
            sleep(pause)
            delay = min(delay * 2, 60.0)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def already_staged(container: Any, checksum: str) -> bool:
    """Whether the marker names this checksum and every file it lists is there."""
    from azure.core.exceptions import ResourceNotFoundError

    try:
        marker = json.loads(container.download_blob(MARKER).readall())
    except ResourceNotFoundError:
        return False
    present = {blob.name for blob in container.list_blobs()}
    return marker.get("checksum") == checksum and set(marker.get("files", [])) <= present


def stage(source: str, checksum: str, container_uri: str, data_format: str = CIFAR10) -> str:
    """Stage ``source`` (in ``data_format``) into the container; what happened, for the log."""
    from azure.core.exceptions import AzureError

    parse_checksum(checksum)  # bad syntax is refused before any I/O
    try:
        container = _container(container_uri)
        staged = retry_refused(
            lambda: already_staged(container, checksum.strip().lower()),
            f"reading {container_uri}",
            wait_s=RBAC_WAIT_S,
        )
        if staged:
            return f"{container_uri} already holds {checksum}: nothing to do"
        with tempfile.TemporaryDirectory(prefix="stage-data-") as tmp:
            archive = Path(tmp) / "archive"
            download(source, archive, checksum)
            batches = Path(tmp) / "batches"
            batches.mkdir()
            unpack = extract_batches if data_format == CIFAR10 else check_corpus
            files = unpack(archive, batches)
            for path in files:
                with open(path, "rb") as data:
                    container.upload_blob(path.name, data, overwrite=True)
            # Last: the workers copy nothing before it is there (training/data/fetch_data.py).
            marker = marker_body(
                (local_file(batches, path) for path in files),
                source=source,
                checksum=checksum.strip().lower(),
                format=data_format,
            )
            container.upload_blob(MARKER, marker, overwrite=True)
        return f"staged {len(files)} files from {source} into {container_uri}"
    except AzureError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise StagingError(f"storage error on {container_uri}: {first}", retry=True) from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m training.data.stage_data",
        description="Download a task's data (CIFAR-10's binary archive, or a text corpus), "
        "check its checksum and upload it to a Blob container (idempotent).",
    )
    parser.add_argument("--source", required=True, help="https URL of the archive or file")
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default=CIFAR10,
        help=f"{CIFAR10}: the binary .tar.gz; {TEXT}: one UTF-8 file, staged as {CORPUS_FILE}",
    )
    parser.add_argument(
        "--checksum", required=True, help="md5:<hex> or sha256:<hex> of the archive"
    )
    parser.add_argument(
        "--container-uri",
        required=True,
        help="the container's URL, e.g. https://ACCOUNT.blob.core.windows.net/data",
    )
    args = parser.parse_args(argv)
    try:
        print(stage(args.source, args.checksum, args.container_uri, args.format), flush=True)
    except StagingError as exc:
        print(f"stage-data: {exc}", file=sys.stderr, flush=True)
        return PERMANENT if exc.retry else BAD_INPUT  # the Job's next pod retries a failure
    except ValueError as exc:  # a malformed container URI, from parse_blob_uri
        print(f"stage-data: {exc}", file=sys.stderr, flush=True)
        return BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
