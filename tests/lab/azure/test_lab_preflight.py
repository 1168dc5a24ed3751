"""``lab preflight`` against recorded Azure answers, fake local tools and scratch stacks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lab.azure.clients import reach
from lab.azure.preflight.command import main
from lab.azure.preflight.identity import action_matches
from stack_config.files import load_stack
from stack_config.model import ConfigError
from tests.support.azure_replay import FakeAzure, NoSignIn, recording
from tests.support.lab_azure_fixtures import (
    OID,
    OTHER_SUB,
    PROJECT_DIR,
    ROLE_ASSIGNMENTS,
    ROLE_DEFINITIONS,
    ROLES,
    SKUS,
    SUB,
    SUB_PATH,
    USAGES,
    _can_unshare,
    _offline,
    _preflight,
    az_account,
    fake_tools,
    provider,
    replay_azure,
    scratch_project,
)

# No preflight here reaches Docker Hub: it answers from loopback.
pytestmark = pytest.mark.usefixtures("hub")


def _statuses(checks: dict[str, Any]) -> dict[str, str]:
    return {name: c["status"] for name, c in checks.items() if name != "_report"}


# ---- all clear ------------------------------------------------------------------------------


@pytest.mark.usefixtures("processes")
def test_a_subscription_where_the_stack_fits_passes_every_check(
    azure: FakeAzure, tools: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, checks = _preflight(azure, capsys)  # no --stack: pulumi's selected stack (dev)
    assert code == 0
    assert set(_statuses(checks).values()) == {"ok"}, _statuses(checks)
    assert checks["_report"]["stack"] == "dev"
    assert checks["subscription"]["detail"] == (
        f"Spot lab (pay-as-you-go) ({SUB}), from az's default, az's default too"
    )
    assert checks["sign-in"]["detail"].startswith(f"ada@example.com (object id {OID})")
    assert checks["tool pulumi"]["detail"] == "v3.210.0"
    assert checks["tool az"]["detail"] == "2.79.0, signed in as ada@example.com"
    # Exactly full: 12 Spot vCPUs for 3 × 4; 4 DSv5 used + 8 needed of 12.
    assert checks["Spot vCPU quota"]["detail"] == (
        "0 used / 12 limit, needs 12 (3 × Standard_NC4as_T4_v3 at 4)"
    )
    assert checks["standardDSv5Family quota"]["detail"] == (
        "4 used / 12 limit, needs 8 (4 × Standard_D2s_v5)"
    )
    assert checks["regional vCPU quota"]["detail"].startswith("4 used / 20 limit, needs 8")
    # The zone restriction of the T4 size does not matter: the pools ask for no zone.
    assert (
        checks["GPU Spot size Standard_NC4as_T4_v3"]["detail"] == "offered in westus3 (zones 1, 2)"
    )
    # Contributor grants resource groups; User Access Administrator (through a group) role
    # assignments. The Owner assignment on another resource group does not count.
    assert (
        "Contributor, User Access Administrator" in checks["may create role assignments"]["detail"]
    )
    assert "Owner" not in checks["may create role assignments"]["detail"]
    assert (
        checks["ACR Tasks"]["detail"]
        == "allowed for the subscription's offer (PayAsYouGo_2014-09-01)"
    )


@pytest.mark.usefixtures("processes")
def test_it_only_reads_and_follows_every_page(
    azure: FakeAzure, tools: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _preflight(azure, capsys)
    assert {s.method for s in azure.seen} == {"GET"}
    sku_pages = [s for s in azure.seen if s.path == SKUS]
    assert len(sku_pages) == 2 and sku_pages[0].query["$filter"] == ["location eq 'westus3'"]
    listing = next(s for s in azure.seen if s.path == ROLE_ASSIGNMENTS)
    assert listing.query["$filter"] == [f"assignedTo('{OID}')"]
    assert all(s.authorization and s.authorization.startswith("Bearer ") for s in azure.seen)


@pytest.mark.usefixtures("processes")
def test_human_output_is_one_line_per_check_and_a_verdict(
    azure: FakeAzure, tools: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--stack", "dev"], replay_azure(azure), PROJECT_DIR) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("ok       stack config")
    assert lines[-1] == "pulumi up can go ahead."
    assert all(line.split()[0] == "ok" for line in lines[:-1])


# ---- bad input ------------------------------------------------------------------------------


def test_a_bad_stack_config_is_reported_first_with_pulumi_ups_message(
    azure: FakeAzure, tools: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project = scratch_project(tmp_path, gpuVmSize="Standard_NC6s_v3", workerMinReplicas="0")
    with pytest.raises(ConfigError) as expected:
        load_stack("test", project)
    code = main(["--stack", "test"], replay_azure(azure), project)
    err = capsys.readouterr().err
    assert code == 2
    assert err == f"error: {expected.value}\n"
    assert "spot-lab:gpuVmSize" in err and "retired" in err and "workerMinReplicas" in err
    assert azure.seen == []


def test_an_unknown_stack_names_the_stacks_there(
    azure: FakeAzure, tools: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--stack", "prod"], replay_azure(azure), PROJECT_DIR) == 2
    err = capsys.readouterr().err
    assert "no stack file Pulumi.prod.yaml" in err and "(stacks here: a100, dev)" in err


def test_bad_flags_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--stak", "dev"])
    assert done.value.code == 2
    assert "unrecognized arguments: --stak" in capsys.readouterr().err


# ---- no Azure -------------------------------------------------------------------------------


@pytest.mark.usefixtures("processes")
def test_not_signed_in_is_one_failure_and_the_rest_is_skipped(
    azure: FakeAzure, tools: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, checks = _preflight(azure, capsys, credential=NoSignIn())
    assert code == 1
    assert checks["azure"]["status"] == "fails"
    assert checks["azure"]["detail"].startswith("not signed in to Azure: Please run 'az login'")
    assert checks["azure"]["fix"] == "az login"
    assert checks["subscription"]["status"] == checks["ACR Tasks"]["status"] == "skipped"
    assert azure.seen == []


@pytest.mark.usefixtures("processes")
def test_unreachable_azure_fails_in_one_line(
    azure: FakeAzure, tools: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    az = replay_azure(azure)
    closed = "http://127.0.0.1:9"  # discard port: nothing listens on loopback
    az.probe = lambda url: reach(closed, timeout=2)
    assert main(["--stack", "dev"], az, PROJECT_DIR) == 1
    out = capsys.readouterr().out
    assert "fails    azure" in out and "cannot reach Azure (127.0.0.1): Connection refused" in out
    assert "Traceback" not in out


@pytest.mark.skipif(not _can_unshare(), reason="needs `unshare -n` (a network namespace)")
@pytest.mark.parametrize(
    ("argv", "messages"),
    [
        (
            ["preflight", "--stack", "dev"],
            [
                "cannot reach Azure (management.azure.com)",
                "cannot reach Docker Hub (registry-1.docker.io)",
            ],
        ),
        (["prices", "--stack", "dev"], ["error: cannot reach Azure (prices.azure.com)"]),
    ],
)
@pytest.mark.usefixtures("processes")
def test_with_no_network_each_command_says_it_cannot_reach_azure(
    argv: list[str], messages: list[str], tmp_path: Path
) -> None:
    done = _offline(argv, tmp_path)
    assert done.returncode == 1, done.stderr
    output = done.stdout + done.stderr
    assert "Traceback" not in output
    # One line for each endpoint, none twice.
    reached = [line for line in output.splitlines() if "cannot reach" in line]
    assert len(reached) == len(messages), reached
    assert all(any(m in line for line in reached) for m in messages), reached


# ---- each check failing ---------------------------------------------------------------------


@pytest.mark.usefixtures("processes")
def test_a_service_principal_configured_by_env_signs_in_and_names_the_subscription(
    azure: FakeAzure, tools: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # pulumi deploys into ARM_SUBSCRIPTION_ID; az's default is another one it can also use.
    fake_tools(tools, az_account(OTHER_SUB, reachable=(SUB,)))
    code, checks = _preflight(azure, capsys, ARM_SUBSCRIPTION_ID=SUB)
    assert code == 0
    sub = checks["subscription"]
    assert sub["status"] == "warning" and "from ARM_SUBSCRIPTION_ID" in sub["detail"]
    assert f"az's default is {OTHER_SUB}" in sub["detail"]
    assert sub["fix"] == f"az account set --subscription {SUB}"


@pytest.mark.usefixtures("processes")
def test_a_subscription_az_cannot_use_fails(
    azure: FakeAzure, tools: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_tools(tools, az_account(OTHER_SUB))
    project = scratch_project(tmp_path, **{"azure-native:subscriptionId": SUB})
    code, checks = _preflight(azure, capsys, "--stack", "test", project=project)
    assert code == 1
    assert "from stack config; az cannot use it" in checks["subscription"]["detail"]
    assert checks["resource providers"]["status"] == "skipped"


@pytest.mark.parametrize(
    ("state", "status", "code"),
    [("Disabled", "fails", 1), ("PastDue", "fails", 1), ("Warned", "warning", 0)],
)
@pytest.mark.usefixtures("processes")
def test_a_subscription_that_is_not_enabled(
    state: str,
    status: str,
    code: int,
    azure: FakeAzure,
    tools: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    body = recording("subscription.json") | {"state": state}
    azure.routes[("GET", SUB_PATH)] = (200, body)
    exit_code, checks = _preflight(azure, capsys)
    assert exit_code == code
    assert (checks["subscription"]["status"], checks["subscription"]["fix"]) == (
        status,
        "use an enabled subscription (azure-native:subscriptionId)",
    )
    assert state in checks["subscription"]["detail"]
    # A subscription that cannot be deployed into leaves nothing else to check.
    assert checks["ACR Tasks"]["status"] == ("skipped" if status == "fails" else "ok")


@pytest.mark.usefixtures("processes")
def test_az_not_signed_in_fails_the_az_check(
    azure: FakeAzure, tools: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_tools(tools, None)
    code, checks = _preflight(azure, capsys)
    assert code == 1
    assert checks["tool az"]["detail"] == (
        "2.79.0, not signed in: ERROR: Please run 'az login' to setup account."
    )
    # Without az's default and no configured subscription, there is nothing to check.
    assert checks["subscription"]["detail"] == "no subscription configured and no az default"


@pytest.mark.usefixtures("processes")
@pytest.mark.parametrize("missing", ["kubelogin", "kubectl"])
def test_a_missing_cluster_tool_fails(
    azure: FakeAzure, tools: Path, capsys: pytest.CaptureFixture[str], missing: str
) -> None:
    """`pulumi up` runs kubectl itself (the wait for the deployer's role, infra/cluster_access.py),
    after the 10-15 min the cluster takes: without it, the up fails there."""
    fake_tools(tools, az_account(), skip=(missing,))
    code, checks = _preflight(azure, capsys)
    assert code == 1
    assert checks[f"tool {missing}"] == {
        "name": f"tool {missing}",
        "status": "fails",
        "detail": "not found on PATH",
        "fix": "az aks install-cli",
    }


@pytest.mark.usefixtures("processes")
def test_an_unregistered_provider_fails_with_its_register_line(
    azure: FakeAzure, tools: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = f"{SUB_PATH}/providers/Microsoft.ContainerService"
    azure.routes[("GET", path)] = (200, provider("Microsoft.ContainerService", "NotRegistered"))
    code, checks = _preflight(azure, capsys)
    assert code == 1
    check = checks["provider Microsoft.ContainerService"]
    assert (check["status"], check["detail"]) == ("fails", "NotRegistered")
    assert check["fix"] == (
        f"az provider register --namespace Microsoft.ContainerService --subscription {SUB}"
    )
    assert "resource providers" not in checks


@pytest.mark.usefixtures("processes")
def test_a_size_withheld_from_the_subscription_fails(
    azure: FakeAzure, tools: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project = scratch_project(
        tmp_path, gpuVmSize="Standard_NC24ads_A100_v4", workerMaxReplicas="1", workerReplicas="1"
    )
    code, checks = _preflight(azure, capsys, "--stack", "test", project=project)
    assert code == 1
    check = checks["GPU Spot size Standard_NC24ads_A100_v4"]
    assert check["detail"] == (
        "not offered to this subscription in westus3 (NotAvailableForSubscription)"
    )
    assert "python -m lab prices" in check["fix"]


@pytest.mark.usefixtures("processes")
def test_a_size_the_region_lacks_fails_and_quota_still_checks_the_rest(
    azure: FakeAzure, tools: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project = scratch_project(tmp_path, systemVmSize="Standard_D4s_v5")
    code, checks = _preflight(azure, capsys, "--stack", "test", project=project)
    assert code == 1
    assert checks["CPU size Standard_D4s_v5"]["detail"] == "not offered in westus3"
    assert checks["CPU vCPU quota"]["status"] == "skipped"
    assert checks["Spot vCPU quota"]["status"] == "ok"


@pytest.mark.usefixtures("processes")
def test_a_size_not_offered_as_spot_fails(
    azure: FakeAzure, tools: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = recording("resource_skus_page2.json")
    t4 = page["value"][0]
    t4["capabilities"] = [
        c | {"value": "False"} if c["name"] == "LowPriorityCapable" else c
        for c in t4["capabilities"]
    ]
    azure.routes[("GET", SKUS, "$skiptoken=page2")] = (200, page)
    code, checks = _preflight(azure, capsys)
    assert code == 1
    assert checks["GPU Spot size Standard_NC4as_T4_v3"]["detail"] == "offered, but not as Spot"


@pytest.mark.usefixtures("processes")
def test_short_spot_and_family_quota_fail_with_used_limit_and_needed(
    azure: FakeAzure, tools: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project = scratch_project(tmp_path, gpuMaxNodes="4", systemNodeCount="4")
    code, checks = _preflight(azure, capsys, "--stack", "test", project=project)
    assert code == 1
    spot = checks["Spot vCPU quota"]
    assert spot["status"] == "fails"
    assert spot["detail"] == "0 used / 12 limit, needs 16 (4 × Standard_NC4as_T4_v3 at 4)"
    assert "'Total Regional Spot vCPUs' in westus3" in spot["fix"]
    assert "spot-lab:gpuMaxNodes" in spot["fix"]
    family = checks["standardDSv5Family quota"]
    assert family["detail"] == "4 used / 12 limit, needs 10 (5 × Standard_D2s_v5)"
    assert checks["regional vCPU quota"]["status"] == "ok"


@pytest.mark.usefixtures("processes")
def test_zero_spot_quota_fails(
    azure: FakeAzure, tools: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    usages = recording("usages.json")
    for usage in usages["value"]:
        if usage["name"]["value"] == "lowPriorityCores":
            usage["limit"] = 0
    azure.routes[("GET", USAGES)] = (200, usages)
    code, checks = _preflight(azure, capsys)
    assert code == 1
    assert checks["Spot vCPU quota"]["detail"].startswith("0 used / 0 limit, needs 12")


def _assignments(*roles: tuple[str, str | None]) -> dict[str, Any]:
    base = recording("role_assignments.json")["value"][0]
    value = []
    for index, (role, condition) in enumerate(roles):
        props = dict(base["properties"])
        props["roleDefinitionId"] = f"{ROLE_DEFINITIONS}/{ROLES[role]}"
        if condition:
            props |= {"condition": condition, "conditionVersion": "2.0"}
        value.append(base | {"name": f"a{index}", "properties": props})
    return {"value": value}


@pytest.mark.usefixtures("processes")
def test_contributor_alone_may_not_create_role_assignments(
    azure: FakeAzure, tools: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    azure.routes[("GET", ROLE_ASSIGNMENTS)] = (200, _assignments(("contributor", None)))
    code, checks = _preflight(azure, capsys)
    assert code == 1
    check = checks["may create role assignments"]
    assert check["detail"] == (
        "no role allows Microsoft.Authorization/roleAssignments/write; "
        "roles at the subscription: Contributor"
    )
    assert "User Access Administrator" in check["fix"]
    assert checks["may create resource groups"]["status"] == "ok"


@pytest.mark.usefixtures("processes")
def test_owner_may_do_both_and_a_condition_only_warns(
    azure: FakeAzure, tools: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    azure.routes[("GET", ROLE_ASSIGNMENTS)] = (200, _assignments(("owner", None)))
    code, checks = _preflight(azure, capsys)
    assert code == 0 and checks["may create role assignments"]["status"] == "ok"
    condition = "((!(ActionMatches{'Microsoft.Authorization/roleAssignments/write'})))"
    azure.routes[("GET", ROLE_ASSIGNMENTS)] = (
        200,
        _assignments(("contributor", None), ("user_access_administrator", condition)),
    )
    code, checks = _preflight(azure, capsys)
    assert code == 0
    assert checks["may create role assignments"]["status"] == "warning"
    assert "only under a condition" in checks["may create role assignments"]["detail"]


@pytest.mark.usefixtures("processes")
def test_a_reader_cannot_and_a_403_says_what_to_ask_for(
    azure: FakeAzure, tools: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    azure.routes[("GET", ROLE_ASSIGNMENTS)] = (200, _assignments(("reader", None)))
    code, checks = _preflight(azure, capsys)
    assert code == 1
    assert checks["may create resource groups"]["status"] == "fails"
    message = (
        f"The client 'ada@example.com' with object id '{OID}' does not have authorization to "
        "perform action 'Microsoft.Authorization/roleAssignments/read'"
    )
    refusal = (403, {"error": {"code": "AuthorizationFailed", "message": message}})
    azure.routes[("GET", ROLE_ASSIGNMENTS)] = refusal
    code, checks = _preflight(azure, capsys)
    assert code == 1
    check = checks["permissions"]
    assert check["detail"] == f"Azure refused to show it: 403 AuthorizationFailed: {message}"
    assert check["fix"] == "ask for Reader on the subscription (preflight only reads)"
    assert checks["ACR Tasks"]["status"] == "ok"  # the checks after it still ran


@pytest.mark.parametrize(
    ("offer", "status"),
    [
        ("FreeTrial_2014-09-01", "fails"),
        ("AzureForStudents_2018-01-01", "fails"),
        ("MSDN_2014-09-01", "warning"),
        ("EnterpriseAgreement_2014-09-01", "ok"),
    ],
)
@pytest.mark.usefixtures("processes")
def test_acr_tasks_by_offer(
    offer: str, status: str, azure: FakeAzure, tools: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body = recording("subscription.json")
    body["subscriptionPolicies"]["quotaId"] = offer
    azure.routes[("GET", SUB_PATH)] = (200, body)
    code, checks = _preflight(azure, capsys)
    assert checks["ACR Tasks"]["status"] == status
    assert code == (1 if status == "fails" else 0)
    if status == "fails":
        assert checks["ACR Tasks"]["fix"].startswith(
            "pulumi config set spot-lab:imageBuilder docker"
        )


@pytest.mark.usefixtures("processes")
def test_the_docker_builder_needs_no_acr_tasks_but_a_docker_daemon(
    azure: FakeAzure, tools: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body = recording("subscription.json")
    body["subscriptionPolicies"]["quotaId"] = "FreeTrial_2014-09-01"
    azure.routes[("GET", SUB_PATH)] = (200, body)
    project = scratch_project(tmp_path, imageBuilder="docker")
    code, checks = _preflight(azure, capsys, "--stack", "test", project=project)
    assert code == 0
    assert checks["ACR Tasks"]["detail"] == "not used (imageBuilder: docker)"
    assert checks["tool docker"]["detail"] == "28.3.1"
    fake_tools(tools, az_account(), skip=("docker",))
    code, checks = _preflight(azure, capsys, "--stack", "test", project=project)
    assert code == 1 and checks["tool docker"]["status"] == "fails"


@pytest.mark.usefixtures("processes")
def test_a_throttled_answer_is_retried(
    azure: FakeAzure, tools: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    error = {"error": {"code": "TooManyRequests", "message": "slow down"}}
    throttled = (429, error, {"Retry-After": "0"})
    azure.routes[("GET", SUB_PATH)] = [throttled, (200, recording("subscription.json"))]
    code, checks = _preflight(azure, capsys)
    assert code == 0, _statuses(checks)
    assert azure.paths().count(SUB_PATH) == 2


# ---- pure pieces ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "allowed"),
    [
        ("*", True),
        ("Microsoft.Authorization/*", True),
        ("microsoft.authorization/*/write", True),
        ("Microsoft.Authorization/*/Delete", False),
        ("*/read", False),
        ("Microsoft.Authorization/roleAssignments/write", True),
    ],
)
def test_action_matching(pattern: str, allowed: bool) -> None:
    assert action_matches(pattern, "Microsoft.Authorization/roleAssignments/write") is allowed
