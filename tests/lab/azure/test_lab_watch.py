"""``lab watch`` against a loopback Kubernetes API server replaying a recorded eviction."""

from __future__ import annotations

import io
import json
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lab.azure.cluster.cloud_run import CloudOptions, DrillOptions, drill, watch
from lab.azure.cluster.kube import Cluster, ClusterError, Target, read_target
from lab.azure.cluster.recorder import Recorder
from lab.live.status_line import StatusLine
from lab.report.run_logs import load_cluster_run
from tests.support.cluster_runs import (
    NO_BLOB_DRIVER,
    REFUSED_OLD,
    TIMED_OUT,
    _cluster,
    _outputs,
    _write_outputs,
)
from tests.support.kube_replay import (
    EVENTS_PATH,
    JOB,
    NS,
    FakeKube,
    job_manifest,
    kubeconfig,
    pod_manifest,
    serve_kube,
)
from tests.support.lab_azure_fixtures import _can_unshare, _offline
from tests.support.pod_logs import NEW_NODE, W0, W1, W2, eviction_logs, k8s_event


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    for fake in serve_kube():
        # The story happens while it is watched: from two seconds after the watch starts (on
        # whole seconds, as events carry them), replayed faster than it happened.
        texts, events = eviction_logs(origin=float(int(time.time()) + 2))
        fake.job = (200, job_manifest())
        fake.pods = [
            pod_manifest(W0, "aks-gpu-vmss000000"),
            pod_manifest(W1, "aks-gpu-vmss000001"),
            pod_manifest(W2, "aks-gpu-vmss000002", phase="Failed"),
            pod_manifest(W2 + "x", NEW_NODE),
        ]
        fake.logs = texts
        fake.events = [e for e in events if e["involvedObject"]["kind"] == "Pod"]
        fake.node_events = [e for e in events if e["involvedObject"]["kind"] == "Node"]
        yield fake


def _until_logged(
    out: Path, pods: int, lines: int, timeout_s: float = 20.0, events: int = 6
) -> Any:
    deadline = time.monotonic() + timeout_s

    def done() -> bool:
        files = list((out / "pods").glob("*.log"))
        counted = sum(len(f.read_text().splitlines()) for f in files)
        log = out / "events.jsonl"
        have_events = log.exists() and len(log.read_text().splitlines()) >= events
        return (len(files) >= pods and counted >= lines and have_events) or (
            time.monotonic() > deadline
        )

    return done


def _expected_lines(kube: FakeKube) -> int:
    return sum(len([line for line in t.splitlines() if line]) for t in kube.logs.values())


