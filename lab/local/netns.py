"""Nodes on a network of their own, and a partition on cue: each node in a network namespace.

Each node runs in a namespace of its own (``ip netns``), its ``eth0`` one end of a veth pair
whose other end is on a bridge in the host's namespace; the bridge holds the host's address, on
which etcd listens. ``cut(node)`` adds, inside that node's namespace, a blackhole route to every
other node's address (``ip route add blackhole``): whatever the node sends its peers is dropped
without a word, and so are its replies to them (a SYN from a peer arrives, its SYN-ACK is
dropped), so to its peers it is a gray failure, a node that sends nothing back, while its own
traffic to etcd, through the bridge, flows on. ``heal(node)`` removes those routes.
``cut_from_host(node)`` is the other partition: a blackhole route to the host's address only
(etcd), so the node still reaches its peers; ``heal_host(node)`` removes it.

Needs root (``CAP_NET_ADMIN``) and iproute2; ``unavailable()`` says why not, for a test to
skip. A node that comes later gets its namespace with ``add``. Every name carries a random
tag, so two runs on one machine never meet, and ``close()`` removes what was made (a
namespace's veth goes with it).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import uuid
from types import TracebackType

IFNAME = "eth0"
"""The node's interface inside its namespace: the name GLOO_SOCKET_IFNAME gives gloo."""


def _ip(*args: str, ns: str | None = None) -> None:
    command = ["ip", *(["-n", ns] if ns else []), *args]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise OSError(f"{' '.join(command)}: {done.stderr.strip() or done.returncode}")


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CAP_NET_ADMIN)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"spl{uuid.uuid4().hex[:8]}"
    try:
        _ip("netns", "add", probe)
    except OSError as exc:
        return f"cannot make a network namespace: {exc}"
    with contextlib.suppress(OSError):
        _ip("netns", "del", probe)
    return None


class Network:
    """A bridge on the host and one namespace per node; a context manager that removes them."""

    def __init__(self, nodes: list[str]) -> None:
        tag = uuid.uuid4().hex[:5]
        self.bridge = f"spl{tag}"
        # A /24 of 10.0.0.0/8 picked at random: another run, or the host's own, is unlikely
        # to use it; ``start`` fails loudly if the kernel refuses it.
        net = f"10.{random.randint(160, 250)}.{random.randint(0, 255)}"
        self.host_addr = f"{net}.1"
        self._tag, self._net, self._nodes = tag, net, list(nodes)
        self.namespaces: dict[str, str] = {}
        self.addrs: dict[str, str] = {}
        self._veths: dict[str, str] = {}
        self.cut_off: set[str] = set()

    def start(self) -> Network:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.host_addr}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for node in self._nodes:
                self.add(node)
        except OSError:
            self.close()
            raise
        return self

    def add(self, node: str) -> None:
        """A namespace for one more node on the running network (a node that joins later);
        a node cut off now does not reach it either. Idempotent."""
        if node in self.namespaces:
            return
        index = len(self.namespaces)
        if index > 200:
            raise OSError(f"no address left on {self._net}.0/24 for {node}")
        ns, veth = f"spl{self._tag}-{node}", f"spl{self._tag}v{index}"
        self.namespaces[node], self._veths[node] = ns, veth
        self.addrs[node] = f"{self._net}.{10 + index}"
        _ip("netns", "add", ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", IFNAME, "netns", ns)
        _ip("link", "set", veth, "master", self.bridge)
        _ip("link", "set", veth, "up")
        _ip("link", "set", "lo", "up", ns=ns)
        _ip("addr", "add", f"{self.addrs[node]}/24", "dev", IFNAME, ns=ns)
        _ip("link", "set", IFNAME, "up", ns=ns)
        for cut in self.cut_off:
            _ip("route", "add", "blackhole", f"{self.addrs[node]}/32", ns=self.namespaces[cut])

    def command(self, node: str, argv: list[str]) -> list[str]:
        """``argv`` run inside ``node``'s namespace (``ip netns exec`` execs it: same pid)."""
        return ["ip", "netns", "exec", self.namespaces[node], *argv]

    def env(self, node: str) -> dict[str, str]:
        """What a training node in the namespace needs: the address its peers reach it at
        (torchrun's ``--local-addr``: its join key, rank 0's MASTER_ADDR) and gloo's
        interface."""
        return {"PET_LOCAL_ADDR": self.addrs[node], "GLOO_SOCKET_IFNAME": IFNAME}

    def cut(self, node: str) -> None:
        """Cut ``node`` off from every other node, not from the host (etcd). Idempotent."""
        if node in self.cut_off:
            return
        for peer, addr in self.addrs.items():
            if peer != node:
                _ip("route", "add", "blackhole", f"{addr}/32", ns=self.namespaces[node])
        self.cut_off.add(node)

    def heal(self, node: str) -> None:
        """``node`` reaches its peers again."""
        for peer, addr in self.addrs.items():
            if peer != node:
                with contextlib.suppress(OSError):
                    _ip("route", "del", "blackhole", f"{addr}/32", ns=self.namespaces[node])
        self.cut_off.discard(node)

    def cut_from_host(self, node: str) -> None:
        """Cut ``node`` off from the host (etcd), not from its peers. Idempotent."""
        with contextlib.suppress(OSError):  # already cut
            _ip("route", "add", "blackhole", f"{self.host_addr}/32", ns=self.namespaces[node])

    def heal_host(self, node: str) -> None:
        """``node`` reaches the host (etcd) again."""
        with contextlib.suppress(OSError):
            _ip("route", "del", "blackhole", f"{self.host_addr}/32", ns=self.namespaces[node])

    def close(self) -> None:
        """Remove every namespace (its veth goes with it) and the bridge."""
        for ns in self.namespaces.values():
            with contextlib.suppress(OSError):
                _ip("netns", "del", ns)
        with contextlib.suppress(OSError):
            _ip("link", "del", self.bridge)

    def __enter__(self) -> Network:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
