"""Check of the Kubernetes version the cluster gets: AKS must offer it in the region, and which
Blob CSI driver that version runs (for information: the dataset copy works on every one).

AKS lists what it offers per region with ``ManagedClusters_ListKubernetesVersions``:
``GET /subscriptions/{sub}/providers/Microsoft.ContainerService/locations/{location}/
kubernetesVersions`` (Azure/azure-rest-api-specs, ``specification/containerservice/
resource-manager/Microsoft.ContainerService/aks/stable/2026-05-01/managedClusters.json`` and
its ``examples/KubernetesVersions_List.json``). The answer is ``values[]``, one per minor
version: ``version`` ("1.33"), ``isDefault``, ``isPreview``, ``patchVersions`` (keyed by
"1.33.2") and ``capabilities.supportPlan`` (``KubernetesOfficial``, ``AKSLongTermSupport``).
A version whose only plan is long-term support needs the Premium tier; the lab's cluster is
Free (``infra/cluster.py``). No installed SDK has this call, so it goes through the lab's own
signed-in ARM client.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from catalog.blob_csi import aks_minor, driver_line
from lab.azure.clients import get_json
from lab.azure.preflight.context import FAILS, OK, WARNING, Check, Context

AKS_API_VERSION = "2026-05-01"
"""The newest stable Microsoft.ContainerService api-version in the REST API specs."""
OFFICIAL = "KubernetesOfficial"
"""The support plan of a Free or Standard tier cluster."""


def offered_versions(ctx: Context) -> list[dict[str, Any]]:
    """The ``values`` of ListKubernetesVersions for the stack's region."""
    path = (
        f"/subscriptions/{ctx.sub}/providers/Microsoft.ContainerService/locations/"
        f"{ctx.cfg.location}/kubernetesVersions?api-version={AKS_API_VERSION}"
    )
    with ctx.azure.arm() as client:
        answer = get_json(client, path)
    values = answer.get("values") if isinstance(answer, dict) else None
    return [v for v in values or [] if isinstance(v, dict) and v.get("version")]


def _sort_key(entry: dict[str, Any]) -> tuple[int, ...]:
    try:
        return aks_minor(str(entry["version"]))
    except ValueError:
        return (0, 0)


def describe_offered(values: Sequence[dict[str, Any]]) -> str:
    """``1.31, 1.32, 1.33 (default), 1.34 (preview)``."""
    words = []
    for entry in sorted(values, key=_sort_key):
        marks = [mark for mark in ("default", "preview") if entry.get(f"is{mark.title()}")]
        if OFFICIAL not in ((entry.get("capabilities") or {}).get("supportPlan") or [OFFICIAL]):
            marks.append("LTS only")
        words.append(entry["version"] + (f" ({', '.join(marks)})" if marks else ""))
    return ", ".join(words) or "none"


def choose(values: Sequence[dict[str, Any]], wanted: str, region: str, key: str) -> Check:
    """The check of ``wanted`` ("" for AKS's default) against what the region offers."""
    offered = f"offered in {region}: {describe_offered(values)}"
    default = next((v for v in values if v.get("isDefault")), None)
    if not wanted:
        if default is None:
            return Check("Kubernetes version", WARNING, f"AKS names no default; {offered}")
        return Check("Kubernetes version", OK, f"AKS's default, {default['version']}; {offered}")
    minor = ".".join(wanted.split(".")[:2])
    entry = next((v for v in values if v.get("version") == minor), None)
    fix = f"pulumi config set {key} <one of those>, or empty for AKS's default"
    if entry is None:
        return Check("Kubernetes version", FAILS, f"{wanted} is not {offered}", fix)
    patches = sorted(entry.get("patchVersions") or {}, key=_patch_key)
    if wanted != minor and wanted not in patches:
        detail = f"{wanted} is not offered in {region}; {minor} has {', '.join(patches) or 'none'}"
        return Check("Kubernetes version", FAILS, detail, fix)
    plans = (entry.get("capabilities") or {}).get("supportPlan") or [OFFICIAL]
    if OFFICIAL not in plans:
        detail = f"{wanted} is offered only with long-term support (Premium tier); {offered}"
        return Check("Kubernetes version", FAILS, detail, fix)
    if entry.get("isPreview"):
        why = f"{wanted} is a preview version in {region}; {offered}"
        return Check("Kubernetes version", WARNING, why, f"{fix}, for a supported one")
    return Check("Kubernetes version", OK, f"{wanted}; {offered}")


def _patch_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) if p.isdigit() else 0 for p in version.split("."))


def blob_csi_line(version: str) -> Check:
    """Which Blob CSI driver AKS runs at ``version``, for information."""
    line = driver_line(version)
    if line is None:
        detail = f"AKS {version} is older than the versions whose driver is known here"
        return Check("Blob CSI driver", OK, detail)
    token = "refreshes" if line.refreshes_token else "never refreshes"
    return Check(
        "Blob CSI driver",
        OK,
        f"{line.driver} on AKS {version} ({token} a mounted token); the workers copy the dataset "
        "when they start, which needs the token once, on every driver line",
    )


def check_kubernetes_version(ctx: Context) -> Iterator[Check]:
    values = offered_versions(ctx)
    wanted = ctx.cfg.cluster.kubernetes_version or ""
    check = choose(values, wanted, ctx.cfg.location, ctx.cfg.key("kubernetesVersion"))
    yield check
    version = wanted or next((str(v["version"]) for v in values if v.get("isDefault")), "")
    if version and check.status != FAILS:
        yield blob_csi_line(version)
