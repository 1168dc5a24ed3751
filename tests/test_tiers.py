"""The test tiers themselves (tests/support/tiers.py), run as an inner pytest session in this
process: markers follow the fixtures, and an undeclared process fails the test."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

INNER = """
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def service(etcd: None) -> str:
    return "a real etcd would start here"


def test_pure() -> None:
    assert 1 + 1 == 2


def test_uses_a_service(service: str) -> None:
    assert service


@pytest.mark.usefixtures("processes")
def test_declares_its_process() -> None:
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_hides_its_process() -> None:
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_swallows_the_refusal() -> None:
    try:
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    except Exception:
        pass
"""


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    pytester.makepyfile(test_inner=INNER)
    return pytester.runpytest_inprocess("-p", "tests.conftest", "-p", "no:cacheprovider", *args)


def test_the_fast_tier_leaves_out_what_uses_a_real_fixture(pytester: pytest.Pytester) -> None:
    result = _run(pytester, "-m", "not slow", "-v")
    result.stdout.fnmatch_lines(["*test_pure PASSED*"])
    assert "test_uses_a_service" not in result.stdout.str()
    assert "test_declares_its_process" not in result.stdout.str()
    result.assert_outcomes(passed=1, failed=2, deselected=2)


def test_a_fixture_that_declares_marks_every_test_that_uses_it(pytester: pytest.Pytester) -> None:
    result = _run(pytester, "-m", "etcd", "-v")
    result.assert_outcomes(passed=1, deselected=4)
    result.stdout.fnmatch_lines(["*test_uses_a_service PASSED*"])


def test_an_undeclared_process_fails_even_when_its_error_is_caught(
    pytester: pytest.Pytester,
) -> None:
    result = _run(pytester, "-k", "hides or swallows")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "*test_hides_its_process starts a process (subprocess)*Request `processes`*",
            "*test_swallows_the_refusal tried to start a process (subprocess) without declaring*",
        ]
    )


@pytest.mark.usefixtures("processes")  # the inner test's process is this test's too
def test_the_whole_suite_runs_what_declares_its_process(pytester: pytest.Pytester) -> None:
    result = _run(pytester, "-k", "declares or pure or service")
    result.assert_outcomes(passed=3)


def test_an_unknown_marker_is_refused(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_typo="import pytest\n\n@pytest.mark.slwo\ndef test_x() -> None:\n    pass\n"
    )
    result = pytester.runpytest_inprocess("-p", "tests.conftest", "--strict-markers")
    result.stdout.fnmatch_lines(["*'slwo' not found in `markers` configuration option*"])


def test_a_test_that_shares_a_setup_or_loads_the_machine_keeps_to_one_worker(
    pytester: pytest.Pytester,
) -> None:
    from tests.support.tiers import worker_group

    pytester.makepyfile(
        test_inner=INNER,
        test_heavy=(
            "import pytest\n\n\n@pytest.fixture\ndef each() -> int:\n    return 1\n\n\n"
            "def test_alone(each: int) -> None:\n    pass\n\n\n"
            "@pytest.mark.usefixtures('heavy')\ndef test_loads_the_machine() -> None:\n    pass\n"
        ),
    )
    items, _ = pytester.inline_genitems("-p", "tests.conftest", "-p", "no:cacheprovider")
    groups = {item.name: worker_group(item) for item in items}
    assert groups["test_uses_a_service"] == "test_inner.py"  # its module's fixture: one setup
    assert groups["test_loads_the_machine"] == "heavy"
    assert groups["test_pure"] is groups["test_alone"] is None  # free to go to either worker


SHARED = """
import os

import pytest


@pytest.fixture(scope="module")
def setup() -> str:
    return os.environ["PYTEST_XDIST_WORKER"]


@pytest.mark.parametrize("n", range(6))
def test_shares(setup: str, n: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    (tmp_path_factory.getbasetemp().parent / f"shares-{n}").write_text(setup)


@pytest.mark.parametrize("n", range(6))
def test_alone(n: int) -> None:
    pass
"""


@pytest.mark.usefixtures("processes")
def test_two_workers_run_a_group_on_one_worker(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    pytester.makepyfile(test_shared=SHARED)
    result = pytester.runpytest_subprocess(
        "-p",
        "tests.conftest",
        "-p",
        "no:cacheprovider",
        "-n",
        "2",
        "--dist",
        "loadgroup",
        f"--basetemp={pytester.path / 'base'}",
    )
    result.assert_outcomes(passed=12)
    shares = list((pytester.path / "base").glob("shares-*"))  # beside the workers' own dirs
    assert len(shares) == 6
    assert len({path.read_text() for path in shares}) == 1  # the module's setup was made once
