"""Imported by the warm launcher's fork server only (``training/launcher.py``, ``PRELOAD``): the
server outlives a SIGTERM sent to every process of the node at once.

An OS shutdown signals every process, the fork server too. Its default action ends it, and the
agent, which learns its workers' exits through the server (``multiprocessing``'s
``popen_forkserver.poll`` reads an end of file as exit 255), then takes every worker for dead:
it skips the wait it gives them to save and exits at once, and the node's last steps go with
it. So the server ignores SIGTERM (it still exits when the agent does: its pipe from the agent
closes); a process it forked takes the signal's default action, as before, until it installs
its own handler (``training/elastic/faults.py``, ``StopRequest``).
"""

from __future__ import annotations

import os
import signal
from types import FrameType

_SERVER = os.getpid()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    if os.getpid() == _SERVER:
        return  # the server: the agent decides when its workers end
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a fresh worker: ended, as by default
    os.kill(os.getpid(), signal.SIGTERM)


signal.signal(signal.SIGTERM, _on_sigterm)