def test_watch_records_the_logs_and_events_and_reports_the_eviction(
    kube: FakeKube, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    options = CloudOptions(_outputs(tmp_path, kube), out, lambda: (0.0915, 0.526, "test"))
    status = StatusLine(io.StringIO(), interval_s=0)
    code = watch(options, until=_until_logged(out, 4, _expected_lines(kube)), status=status)
    assert code == 0
    # Every line of every pod's log, once; the cluster's events, once each.
    for pod, text in kube.logs.items():
        assert (out / "pods" / f"{pod}.log").read_text().splitlines() == [
            line for line in text.splitlines() if line
        ]
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert sorted(e["reason"] for e in events) == sorted(
        e["reason"] for e in kube.events + kube.node_events
    )
    report = json.loads((out / "report.json").read_text())
    leave = report["faults"][0]
    assert (leave["world_size_before"], leave["world_size_after"], leave["steps_lost"]) == (3, 2, 0)
    assert leave["arrival"]["node"] == NEW_NODE and leave["arrival"]["arrival_s"] == 309.0
    assert report["cost"]["spot_usd_per_h"] == 0.0915
    assert (out / "timeline.png").exists()
    # It only reads, and follows with the watch API and log streaming.
    assert kube.methods() == {"GET"}
    watches = [q for m, p, q in kube.seen if p == EVENTS_PATH]
    assert watches and all(q["watch"][0].lower() == "true" for q in watches)
    logs = [q for m, p, q in kube.seen if p.endswith("/log")]
    assert logs and all(q["follow"] == q["timestamps"] == ["True"] for q in logs)
    assert "report: " in capsys.readouterr().out


def test_a_dropped_log_stream_and_a_broken_watch_are_opened_again(
    kube: FakeKube, tmp_path: Path
) -> None:
    kube.cut_first_log_at = 40
    kube.broken_first_watch = True
    out = tmp_path / "run"
    options = CloudOptions(_outputs(tmp_path, kube), out)
    stream = io.StringIO()
    status = StatusLine(stream, interval_s=0)
    assert watch(options, until=_until_logged(out, 4, _expected_lines(kube)), status=status) == 0
    # A torn watch is said once, in one line, and opened again.
    warnings = [line for line in stream.getvalue().splitlines() if line.startswith("warning")]
    assert any("the event watch stream dropped" in w and "opening it again" in w for w in warnings)
    text = kube.logs[W0]
    assert (out / "pods" / f"{W0}.log").read_text().splitlines() == [
        line for line in text.splitlines() if line
    ]
    assert len([p for _, p, _ in kube.seen if p.endswith(f"{W0}/log")]) >= 2
    run = load_cluster_run(out)
    assert [f["kind"] for f in run.injections] == ["leave", "join"]


@pytest.mark.parametrize(
    ("status", "message"),
    [
        (401, "refused the sign-in"),
        (403, "not allowed to read PyTorchJob spotlab-train"),
        (404, "PyTorchJob spotlab-train in namespace spot-lab not found"),
    ],
)
def test_cluster_errors_are_one_clear_line(
    status: int, message: str, kube: FakeKube, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kube.job = (status, {"kind": "Status", "code": status, "reason": "x", "message": "no"})
    options = CloudOptions(_outputs(tmp_path, kube), tmp_path / "run")
    assert watch(options, status=StatusLine(io.StringIO())) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_an_unreachable_cluster_and_bad_outputs(tmp_path: Path) -> None:
    cluster = _cluster(FakeKube(url="http://127.0.0.1:9"))
    with pytest.raises(ClusterError, match="cannot reach the cluster") as raised:
        cluster.job()
    # The reason, not urllib3's nested reprs of the pool and the retries.
    assert str(raised.value).endswith(": Connection refused")
    bad = tmp_path / "outputs.json"
    bad.write_text(json.dumps({"namespace": NS}))
    with pytest.raises(ClusterError, match="lacks kubeconfig, jobName"):
        read_target(bad)
    bad.write_text("{not json")
    with pytest.raises(ClusterError, match="pulumi stack output --json --show-secrets"):
        read_target(bad)


def test_a_kubeconfig_the_client_cannot_use_is_named(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match="the stack's kubeconfig is not usable"):
        Cluster(Target({"apiVersion": "v1", "kind": "Config", "clusters": []}, NS, JOB))


def _signing_in_with(command: str) -> dict[str, Any]:
    """The fake's kubeconfig with an exec sign-in plugin, as the stack's kubelogin one."""
    config = kubeconfig("http://127.0.0.1:9")
    config["users"][0]["user"] = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1beta1",
            "command": command,
            "args": ["get-token", "--login", "azurecli", "--server-id", "6dae42f8"],
            "installHint": "kubelogin signs in to Entra ID for the cluster: install it with\n"
            "`az aks install-cli`",
        }
    }
    return config


def test_a_sign_in_plugin_that_is_not_installed_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ClusterError) as raised:
        Cluster(Target(_signing_in_with("kubelogin"), NS, JOB))
    assert str(raised.value) == (
        "the stack's kubeconfig signs in with kubelogin, which is not on PATH: kubelogin signs "
        "in to Entra ID for the cluster: install it with `az aks install-cli`"
    )


