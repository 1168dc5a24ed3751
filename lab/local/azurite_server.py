"""Azurite, Azure Blob's emulator, from ``node_modules`` on a free loopback port: the durable
store of the benchmarks and of the tests (``npm ci`` installs it; ``make test`` does)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from lab.local.etcd_server import free_port

REPO = Path(__file__).resolve().parents[2]
AZURITE_BLOB = REPO / "node_modules" / ".bin" / "azurite-blob"
# Azurite's documented development account and key: public, not a secret.
ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)
START_TIMEOUT_S = 30.0


@contextmanager
def serve(workdir: Path, extra_args: Sequence[str] = ()) -> Iterator[int]:
    """Azurite's Blob service with its data in ``workdir`` for as long as the block runs; yields
    its port. Its process group is stopped however the block ends."""
    if not AZURITE_BLOB.exists():
        raise ValueError(
            f"Azurite is not installed ({AZURITE_BLOB} is missing): run `make test`, or "
            "`npm ci` in the repo root first"
        )
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = workdir / "azurite.log"
    args = [str(AZURITE_BLOB), "--blobHost", "127.0.0.1", "--blobPort", str(port)]
    args += ["--location", str(workdir), "--skipApiVersionCheck", "--loose"]
    # Azurite sends usage data to Application Insights by default; tests and benchmarks stay
    # off the network.
    args += ["--disableTelemetry", *extra_args]
    with open(log, "wb") as out:
        # Its own session: the whole group is signalled, so no node child outlives it.
        proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=workdir
        )
    try:
        _wait_until_listening(proc, port, log)
        yield port
    finally:
        _stop(proc)


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _wait_until_listening(proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _answers(port):
        if proc.poll() is not None:
            raise RuntimeError(f"azurite exited with {proc.returncode}:\n{log.read_text()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"azurite did not listen on {port} in time:\n{log.read_text()}")
        time.sleep(0.1)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
