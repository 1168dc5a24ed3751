"""Pruning node-local emergency saves without deleting one that is still in use.

Every re-form on a long-lived node adds a full state to its disk, so each save prunes the
node's older ones down to ``keep``. A worker ends with ``os._exit`` right after its save, which
no thread outlives, so the save retires the older ones at once: each is renamed to a hidden
``.trash-`` name, which takes microseconds; freeing its blocks (an unlink, 50 to 70 ms per GiB
on ext4) runs on a thread, and what a process left in the trash when it ended, the next one
that opens the directory deletes. The durable store's rule (delete
only past a 120 s grace, keep what two manifests name: ``checkpoint.py``) does not bound a
node's disk when rounds re-form quickly, and a node has something better than a grace: its
readers and writers share one kernel, so each marks what it uses with ``flock``.

- ``Pin``: a shared lock on a save a process still needs: the save it just wrote (its durable
  commit streams that file; pinned before the file has a name a prune lists), or the newest
  save the agent commits after its SIGTERM (``NodeLocalState.newest``). The kernel drops it
  when the process ends, however it ends, so a crash leaves nothing pinned.
- ``reading``: a reader reads the manifests and opens a save under a shared lock on the
  directory. A prune takes that lock exclusively and does not wait: with a reader present it
  leaves the pruning to the next save. So no file goes between a manifest read and its open.
- A prune retires only what it can lock exclusively at once, and never the newest valid
  manifest or the ``keep`` newest saves it names. A pin checks, once locked, that its name
  still names the file it locked: retired in between, it is not pinned.

The same locks keep a node's scratch space (``<local-dir>/.scratch``: a save spooled before its
upload, a checkpoint fetched before its load) from filling its disk: each save or load works in
a folder of its own that it holds locked (``scratch_folder``), and a process that starts
removes every such folder nobody holds, which a killed process left (``sweep_scratch``).

flock's locks belong to an open file description: two opens of one file conflict, in one
process or two, and closing the last descriptor releases the lock (man 2 flock). A forked
child shares its parent's descriptions, so it closes this module's descriptors at once.
Node-local disks are local filesystems (``FileStore`` refuses FUSE), where flock holds.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from training.checkpoints.manifest import Manifest, is_object_of, manifest_name, manifest_seq

logger = logging.getLogger(__name__)

TRASH = ".trash-"
"""The prefix of a retired file's name: hidden, so no listing of saves sees it."""
LOCK_NAME = ".prune-lock"
"""The directory's lock: shared by readers, taken exclusively (without waiting) by a prune."""


SCRATCH = ".scratch"
"""The scratch space's folder under ``--local-dir``."""
SCRATCH_PREFIXES = (".spool-", ".load-", ".init-")
"""The folders of the scratch space: a save's spooled files, a load's fetched ones, an
``--init-from``'s."""
_CLAIMING = ".claiming-"
"""A scratch folder's name until its lock is held: never one a sweep removes."""

WAIT_S = 10.0
"""How long a reader waits for a prune holding the directory (a few unlinks). Past it, a prune
that froze: the reader goes on without the lock, and a save gone since its manifest read makes
it fall back, as a torn one would."""

_open_fds: dict[int, object] = {}
"""This module's descriptors, each with its owner's token: what a forked child closes."""


def _open(path: Path, flags: int, owner: object) -> int:
    fd = os.open(path, flags, 0o644)
    _open_fds[fd] = owner
    return fd


def _close(fd: int, owner: object) -> None:
    if _open_fds.get(fd) is owner:  # not a number a forked child reused
        del _open_fds[fd]
        os.close(fd)


def _forget_in_child() -> None:
    # A lock lives until every descriptor of its open file description is closed: a child
    # forked while one is held (a DataLoader worker, say) would hold it for its whole life.
    for fd in list(_open_fds):
        with suppress(OSError):
            os.close(fd)
    _open_fds.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _lock_within(fd: int, operation: int, seconds: float) -> bool:
    """``flock(fd, operation)``, waiting at most ``seconds``; whether it was taken."""
    give_up = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= give_up:
                return False
            time.sleep(0.005)


class Pin:
    """A shared lock on one file: no prune deletes it while this is held."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._token = object()  # not the pin itself: the registry must not keep it alive
        fd = _open(path, os.O_RDONLY, self._token)
        try:
            if not _lock_within(fd, fcntl.LOCK_SH, WAIT_S):
                raise TimeoutError(f"{path} has been locked by a prune for {WAIT_S:g} s")
            if not _names(path, os.fstat(fd)):  # pruned between the open and the lock
                raise FileNotFoundError(f"{path} was pruned")
        except BaseException:
            _close(fd, self._token)
            raise
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            _close(self._fd, self._token)
            self._fd = None

    def __del__(self) -> None:  # an owner dropped without ``release``: no fd leaks
        try:
            self.release()
        except Exception:  # at interpreter exit, this module's globals may be gone
            return


class Pruner:
    """Runs ``prune`` on a thread of its own, one run at a time, until no save asked for more.

    A prune that starts while another holds the directory's lock gives up (it never waits), so
    one thread per save would leave the saves that landed during a slow prune until the next
    save. A request during a run makes the same thread run again, after it.
    """

    def __init__(self, prune: Callable[[], object], name: str = "node-local-prune") -> None:
        self._prune, self._name = prune, name
        self._state = threading.Lock()
        self._wanted = False
        self._thread: threading.Thread | None = None

    def request(self) -> None:
        with self._state:
            self._wanted = True
            if self._thread is None:
                # Daemon: cut off by the process's end, the next save prunes again.
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._state:
                if not self._wanted:
                    self._thread = None  # under the lock: a request now starts a new thread
                    return
                self._wanted = False
            try:
                self._prune()
            except Exception:  # never let the thread die with a request still open
                logger.exception("pruning the node-local saves failed")

    def wait(self) -> None:
        """Wait until every requested prune has run."""
        while True:
            with self._state:
                thread = self._thread
            if thread is None:
                return
            thread.join()
            with self._state:  # ended without clearing it: killed, or forked without it
                if self._thread is thread:
                    self._thread = None


@contextmanager
def reading(root: Path) -> Iterator[None]:
    """Hold off prunes while the caller reads the manifests and opens a save."""
    token = object()
    fd = _open(root / LOCK_NAME, os.O_RDONLY | os.O_CREAT, token)
    try:
        if not _lock_within(fd, fcntl.LOCK_SH, WAIT_S):
            logger.warning(
                "a prune has held %s for %g s; reading the node-local saves without it",
                root / LOCK_NAME,
                WAIT_S,
            )
        yield
    finally:
        _close(fd, token)


def _names(path: Path, locked: os.stat_result) -> bool:
    """Whether ``path`` still names the file whose status is ``locked``."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    return locked.st_nlink > 0 and (now.st_dev, now.st_ino) == (locked.st_dev, locked.st_ino)


