"""The staging Job on a first `pulumi up`: a read that Azure refuses (401, 403) because the
stager's role or federated credential is not honoured yet is tried again, with backoff, for up to
15 minutes, and the log says so. Blob Storage's answers are replayed on loopback through the
SDK's own transport; the clock and the sleep are the test's, so nothing waits."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from azure.core.exceptions import ClientAuthenticationError, HttpResponseError
from azure.storage.blob import ContainerClient

from lab.local import azurite_server
from tests.support.azure_replay import FakeAzure, serve
from training.checkpoints.blob_store import CONNECTION_STRING_ENV
from training.data import stage_data
from training.data.stage_data import RBAC_WAIT_S, StagingError, already_staged, retry_refused

MARKER_PATH = "/devstoreaccount1/data/.staged.json"
# What Blob Storage answers a read its caller has no role for, and a blob that is not there.
FORBIDDEN = (403, None, {"x-ms-error-code": "AuthorizationPermissionMismatch"})
NOT_FOUND = (404, None, {"x-ms-error-code": "BlobNotFound"})


@pytest.fixture
def blob() -> Iterator[FakeAzure]:
    yield from serve()


class Clock:
    """A monotonic clock that moves only when the code under test sleeps."""

    def __init__(self) -> None:
        self.now, self.slept = 1000.0, []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def _container(fake: FakeAzure) -> ContainerClient:
    key = {"account_name": azurite_server.ACCOUNT, "account_key": azurite_server.ACCOUNT_KEY}
    return ContainerClient(f"{fake.url}/devstoreaccount1", "data", credential=key)


def test_a_refused_read_is_tried_again_with_backoff_and_said_in_the_log(
    blob: FakeAzure,
) -> None:
    blob.routes[("GET", MARKER_PATH)] = [FORBIDDEN, FORBIDDEN, FORBIDDEN, NOT_FOUND]
    clock, lines = Clock(), []
    container = _container(blob)
    staged = retry_refused(
        lambda: already_staged(container, "md5:00"),
        "reading data",
        sleep=clock.sleep,
        clock=lambda: clock.now,
        log=lines.append,
    )
    assert staged is False  # the role applied: the marker is simply not there yet
    assert clock.slept == [5.0, 10.0, 20.0]
    assert len(lines) == 3 and all("reading data refused" in line for line in lines)
    assert "a new role or federated credential takes minutes to apply" in lines[0]
    assert "trying again in 5 s, for 900 s more" in lines[0]
    assert blob.paths().count(MARKER_PATH) == 4


def test_refusals_past_15_minutes_fail_for_good_naming_the_role(blob: FakeAzure) -> None:
    blob.routes[("GET", MARKER_PATH)] = FORBIDDEN
    clock, lines = Clock(), []
    container = _container(blob)
    with pytest.raises(StagingError) as info:
        retry_refused(
            lambda: already_staged(container, "md5:00"),
            "reading data",
            sleep=clock.sleep,
            clock=lambda: clock.now,
            log=lines.append,
        )
    assert RBAC_WAIT_S == 900 and sum(clock.slept) == pytest.approx(900)
    assert max(clock.slept) == 60.0  # the backoff's ceiling
    assert info.value.retry is False  # exit 2: the Job fails, the next `pulumi up` replaces it
    assert "still refused after 900 s" in str(info.value)
    assert "Storage Blob Data Contributor" in str(info.value)


@pytest.mark.parametrize(
    ("error", "retried"),
    [
        (ClientAuthenticationError("AADSTS70021: No matching federated identity record"), True),
        (HttpResponseError("the server failed"), False),
    ],
)
def test_only_a_refusal_is_waited_for(error: Exception, retried: bool) -> None:
    if isinstance(error, HttpResponseError) and not isinstance(error, ClientAuthenticationError):
        error.status_code = 500
    calls, clock = [], Clock()

    def read() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise error
        return "read"

    run = lambda: retry_refused(read, "x", sleep=clock.sleep, clock=lambda: clock.now, log=print)  # noqa: E731
    if retried:
        assert run() == "read" and clock.slept == [5.0]
    else:
        with pytest.raises(HttpResponseError):
            run()
        assert clock.slept == []


def test_the_staging_job_waits_on_its_first_read(
    blob: FakeAzure, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``main``'s first storage call goes through the wait: with no time left, a refusal is a
    permanent failure (exit 2) that names what is missing, before any download."""
    blob.routes[("GET", MARKER_PATH)] = FORBIDDEN
    monkeypatch.setenv(CONNECTION_STRING_ENV, "UseDevelopmentStorage=true")
    monkeypatch.setattr(stage_data, "RBAC_WAIT_S", 0)
    args = ["--source", "http://127.0.0.1:9/none", "--checksum", "md5:" + "0" * 32]
    code = stage_data.main([*args, "--container-uri", f"{blob.url}/devstoreaccount1/data"])
    assert code == stage_data.BAD_INPUT
    assert "reading " in capsys.readouterr().err
    assert blob.paths() == [MARKER_PATH]
