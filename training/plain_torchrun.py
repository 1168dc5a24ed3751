"""``torchrun`` itself, with this rendezvous registered: what ``TRAIN_LAUNCHER=torchrun`` runs.

Plain torchrun starts a new interpreter per worker (no warm fork server), but it must still
meet the others in the same rendezvous: torch's own ``etcd`` and ``etcd-v2`` backends speak
etcd's v2 API, which etcd 3.6 removed. So the backend the PyTorchJob names (``etcd``) is served
by training/elastic/rendezvous.py here too, registered through torch's public registry before
torchrun's ``main`` parses its flags and the PET_* env.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from training.elastic.launch import ETCD_BACKENDS


def ours(args: Sequence[str], backend: str) -> list[str]:
    """``args`` and the env with an etcd rendezvous backend named ``backend``."""
    if os.environ.get("PET_RDZV_BACKEND") in ETCD_BACKENDS:
        os.environ["PET_RDZV_BACKEND"] = backend
    out = list(args)
    for i, arg in enumerate(out):
        name, eq, value = arg.partition("=")
        if name in ("--rdzv-backend", "--rdzv_backend"):
            if eq and value in ETCD_BACKENDS:
                out[i] = f"{name}={backend}"
            elif not eq and i + 1 < len(out) and out[i + 1] in ETCD_BACKENDS:
                out[i + 1] = backend
    return out


def main(argv: Sequence[str] | None = None) -> None:
    from torch.distributed.run import main as torchrun

    from training.elastic.rendezvous import register

    torchrun(ours(sys.argv[1:] if argv is None else argv, register()))


if __name__ == "__main__":
    main()
