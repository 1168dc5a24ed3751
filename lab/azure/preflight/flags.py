"""The flags of ``python -m lab preflight``, apart from its checks: ``--help`` and a wrong flag
answer before the checks load the Azure SDKs (``lab/cli.py`` parses with this first)."""

from __future__ import annotations

import argparse

from lab.exit_status import HelpFormatter


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m lab preflight`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="python -m lab preflight",
        description=(
            "Check, before it creates and bills anything, that `pulumi up` will work: the stack "
            "config, the tools it runs (pulumi, az signed in, git, kubelogin; docker for "
            "imageBuilder docker), who becomes the cluster's admin and whether kubelogin can "
            "sign in as it, the subscription it deploys into, resource providers, the VM sizes "
            "in the region, Spot and CPU quotas, the Kubernetes version (and its Blob CSI "
            "driver), permission to create role assignments, ACR Tasks for the subscription's "
            "offer, and the images' base tags and digests in their registry (anonymously). "
            "Only reads. Signs in as `pulumi up` does: ARM_CLIENT_ID with ARM_CLIENT_SECRET "
            "(or a certificate) and ARM_TENANT_ID, ARM_USE_MSI, else az login.\n"
            "Exit status: 0 pulumi up can go ahead, 1 a check fails, 2 bad input."
        ),
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--stack",
        help="stack to check, as in Pulumi.<stack>.yaml (default: the selected Pulumi stack)",
    )
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    return parser
