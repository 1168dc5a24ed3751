"""The wait for the deployer's role: the real script, run against a stand-in ``kubectl``.

``kubectl auth can-i`` asks the API server with a SelfSubjectAccessReview and prints ``yes``
(exit 0), or ``no``, then `` - <reason>`` when the authorizer gave one (exit 1), on stdout;
an error that kept it from asking (no sign-in, a missing exec plugin, an unreachable server)
goes to stderr, also with exit 1 (kubectl, pkg/cmd/auth/cani.go, ``RunAccessCheck``). The
stand-in answers from a script of answers, one per call, so the tests follow events, not the
clock.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from infra.cluster_access import KUBECONFIG_ENV, access_wait_script
from tests.support.pulumi_harness import ProgramRun, run_program

FAKE_KUBECTL = """#!/bin/sh
# Answers the next line of $ANSWERS; records its arguments and the kubeconfig it was given.
n=$(cat "$STATE/calls" 2>/dev/null || echo 0)
n=$((n + 1)); echo "$n" > "$STATE/calls"
echo "$@" >> "$STATE/args"
cp "$2" "$STATE/kubeconfig"
line=$(sed -n "${n}p" "$ANSWERS")
[ -n "$line" ] || line=$(tail -n 1 "$ANSWERS")
text="${line#* }"
case "$text" in
  yes*|no*) echo "$text" ;;
  *) echo "$text" >&2 ;;
esac
exit "${line%% *}"
"""


def _wait(
    tmp_path: Path,
    answers: list[str],
    wait_s: int,
    tools: tuple[str, ...] = ("kubectl", "kubelogin"),
) -> subprocess.CompletedProcess[str]:
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir(), state.mkdir()
    for tool in tools:
        path = bin_dir / tool
        path.write_text(FAKE_KUBECTL if tool == "kubectl" else "#!/bin/sh\nexit 0\n")
        path.chmod(0o755)
    (tmp_path / "answers").write_text("\n".join(answers) + "\n")
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "STATE": str(state),
        "ANSWERS": str(tmp_path / "answers"),
        KUBECONFIG_ENV: "apiVersion: v1\nkind: Config\n",
    }
    script = access_wait_script("user ada@example.com", wait_s=wait_s, interval_s=0)
    return subprocess.run(
        ["/bin/sh", "-c", script], env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.usefixtures("processes")
def test_it_returns_once_the_api_server_says_yes(tmp_path: Path) -> None:
    # Forbidden twice while the role propagates, then allowed.
    done = _wait(tmp_path, ["1 no", "1 no", "0 yes"], wait_s=3600)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "state" / "calls").read_text().strip() == "3"
    args = (tmp_path / "state" / "args").read_text().splitlines()[0]
    assert args.endswith("auth can-i create namespaces")
    # kubectl read the kubeconfig from a file the script wrote, which it removes afterwards.
    assert (tmp_path / "state" / "kubeconfig").read_text() == "apiVersion: v1\nkind: Config\n"


@pytest.mark.usefixtures("processes")
def test_it_gives_up_on_a_no_with_the_last_answer_and_the_fix(tmp_path: Path) -> None:
    reason = "no - User does not have access to the resource in Azure."
    done = _wait(tmp_path, [f"1 {reason}"], 0)
    assert done.returncode == 1
    assert "the cluster still refuses user ada@example.com after 0 s" in done.stderr
    assert reason in done.stderr and "up to 5 minutes" in done.stderr


@pytest.mark.parametrize(
    "error",
    [
        "error: You must be logged in to the server (Unauthorized)",
        "error: exec: executable kubelogin failed with exit code 1: AADSTS50076: sign-in needed",
        "Unable to connect to the server: dial tcp: lookup aks.example: no such host",
    ],
)
@pytest.mark.usefixtures("processes")
def test_an_error_that_is_not_a_no_stops_at_once_and_is_quoted(tmp_path: Path, error: str) -> None:
    """Only Azure RBAC's "no" can turn into a yes while the role propagates: a sign-in that
    fails, a missing exec plugin or an unreachable server fails the same way for 600 s."""
    done = _wait(tmp_path, [f"1 {error}", "0 yes"], wait_s=3600)
    assert done.returncode == 1
    assert (tmp_path / "state" / "calls").read_text().strip() == "1"
    assert error in done.stderr
    assert "user ada@example.com" in done.stderr
    assert "waiting cannot fix" in done.stderr


@pytest.mark.usefixtures("processes")
def test_missing_tools_fail_at_once_with_how_to_install(tmp_path: Path) -> None:
    done = _wait(tmp_path, ["0 yes"], wait_s=3600, tools=("kubectl",))
    assert done.returncode == 1
    assert "kubelogin is not installed: az aks install-cli" in done.stderr
    assert not (tmp_path / "state" / "calls").exists()


@pytest.fixture(scope="module")
def run() -> ProgramRun:
    return run_program("dev")


def test_the_wait_is_a_resource_the_program_registers(run: ProgramRun) -> None:
    wait = run.one("command:local:Command", "admin-access")
    grant = run.one("azure-native:authorization:RoleAssignment", "deployer-cluster-admin")
    assert wait.inputs["create"] == access_wait_script(
        "the Azure CLI's login (az login: a user, or a principal after --service-principal)"
    )
    # The kubeconfig goes in as a secret environment variable, never on the command line.
    assert "environment" in wait.secret_inputs
    assert "apiVersion" not in wait.inputs["create"]
    # A new role assignment (another deployer) is waited for again.
    assert wait.inputs["triggers"] == [grant.id]
    assert wait.parent_type == "spot-lab:cluster:ClusterAccessWait"
    # Every Kubernetes object waits for it.
    for obj in run.resources:
        if obj.type.startswith("kubernetes:"):
            assert run.waits_for(obj, wait), obj.name


@pytest.mark.usefixtures("processes")
def test_the_script_is_posix_shell() -> None:
    checked = subprocess.run(
        ["/bin/sh", "-n", "-c", access_wait_script("x")], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stderr
    assert os.path.exists("/bin/sh")
