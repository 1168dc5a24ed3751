"""What every preflight check shares: the line it reports and the context it reads.

A check is a generator of ``Check`` lines over a ``Context``: the stack, the Azure clients,
the local tools' runner and what earlier checks found (az's account, the subscription, the
caller, the VM sizes' entries). Checks only read: every Azure call is a GET, every local tool
is asked for its version or its account.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lab.azure.clients import Azure
from stack_config.files import StackSettings
from stack_config.model import LabConfig

OK, WARNING, FAILS, SKIPPED = "ok", "warning", "fails", "skipped"


@dataclass(frozen=True)
class Check:
    """One line of the report."""

    name: str
    status: str
    detail: str
    fix: str = ""


Runner = Callable[[list[str]], subprocess.CompletedProcess[str]]


def run_tool(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run a local tool with a time limit; a hung tool reads as a failed one."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, "", f"{argv[0]} did not answer in 60 s")
    except OSError as err:
        return subprocess.CompletedProcess(argv, 127, "", str(err))


@dataclass
class Context:
    """What the checks share: the stack, Azure, the tools' answers found so far."""

    settings: StackSettings
    azure: Azure
    run: Runner = run_tool
    az_account: dict[str, Any] | None = None
    """``az account show``: az's signed-in account and default subscription."""
    subscription: str | None = None
    subscription_source: str = ""
    offer: str | None = None
    """The subscription's quotaId (its offer)."""
    caller: dict[str, Any] = field(default_factory=dict)
    skus: dict[str, Any] = field(default_factory=dict)
    """The needed VM sizes' Resource SKU entries, by lower-case name."""

    @property
    def cfg(self) -> LabConfig:
        return self.settings.config

    @property
    def environ(self) -> Mapping[str, str]:
        """The environment ``pulumi up`` would see (sign-in and subscription variables)."""
        return self.azure.environ

    @property
    def sub(self) -> str:
        """The chosen subscription: the checks after ``check_subscription`` run only with one."""
        assert self.subscription is not None  # check_subscription ran first and passed
        return self.subscription


def enum_text(value: object) -> str:
    """An SDK enum member as Azure spelled it (``NotAvailableForSubscription``)."""
    return str(getattr(value, "value", value))
