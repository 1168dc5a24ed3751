"""``python -m bench.sharded_memory``: its flags, and the peak it reads from the kernel."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.sharded_memory import single_file
from bench.sharded_memory.__main__ import main
from bench.sharded_memory.peak_rss import MIB, _peak, _reset_peak
from training.checkpoints.state_transfer import BUCKET_BYTES


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mode", "tp"], "--mode must be one of fsdp2, ddp, ddp-file, got 'tp'"),
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


@pytest.mark.usefixtures("processes")
@pytest.mark.timeout(300)
def test_a_ddp_restore_holds_the_state_once_per_rank_and_a_save_adds_no_copy(
    tmp_path: Path,
) -> None:
    # Before the state went tensor by tensor, the receiver held it twice and its holder three
    # (local) or four (durable) times; until the durable holder mapped a fetched file, it held
    # two. Small tensors go packed in a bucket. A periodic save serialized its snapshot into
    # bytes (one copy more); now it writes a file on local disk.
    rows = single_file.measure(96, 2, tmp_path)
    (save,) = rows.pop("save")
    assert save["peak"] - save["before"] < 32 * MIB, (save["peak"] - save["before"]) / MIB
    for source, source_rows in rows.items():
        for row in source_rows:
            grew = row["peak"] - row["before"]
            bound = row["share"] + BUCKET_BYTES + 32 * MIB
            assert grew < bound, (source, row, grew / MIB)
