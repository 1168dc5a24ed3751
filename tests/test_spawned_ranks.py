"""The tests' spawned ranks (``gloo_group`` in tests/support/waiting.py) cannot hang a test: a
rank stuck outside any collective prints where and ends, and ``mp.spawn`` fails."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from tests.support.waiting import gloo_group


def _stuck(rank: int, root: str) -> None:
    # Only the stuck rank's timer may fire first: had rank 0's (waiting in the barrier) fired
    # as well, whichever dumped first ended the run, and the dump could lack rank 1's frame.
    stuck_s = 5 if rank == 1 else 100
    with gloo_group(Path(root) / "init", rank, 2, stuck_s=stuck_s):
        if rank == 1:
            threading.Event().wait()  # never set, no timeout: what no collective timeout ends


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(120)
def test_a_stuck_rank_prints_its_stack_and_ends_instead_of_hanging_the_test(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(mp.ProcessExitedException, match="process 1 terminated with exit code 1"):
        mp.spawn(_stuck, args=(str(tmp_path),), nprocs=2)
    dump = capfd.readouterr().err
    assert "Timeout (0:00:05)!" in dump
    assert "line 21 in _stuck" in dump, dump  # the rank's own frame, at the wait