@pytest.mark.usefixtures("processes")
def test_a_failed_sign_in_is_one_clear_line_and_logs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    plugin = tmp_path / "kubelogin"
    plugin.write_text(
        "#!/bin/sh\necho 'Error: AzureCLICredential: Please run az login' >&2\nexit 1\n"
    )
    plugin.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    handlers = list(logging.getLogger().handlers)
    with pytest.raises(ClusterError) as raised:
        Cluster(Target(_signing_in_with("kubelogin"), NS, JOB))
    message = str(raised.value)
    assert message.startswith("signing in to the cluster failed (exec: process returned 1.")
    assert "Please run az login" in message and "\n" not in message
    # The client's own logging.error is kept, not printed, and installs no root handler.
    assert caplog.records == []
    assert logging.getLogger().handlers == handlers


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "cannot read it (No such file or directory)"),
        ("[1]", "must hold a JSON object of stack outputs"),
        (
            json.dumps(
                {
                    "kubeconfig": "a: [",
                    "namespace": NS,
                    "jobName": JOB,
                    "nodeResourceGroup": "MC_x",
                    "gpuPoolName": "gpu",
                }
            ),
            "not YAML (line 1)",
        ),
    ],
)
def test_outputs_that_are_not_the_stacks_are_bad_input(
    text: str | None, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "outputs.json"
    if text is not None:
        path.write_text(text)
    options, quiet = CloudOptions(path, tmp_path / "run"), StatusLine(io.StringIO())
    assert watch(options, status=quiet) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert drill(options, DrillOptions(), lambda node: pytest.fail("evicted"), status=quiet) == 2
    assert message in capsys.readouterr().err


def test_a_log_line_that_only_looks_like_a_record_is_kept_but_not_read(tmp_path: Path) -> None:
    recorder = Recorder(tmp_path)
    line = '2026-09-21T00:00:01.000000000Z {"ts": 1790000001.0, "kind": "metrics"}'
    assert recorder.log_line(W0, line)
    assert recorder.records == [] and recorder.view.step == 0
    assert (tmp_path / "pods" / f"{W0}.log").read_text() == line + "\n"


def test_the_status_line_shows_the_job_its_pods_and_the_last_events(
    kube: FakeKube, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    stream = io.StringIO()
    status = StatusLine(stream, interval_s=0)
    watch(
        CloudOptions(_outputs(tmp_path, kube), out),
        until=_until_logged(out, 4, _expected_lines(kube)),
        status=status,
    )
    last = [line for line in stream.getvalue().splitlines() if line.startswith("Running")][-1]
    assert f"{W0}@aks-gpu-vmss000000" in last
    assert "world 3 | step 400/400 | loss 0.5000" in last
    assert "500 samples/s" in last
    assert "finished step 400" in last


def test_the_report_covers_the_time_watched(kube: FakeKube, tmp_path: Path) -> None:
    # The same eviction, but an hour before the watch started: context, not a fault of it.
    texts, events = eviction_logs(origin=float(int(time.time()) - 3600))
    kube.logs = texts
    kube.events = [e for e in events if e["involvedObject"]["kind"] == "Pod"]
    kube.node_events = [e for e in events if e["involvedObject"]["kind"] == "Node"]
    out = tmp_path / "run"
    options = CloudOptions(_outputs(tmp_path, kube), out)
    until = _until_logged(out, 4, _expected_lines(kube))
    assert watch(options, until=until, status=StatusLine(io.StringIO())) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["faults"] == []
    assert report["run"]["final_step"] == 400  # what the logs show, whenever it was logged


def test_a_refused_watch_is_said_once_and_the_rest_goes_on(kube: FakeKube, tmp_path: Path) -> None:
    kube.node_events_status = 403
    out = tmp_path / "run"
    stream = io.StringIO()
    options = CloudOptions(_outputs(tmp_path, kube), out)
    pods_logged = _until_logged(out, 4, _expected_lines(kube), events=4)  # the pods' only
    deadline = time.monotonic() + 4  # long enough for a few retries of the refused watch

    def until() -> bool:
        return pods_logged() and time.monotonic() > deadline

    assert watch(options, until=until, status=StatusLine(stream, interval_s=0)) == 0
    warnings = [line for line in stream.getvalue().splitlines() if "node event watch" in line]
    assert len(warnings) == 1
    assert "403, Kubernetes RBAC" in warnings[0]
    assert (out / "pods" / f"{W0}.log").exists()


def _stack_outputs(tmp_path: Path, user: dict[str, Any]) -> Path:
    """Outputs of a stack that is up, its API server at AKS's kind of address."""
    config = kubeconfig("https://spotlab-dev-1a2b3c4d.hcp.westus3.azmk8s.io:443")
    config["users"][0]["user"] = user
    return _write_outputs(tmp_path, config)


@pytest.mark.skipif(not _can_unshare(), reason="needs `unshare -n` (a network namespace)")
@pytest.mark.parametrize("command", ["watch", "drill"])
@pytest.mark.parametrize(
    ("user", "message"),
    [
        ({"token": "test-token"}, "error: cannot reach the cluster reading PyTorchJob"),
        (
            _signing_in_with("kubelogin")["users"][0]["user"],
            "error: the stack's kubeconfig signs in with kubelogin, which is not on PATH",
        ),
    ],
)
@pytest.mark.usefixtures("processes")
def test_with_no_network_watch_and_drill_say_so_in_one_line(
    command: str,
    user: dict[str, Any],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    outputs = _stack_outputs(tmp_path, user)
    argv = [command, "--stack-outputs", str(outputs), "--out", str(tmp_path / "run")]
    tools = tmp_path / "bin"  # unshare, and no kubelogin even where one is installed
    tools.mkdir()
    (tools / "unshare").symlink_to(shutil.which("unshare") or "unshare")
    monkeypatch.setenv("PATH", str(tools))
    done = _offline(argv, tmp_path)
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    assert done.stderr.startswith(message) and len(done.stderr.splitlines()) == 1, done.stderr


def _failed_mount(pod: str, message: str, count: int) -> dict[str, Any]:
    """The kubelet's FailedMount, the count-th time it retried (a new resourceVersion each)."""
    event = k8s_event(400.0 + count, "FailedMount", "Pod", pod, message)
    event["metadata"]["resourceVersion"] = str(1000 + count + len(message))
    return event | {"type": "Warning", "count": count}


def test_a_volume_that_fails_to_mount_is_one_line_with_its_fix_per_pod_and_cause(
    kube: FakeKube, tmp_path: Path
) -> None:
    replacement = W2 + "x"
    failed = [_failed_mount(replacement, REFUSED_OLD, n) for n in (1, 2, 3)]
    failed += [_failed_mount(replacement, TIMED_OUT, 4), _failed_mount(W1, NO_BLOB_DRIVER, 1)]
    failed += [_failed_mount("spot-lab-etcd-0", REFUSED_OLD, 1)]  # not the job's
    kube.events += failed
    out = tmp_path / "run"
    stream = io.StringIO()
    until = _until_logged(out, 4, _expected_lines(kube), events=6 + len(failed))
    watch(CloudOptions(_outputs(tmp_path, kube), out), until=until, status=StatusLine(stream, 0))
    said = [line for line in stream.getvalue().splitlines() if "FailedMount" in line]
    assert sorted(said) == [
        f"warning: FailedMount {W1}: the dataset volume spot-lab-dataset has no driver: "
        "blob.csi.azure.com is not running on the node, so the cluster's Blob CSI driver is off; "
        "turn on storageProfile.blobCSIDriver.enabled (pulumi up sets it; by hand: az aks update "
        "--enable-blob-driver)",
        f"warning: FailedMount {replacement}: the dataset volume spot-lab-dataset was refused by "
        "Blob Storage: the training identity needs Storage Blob Data Reader on the data container "
        "(pulumi up grants it; a new role assignment can take minutes to apply, and the kubelet "
        "keeps retrying)",
    ]
