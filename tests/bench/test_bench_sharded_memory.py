"""``python -m bench.sharded_memory``: its flags, and the peak it reads from the kernel."""

from __future__ import annotations

import pytest
import torch

from bench.sharded_memory.__main__ import main
from bench.sharded_memory.peak_rss import MIB, _peak, _reset_peak


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mode", "tp"], "--mode must be one of fsdp2, ddp, got 'tp'"),
        (["--state-mib", "2"], "--state-mib must be >= 3 and each of --worlds >= 1"),
        (["--worlds", "2", "0"], "--state-mib must be >= 3 and each of --worlds >= 1"),
    ],
)
def test_bad_flags_name_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as ended:
        main(argv)
    assert ended.value.code == 2
    assert message in capsys.readouterr().err


def test_the_peak_is_reset_and_then_counts_what_was_held_since() -> None:
    before = _reset_peak()
    # 64 MiB, touched; above glibc's largest mmap threshold (32 MiB), so freed at once.
    held = torch.ones(64 * MIB // 4)
    assert _peak() - before >= 63 * MIB
    del held
    assert _reset_peak() - before < 32 * MIB  # gone again, and the mark follows it down
