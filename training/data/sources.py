"""Where each task's data is staged from, and in what form: a catalogue below its users.

The stack config (its defaults and checks), the staging Job (``stage_data.py``) and the copy
to a node's disk (``fetch_data.py``) read it. Pure and free of torch: the Pulumi program
imports it. A task whose data ``pulumi up`` should stage has one line here; its loader
(training/tasks/) reads the files the format names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

CIFAR10 = "cifar10"
"""The binary CIFAR-10 archive (.tar.gz): data_batch_1..5.bin and test_batch.bin."""
TEXT = "text"
"""One UTF-8 text file, staged as ``CORPUS_FILE``."""
FORMATS = (CIFAR10, TEXT)
CORPUS_FILE = "input.txt"
CHECKSUM = re.compile(r"^(md5:[0-9a-f]{32}|sha256:[0-9a-f]{64})$")
"""A source's checksum as the stack config and the staging Job accept it."""


@dataclass(frozen=True)
class DataSource:
    url: str
    """An https URL: the archive or the file."""
    checksum: str
    """``md5:<hex>`` or ``sha256:<hex>`` of what ``url`` serves."""
    format: str
    """One of ``FORMATS``: how staging checks and unpacks it."""


SOURCES: dict[str, DataSource] = {
    # The official archive and the MD5 its page publishes (binary version).
    "cifar": DataSource(
        "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz",
        "md5:c32a1d4ab5d03f1284b67883e8d87530",
        CIFAR10,
    ),
    # Tiny Shakespeare (karpathy/char-rnn, data/tinyshakespeare/input.txt), pinned to the
    # repository's commit so the bytes cannot change under the checksum; the SHA-256 was
    # computed from that commit's blob (1,115,394 bytes).
    "charlm": DataSource(
        "https://raw.githubusercontent.com/karpathy/char-rnn/"
        "6f9487a6fe5b420b7ca9afb0d7c078e37c1d1b4e/data/tinyshakespeare/input.txt",
        "sha256:86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
        TEXT,
    ),
}
"""Each task's default source, by the task's name."""
