"""Which Azure GPU sizes the Spot pool can use: NVIDIA, whole GPUs, current, driver by AKS.

The pool asks AKS to install the NVIDIA driver (``gpuProfile.driver: Install``) and runs our
own NVIDIA device plugin; every worker asks for a whole ``nvidia.com/gpu``. That rules out
AMD GPUs (no NVIDIA driver or plugin), fractional GRID vGPUs (the plugin sees no CUDA
device), retired sizes (AKS cannot create them) and confidential H100s (they need the GPU
Operator's signed driver instead of AKS's). Pure: no pulumi import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuFamily:
    """One VM family the pool accepts."""

    name: str
    """Azure's family name, e.g. ``NCasT4_v3``."""
    pattern: re.Pattern[str]
    example: str
    """The family's smallest size."""


FAMILIES: tuple[GpuFamily, ...] = (
    GpuFamily("NCasT4_v3 (T4)", re.compile(r"^Standard_NC\d+as_T4_v3$"), "Standard_NC4as_T4_v3"),
    GpuFamily(
        "NCadsA10_v4 (A10)", re.compile(r"^Standard_NC\d+ads_A10_v4$"), "Standard_NC8ads_A10_v4"
    ),
    GpuFamily(
        "NCadsA100_v4 (A100 PCIe)",
        re.compile(r"^Standard_NC\d+ads_A100_v4$"),
        "Standard_NC24ads_A100_v4",
    ),
    GpuFamily(
        "NCadsH100_v5 (H100 NVL)",
        re.compile(r"^Standard_NC\d+adi?s_H100_v5$"),
        "Standard_NC40ads_H100_v5",
    ),
    GpuFamily(
        "NDasrA100_v4 (8x A100)", re.compile(r"^Standard_ND\d+asr_v4$"), "Standard_ND96asr_v4"
    ),
    GpuFamily(
        "NDamsrA100_v4 (8x A100 80GB)",
        re.compile(r"^Standard_ND\d+amsr_A100_v4$"),
        "Standard_ND96amsr_A100_v4",
    ),
    GpuFamily(
        "NDisrH100_v5 (8x H100)",
        re.compile(r"^Standard_ND\d+isr_H100_v5$"),
        "Standard_ND96isr_H100_v5",
    ),
    GpuFamily(
        "NDisrH200_v5 (8x H200)",
        re.compile(r"^Standard_ND\d+isr_H200_v5$"),
        "Standard_ND96isr_H200_v5",
    ),
)

# Sizes people reach for that cannot run this job, and why; checked in this order.
_REJECTED: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"^Standard_NC\d+r?s_v3$"),
        "NCv3 (V100), retired on 2025-09-30",
    ),
    (
        re.compile(r"^Standard_(NC\d+r?|NC\d+r?s_v2|ND\d+r?s|NV\d+)(_Promo)?$"),
        "of a retired family (NC, NCv2, ND or NV v1): AKS can no longer create it",
    ),
    (
        re.compile(r"^Standard_(NV\d+as_v4|NG\d+\w*_V620\w*|NV\d+\w*_V710\w*|ND\d+\w*MI300X\w*)$"),
        "an AMD GPU: AKS installs no NVIDIA driver and the NVIDIA device plugin finds no GPU",
    ),
    (
        re.compile(r"^Standard_NV\d+ad(m)?s_A10_v5$"),
        "an NVadsA10_v5 GRID vGPU size, made for graphics and mostly a fraction of an A10; "
        "for A10 compute use NCadsA10_v4",
    ),
    (
        re.compile(r"^Standard_NCC\d+\w*$"),
        "a confidential GPU: it needs the NVIDIA GPU Operator's signed driver, not AKS's",
    ),
)


def gpu_family(vm_size: str) -> GpuFamily | None:
    """The accepted family ``vm_size`` belongs to, or None."""
    return next((f for f in FAMILIES if f.pattern.match(vm_size)), None)


def rejection_reason(vm_size: str) -> str | None:
    """Why a known but unusable size is refused (None: not one we recognise)."""
    return next((why for pattern, why in _REJECTED if pattern.match(vm_size)), None)


def allowed_families() -> str:
    """The accepted families with an example each, for error messages."""
    return ", ".join(f"{f.name} e.g. {f.example}" for f in FAMILIES)
