"""``python -m bench.data_copy [--gib G] [--files N] [--dir DIR]``: write G GiB in N files (a
nested layout) and their marker, copy them as a pod's agent does, in a process of its own, and
print the bytes, the seconds and that process's peak RSS; then copy again into a fresh
directory, kill the copy once half the bytes are on disk, start it again and print what the
second start read from the source."""

from __future__ import annotations

import argparse
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from training.data.dataset_marker import MARKER, local_file, marker_body
from training.records import DATA_COPIED, events_named, read_lines

BLOCK = 1 << 20
COPY = (
    "import sys; from training.data.fetch_data import fetch_dataset; "
    "fetch_dataset(sys.argv[1], sys.argv[2])"
)


def write_source(root: Path, total: int, files: int) -> None:
    """``files`` files of ``total`` bytes in all, two folders deep, and their marker."""
    each = total // files
    block = os.urandom(BLOCK)
    paths = []
    for index in range(files):
        path = root / f"part-{index % 4}" / f"shard-{index:04d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as out:
            for offset in range(0, each, BLOCK):
                out.write(block[: min(BLOCK, each - offset)])
        paths.append(path)
    (root / MARKER).write_bytes(marker_body(local_file(root, p) for p in paths))


def copy(source: Path, dest: Path, kill_at: int | None = None) -> dict[str, float]:
    """One copy in a child process: its seconds, peak RSS and the bytes it read (its
    ``data_copied`` event); killed with SIGKILL once ``kill_at`` bytes are on disk."""
    started = time.monotonic()
    child = subprocess.Popen(
        [sys.executable, "-c", COPY, str(source), str(dest)], stdout=subprocess.PIPE, text=True
    )
    if kill_at is not None:
        while child.poll() is None and _on_disk(dest) < kill_at:
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
    out, _ = child.communicate()
    seconds = time.monotonic() - started
    # ru_maxrss of the children waited for: the largest, in KiB on Linux; one child at a time.
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    copied = events_named(read_lines(out), DATA_COPIED)
    read = copied[0]["bytes_read"] if copied else _on_disk(dest)
    return {"seconds": seconds, "peak_rss": peak, "bytes_read": read, "code": child.returncode}


def _on_disk(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.exists() else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.data_copy", description=__doc__)
    parser.add_argument("--gib", type=float, default=2.0, help="GiB of data (> 0)")
    parser.add_argument("--files", type=int, default=16, help="how many files (>= 1)")
    parser.add_argument("--dir", type=Path, help="scratch directory (default: a temporary one)")
    flags = parser.parse_args(argv)
    if not flags.gib > 0 or flags.files < 1:
        parser.error("--gib must be > 0 and --files >= 1")
    total = int(flags.gib * 2**30)
    with tempfile.TemporaryDirectory(dir=flags.dir, prefix="data-copy-") as scratch:
        source = Path(scratch) / "source"
        write_source(source, total, flags.files)
        total = _on_disk(source) - (source / MARKER).stat().st_size
        whole = copy(source, Path(scratch) / "whole")
        print(
            f"copied {total / 2**30:.2f} GiB in {flags.files} files: {whole['seconds']:.1f} s "
            f"({total / whole['seconds'] / 1e6:.0f} MB/s), peak RSS of the copy "
            f"{whole['peak_rss'] / 2**20:.1f} MiB"
        )
        first = copy(source, Path(scratch) / "cut", kill_at=total // 2)
        again = copy(source, Path(scratch) / "cut")
        print(
            f"killed at {first['bytes_read'] / 2**30:.2f} GiB on disk (exit {first['code']}); "
            f"the restart read {again['bytes_read'] / 2**30:.2f} GiB of {total / 2**30:.2f} GiB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
