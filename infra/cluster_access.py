"""Wait until the deployer may act in the cluster, so the first ``pulumi up`` needs no second run.

The cluster-admin role assignment (Azure RBAC) exists as soon as ARM has created it, but AKS
documents that the API server may take up to five minutes to honour it; until then every
Kubernetes call is refused with 403. The Kubernetes provider's own start proves nothing:
``/version`` answers anyone. So a local command asks the API server, as the deployer and
through the same kubeconfig, whether it may create a namespace (``kubectl auth can-i``, a
SelfSubjectAccessReview), every few seconds while it says no, and fails with the last answer
after a bound, or at once on an error that is not a no. Every Kubernetes object waits for it
(``workloads/lab_workloads.py``).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

import pulumi
import pulumi_command as command

KUBECONFIG_ENV = "SPOT_LAB_KUBECONFIG"
"""The command gets the kubeconfig in this variable (a secret input), never on its command line."""
WAIT_S = 600
"""Twice what AKS documents for a role assignment to apply (up to five minutes)."""
INTERVAL_S = 10
PROBE = 'kubectl --kubeconfig "$config" auth can-i create namespaces'
"""A cluster-scoped write the program makes first; the role grants every action or none."""


def access_wait_script(who: str, wait_s: int = WAIT_S, interval_s: int = INTERVAL_S) -> str:
    """A POSIX shell script: exit 0 once the API server lets the deployer create a namespace;
    exit 1 with the last answer once ``wait_s`` has passed, or at once without the tools or on
    an answer that is not a "no".

    ``kubectl auth can-i`` prints ``no`` (then `` - <reason>``) on stdout when the authorizer
    refused, which is what Azure RBAC says until the new role assignment applies; anything
    else (no sign-in, kubelogin failing, an unreachable server) is an error on stderr that
    asking again cannot fix (kubectl, pkg/cmd/auth/cani.go, ``RunAccessCheck``).
    """
    hint = (
        f"the cluster still refuses {who} after {wait_s} s. "
        "Azure RBAC can take up to 5 minutes to apply a new role assignment. "
        "kubectl auth can-i create namespaces said:"
    )
    failed = (
        f"kubectl could not ask the cluster whether {who} may act, an error that waiting cannot "
        "fix; if it is Unauthorized (401), kubelogin signs in as someone else or in another "
        "tenant than the one granted (docs/azure.md, Prerequisites). kubectl said:"
    )
    return "\n".join(
        [
            "set -u",
            "for tool in kubectl kubelogin; do",
            '  command -v "$tool" >/dev/null 2>&1 || {',
            '    echo "$tool is not installed: az aks install-cli installs it" >&2',
            "    exit 1",
            "  }",
            "done",
            "config=$(mktemp) || exit 1",
            "errors=$(mktemp) || exit 1",
            'trap \'rm -f "$config" "$errors"\' EXIT',
            f'printf \'%s\' "${KUBECONFIG_ENV}" > "$config"',
            f"deadline=$(( $(date +%s) + {int(wait_s)} ))",
            "while :; do",
            f'  if answer=$({PROBE} 2>"$errors"); then',
            '    echo "the API server lets the deployer act: $answer"',
            "    exit 0",
            "  fi",
            '  case "$answer" in',
            "    no|no\\ *) ;;",
            f'    *) echo {shlex.quote(failed)} "$answer" "$(cat "$errors")" >&2; exit 1 ;;',
            "  esac",
            '  if [ "$(date +%s)" -ge "$deadline" ]; then',
            f'    echo {shlex.quote(hint)} "$answer" >&2',
            "    exit 1",
            "  fi",
            f"  sleep {int(interval_s)}",
            "done",
        ]
    )


@dataclass
class ClusterAccessWaitArgs:
    """Inputs of ``ClusterAccessWait``."""

    kubeconfig: pulumi.Input[str]
    """The kubeconfig the Kubernetes provider uses (secret)."""
    admin_grant: pulumi.CustomResource
    """The deployer's cluster-admin role assignment."""
    who: str
    """The deployer, in words, for the error message."""


class ClusterAccessWait(pulumi.ComponentResource):
    """A command that returns once the cluster honours the deployer's admin role."""

    ready: pulumi.Resource
    """Depend on this to act in the cluster."""

    def __init__(
        self, name: str, args: ClusterAccessWaitArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("spot-lab:cluster:ClusterAccessWait", name, None, opts)
        self.ready = command.local.Command(
            f"{name}-can-i",
            create=access_wait_script(args.who),
            environment={KUBECONFIG_ENV: pulumi.Output.secret(args.kubeconfig)},
            # A new assignment (another deployer, a new cluster) is waited for again.
            triggers=[args.admin_grant.id],
            opts=pulumi.ResourceOptions(parent=self, depends_on=[args.admin_grant]),
        )
        self.register_outputs({})
