"""Signals to a whole process tree, found through /proc.

torchrun starts each worker in its own session, so ``kill -PGID`` of the agent leaves the
worker training as an orphan. A faithful node loss walks the parent links in /proc and
signals the agent and every descendant.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

PROC = Path("/proc")
# prctl(PR_SET_CHILD_SUBREAPER): orphans below us are re-parented to us, not to init.
_PR_SET_CHILD_SUBREAPER = 36


def _stat_fields(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of ``pid``, or None when it is gone."""
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name may contain spaces and parentheses: split after the last ')'.
    fields = raw[raw.rfind(")") + 2 :].split()
    return fields[0], int(fields[1])


def parent_map() -> dict[int, list[int]]:
    """ppid -> child pids, for every process visible in /proc."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None:
            children.setdefault(fields[1], []).append(int(entry.name))
    return children


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (not ``pid`` itself), parents before children."""
    children = parent_map()
    found: list[int] = []
    queue = list(children.get(pid, []))
    while queue:
        child = queue.pop(0)
        found.append(child)
        queue.extend(children.get(child, []))
    return found


def is_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def is_stopped(pid: int) -> bool:
    """True when ``pid`` is stopped by a signal (state T)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] == "T"


def _send(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def tree(pid: int) -> list[int]:
    """``pid`` and its live descendants."""
    return [pid, *descendants(pid)] if is_alive(pid) else descendants(pid)


def freeze_tree(pid: int) -> list[int]:
    """SIGSTOP ``pid`` and all descendants until no new process appears; the frozen pids.

    A frozen process keeps its sockets open and sends nothing: to its peers it looks like
    a VM that vanished without an RST.
    """
    frozen: set[int] = set()
    while True:
        pids = [p for p in tree(pid) if p not in frozen]
        if not pids:
            return sorted(frozen)
        _send(pids, signal.SIGSTOP)
        frozen.update(pids)


def thaw_tree(pid: int) -> list[int]:
    """SIGCONT ``pid`` and all descendants (a frozen VM that comes back); the pids signalled."""
    pids = tree(pid)
    _send(pids, signal.SIGCONT)
    return pids


def kill_tree(pid: int) -> list[int]:
    """SIGKILL ``pid`` and all descendants; the pids signalled.

    The tree is frozen first: a killed parent's children are re-parented and could no
    longer be found, and a running agent could start a new worker mid-walk.
    """
    pids = freeze_tree(pid)
    _send(pids, signal.SIGKILL)
    return pids


def terminate_tree(pid: int, grace_s: float) -> list[int]:
    """SIGTERM ``pid`` only (the agent forwards it), then SIGKILL the tree after ``grace_s``."""
    return terminate_trees([pid], grace_s)


def terminate_trees(pids: list[int], grace_s: float) -> list[int]:
    """Stop several trees at once: SIGTERM each root (an agent forwards it to its workers),
    wait until one shared deadline, then SIGKILL whatever of any tree is left; the pids
    that got SIGKILL.

    Together, not one after another: N stuck trees cost one grace period, not N. A stopped
    (frozen) tree would never act on SIGTERM, so it is killed at once.
    """
    frozen = [p for p in pids if is_stopped(p)]
    killed = [member for pid in frozen for member in kill_tree(pid)]
    roots = [p for p in pids if p not in frozen]
    members = {m for root in roots for m in tree(root)}
    _send(roots, signal.SIGTERM)

    def alive() -> list[int]:
        # Workers re-parented away from a dead agent are no longer in its tree: keep members.
        return [p for p in {*members, *(m for r in roots for m in tree(r))} if is_alive(p)]

    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and alive():
        time.sleep(0.05)
    for pid in alive():
        if pid not in killed:  # a member of a tree killed a moment ago is dying already
            killed.extend(kill_tree(pid))
    return list(dict.fromkeys(killed))


def reap(pids: list[int], timeout_s: float = 2.0) -> None:
    """Wait until each of ``pids`` is dead, and reap those that are zombie children of this
    process; gives up after ``timeout_s``.

    SIGKILL is not instant: a loaded machine may run the victim a moment longer, so a
    caller that returns before this would leave a live process behind. Workers of a killed
    agent re-parent to us (the subreaper) and stay zombies until reaped. Pass only pids no
    ``subprocess.Popen`` owns: it must reap its own child to see the code.
    """
    waiting = set(pids)
    deadline = time.monotonic() + timeout_s
    while waiting:
        for pid in list(waiting):
            fields = _stat_fields(pid)
            if fields is None:
                waiting.discard(pid)
            elif fields[0] in ("Z", "X"):
                if fields[1] == os.getpid():
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(pid, os.WNOHANG)
                waiting.discard(pid)  # someone else's zombie: its parent or init reaps it
        if not waiting or time.monotonic() > deadline:
            return
        time.sleep(0.02)


def _mentions(pid: int, marker: bytes) -> bool:
    """True when ``marker`` is in the process's environment or command line."""
    for name in ("environ", "cmdline"):
        try:
            if marker in (PROC / str(pid) / name).read_bytes():
                return True
        except OSError:
            continue
    return False


def kill_marked_descendants(marker: str) -> list[int]:
    """SIGKILL every descendant of this process whose environment or command line holds
    ``marker`` (e.g. a session's workspace path), with its tree, and reap them; the pids.

    Only marked processes: a library caller may have children of its own.
    """
    own = os.getpid()
    marked = [p for p in descendants(own) if _mentions(p, marker.encode())]
    killed: list[int] = []
    for pid in marked:
        if pid not in killed:
            killed.extend(kill_tree(pid))
    reap(killed)
    return killed


def become_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process; False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


# prctl(PR_SET_PDEATHSIG) is set by this trampoline, run after exec in a fresh single-threaded
# process that then execs the command in place (same pid). Not by a preexec_fn: that runs
# between fork and exec while the lab's or the benchmark's threads run, which CPython documents
# as unsafe (a lock another thread held at the fork stays held in the child, which can hang).
_DIE_WITH_PARENT = """\
import ctypes, os, signal, sys
# prctl(PR_SET_PDEATHSIG = 1): the kernel signals this process when its parent dies.
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)
if os.getppid() != int(sys.argv[1]):  # the parent died before prctl took effect
    sys.exit(128 + signal.SIGTERM)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def dying_with_this_process(command: Sequence[str], python: str = sys.executable) -> list[str]:
    """``command`` run so that it gets SIGTERM when this process dies, even of SIGKILL.

    A torchrun agent drains its workers on SIGTERM, so a killed lab leaves no training behind.
    """
    return [python, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *command]


def reap_orphans(keep: set[int]) -> None:
    """Reap zombie children of this process whose pids are not in ``keep``.

    ``keep`` holds the pids owned by ``subprocess.Popen`` objects, which must reap their
    own children to see the real exit code.
    """
    for child in parent_map().get(os.getpid(), []):
        fields = _stat_fields(child)
        if child not in keep and fields is not None and fields[0] == "Z":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(child, os.WNOHANG)