def prune(root: Path, prefix: str, keep: int) -> list[str]:
    """``retire``, then delete every retired file of ``root``; the names retired."""
    retired = retire(root, prefix, keep)
    for path in root.glob(TRASH + "*"):
        with suppress(OSError):  # another process's prune may be deleting it too
            path.unlink()
    return retired


def retire(root: Path, prefix: str, keep: int) -> list[str]:
    """Rename what is older than the ``keep`` newest saves of ``root`` into the trash (the
    renames alone: no file's blocks are freed here); the names retired.

    Nothing when a reader is present or no manifest is valid (then nothing says which save
    is the newest); a pinned file stays. A failure is logged: the next save prunes again.
    """
    token = object()
    try:
        fd = _open(root / LOCK_NAME, os.O_RDONLY | os.O_CREAT, token)
    except OSError as exc:
        logger.warning("pruning the node-local saves in %s failed: %s", root, exc)
        return []
    try:
        if not _lock_within(fd, fcntl.LOCK_EX, 0):
            logger.info("node-local saves in %s are being read; pruning them next time", root)
            return []
        return [name for name in _doomed(root, prefix, keep) if _retire_unless_pinned(root / name)]
    except OSError as exc:
        logger.warning("pruning the node-local saves in %s failed: %s", root, exc)
        return []
    finally:
        _close(fd, token)


def _doomed(root: Path, prefix: str, keep: int) -> list[str]:
    """Saves the newest valid manifest does not keep, and the manifests before it."""
    names = [name for name in os.listdir(root) if not name.startswith(".")]
    seqs = sorted(seq for seq in (manifest_seq(n, prefix) for n in names) if seq is not None)
    newest = _newest_valid(root, prefix, seqs)
    if newest is None:
        return []
    kept = {name for entry in newest.entries[:keep] for name in entry.objects}
    objects = [n for n in names if is_object_of(n, prefix) and n not in kept]
    # Newer manifests than the newest valid one stay: torn, they still hold their number.
    return objects + [manifest_name(prefix, seq) for seq in seqs if seq < newest.seq]


def _newest_valid(root: Path, prefix: str, seqs: list[int]) -> Manifest | None:
    for seq in reversed(seqs):
        try:
            manifest = Manifest.decode((root / manifest_name(prefix, seq)).read_bytes())
        except FileNotFoundError:
            continue
        if manifest is not None and manifest.seq == seq and not manifest.foreign(prefix):
            return manifest
    return None


def _retire_unless_pinned(path: Path) -> bool:
    token = object()
    try:
        fd = _open(path, os.O_RDONLY, token)
    except FileNotFoundError:
        return False
    try:
        if not _lock_within(fd, fcntl.LOCK_EX, 0):
            logger.info("kept %s: a reader or a durable commit is using it", path.name)
            return False
        os.rename(path, path.with_name(TRASH + path.name))  # under the lock: no pin in between
        return True
    finally:
        _close(fd, token)


@contextmanager
def scratch_folder(root: Path, prefix: str) -> Iterator[Path]:
    """A new folder in ``root`` for one save's or load's files, named ``prefix`` + a random
    part, held (a shared lock) while the block runs and removed after it. A process killed
    in the block leaves it, unheld, for the next ``sweep_scratch``."""
    root.mkdir(parents=True, exist_ok=True)
    token = object()
    claiming = Path(tempfile.mkdtemp(prefix=_CLAIMING, dir=root))
    fd = _open(claiming, os.O_RDONLY, token)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        # Renamed only once held: a sweep never sees a name of its own that nobody holds yet.
        folder = claiming.rename(root / (prefix + claiming.name[len(_CLAIMING) :]))
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    finally:
        _close(fd, token)


def sweep_scratch(root: Path) -> list[str]:
    """Remove each scratch folder in ``root`` that no live process holds (a killed save's or
    load's: up to a whole state each); the names removed."""
    removed: list[str] = []
    try:
        names = sorted(p.name for p in root.iterdir() if p.name.startswith(SCRATCH_PREFIXES))
    except FileNotFoundError:
        return removed
    for name in names:
        try:
            fd = os.open(root / name, os.O_RDONLY)
        except FileNotFoundError:  # its owner was done first
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # held: a save or a load in another process
            os.close(fd)
            continue
        try:
            shutil.rmtree(root / name, ignore_errors=True)
            removed.append(name)
        finally:
            os.close(fd)
    if removed:
        logger.info("removed %d scratch folder(s) a killed process left in %s", len(removed), root)
    return removed
