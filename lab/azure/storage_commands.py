"""The command lines of ``lab data upload`` and ``lab export``: a run's data in, its weights
out. Light at import (``python -m lab`` builds these parsers for every command); the SDKs and
torch load when a command runs."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from lab.exit_status import HelpFormatter

STORAGE_COMMANDS = ("data", "export")


def add_storage_parsers(sub: argparse._SubParsersAction) -> None:
    """The parsers of ``data upload`` and ``export`` under ``python -m lab``."""
    data = sub.add_parser(
        "data",
        help="the stack's dataset: `data upload DIR` puts a directory into its data container",
        description="The stack's dataset.",
        formatter_class=HelpFormatter,
    )
    verbs = data.add_subparsers(dest="verb", required=True)
    upload = verbs.add_parser(
        "upload",
        help="upload DIR to the stack's data container, its completion marker last",
        description="Upload every file under DIR, nested folders too, to the stack's data "
        "container (or --prefix in it), signed in as the identity that ran `pulumi up` "
        "(`az login`), with a progress bar. The completion marker, listing each file's size "
        "and SHA-256, goes last: the workers, which wait for it, then copy the dataset to "
        "their disks and read it as --data-dir. Files already there with the same digest are "
        "not uploaded again.\nExit status: 0 uploaded, 1 Azure refused or failed, 2 a bad "
        "flag or no stack outputs.",
        formatter_class=HelpFormatter,
    )
    upload.add_argument("dir", type=Path, metavar="DIR", help="the dataset's directory")
    upload.add_argument(
        "--stack", help="the stack whose data container it goes to (default: the selected one)"
    )
    upload.add_argument(
        "--prefix", metavar="PATH", help="a folder inside the container (default: its root)"
    )
    upload.add_argument(
        "--container-uri",
        metavar="URL",
        help="the container's URL instead of the stack's, e.g. "
        "https://ACCOUNT.blob.core.windows.net/data",
    )
    _export_parser(sub)


def _export_parser(sub: argparse._SubParsersAction) -> None:
    export = sub.add_parser(
        "export",
        help="write a run's trained model as one plain state dict (torch.load, safetensors)",
        description="Write the model of the newest verified checkpoint (or --step N) as one "
        "plain state dict, the model's own parameter and buffer names, from a DDP or an "
        "fsdp2 run alike: a .pt file that torch.load(weights_only=True) reads, or a "
        ".safetensors file. Each file of the checkpoint is checked against its manifest's "
        "SHA-256 first; the tensors are then read and written one at a time. A torn or "
        "unverified checkpoint is refused.\nExit status: 0 written, 1 the store cannot be "
        "read, 2 a bad flag, no such checkpoint or one that does not verify.",
        formatter_class=HelpFormatter,
    )
    where = export.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--checkpoint-uri",
        metavar="URI",
        help="the run's --checkpoint-uri: a directory or an https:// Blob URL",
    )
    where.add_argument("--stack", help="the stack whose job's checkpoints to read")
    export.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="FILE",
        help="the file to write: .pt, or .safetensors for that format",
    )
    export.add_argument(
        "--step", type=int, metavar="N", help="the checkpoint of step N (default: the newest)"
    )
    export.add_argument(
        "--scratch",
        type=Path,
        metavar="DIR",
        help="local disk for a Blob checkpoint's files while they are checked and read "
        "(default: beside --out)",
    )


def run_storage_command(args: argparse.Namespace) -> int:
    """Run ``data upload`` or ``export``; the exit status."""
    if args.command == "data":
        from lab.azure.data_upload import main as data_upload

        return data_upload(args, os.environ)
    from lab.azure.weights_export import main as export

    return export(args, os.environ)
